"""Smoke test of the operator benchmark (bench/ops_bench.py) in its tiny --quick configuration.

It checks that every case runs end to end and renders its tables, not the timings themselves
(those depend on the machine). Peers that are not installed must show up as SKIP, not crash.
"""

import platform
import shlex
import sys
from pathlib import Path

import pytest
import torch

from lcsm.ops import eos
from lcsm.testing import assert_close

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import ops_bench  # noqa: E402


def test_quick_run_prints_every_table(tmp_path, capsys):
    out = tmp_path / "ops.md"
    threads = torch.get_num_threads()
    try:
        assert ops_bench.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets it process-wide; leave other tests as they were
    text = capsys.readouterr().out
    assert out.read_text().strip() == text.strip()
    for heading in ("## Targets", "## Timings", "## Peak memory", "## Throughput"):
        assert heading in text, heading
    assert "| check | measured | target | result |" in text
    assert "- git commit: " in text and "- machine cpu: " in text
    assert f"- command: lcsm bench ops --quick --threads 1 --out {shlex.quote(str(out))}\n" in text  # however started
    assert "- allocator: " in text and "| page faults / token | sys % |" in text
    # Every row of the targets table ends in a verdict; a crashed measurement would leave a note.
    targets = text.split("## Targets")[1].split("\n## ")[0].strip().splitlines()[2:]
    verdicts = [row.rsplit("|", 2)[-2].strip().split(" ")[0] for row in targets]
    assert len(verdicts) >= 10 and set(verdicts) <= {"PASS", "FAIL", "SKIP", "info"}, targets
    assert "PASS" in verdicts or "FAIL" in verdicts
    assert "failed:" not in text and "DISAGREES" not in text
    # The lcsm side of every timed case ran; fla rows are present exactly when fla is importable.
    for label in (
        "lcsm eos chunk, row decay",
        "lcsm eos chunk, no decay",
        "causal scaled_dot_product_attention",
        "per-step Python loop",
        "LCSM code 1-9-1-0: per-step K x D decay",
        "lcsm eos fft (time-invariant, real FFTs)",
        "lcsm eos chunk on the same system",
        "lcsm eos_rotating, rotation: rotating frame",
    ):
        assert label in text, label
    fla_present = ops_bench._fla()[0] is not None
    assert ("SKIP (fla-core not installed)" in text) == (not fla_present)
    assert ("fla naive_chunk_simple_gla" in text.split("## Timings")[1]) == fla_present


def test_memory_peaks_below_the_resolution_are_skipped_not_divided(monkeypatch):
    # A tiny backward can leave the resident set where it was (a peak of 0 bytes), as the quick
    # sizes did on CI; its ratio must be a SKIP that says why, and resolved cells still checked.
    z = ops_bench.QUICK
    cells = len(ops_bench.GATES) * len(z.memory)
    mib = ops_bench.MEMORY_RESOLUTION_BYTES
    fake = {"custom": [mib] * cells, "autograd": [0] + [2 * mib] * (cells - 1)}
    monkeypatch.setattr(ops_bench, "peak_memory_subprocess", lambda sizes, mode, threads: fake[mode])
    bench = ops_bench.Bench(z, 1, lambda msg: None)
    bench.case_memory()
    ratios = [c for c in bench.r.checks if c.name.startswith("peak memory custom / autograd")]
    assert len(ratios) == cells
    assert ratios[0].measured is None and "below the measurement resolution" in ratios[0].result
    assert [c.measured for c in ratios[1:]] == [0.5] * (cells - 1)
    assert all(c.result == "PASS" for c in ratios[1:])
    table = ops_bench.render(bench.r, z, {}, ["memory"]).split("## Peak memory")[1].splitlines()
    rows = [line for line in table if line.startswith("| ") and line.split("|")[2].strip().isdigit()]
    assert len(rows) == cells
    assert "n/a (autograd peak 0.0 MiB is below the measurement resolution" in rows[0]
    assert all("| 0.500 |" in row for row in rows[1:])


def test_flop_model_matches_the_counted_flops_without_sub_chunking():
    # Moderate row decays take the one-reference-per-chunk path, which issues exactly the analytic
    # count (without decay a small prefix-sum matmul comes on top).
    z = ops_bench.QUICK
    analytic = ops_bench.chunk_fwd_bwd_flops(z.B, z.H, z.T, z.K, z.D, z.C)
    assert ops_bench.counted_matmul_flops(z, "row", z.T) == analytic


