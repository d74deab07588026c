"""``lcsm train``, ``lcsm eval`` and ``lcsm generate``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ._common import UsageError

# The resolved config a run writes into its directory (lcsm.engine.trainer).
RUN_CONFIG = "config.yaml"

# What ``lcsm train`` sets where the config does not, unlike the library: a training process may
# keep freed host memory for good (see lcsm.engine.host_memory); a caller of lcsm's Python API keeps
# its malloc as it is unless it asks.
TRAIN_DEFAULTS = {"run.host_allocator": "retain"}


def _print_metrics(title: str, metrics) -> None:
    print(title)
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        # (a result.json read back holds None where the metric was not finite)
        print(f"  {key:<{width}}  {'nan' if value is None else format(value, '.4f')}")


def _run_config_file(target: str, out: str | None) -> tuple[Path, str | None]:
    """The config file and out_dir ``lcsm train TARGET`` trains: a run directory (one holding the
    config.yaml a run writes), or that config.yaml beside what its run wrote, trains the run there,
    wherever the command runs from (the file records out_dir as it was given, relative to the
    first run's working directory); --out still chooses another directory."""
    path = Path(target)
    if path.is_dir():
        if not (path / RUN_CONFIG).is_file():
            raise UsageError(
                f"{target}: a directory without {RUN_CONFIG}; give a run config file, or a run directory "
                f"that `lcsm train` wrote"
            )
        path = path / RUN_CONFIG
    if out is None and path.name == RUN_CONFIG and (_holds_a_run(path.parent) or _names_itself(path)):
        out = str(path.parent)
    return path, out


def _names_itself(config: Path) -> bool:
    """Whether ``config``'s out_dir is the directory holding it, as the config.yaml a run writes
    first says (relative to the working directory of the run's first start, so its last parts): a
    run stopped before its lock, as a sweep's run that failed as it started, leaves nothing else."""
    from lcsm.engine.config import read_yaml

    try:
        given = read_yaml(config).get("out_dir")
    except ValueError:
        return False
    if not isinstance(given, str) or not given:
        return False
    tail = tuple(p for p in Path(os.path.normpath(given)).parts if p != "..")
    return bool(tail) and config.parent.resolve().parts[-len(tail) :] == tail


def _holds_a_run(directory: Path) -> bool:
    """Whether a run wrote into ``directory``: checkpoints, a result, a metrics log or a lock (a run
    killed before its first checkpoint leaves the last two)."""
    from lcsm.engine.checkpoint import CHECKPOINTS
    from lcsm.engine.lock import LOCK_NAME

    return (directory / CHECKPOINTS).is_dir() or any(
        (directory / name).is_file() for name in ("result.json", "metrics.jsonl", LOCK_NAME)
    )


def cmd_train(args) -> int:
    from lcsm.engine import load_config, train

    path, out = _run_config_file(args.config, args.out)
    config = load_config(path, args.set or [], out_dir=out, defaults=TRAIN_DEFAULTS)
    result = train(config, resume=True, restart=args.restart, quiet=args.quiet)
    # every process of a torchrun launch gets the result; the first prints it
    if not args.quiet and os.environ.get("RANK", "0") == "0":
        _print_metrics(
            f"final {result['eval_split']} metrics of {config.out_dir} (step {result['step']}):", result["metrics"]
        )
    return 0


def cmd_eval(args) -> int:
    from lcsm.engine import evaluate, load_run
    from lcsm.engine.distributed import resolve_device
    from lcsm.engine.monitor import json_safe

    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    config, task, model, path = load_run(
        args.checkpoint, which="best" if args.best else "last", device=resolve_device(args.device, "--device")
    )
    split = args.split or ("validation" if "validation" in task.splits else "test")
    if split not in task.splits:
        raise UsageError(f"--split: task {task.registry_name!r} has splits {', '.join(task.splits)}, got {split!r}")
    batch = args.batch_size if args.batch_size is not None else config.train.eval_batch_size or config.train.batch_size
    metrics = evaluate(model, task, split, batch, next(model.parameters()).device, config.train.precision)
    if args.json:
        print(json.dumps(json_safe({"checkpoint": str(path), "split": split, "metrics": metrics}), allow_nan=False))
    else:
        _print_metrics(f"{path} on {task.registry_name} / {split}:", metrics)
    return 0


def _prompt_ids(task, args):
    if args.prompt_ids is not None:
        try:
            ids = [int(tok) for tok in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise UsageError(
                f"--prompt-ids: expected integers separated by spaces or commas, got {args.prompt_ids!r}"
            ) from None
    else:
        try:
            ids = task.encode(args.prompt)
        except NotImplementedError as err:
            raise UsageError(f"--prompt: {err} (use --prompt-ids)") from None
    if not ids:
        raise UsageError("--prompt / --prompt-ids: the prompt is empty")
    bad = [i for i in ids if not 0 <= i < task.vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: ids must lie in [0, {task.vocab_size}), got {bad[:5]}")
    return ids


def cmd_generate(args) -> int:
    import torch

    from lcsm.engine import load_run
    from lcsm.engine.distributed import resolve_device
    from lcsm.models import CausalLM
    from lcsm.models.model import check_sampling

    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-ids IDS")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed: expected an integer in [0, 2**63), got {args.seed}")
    try:  # before the checkpoint loads, and named by the flags ("max_new_tokens: ..." is generate's)
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        name, _, rest = str(err).partition(":")
        raise UsageError(f"--{name.replace('_', '-')}:{rest}") from None
    config, task, model, path = load_run(
        args.checkpoint, which="best" if args.best else "last", device=resolve_device(args.device, "--device")
    )
    if not isinstance(model, CausalLM):
        raise UsageError(
            f"checkpoint {path} holds a {config.model_config(task).head.kind!r} model; generation needs a "
            "language model (head 'lm')"
        )
    ids = _prompt_ids(task, args)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    show = _Shown(task)
    show.text(ids)
    try:
        model.generate(
            [ids],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
            vocab_size=task.vocab_size,
            on_token=lambda token: show.token(int(token[0])),
        )
    finally:
        show.end()
    return 0


class _Shown:
    """The prompt and each new token printed as it comes, so that a long generation stopped by
    Ctrl-C keeps what it drew. Text is printed once it decodes whole: a character split over tokens
    (UTF-8 bytes, byte-level BPE pieces) waits for its last one. A task without a text tokenizer
    gets the new ids, space-separated."""

    def __init__(self, task):
        self.task, self.pending, self.first, self.printed = task, [], True, False
        try:
            task.decode([])
            self.decodes = True
        except NotImplementedError:
            self.decodes = False

    def text(self, ids):
        if self.decodes:
            self._print(self.task.decode(ids))

    def token(self, token: int):
        if not self.decodes:
            self._print(("" if self.first else " ") + str(token))
            self.first = False
            return
        self.pending.append(token)
        text = self.task.decode(self.pending)
        if not text.endswith("\ufffd"):
            self._print(text)
            self.pending = []

    def end(self):
        if self.pending:
            self._print(self.task.decode(self.pending))
        if self.printed:  # a generation that failed before its first token leaves stdout empty
            print(flush=True)

    def _print(self, text: str):
        print(text, end="", flush=True)
        self.printed = self.printed or bool(text)


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train (or resume) a run from a YAML config",
        description="Train the run a YAML config describes (see docs/engine.md). Running the same "
        "command again resumes from the newest checkpoint in out_dir. Under torchrun "
        "every process runs this command (DistributedDataParallel).",
    )
    p.add_argument(
        "config",
        help="YAML run config (sections task, model, optim, train), or a run directory (resumes the run "
        "there, as its config.yaml does)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=200 --set model.mixer=gla (repeatable)",
    )
    p.add_argument("--out", help="output directory (default: the config's out_dir, or runs/<config name>)")
    p.add_argument("--restart", action="store_true", help="discard the checkpoints and metrics already in out_dir")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on its task")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--best", action="store_true", help="use the run's best checkpoint instead of its newest")
    p.add_argument("--split", help="split to evaluate (default: validation if the task has one, else test)")
    p.add_argument("--batch-size", type=int, help="evaluation batch size (default: the run's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "generate",
        help="decode new tokens from a language-model checkpoint",
        description="Decode with the mixers' recurrent states (constant cost per new token).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--prompt", help="prompt text (tasks with a text tokenizer)")
    p.add_argument("--prompt-ids", help="prompt as token ids, e.g. '5 17 3'")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--best", action="store_true", help="use the run's best checkpoint")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.set_defaults(func=cmd_generate)
