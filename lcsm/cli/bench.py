"""``lcsm bench SUITE``: the benchmarks of ``bench/`` (run from a source checkout)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ._common import UsageError


def _bench_module(name: str):
    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / f"{name}_bench.py").exists():
        raise UsageError(
            f"benchmark {name!r} not found under {root / 'bench'}; benchmarks run from a source "
            "checkout (pip install -e .)"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"bench.{name}_bench")


def cmd_bench(args) -> int:
    return _bench_module(args.suite).main(args.rest)


def add_parsers(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite from bench/ (e.g. `lcsm bench ops`)")
    p.add_argument(
        "suite", choices=["ops", "tasks", "efficiency", "step", "packed", "dplr", "gpu"], help="which benchmark"
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark (see --help)")
    p.set_defaults(func=cmd_bench)
