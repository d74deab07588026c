"""Smoke test of the efficiency benchmark (bench/efficiency_bench.py, ``lcsm bench efficiency``)
in its tiny --quick configuration: it runs end to end and writes every table with one row per
model. Timings are machine-dependent and not asserted."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import efficiency_bench  # noqa: E402
from lcsm.cli import main as cli_main  # noqa: E402


def _section(text: str, heading: str) -> list:
    body = text.split(heading)[1].split("\n## ")[0]
    return [line for line in body.splitlines() if line.startswith("| ")]


def test_quick_run_writes_every_table(tmp_path, capsys, monkeypatch):
    out = tmp_path / "efficiency.md"
    threads = torch.get_num_threads()
    # the report is on disk after each stage, whole (renamed into place), before the run's end
    partial = []
    replace = efficiency_bench.os.replace
    monkeypatch.setattr(
        efficiency_bench.os, "replace", lambda a, b: (replace(a, b), partial.append(Path(b).read_text()))[0]
    )
    assert cli_main(["bench", "efficiency", "--quick", "--threads", "1", "--out", str(out)]) == 0
    z = efficiency_bench.QUICK
    assert len(partial) == len(z.train) + 1 and all("- partial report: written after " in t for t in partial)
    assert f"training at T={z.train[0]}; the run did not reach its end" in partial[0] and "decoding" in partial[-1]
    assert "| transformer | " in partial[0] and "partial report" not in out.read_text()
    assert torch.get_num_threads() == threads  # main() restores the process-wide setting
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "- git commit: " in text and "- machine cpu: " in text and "- wall time: " in text
    assert "--quick" in text and "load average" in text and "- allocator: " in text and "- device: cpu" in text
    models = efficiency_bench.MODELS
    for heading in ("## Models", "## Training throughput", "## Peak memory", "## Decoding"):
        rows = _section(text, heading)
        for name in models:
            row = next((r for r in rows if r.startswith(f"| {name} |")), None)
            assert row is not None, (heading, name)
            assert "n/a" not in row and "—" not in row, (heading, row)  # every cell was measured
    checks = _section(text, "## Checks")[2:]
    assert len(checks) == 2 * len(efficiency_bench.LINEAR) + 2
    assert all(r.rstrip(" |").rsplit("|", 1)[-1].strip() in ("PASS", "FAIL") for r in checks), checks
    assert f"T={z.train[-1]}" in checks[0] and f"context {z.decode[-1]} / {z.decode[0]}" in checks[-3]
    assert "## Notes" not in text  # no measurement failed
    assert "shown for comparison" not in text  # the targets are this CPU's


def test_models_are_of_comparable_size():
    z = efficiency_bench.FULL
    counts = {
        n: efficiency_bench.build_model(efficiency_bench.model_config(n, z), verbose=False).num_parameters()
        for n in efficiency_bench.MODELS
    }
    base = counts[efficiency_bench.BASELINE]
    assert all(0.8 <= c / base <= 1.3 for c in counts.values()), counts


def test_device_option_errors_name_it(capsys):
    bad = ["tpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda"])
    for value in bad:
        try:
            cli_main(["bench", "efficiency", "--quick", "--device", value])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"--device {value} was accepted")
        err = capsys.readouterr().err
        assert "--device" in err and repr(value) in err, err


def test_cuda_timers_wait_for_the_device(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    efficiency_bench.timed(lambda: events.append("work"), torch.device("cuda"))
    assert events == ["sync", "work", "sync"]
    events.clear()
    efficiency_bench.timed(lambda: events.append("work"), torch.device("cpu"))
    assert events == ["work"]


def test_intervals_pair_the_models_by_round_and_turn():
    """Round k's Transformer step against round k's GLA step: a machine that slows down from round
    to round leaves a constant 3x ratio with no width; decoding growth pairs each turn's latency
    at the long context with the same turn's at the short one."""
    r = efficiency_bench.Results({}, {}, {}, {}, {}, {}, {}, [], torch.device("cpu"))
    r.train["transformer", 64], r.train["gla", 64] = [3.0, 6.0, 12.0], [1.0, 2.0, 4.0]
    assert efficiency_bench.speedup_interval(r, "gla", 64) == pytest.approx((3.0, 3.0, 3.0))
    assert efficiency_bench.speedup_interval(r, "mamba", 64) is None  # not measured
    r.decode_turns["gla", 1], r.decode_turns["gla", 2] = [1.0, 2.0], [1.0, 2.0]
    r.decode_turns["transformer", 1], r.decode_turns["transformer", 2] = [1.0, 3.0], [4.0, 12.0]
    assert efficiency_bench.growth_interval(r, "gla", 1, 2) == pytest.approx((1.0, 1.0, 1.0))
    assert efficiency_bench.growth_interval(r, "gla", 1, 2, against="transformer") == pytest.approx((4.0, 4.0, 4.0))


def test_checks_off_the_cpu_say_whose_targets_they_are():
    names = efficiency_bench.MODELS
    r = efficiency_bench.Results(
        {n: 1 for n in names}, {n: n for n in names}, {}, {}, {}, {}, {}, [], torch.device("cuda")
    )
    text = efficiency_bench.render(r, efficiency_bench.QUICK, {})
    checks = text.split("## Checks", 1)[1]
    assert checks.lstrip().startswith("The targets are set for a 2-core CPU; on cuda")
    assert "not measured" in checks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_run_on_cuda(tmp_path, capsys):
    assert cli_main(["bench", "efficiency", "--quick", "--device", "cuda", "--out", str(tmp_path / "e.md")]) == 0
    text = capsys.readouterr().out
    assert "- device: cuda" in text and "CUDA caching allocator's peak" in text and "## Notes" not in text
    assert "targets are set for a 2-core CPU; on cuda they are shown for comparison" in text
