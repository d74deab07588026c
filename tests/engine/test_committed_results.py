"""The committed results: every run under results/<name>/ is a run of the committed experiment
file <name> with the training config that file gives it, and each report counts the runs there.

Issue 6 asks that every number in results/ come from a run whose config is committed. A run
left behind by a changed grid or base, or a report not regenerated after new runs, fails here.
"""

import json
import re
from pathlib import Path

import pytest

from lcsm.engine.config import read_yaml
from lcsm.engine.sweep import cached_result, load_experiment
from lcsm.tasks.lm import LanguageModelling

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
# The paper experiments, as the Makefile's `reports` target lists them.
EXPERIMENTS = sorted(
    p for p in REPO.glob("experiments/*/*.yaml") if p.parent.name != "configs" and not p.name.endswith("base.yaml")
)


@pytest.fixture
def offline_lm_vocabulary(monkeypatch, tmp_path):
    """Validating an LM run config trains its BPE tokenizer on the corpus for the vocabulary size,
    and the corpus is downloaded; the vocabulary is not part of a run's training config (the model
    section is compared as written), so its upper bound stands in here."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        LanguageModelling,
        "vocab_size",
        property(lambda self: 257 if self.config.tokenizer == "byte" else self.config.bpe_vocab),
    )


def test_every_paper_experiment_is_found():
    assert len(EXPERIMENTS) >= 20 and all(p.suffix == ".yaml" for p in EXPERIMENTS)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_runs_are_runs_of_the_committed_experiment(path, offline_lm_vocabulary):
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
