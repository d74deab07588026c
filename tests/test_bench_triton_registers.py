"""bench/triton_registers.py compiles lcsm's Triton kernels for sm_90 with the kernels' own
signatures: Triton's interpreter, which the other tests run, accepts programs the compiler
refuses, and a kernel argument the bench does not know (a pointer taken for an integer) fails the
compile. Two variants of the chunk form (the packed states and strict kernels), the delta-rule
carry's backward and the selective scan's packed forward and backward; the whole table is the
bench's own run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ONLY = "packed row bfloat16|delta carry backward row|scan.*packed product"


def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell").exists():
        pytest.skip("triton without its NVIDIA backend's ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "bench.triton_registers", "--only", ONLY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "registers" in line]
    kernels = [row.split("|")[1].strip() for row in rows]
    expected = ["states, packed", "strict, packed", "delta carry backward", "scan, packed", "scan backward, packed"]
    assert kernels == expected, out.stdout
    for row in rows:
        assert re.search(r"Used \d+ registers", row), row
