"""The run section: how a run runs (device, threads, logging, ...) kept apart from what it trains.
It is no part of the training config, so run ids and resumes ignore it; an older config's
``train.threads`` (the committed runs, an old --set) is read as ``run.threads``, never both."""

import dataclasses
import io

import pytest
import yaml

from lcsm.engine import RunConfig, RuntimeConfig, TrainConfig, apply_overrides, load_config
from lcsm.engine.sweep import Equivalents, load_experiment, runner

from .conftest import TINY, write_config

OTHER = {
    "device": "cpu",
    "threads": 3,
    "host_allocator": "retain",
    "log_every": 1,
    "tensorboard": True,
    "keep_last": 7,
    "on_nonfinite": "skip",
    "parallel": "fsdp",
    "activation_checkpointing": True,
    "compile": "aot_eager",
}


def test_no_runtime_setting_is_part_of_the_training_config():
    assert set(OTHER) == {f.name for f in dataclasses.fields(RuntimeConfig)}
    default = RunConfig.from_dict(TINY)
    for key, value in OTHER.items():
        assert getattr(default.run, key) != value
        changed = RunConfig.from_dict(apply_overrides(TINY, {f"run.{key}": value}))
        assert getattr(changed.run, key) == value
        assert changed.training_dict() == default.training_dict(), key
    assert "run" not in default.training_dict()
    assert not set(OTHER) & set(default.training_dict()["train"])


def test_an_older_config_gives_the_runtime_settings_in_train():
    old = {**TINY, "train": {**TINY["train"], **OTHER}}
    del old["run"]
    config = RunConfig.from_dict(old)
    assert config.run == RuntimeConfig(**OTHER)
    assert config.to_dict()["run"] == OTHER and not set(OTHER) & set(config.to_dict()["train"])
    assert config.training_dict() == RunConfig.from_dict(TINY).training_dict()
    # a sweep compares a finished run of an older config with today's by the same sections
    assert Equivalents._typed_sections(old) == Equivalents._typed_sections(TINY)


def test_a_setting_in_both_places_fails_naming_both():
    with pytest.raises(ValueError, match=r"train.threads: the older spelling of run.threads, and both are given "):
        RunConfig.from_dict(apply_overrides(TINY, {"train.threads": 2}))  # TINY has run.threads: 1


def test_the_sections_name_where_a_setting_belongs():
    with pytest.raises(
        ValueError,
        match=r"train: threads: a setting of how the run runs, in the run section \(run.threads: 2\), not in train",
    ):
        TrainConfig.from_dict({"max_steps": 1, "threads": 2})
    with pytest.raises(ValueError, match=r"run: unknown key\(s\) 'thread' \(did you mean 'threads'\?\)"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.thread": 2}))
    with pytest.raises(ValueError, match=r"run: unknown key\(s\) 'max_steps'"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.max_steps": 2}))
    with pytest.raises(ValueError, match=r"run.threads: expected an integer >= 1 or None, got 0"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.threads": 0}))


@pytest.mark.parametrize("value", [3, True, 2.5, [1, 2]])
def test_a_section_that_is_no_mapping_is_named(value):
    """model.mixer_options of a scalar was a TypeError from the error's renaming, not its message."""
    with pytest.raises(ValueError, match=r"model.mixer_options: expected a mapping of options, got "):
        RunConfig.from_dict(apply_overrides(TINY, {"model.mixer_options": value}))


def test_set_takes_either_spelling(tmp_path):
    """``--set run.threads=2``; ``--set train.threads=2``, the older spelling, where the config
    gives no run.threads."""
    new = write_config(tmp_path / "new.yaml", TINY)
    assert load_config(new, ["run.threads=2"]).run.threads == 2
    no_threads = write_config(tmp_path / "no_threads.yaml", {**TINY, "run": {"log_every": 2}})
    assert load_config(no_threads, ["train.threads=2"]).run.threads == 2
    with pytest.raises(ValueError, match=r"train.threads: the older spelling of run.threads"):
        load_config(new, ["train.threads=2"])


def test_parallel_sweep_runs_get_their_threads_in_the_run_section(tmp_path, monkeypatch):
    """A sweep with --parallel sets each run's threads; an older experiment's train.threads is
    moved, not left beside it (the run would refuse both)."""
    old = {**TINY, "train": {**TINY["train"], "threads": 1}}
    del old["run"]
    (tmp_path / "exp.yaml").write_text(
        yaml.safe_dump({"name": "exp", "config": old, "grid": {"optim.lr": [1e-3, 2e-3]}})
    )
    exp = load_experiment(tmp_path / "exp.yaml", out_dir=tmp_path / "out")

    class Done:
        returncode = 0
        stdout = io.StringIO("")

        def __init__(self, *args, **kwargs):
            pass

        def poll(self):
            return 0

    monkeypatch.setattr(runner.subprocess, "Popen", Done)
    assert runner.execute(exp.runs(), parallel=2, log=lambda *_: None) == {r.id: 0 for r in exp.runs()}
    for run in exp.runs():
        written = yaml.safe_load((run.out_dir / "config.yaml").read_text())
        assert "threads" not in written["train"] and written["run"]["threads"] >= 1
        RunConfig.from_dict(written)
