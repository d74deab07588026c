"""The report's template: the verdict box and file, the per-report command, the run log, and the
module layering (results <- sweep, results <- report, with no cycle)."""

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lcsm.engine import report as report_mod
from lcsm.engine.report import read_verdict, report_command, run_log, verdict_box

ENGINE = Path(report_mod.__file__).parent


def _engine_imports(path: Path) -> set[str]:
    """The engine modules ``path`` imports at run time (``if TYPE_CHECKING`` blocks skipped)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and id(node) not in typing_only:
            names.add(node.module)
    return names


def test_report_and_results_do_not_import_sweep():
    assert "sweep" not in _engine_imports(ENGINE / "report.py")
    assert not {"sweep", "report"} & _engine_imports(ENGINE / "results.py")
    # nor any module of the sweep package
    for path in (ENGINE / "report.py", ENGINE / "results.py"):
        assert not [m for m in _engine_imports(path) if m.startswith("sweep.")]


def test_verdict_file_and_box(tmp_path):
    assert read_verdict(tmp_path / "VERDICT.md") is None
    path = tmp_path / "VERDICT.md"
    path.write_text("ours: x beats y by 2 points\nverdict: supported\n\n- one\n- two,\n  continued\n")
    verdict = read_verdict(path)
    assert verdict == {
        "ours": "x beats y by 2 points",
        "verdict": "supported",
        "bullets": ["- one", "- two,", "  continued"],
    }
    box = verdict_box("The paper: x beats y\n(Table 2).", verdict)
    assert box[2] == "| The paper: x beats y (Table 2). | x beats y by 2 points | **supported** |" and len(box) <= 5
    assert verdict_box("| a | b |\n|---|---|", None)[2].startswith("| the paper's numbers: below |")
    path.write_text("ours: x\nverdict: maybe\n\n- one\n")
    with pytest.raises(ValueError, match="'verdict:' one of supported"):
        read_verdict(path)
    path.write_text("ours: x\nverdict: open\n\n" + "".join(f"- {i}\n" for i in range(11)))
    with pytest.raises(ValueError, match="at most 10 bullets"):
        read_verdict(path)


def test_each_report_of_a_multi_file_call_names_its_own_command(tmp_path, monkeypatch):
    """`lcsm report a.yaml b.yaml --out results` writes a report per experiment, each naming the
    command that writes it alone (reliability review A16), and a sweep's report its own command."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lcsm", "report", "exp/a.yaml", "exp/b.yaml", "--out", "results"])
    b = SimpleNamespace(path=Path("exp/b.yaml"), out_dir=Path("results/b"))
    assert report_command(b, Path("results/b")) == "lcsm report exp/b.yaml --out results/b"
    sweep_dir = SimpleNamespace(path=Path("runs/b/experiment.yaml"), out_dir=Path("runs/b"))
    assert report_command(sweep_dir, Path("runs/b")) == "lcsm report runs/b"
    assert report_command(sweep_dir, Path("results/b")) == "lcsm report runs/b --out results/b"
    monkeypatch.setattr(sys, "argv", ["lcsm", "sweep", "exp/b.yaml", "--grid", "model.mixer=gla", "--report"])
    assert report_command(b, Path("runs/b")) == "lcsm sweep exp/b.yaml --grid model.mixer=gla --report"


def test_run_log_from_the_runs_records(tmp_path):
    """Where (each machine's steps), when (train.csv's first and last times), at which commit and,
    for a copy, from which experiment each run trained; a missing run says so."""
    gpu = {"device": "cuda", "cpu": "Xeon", "torch": "2.11"}
    cpu = {"device": "cpu", "cpu": "EPYC", "torch": "2.13"}
    run = tmp_path / "a-1"
    run.mkdir()
    result = {
        "status": "completed",
        "step": 200,
        "wall_time_s": 12.4,
        "config": {"name": "other_exp/code=1"},
        "machine": cpu,
        "trained_on": [
            {**gpu, "git_commit": "abc", "from_step": 0, "to_step": 100},
            {**cpu, "git_commit": "def", "from_step": 100, "to_step": 200},
        ],
    }
    (run / "result.json").write_text(json.dumps(result))
    (run / "train.csv").write_text("step,time,loss\n50,1764547200.0,1.0\n200,1764550800.0,0.5\n")
    exp = SimpleNamespace(name="this_exp", out_dir=tmp_path)
    text = run_log(exp, [{"run": "a-1", "status": "completed"}, {"run": "b-2", "status": "missing"}])
    row = next(line for line in text.splitlines() if line.startswith("| a-1 |"))
    assert row == (
        "| a-1 | completed | 200 | 12 | 2025-12-01 00:00 - 2025-12-01 01:00 | cuda; Xeon; torch 2.11 (0-100) then "
        "cpu; EPYC; torch 2.13 (100-200) | abc then def | other_exp |"
    )
    assert "| b-2 | missing |" in text and "1 of 2 runs finished" in text
