"""Benchmarks of lcsm (run from the repository root: ``python -m bench.ops_bench --help``)."""
