"""The ``lcsm`` command line: ``lcsm list`` and ``lcsm bench ops``.

Errors a user can cause end in one clear message on stderr and exit status 2, not a traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional


class UsageError(Exception):
    """A problem with what the user asked for (reported without a traceback)."""


def _mixer_table(d_model: int) -> str:
    from lcsm import layers

    by_target = {}
    for alias, target in layers.aliases().items():
        by_target.setdefault(target, []).append(alias)
    header = ["mixer", "aliases", "input", "expand", "oscillation", "shrink", "memory", "psi",
              "data-dependent"]
    rows = []
    for name in layers.available():
        row = layers.build(name, d_model).describe()
        dd = [n for n, flag in (("i", row.input_dd), ("e", row.expand_dd), ("o", row.oscillation_dd),
                                ("s", row.shrink_dd)) if flag]
        rows.append([name, ", ".join(sorted(by_target.get(name, []))) or "-", row.input, row.expand,
                     row.oscillation, row.shrink, row.memory, row.psi, ",".join(dd) or "none"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def cmd_list(args) -> int:
    print(f"Token mixers as EOS configurations (LCSM Table 1), built at d_model={args.d_model}:\n")
    print(_mixer_table(args.d_model))
    return 0


def _bench_module(name: str):
    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / f"{name}_bench.py").exists():
        raise UsageError(
            f"benchmark {name!r} not found under {root / 'bench'}; benchmarks run from a source "
            "checkout (pip install -e .)"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(f"bench.{name}_bench")


def cmd_bench(args) -> int:
    return _bench_module(args.suite).main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lcsm", description="Linear-complexity sequence models: "
                                     "one EOS operator, every model, every form.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="print the unified EOS table of all registered mixers")
    p.add_argument("--d-model", type=int, default=64, help="width the mixers are built at (default 64)")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("bench", help="run a benchmark suite from bench/ (e.g. `lcsm bench ops`)")
    p.add_argument("suite", choices=["ops"], help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark (see --help)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError) as err:
        print(f"lcsm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lcsm {args.command}: interrupted", file=sys.stderr)
        return 130