def test_timing_counts_the_page_faults_of_fresh_memory():
    # Each run allocates more than any run before it, so it touches fresh pages whatever the
    # allocator keeps (retain, which other tests may have set in this process, or glibc's mmap).
    x = torch.ones(1, requires_grad=True)
    sizes = iter(range(1, 4))
    times, usage = ops_bench.time_fwd_bwd(lambda: (x * torch.ones(next(sizes) << 23)).sum(), [x], repeats=2, warmup=1)
    assert len(times) == 2
    assert usage["faults"] > 0 and 0 <= usage["sys_s"] <= usage["cpu_s"]


def test_bad_options_are_rejected(capsys):
    with pytest.raises(SystemExit):
        ops_bench.main(["--only", "row_decay,nonsense"])
    assert "nonsense" in capsys.readouterr().err


def test_python_loop_matches_eos():
    g = torch.Generator().manual_seed(0)
    i, e, s = (torch.randn(1, 9, 2, n, generator=g, dtype=torch.float64) for n in (5, 3, 3))
    log_o = -torch.rand(1, 9, 2, 3, 5, generator=g, dtype=torch.float64)
    expected, _ = eos(i, e, s, log_o, mode="recurrent")
    assert_close({"y": ops_bench.python_loop(i, e, s, log_o)}, {"y": expected}, context="python_loop")


def test_tasks_bench_measures_a_task(tmp_path, capsys, monkeypatch):
    from bench import tasks_bench

    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tasks.md"
    assert tasks_bench.main(["--only", "mad_compression", "--steps", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text().strip() == text.strip()
    row = next(line for line in text.splitlines() if line.startswith("| mad_compression |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "classifier" and cells[2] == "12800 / 1280" and int(cells[6]) == 400


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_tasks_bench_refuses_steps_below_one(steps, capsys):
    from bench import tasks_bench

    with pytest.raises(SystemExit) as exc:
        tasks_bench.main(["--only", "mqar", "--steps", steps])
    assert exc.value.code == 2 and f"--steps: expected an integer >= 1, got {steps}" in capsys.readouterr().err


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt")
def test_parity_case_pairs_both_states_in_one_worker():
    # One worker, QUICK.parity_rounds rounds: a check per chunk case, each a ratio interval over
    # the rounds (its upper end the measured value), and no note (every case timed in both states).
    bench = ops_bench.Bench(ops_bench.QUICK, 1, lambda msg: None)
    bench.case_parity()
    assert not bench.r.notes, bench.r.notes
    assert len(bench.r.checks) == len(ops_bench.LIMIT_DECAYS) + 1
    for check in bench.r.checks:
        assert f"paired in one process over {ops_bench.QUICK.parity_rounds} rounds" in check.name
        low, high = (float(x) for x in check.name.split("[")[1].split("]")[0].split(", "))
        # printed to 3 decimals; 2 rounds give wide intervals, whose low end may print as 0.000
        assert 0 <= low <= high == pytest.approx(check.measured, rel=1e-3, abs=1e-3)


def test_limit_case_runs_each_allocator_in_a_worker():
    # The limit case's workers (one fresh process per allocator) at the quick sizes: every check
    # gets a measurement (each share paired over the rounds), each allocator's timings and the
    # batched matmul reference come back, and the table has one row per compared timing.
    bench = ops_bench.Bench(ops_bench.QUICK, 1, lambda msg: None)
    bench.case_limit()
    names = [c.name for c in bench.r.checks]
    assert len(names) == len(ops_bench.LIMIT_DECAYS) + 2, names
    shares = [n for n in names if "batched matmul throughput" in n]
    assert len(shares) == len(ops_bench.LIMIT_DECAYS)
    assert all(f"paired over {ops_bench.QUICK.limit_rounds} rounds" in n for n in shares), shares
    assert all(c.measured is not None and c.measured > 0 for c in bench.r.checks), bench.r.notes
    assert "limit, system allocator worker: system" in bench.r.notes
    assert any(n.startswith("limit, retain allocator worker: retain") for n in bench.r.notes)
    assert {k.split(":")[0] for k in bench.r.timings} == {"retain", "system"}
    assert len(bench.r.limit) == len(ops_bench.LIMIT_DECAYS) + 1
    assert sum("batched matmul throughput" in what for what, _ in bench.r.info) == 2
    text = ops_bench.render(bench.r, ops_bench.QUICK, {}, ["limit"])
    assert "## Against the batched matmul limit, by host allocator" in text
    assert "column decay [B,T,H,1,D] (system allocator)" in text
