"""Smoke test of the GPU benchmark's script (bench/gpu_bench.py) with ``--device cpu`` at tiny
sizes: every op and model case is built, run and reported (fla's Triton kernels cannot run on the
CPU, so their cells read "-"). Timings are machine-dependent and not asserted."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import gpu_bench  # noqa: E402


def test_every_case_is_reported(tmp_path):
    out = tmp_path / "gpu.md"
    argv = ["--device", "cpu", "--lengths", "40", "--heads", "2", "--dim", "8", "--warmup", "1", "--repeats", "1"]
    argv += ["--model-dim", "64", "--model-layers", "1", "--vocab", "50", "--train-batch", "1", "--train-len", "16"]
    argv += ["--mixers", "gla,gated_deltanet,attention,mamba", "--fla-models", "", "--out", str(out)]
    argv += ["--profile", "gla:float32:40,delta:bfloat16:24", "--top", "3"]
    argv += ["--shapes", "simple_gla:float32:16,gated_delta:float32:24,scan:float32:40"]
    argv += ["--scan-lengths", "20,40", "--scan-dim", "8", "--scan-chunk-max", "20"]
    kernels = (("chunk", "gla"), ("delta", "delta"), ("scan", "scan"))
    own = {name: gpu_bench._kernel_module(op).__dict__.copy() for name, op in kernels}
    assert gpu_bench.main(argv) == 0
    text = out.read_text()
    for op in gpu_bench.OPS:
        for dtype in ("bfloat16", "float32"):
            row = next(line for line in text.splitlines() if line.startswith(f"| {op} | {dtype} | 40 |"))
            lcsm_ms = row.split("|")[4].strip()
            assert float(lcsm_ms) > 0, row
    for model in ("lcsm gla", "lcsm gated_deltanet", "lcsm attention", "lcsm mamba"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {model} |"))
        assert "failed" not in row and "SKIP" not in row, row
    assert "- git commit:" in text and "- device: cpu (smoke test)" in text
    for dtype in ("bfloat16", "float32"):
        for T, chunk in ((20, True), (40, False)):
            cells = next(line for line in text.splitlines() if line.startswith(f"| {dtype} | {T} |")).split("|")
            assert float(cells[3]) > 0 and float(cells[6]) > 0, cells  # triton, SDPA
            assert (cells[4].strip() != "-") == chunk, cells  # the chunk form up to --scan-chunk-max
    for case in ("gla float32 T=40", "delta bfloat16 T=24"):
        for form in ("lcsm triton", "lcsm chunk"):
            rows = [line for line in text.splitlines() if line.startswith(f"| {case} {form} |")]
            assert len(rows) == 4 and rows[-1].split("|")[2].strip().startswith("all "), rows  # top 3 and the total
            assert all(float(row.split("|")[4]) > 0 for row in rows), rows
        fla = next(line for line in text.splitlines() if line.startswith(f"| {case} fla |"))
        assert "failed" in fla, fla  # fla's Triton kernels do not run on the CPU
    shaped = (
        ("simple_gla float32 T=16", "triton_chunk"),
        ("gated_delta float32 T=24", "triton_delta"),
        ("scan float32 T=40", "triton_scan"),
    )
    for case, module in shaped:
        rows = [line.split("|") for line in text.splitlines() if line.startswith(f"| {case} | {module} |")]
        assert len(rows) == len(gpu_bench.SHAPES[module]), rows
        assert rows[0][3].strip().startswith("own: ") and rows[0][5].strip() == "1.000", rows[0]
        assert all(float(row[4]) > 0 and float(row[5]) > 0 for row in rows), rows
    for name, op in kernels:  # every override put back
        module = gpu_bench._kernel_module(op)
        shapes = gpu_bench.SHAPES[module.__name__.rsplit(".", 1)[-1]]
        assert all(getattr(module, k) == own[name][k] for o in shapes for k in o)


def test_profile_cases_are_checked():
    import pytest

    with pytest.raises(SystemExit):
        gpu_bench.main(["--device", "cpu", "--profile", "gla:float16:40"])
