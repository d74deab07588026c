"""Smoke test of the GPU benchmark's script (bench/gpu_bench.py) with ``--device cpu`` at tiny
sizes: every op and model case is built, run and reported. fla's Triton kernels cannot run on the
CPU, so lcsm's chunk form and models stand in for fla's ops and models: the test checks where
fla's pass fills the report (last, in its dtypes and lengths only), not fla. Timings are
machine-dependent and not asserted."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import gpu_bench, gpu_peers  # noqa: E402


@pytest.fixture
def fla_stand_in(monkeypatch):
    """fla's ops and models replaced by lcsm's; returns the list of what ran, in order (fla's calls,
    and the shapes section's start and end)."""
    events = []

    def fla_op(op, x):
        events.append(("fla", op, x["q"].dtype))
        return gpu_bench.lcsm_op(op, x)

    def fla_lm(name, d, layers, vocab):
        events.append(("fla model", name))
        model = gpu_bench.lcsm_lm(name, d, layers, vocab)
        forward = model.forward
        model.forward = lambda tokens: types.SimpleNamespace(logits=forward(tokens))  # fla's output type
        return model

    def bench_shapes(*args):
        events.append("shapes")
        shapes(*args)
        events.append("shapes done")

    shapes = gpu_bench.bench_shapes
    fla = types.ModuleType("fla")
    fla.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "fla", fla)  # the report's header reads its version
    monkeypatch.setattr(gpu_bench, "fla_unavailable", lambda: None)
    monkeypatch.setattr(gpu_bench, "fla_op", fla_op)
    monkeypatch.setattr(gpu_bench, "fla_lm", fla_lm)
    monkeypatch.setattr(gpu_bench, "bench_shapes", bench_shapes)
    return events


def rows_of(text: str, start: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith(start)]


def test_every_case_is_reported(tmp_path, monkeypatch, fla_stand_in):
    out = tmp_path / "gpu.md"
    argv = ["--device", "cpu", "--lengths", "40", "--heads", "2", "--dim", "8", "--warmup", "1", "--repeats", "1"]
    argv += ["--model-dim", "64", "--model-layers", "1", "--vocab", "50", "--train-batch", "1", "--train-len", "16"]
    argv += ["--mixers", "gla,gated_deltanet,attention,mamba", "--fla-models", "gla", "--out", str(out)]
    argv += ["--profile", "gla:float32:40,delta:bfloat16:24", "--top", "3", "--fla-lengths", "40"]
    argv += ["--shapes", "simple_gla:float32:16,gated_delta:float32:24,scan:float32:40"]
    argv += ["--scan-lengths", "20,40", "--scan-dim", "8", "--scan-chunk-max", "20"]
    kernels = (("chunk", "gla"), ("delta", "delta"), ("scan", "scan"))
    own = {name: gpu_bench._kernel_module(op).__dict__.copy() for name, op in kernels}
    flushed, replaced = [], []
    flush, replace = gpu_bench.Report.flush, os.replace
    monkeypatch.setattr(gpu_bench.Report, "flush", lambda self: (flush(self), flushed.append(out.read_text())))
    monkeypatch.setattr(gpu_bench.os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), replace(a, b)))
    assert gpu_bench.main(argv) == 0
    text = out.read_text()
    assert "- fla: stand-in" in text
    # the report is renamed over, never written in place, and carries the targets from its first row on
    assert (tmp_path / "gpu.md.tmp", out) in replaced and not (tmp_path / "gpu.md.tmp").exists()
    assert flushed and all("## Targets" in t for t in flushed)
    targets = rows_of(text, "| ")
    assert sum(r[0].endswith("lcsm / fla") for r in targets) == len(gpu_bench.OPS)  # bfloat16 only
    assert sum(r[0].endswith("best lcsm form / SDPA") for r in targets) == 2 * len(gpu_bench.OPS)
    for op in gpu_bench.OPS:
        for dtype in ("bfloat16", "float32"):
            (row,) = rows_of(text, f"| {op} | {dtype} | 40 |")
            assert float(row[3]) > 0 and float(row[4]) > 0 and float(row[9]) > 0, row  # chunk, triton, SDPA
            if dtype == "bfloat16":  # fla's cells and ratios, its first call timed
                assert float(row[5]) > 0 and float(row[6]) >= 0 and float(row[7]) > 0, row
            else:  # outside fla's pass
                assert row[5] == row[6] == "" and row[7] == "-", row
    # fla's pass after every section of lcsm's, in its dtype only
    fla_calls = [e for e in fla_stand_in if e[0] in ("fla", "fla model")]
    assert fla_stand_in.index("shapes done") < fla_stand_in.index(fla_calls[0])
    assert {e[2] for e in fla_calls if e[0] == "fla"} == {gpu_bench.torch.bfloat16}
    assert ("fla model", "gla") in fla_calls
    for model in ("lcsm gla", "lcsm gated_deltanet", "lcsm attention", "lcsm mamba", "fla gla"):
        (row,) = rows_of(text, f"| {model} |")
        assert "failed" not in row[1] and "SKIP" not in row[1] and float(row[5]) >= 0, row
    lines = text.splitlines()

    def first(start):
        return next(i for i, line in enumerate(lines) if line.startswith(start))

    def last(start):
        return max(i for i, line in enumerate(lines) if line.startswith(start))

    assert first("| fla gla |") > last("| lcsm mamba |")  # fla's models after lcsm's, in the same table
    assert "- git commit:" in text and "- device: cpu (smoke test)" in text
    for dtype in ("bfloat16", "float32"):
        for T, chunk in ((20, True), (40, False)):
            (cells,) = rows_of(text, f"| {dtype} | {T} |")
            assert float(cells[2]) > 0 and float(cells[5]) > 0, cells  # triton, SDPA
            assert (cells[3] != "-") == chunk, cells  # the chunk form up to --scan-chunk-max
    for case in ("gla float32 T=40", "delta bfloat16 T=24"):
        for form in ("lcsm triton", "lcsm chunk"):
            rows = rows_of(text, f"| {case} {form} |")
            assert len(rows) == 4 and rows[-1][1].startswith("all "), rows  # top 3 and the total
            assert all(float(row[3]) > 0 for row in rows), rows
    assert not rows_of(text, "| gla float32 T=40 fla |")  # outside fla's dtypes
    fla_rows = rows_of(text, "| delta bfloat16 T=24 fla |")
    assert len(fla_rows) == 4 and "first call" in fla_rows[-1][1], fla_rows
    assert first("| delta bfloat16 T=24 fla |") > last("| gla float32 T=40 lcsm chunk |")
    shaped = (
        ("simple_gla float32 T=16", "triton_chunk"),
        ("gated_delta float32 T=24", "triton_delta"),
        ("scan float32 T=40", "triton_scan"),
    )
    for case, module in shaped:
        rows = rows_of(text, f"| {case} | {module} |")
        assert len(rows) == len(gpu_bench.SHAPES[module]), rows
        assert rows[0][2].startswith("own: ") and rows[0][4] == "1.000", rows[0]
        assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows), rows
    for name, op in kernels:  # every override put back
        module = gpu_bench._kernel_module(op)
        shapes = gpu_bench.SHAPES[module.__name__.rsplit(".", 1)[-1]]
        assert all(getattr(module, k) == own[name][k] for o in shapes for k in o)


