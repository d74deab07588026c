"""Smoke test of the packed-sequence benchmark (bench/packed_bench.py, ``lcsm bench packed``): each
number of documents is timed with and without states against one sequence and checked against the
target. Timings are machine-dependent and not asserted."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from lcsm.cli import main  # noqa: E402


def test_packed_rows_are_timed_against_one_sequence(tmp_path, capsys):
    out = tmp_path / "packed.md"
    assert main(["bench", "packed", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Packed sequences") and "- command: lcsm bench packed --quick" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "x |" in line]
    timings = [r for r in rows if len(r) == 5]
    assert [(r[0].strip(), r[1].strip()) for r in timings] == [("4", "no"), ("16", "no"), ("4", "yes"), ("16", "yes")]
    for r in timings:
        plain, packed, ratio = float(r[2]), float(r[3]), float(r[4].strip().rstrip("x"))
        # the table rounds times to 0.01 ms (the ratio to 3 significant digits): at smoke-test sizes
        # that moves the quotient by a few percent
        assert plain > 0 and packed > 0 and abs(ratio - packed / plain) <= 0.05 * ratio
    checks = [r for r in rows if len(r) == 4]
    assert len(checks) == 4 and all(r[3].strip() in ("PASS", "FAIL") for r in checks)
