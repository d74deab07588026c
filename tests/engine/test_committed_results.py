"""The committed results: every run under results/<name>/ is a run of the committed experiment
file <name> with the training config that file gives it, each report counts the runs there and
carries the hand-written verdict beside it, and the experiment file holds a claim, not prose.

Every number in results/ must come from a run whose config is committed. A run
left behind by a changed grid or base, or a report not regenerated after new runs, fails here.
"""

import json
import re
from pathlib import Path

import pytest

from lcsm.engine.config import read_yaml
from lcsm.engine.report import MAX_CLAIM_LINES, RUNLOG_FILE, VERDICT_FILE, read_verdict
from lcsm.engine.sweep import cached_result, load_experiment, sweep

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
# The experiments with committed results, as the Makefile's `reports` target lists them: the
# paper experiments and the top-level ones but the demos, whose runs go to runs/ (experiments/gpu/
# holds plans for a GPU loan and experiments/planned/ CPU experiments fixed before their runs, both
# without committed runs yet).
PLANS = ("gpu", "planned")
EXPERIMENTS = sorted(
    [
        p
        for p in REPO.glob("experiments/*/*.yaml")
        if p.parent.name not in ("configs", *PLANS) and not p.name.endswith("base.yaml")
    ]
    + [p for p in REPO.glob("experiments/*.yaml") if not p.stem.endswith("_demo")]
)


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """Task data, if any were made, under the test's own directory (validating a run config makes
    none: an LM's corpus is read only when its run is built)."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))


def test_every_paper_experiment_is_found():
    assert len(EXPERIMENTS) >= 20 and all(p.suffix == ".yaml" for p in EXPERIMENTS)


@pytest.mark.parametrize(
    "path", sorted(p for d in PLANS for p in REPO.glob(f"experiments/{d}/*.yaml")), ids=lambda p: p.stem
)
def test_gpu_plans_build_every_run(path, own_cache, tmp_path):
    """A GPU loan is too short to meet a plan that does not load: each plan's runs build (a dry run,
    which trains nothing), on the CPU as here; so do the planned CPU experiments'."""
    log = []
    exp = load_experiment(path, out_dir=tmp_path / "out")
    sweep(exp, dry_run=True, log=log.append)
    assert sum(line.startswith("  to run") for line in log) == len(list(exp.runs())) > 0, log


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_runs_are_runs_of_the_committed_experiment(path, own_cache):
    name = read_yaml(path).get("name", path.stem)
    out = RESULTS / name
    assert out.is_dir(), f"{path.relative_to(REPO)}: no results directory results/{name}/"
    exp = load_experiment(path, out_dir=out)
    runs = {run.id: run for run in exp.runs()}
    committed = sorted(p.parent.name for p in out.glob("*/result.json"))
    stray = [d for d in committed if d not in runs]
    assert not stray, f"results/{name}/: run directories not in the grid of {path.name}: {stray}"
    changed = [d for d in committed if cached_result(runs[d]) is None]
    assert not changed, f"results/{name}/: runs whose training config is not what {path.name} gives: {changed}"
    for d in committed:
        result = json.loads((out / d / "result.json").read_text())
        assert result["status"] in ("completed", "early_stopped") and (out / d / "config.yaml").is_file(), f"{name}/{d}"

    report = (out / "report.md").read_text()
    counted = re.search(r"^- runs: (\d+) of (\d+) finished", report, re.M)
    assert counted, f"results/{name}/report.md: no '- runs: N of M finished' line"
    assert (int(counted[1]), int(counted[2])) == (len(committed), len(runs)), (
        f"results/{name}/report.md counts {counted[1]} of {counted[2]} runs, the directory holds "
        f"{len(committed)} of {len(runs)}: regenerate it with `lcsm report {path.relative_to(REPO)} --out "
        f"results/{name}`"
    )


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_report_opens_with_its_verdict(path):
    """The experiment file states the paper's claim in at most 5 lines and keeps no reading; the
    verdict is hand-written in results/<name>/VERDICT.md (at most 10 bullets, read_verdict checks),
    and the committed report shows it as written now, with its generated run log beside it."""
    spec = read_yaml(path)
    name = spec.get("name", path.stem)
    text = path.read_text()
    claim = re.search(r"^paper:.*?(?=^\S|\Z)", text, re.M | re.S)
    lines = len(claim[0].strip().splitlines()) if claim else 0
    assert 1 <= lines <= MAX_CLAIM_LINES, f"{path.name}: 'paper' is {lines} lines; the paper's claim takes 1-5"
    assert "reading" not in spec, f"{path.name}: the reading goes to results/{name}/{VERDICT_FILE}"
    out = RESULTS / name
    verdict = read_verdict(out / VERDICT_FILE)
    assert verdict, f"results/{name}/: no {VERDICT_FILE}"
    report = (out / "report.md").read_text()
    assert f"| **{verdict['verdict']}** |" in report.split("\n\n")[1], f"results/{name}/report.md: no verdict box first"
    assert "\n".join(verdict["bullets"]) in report, (
        f"results/{name}/report.md does not show {VERDICT_FILE} as written: regenerate it with "
        f"`lcsm report {path.relative_to(REPO)} --out results/{name}`"
    )
    assert (out / RUNLOG_FILE).is_file(), f"results/{name}/: no {RUNLOG_FILE}"
