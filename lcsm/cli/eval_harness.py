"""``lcsm eval-harness``: EleutherAI's lm-evaluation-harness on an exported model or a trained run."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ._common import UsageError


def _model_args(text: str | None) -> dict:
    if not text:
        return {}
    pairs = [item.partition("=") for item in text.split(",") if item]
    bad = [key for key, eq, _ in pairs if not eq or not key]
    if bad:
        raise UsageError(f"--model-args: expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
    from lm_eval.utils import handle_arg_string  # "8" -> 8, "True" -> True, as lm_eval's --model_args

    return {key: handle_arg_string(value) for key, _, value in pairs}


def _write_json(results: dict, out: Path) -> None:
    from lm_eval.utils import handle_non_serializable

    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(out)


def _evaluate_export(harness, model_dir: Path, args, tasks: list[str]) -> dict:
    if not (model_dir / "tokenizer.json").is_file():
        raise UsageError(
            f"{str(model_dir)!r} has no tokenizer (tokenizer.json): lm-evaluation-harness scores text, and a model "
            "exported from a task of token ids (mqar) has none"
        )
    return harness.evaluate(
        model_dir,
        tasks,
        include_paths=args.include_path,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=args.device,
        model_args=_model_args(args.model_args),
        log_samples=args.log_samples,
    )


def _evaluate(harness, model_dir: Path, args, tasks: list[str]) -> dict:
    from lcsm.hf.export import export_run

    if (model_dir / "config.json").is_file():
        if args.best:
            raise UsageError(f"--best: {str(model_dir)!r} is an exported model, not a run (--best picks a checkpoint)")
        return _evaluate_export(harness, model_dir, args, tasks)
    # Not a Hugging Face directory: a run (or one checkpoint), exported for this evaluation only.
    with tempfile.TemporaryDirectory(prefix="lcsm-eval-harness-") as tmp:
        try:
            exported = export_run(model_dir, Path(tmp) / "hf", best=args.best)
        except ValueError as err:
            raise UsageError(f"MODEL_DIR: no config.json (not an exported model), read as a run: {err}") from None
        return _evaluate_export(harness, exported, args, tasks)


def cmd_eval_harness(args) -> int:
    try:
        from lcsm.hf import harness
    except ImportError as err:
        raise UsageError(str(err)) from None
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UsageError(f"MODEL_DIR: {args.model!r} is not a directory (an exported model, or a run)")
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise UsageError("--tasks: give at least one task name")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit: expected a positive number of examples, got {args.limit}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    results = _evaluate(harness, model_dir, args, tasks)

    from lm_eval.utils import make_table

    print(make_table(results))
    out = Path(args.out) if args.out else model_dir / "eval-harness.json"
    _write_json(results, out)
    print(f"results: {out}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "eval-harness",
        help="evaluate a model with EleutherAI's lm-evaluation-harness",
        description="Evaluate an exported model (`lcsm export --hf`) or a trained run (exported to a temporary "
        "directory first) with lm-evaluation-harness's hf model, print its results table and write them as JSON. "
        "Tasks are looked up in lcsm's own local tasks (lcsm/hf/tasks: lcsm_facts), the --include-path "
        "directories, then lm_eval's built-in tasks (which download their data). Needs the 'eval' extra; "
        "see docs/hf.md.",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="an exported model directory, or a run / checkpoint directory")
    p.add_argument("--tasks", required=True, help="comma-separated task names (e.g. lcsm_facts)")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory of task YAMLs (repeatable), as lm_eval's --include_path",
    )
    p.add_argument("--limit", type=int, metavar="N", help="evaluate the first N examples of each task")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (the task's default)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward (default 8)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--model-args", metavar="K=V,...", help="more arguments of lm_eval's hf model (max_length, dtype)")
    p.add_argument("--log-samples", action="store_true", help="add each example's inputs and scores to the JSON")
    p.add_argument("--best", action="store_true", help="a run: evaluate its best checkpoint instead of its newest")
    p.add_argument("--out", metavar="FILE", help="the results JSON (default MODEL_DIR/eval-harness.json)")
    p.set_defaults(func=cmd_eval_harness)