def test_spent_budget_skips_and_keeps_targets(tmp_path, fla_stand_in):
    out = tmp_path / "gpu.md"
    argv = ["--device", "cpu", "--lengths", "40", "--fla-lengths", "40", "--budget", "0", "--out", str(out)]
    assert gpu_bench.main([*argv, "--skip", "scan,kernels,train,shapes"]) == 0
    text = out.read_text()
    assert not fla_stand_in
    for op in gpu_bench.OPS:
        (row,) = rows_of(text, f"| {op} | bfloat16 | 40 |")
        assert row[3] == row[5] == "SKIP (budget spent)", row
    results = [r[3] for r in rows_of(text, "| ") if "T=8K" in r[0] or "T=32K" in r[0]]
    assert results and all(r.startswith("SKIP") for r in results), results


def test_profile_cases_are_checked():
    with pytest.raises(SystemExit):
        gpu_bench.main(["--device", "cpu", "--profile", "gla:float16:40"])


def test_peer_cases_import_fla_inside_their_factories(monkeypatch):
    """gpu_peers catches a case's failure around its factory's call: fla's import (missing, or
    failing on an older transformers) must happen there, not while the cases are listed."""
    monkeypatch.setitem(sys.modules, "fla.layers.gdn2", None)  # its import raises ImportError
    cases = list(gpu_peers.gdn2_cases())
    assert len(cases) == 2
    for _, layers in cases:
        with pytest.raises(ImportError):
            layers()


SAMPLE = """
import os, time

def test_bad():
    assert 1 == 2, "the reason"

def test_written_before_the_session_ends():
    path = os.environ["LCSM_LIVE_FAILURES"]
    for _ in range(100):  # under xdist the controller writes it when the worker's report arrives
        if os.path.exists(path) and "test_bad" in open(path).read():
            return
        time.sleep(0.1)
    raise AssertionError("test_bad's failure not written yet")
"""


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["one process", "xdist"])
def test_live_failures_are_written_as_they_happen(tmp_path, workers):
    """bench/_live_failures.py, gpu.sh's test step's plugin: a failure's traceback is on disk while the
    session still runs, once (the controller's copy only under xdist)."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    log = tmp_path / "failures.log"
    env = {**os.environ, "LCSM_LIVE_FAILURES": str(log), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench._live_failures", *workers]
    proc = subprocess.run([*argv, "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    text = log.read_text()
    assert text.count("==== test_sample.py::test_bad (call)") == 1 and "the reason" in text, text
    assert "test_written_before" not in text, text
