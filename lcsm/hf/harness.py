"""lcsm models in EleutherAI's lm-evaluation-harness (the ``eval`` extra: ``pip install 'lcsm[eval]'``).

    lcsm eval-harness hf/metala --tasks lcsm_facts                         # the command line
    python -m lcsm.hf.harness run --model hf --model_args pretrained=hf/metala,backend=causal \\
        --tasks lcsm_facts --include_path lcsm/hf/tasks                    # lm_eval's own command line

lm_eval's ``hf`` model loads a directory with transformers' Auto classes, which know model_type
"lcsm" only once ``lcsm.hf`` has been imported: the model's code is lcsm's, not remote code in the
directory. Plain ``lm_eval --model hf`` therefore cannot load an lcsm directory; both entry points
here import ``lcsm.hf`` first. ``TASKS_DIR`` holds lcsm's own local tasks (see its YAMLs); every
evaluation here looks tasks up there too. See docs/hf.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lcsm.hf  # noqa: F401  (registers model_type "lcsm" with the Auto classes lm_eval's hf model uses)

try:
    import lm_eval
except ImportError as err:
    raise ImportError(
        "lcsm.hf.harness needs lm-evaluation-harness (the lm_eval package), which is not installed; install "
        "lcsm's 'eval' extra: pip install 'lcsm[eval]' (or pip install -e '.[eval]' in a checkout)"
    ) from err

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def task_manager(tasks: Sequence[str], include_paths: Sequence[str | Path] = ()):
    """An lm_eval ``TaskManager`` that knows ``tasks``: looked up in ``TASKS_DIR`` and ``include_paths``
    first, then among lm_eval's built-in tasks. Indexing the built-in ones takes seconds, so they are
    indexed only when a task is not local. An unknown task name is a ValueError naming it."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR), *(str(p) for p in include_paths)]
    for path in paths[1:]:
        if not Path(path).is_dir():
            raise ValueError(f"include path {path!r} is not a directory")
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not set(tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"unknown task(s) {', '.join(map(repr, unknown))}: not in lcsm's tasks ({TASKS_DIR}), the include "
            "paths, or lm_eval's built-in tasks"
        )
    return manager


def evaluate(
    model_dir: str | Path,
    tasks: Sequence[str],
    *,
    include_paths: Sequence[str | Path] = (),
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    model_args: dict[str, Any] | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Run lm_eval's ``simple_evaluate`` with its ``hf`` model on an lcsm Hugging Face directory
    (``lcsm export --hf``, or ``save_pretrained`` plus a tokenizer) and return its result dict
    (``results``, ``configs``, ``n-samples``, ...; ``samples`` with ``log_samples``).

    ``model_args`` adds to lm_eval's HFLM arguments (``max_length``, ``dtype``, ...). The backend is
    given as causal: lm_eval infers it from transformers' built-in model lists, which a registered
    model type is not in. The directory is passed as an absolute path, which lm_eval's lookup of a
    hub revision rejects at once instead of asking the hub about a name like ``hf/metala``."""
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{str(model_dir)!r} holds no config.json: not a Hugging Face model directory")
    args = {"pretrained": str(model_dir), "backend": "causal", **(model_args or {})}
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=args,
        tasks=list(tasks),
        task_manager=task_manager(tasks, include_paths),
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        device=device,
        limit=limit,
        log_samples=log_samples,
    )


def main() -> None:
    """lm_eval's own command line (``lm_eval run ...``, its ``--help``) with model_type "lcsm" registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
