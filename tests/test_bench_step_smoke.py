"""Smoke test of the step benchmark (bench/step_bench.py, ``lcsm bench step``) on a tiny MQAR
config: every variant is built, timed and reported with its ratio to the first. Timings are
machine-dependent and not asserted."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import step_bench  # noqa: E402
from lcsm.cli import main as cli_main  # noqa: E402

TINY = [
    "--set",
    "task.train_examples=64",
    "--set",
    "task.test_examples=16",
    "--set",
    "model.d_model=16",
    "--set",
    "train.batch_size=8",
    "--set",
    "train.max_steps=10",
]


def test_variants_are_timed_side_by_side(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "step.md"
    threads = torch.get_num_threads()
    argv = [
        "bench",
        "step",
        str(REPO / "experiments/configs/mqar_demo.yaml"),
        *TINY,
        "--variant",
        "gla=model.mixer=gla",
        "--variant",
        "lcsm1=model.mixer=lcsm:1-1-1-0,model.n_layers=1",
        "--steps",
        "1",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 0
    assert torch.get_num_threads() == threads  # main() restores the process-wide setting
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "- git commit: " in text and "- machine cpu: " in text and "- wall time: " in text
    assert "- host allocator: " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split("|")[1].strip() for r in rows] == ["gla", "lcsm1"]
    assert rows[0].split("|")[6].strip() == "1.00x"
    assert "model.mixer=lcsm:1-1-1-0 model.n_layers=1" in rows[1] and "(10 steps)" in rows[1]


@pytest.mark.parametrize("text", ["nolabel", "=model.d_model=8", "label=", "label=model.d_model"])
def test_bad_variants_are_refused(text):
    with pytest.raises(ValueError, match="^--variant"):
        step_bench.parse_variant(text)


def test_a_variant_value_may_be_a_mapping_with_commas():
    label, overrides = step_bench.parse_variant("a=model.mixer_options={expand: 32, chunk_size: 16},optim.lr=1e-3")
    assert label == "a" and overrides == ["model.mixer_options={expand: 32, chunk_size: 16}", "optim.lr=1e-3"]


def test_variants_must_share_the_host_allocator(tmp_path, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--variant: run.host_allocator acts on the whole process"):
        step_bench.time_steps(
            str(REPO / "experiments/configs/mqar_demo.yaml"),
            TINY[1::2],
            [("a", ["train.host_allocator=system"]), ("b", ["train.host_allocator=retain"])],
            1,
            print,
        )
