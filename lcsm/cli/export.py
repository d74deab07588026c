"""``lcsm export``: a trained run in another library's format (``--hf``: Hugging Face transformers)."""

from __future__ import annotations

from ._common import UsageError


def cmd_export(args) -> int:
    try:
        from lcsm.hf.export import export_run
    except ImportError as err:
        raise UsageError(f"--hf: {err}") from None
    export_run(args.run, args.hf, best=args.best)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained run as a Hugging Face model directory",
        description="Write the run's model (its newest intact checkpoint, or --best) and its tokenizer as a "
        "directory that transformers' AutoModelForCausalLM.from_pretrained loads after `import lcsm.hf` "
        "(see docs/hf.md). Needs the 'hf' extra.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory, or one checkpoint directory")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--best", action="store_true", help="export the run's best checkpoint instead of its newest")
    p.set_defaults(func=cmd_export)
