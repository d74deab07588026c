"""Checkpoint / resume: a run interrupted anywhere (SIGINT, SIGTERM, SIGKILL, a lost tail of
checkpoints) and resumed ends with bit-identical weights to the uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lcsm.engine import RunConfig, apply_overrides, train
from lcsm.engine.sweep import machine_label
from lcsm.engine.trainer import Trainer, discard_run

from .conftest import TINY, cli_env, write_config

# Dropout makes the RNG state part of what a checkpoint must restore. The signal is sent once the
# first checkpoint (step 10) is on disk: 50 steps, 3 epochs of TINY's 16 steps, lie after it.
LONG = apply_overrides(
    TINY,
    {
        "model.dropout": 0.1,
        "train.max_steps": 60,
        "train.save_every": 10,
        "train.eval_every": 20,
        "run.keep_last": 3,
        "run.log_every": 10,
    },
)


def final_weights(run_dir):
    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(last / "model.safetensors"))


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def metric_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")} for r in rows]


def died_after_step(run_dir, step=4):
    """Leave a finished run as if its process had died right after the checkpoint of ``step``."""
    for path in (run_dir / "checkpoints").glob("step-*"):
        if path.name != f"step-{step:08d}":
            shutil.rmtree(path)
    (run_dir / "result.json").unlink()


@pytest.mark.parametrize("stop, steps", [(4, 12), (20, 24)], ids=["epoch-0", "epoch-1"])
def test_resume_from_a_middle_checkpoint_is_exact(cache_env, stop, steps):
    """Resumed in the first epoch or in the second (TINY has 16 batches an epoch), the run ends as
    the uninterrupted one: the epoch's batch order, position in it, RNG, optimizer, schedule."""
    values = apply_overrides(TINY, {"model.dropout": 0.1, "run.keep_last": 10, "train.max_steps": steps})
    train(RunConfig.from_dict({**values, "out_dir": str(cache_env / "a")}), quiet=True)
    b = cache_env / "b"
    train(RunConfig.from_dict({**values, "out_dir": str(b)}), quiet=True)
    died_after_step(b, stop)
    result = train(RunConfig.from_dict({**values, "out_dir": str(b)}), quiet=True)
    assert result["step"] == steps
    assert_identical(final_weights(cache_env / "a"), final_weights(b))
    assert metric_rows(cache_env / "a") == metric_rows(b)
    # resumed on the same machine and code: one stretch of steps
    assert [(m["device"], m["from_step"], m["to_step"]) for m in result["trained_on"]] == [("cpu", 0, steps)]


def test_a_run_resumed_on_another_machine_records_both(cache_env):
    values = apply_overrides(TINY, {"run.keep_last": 10})
    run = cache_env / "a"
    train(RunConfig.from_dict({**values, "out_dir": str(run)}), quiet=True)
    died_after_step(run)
    # As if the first 4 steps had run on a GPU.
    saved = run / "checkpoints" / "step-00000004" / "trainer.pt"
    trainer = torch.load(saved, weights_only=True)
    assert [(m["from_step"], m["to_step"]) for m in trainer["state"]["trained_on"]] == [(0, 4)]
    trainer["state"]["trained_on"][0]["device"] = "cuda:0 NVIDIA H200"
    torch.save(trainer, saved)
    result = train(RunConfig.from_dict({**values, "out_dir": str(run)}), quiet=True)
    assert [(m["device"], m["from_step"], m["to_step"]) for m in result["trained_on"]] == [
        ("cuda:0 NVIDIA H200", 0, 4),
        ("cpu", 4, 12),
    ]
    assert result["machine"]["device"] == "cpu"
    assert machine_label(result) == (
        f"cuda:0 NVIDIA H200; {result['machine']['cpu']}; torch {torch.__version__} then "
        f"cpu; {result['machine']['cpu']}; torch {torch.__version__}"
    )


def test_a_finished_run_is_not_retrained(cache_env, monkeypatch, capsys):
    """Run again, a finished run returns its recorded result: no step trained, nothing evaluated
    again, its result (commit, machine, wall time) and logs untouched."""
    cfg = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")})
    first = train(cfg, quiet=True)
    run_files = {p: p.read_bytes() for p in (cache_env / "a").rglob("*") if p.is_file()}

    def evaluates(self, split=None):
        raise AssertionError("a finished run evaluated again")

    monkeypatch.setattr(Trainer, "evaluate", evaluates)
    again = train(cfg)
    assert again == json.loads(json.dumps(first))
    assert {p: p.read_bytes() for p in (cache_env / "a").rglob("*") if p.is_file()} == run_files
    assert "finished already (completed at step 12)" in capsys.readouterr().err
    # another thread count: nothing is trained, so nothing continues "not bit-identically"
    train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a"), "run": {"threads": 2}}))
    err = capsys.readouterr().err
    assert "finished already" in err and "not bit-identically" not in err


def test_a_finished_run_without_checkpoints_is_kept(cache_env, monkeypatch):
    """The committed runs of results/ keep no checkpoints: run again with its config, such a run
    returns its result (it was trained again and its result replaced); with another config, or
    asked not to resume, it is refused rather than replaced; --restart trains it anew."""
    cfg = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")})
    first = train(cfg, quiet=True)
    shutil.rmtree(cache_env / "a" / "checkpoints")
    kept = (cache_env / "a" / "result.json").read_bytes()
    monkeypatch.setattr(Trainer, "evaluate", lambda *a, **k: pytest.fail("a finished run evaluated again"))
    assert train(cfg, quiet=True) == json.loads(json.dumps(first))
    changed = RunConfig.from_dict(apply_overrides(TINY, {"optim.lr": 1e-2, "out_dir": str(cache_env / "a")}))
    with pytest.raises(
        ValueError, match=r"result of a finished run .* different training config \(differs in optim.lr\)"
    ):
        train(changed, quiet=True)
    with pytest.raises(ValueError, match="result of a finished run .*resume it, or start over with --restart"):
        train(cfg, resume=False, quiet=True)
    assert (cache_env / "a" / "result.json").read_bytes() == kept
    monkeypatch.undo()
    assert train(changed, restart=True, quiet=True)["config"]["optim"]["lr"] == 1e-2


def test_a_stop_during_the_last_step_comes_before_the_final_evaluation(cache_env, monkeypatch):
    """Ctrl-C during the last step (which ends the loop by itself) still stops the run: its
    checkpoint written, nothing evaluated; run again, it evaluates and ends as an uninterrupted run."""
    reference = train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "reference")}), quiet=True)
    step = Trainer.train_step

    def interrupted_in_the_last(self, batch):
        if self.state.step == self.total_steps - 1:
            os.kill(os.getpid(), signal.SIGINT)  # the handler sets the flag the loop reads
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted_in_the_last)
    cfg = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, quiet=True)
    assert (cache_env / "a" / "checkpoints" / "step-00000012").is_dir() and not (
        cache_env / "a" / "result.json"
    ).exists()
    monkeypatch.undo()
    result = train(cfg, quiet=True)
    assert (result["step"], result["metrics"], result["best"]) == (12, reference["metrics"], reference["best"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_the_last_checkpoints_write_loses_no_step(cache_env, monkeypatch, signum):
    """A signal right after the last step, while its checkpoint is written (the loop has ended):
    the write completes under the loop's handling, the run stops before the final evaluation, and
    the next call evaluates; a SIGTERM had killed the process, a Ctrl-C had cut the write."""
    reference = train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "reference")}), quiet=True)
    save = Trainer.save

    def signalled_while_saving_the_last(self, name=None):
        if name is None and self.state.step == self.total_steps:
            os.kill(os.getpid(), signum)
        return save(self, name)

    monkeypatch.setattr(Trainer, "save", signalled_while_saving_the_last)
    cfg = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a"), "train": {**TINY["train"], "save_every": 0}})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, quiet=True)
    last = cache_env / "a" / "checkpoints" / "step-00000012"
    assert (last / "model.safetensors").is_file() and not (cache_env / "a" / "result.json").exists()
    monkeypatch.undo()
    result = train(cfg, quiet=True)
    assert (result["step"], result["metrics"], result["best"]) == (12, reference["metrics"], reference["best"])


def test_a_failed_final_evaluation_loses_no_training(cache_env, monkeypatch):
    """The last checkpoint is written before the final evaluation: run again, the run evaluates
    and ends as an uninterrupted one, no step retrained."""
    reference = train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "reference")}), quiet=True)
    evaluate = Trainer.evaluate

    def fails_at_the_end(self, split=None):
        if self.state.step == 12:
            raise RuntimeError("out of memory")
        return evaluate(self, split)

    monkeypatch.setattr(Trainer, "evaluate", fails_at_the_end)
    cfg = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")})
    with pytest.raises(RuntimeError, match="out of memory"):
        train(cfg, quiet=True)
    last = cache_env / "a" / "checkpoints" / "step-00000012"
    stamp = (last / "model.safetensors").stat().st_mtime_ns
    monkeypatch.undo()
    result = train(cfg, quiet=True)
    assert (last / "model.safetensors").stat().st_mtime_ns == stamp
    assert (result["status"], result["metrics"], result["best"]) == (
        "completed",
        reference["metrics"],
        reference["best"],
    )
    assert metric_rows(cache_env / "a") == metric_rows(cache_env / "reference")
    assert_identical(final_weights(cache_env / "a"), final_weights(cache_env / "reference"))


def test_resume_refuses_a_different_config(cache_env):
    train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")}), quiet=True)
    changed = apply_overrides(TINY, {"optim.lr": 1e-2, "out_dir": str(cache_env / "a")})
    with pytest.raises(ValueError, match="different training config.*optim.lr"):
        train(RunConfig.from_dict(changed), quiet=True)
    result = train(RunConfig.from_dict(changed), restart=True, quiet=True)
    assert result["config"]["optim"]["lr"] == 1e-2


def test_discarding_a_run_leaves_only_what_it_did_not_write(cache_env):
    """--restart's discard: every file and folder a finished run wrote goes (a stale one would be
    read as the new run's), a file of the user's own in the directory stays."""
    out = cache_env / "a"
    train(RunConfig.from_dict({**TINY, "out_dir": str(out)}), quiet=True)
    (out / "notes.txt").write_text("mine")
    discard_run(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_resume_refuses_other_task_data(cache_env, monkeypatch):
    """A task whose generator changed its data for the same options (a new generator_version)
    would continue a checkpoint on other data."""
    from lcsm.tasks import resolve

    config = RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")})
    result = train(config, quiet=True)
    mqar = resolve("mqar")
    assert result["task_data"] == {"task": "mqar", "generator_version": mqar.generator_version}
    monkeypatch.setattr(mqar, "generator_version", mqar.generator_version + 1)
    with pytest.raises(ValueError, match="task 'mqar', generator version 1, but this lcsm makes version 2.*other data"):
        train(config, quiet=True)
    assert train(config, restart=True, quiet=True)["task_data"]["generator_version"] == 2


def test_a_checkpoint_without_task_data_is_of_the_versions_before_records(cache_env, monkeypatch):
    """Checkpoints from before runs recorded their task data trained on the generator versions of
    that time (VERSIONS_BEFORE_RECORDS), which resuming compares like a recorded one."""
    from lcsm.tasks import base

    config = RunConfig.from_dict(
        {**apply_overrides(TINY, {"train.max_steps": 4, "train.save_every": 2}), "out_dir": str(cache_env / "a")}
    )
    train(config, quiet=True)
    for info_path in (cache_env / "a" / "checkpoints").glob("*/run.json"):
        info = json.loads(info_path.read_text())
        del info["task_data"]
        info_path.write_text(json.dumps(info))
    monkeypatch.setitem(base.VERSIONS_BEFORE_RECORDS, "mqar", 0)
    with pytest.raises(ValueError, match="generator version 0, but this lcsm makes version 1"):
        train(config, quiet=True)


def _train_cmd(config_path, out):
    return [sys.executable, "-m", "lcsm", "train", str(config_path), "--out", str(out)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, in a subprocess like the interrupted ones (same threads, same code path)."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = write_config(tmp / "long.yaml", LONG)
    proc = subprocess.run(_train_cmd(cfg, tmp / "run"), env=cli_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["SIGKILL", "SIGINT", "SIGTERM"])
def test_interrupted_run_resumes_bit_exactly(tmp_path, reference_run, sig):
    cfg = write_config(tmp_path / "long.yaml", LONG)
    run = tmp_path / "run"
    env = cli_env(tmp_path)
    proc = subprocess.Popen(_train_cmd(cfg, run), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((run / "checkpoints").glob("step-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    # The kill must land mid-run, or this test would prove nothing.
    assert not (run / "result.json").exists()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, err
        assert "interrupted at step" in err and "run the same command again to resume" in err
    stopped_at = sorted((run / "checkpoints").glob("step-*"))[-1].name
    resumed = subprocess.run(_train_cmd(cfg, run), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"from {run / 'checkpoints' / stopped_at}" in resumed.stderr
    assert_identical(final_weights(reference_run), final_weights(run))
    assert metric_rows(reference_run) == metric_rows(run)


def test_a_quiet_run_still_says_where_it_stopped(cache_env, capsys, monkeypatch):
    """--quiet silences the progress, not the line that says which checkpoint to resume from."""
    from lcsm.engine import trainer

    class StoppedAtOnce(trainer._StopRequest):
        def __enter__(self):
            super().__enter__()
            self.requested = True
            return self

    monkeypatch.setattr(trainer, "_StopRequest", StoppedAtOnce)
    with pytest.raises(KeyboardInterrupt):
        train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "a")}), quiet=True)
    checkpoint = cache_env / "a" / "checkpoints" / "step-00000001"
    assert f"interrupted at step 1: checkpoint {checkpoint}; run the same command again" in capsys.readouterr().err


def test_resume_refuses_other_optimizer_groups(cache_env, monkeypatch):
    """A parameter whose weight-decay tag changed since the run started (DSS's W did) changes the
    optimizer's groups; torch's own error does not say what to do."""
    from lcsm.engine import trainer

    config = RunConfig.from_dict(
        {**apply_overrides(TINY, {"train.max_steps": 4, "train.save_every": 2}), "out_dir": str(cache_env / "a")}
    )
    train(config, quiet=True)
    monkeypatch.setattr(trainer, "build_optimizer", lambda model, cfg: torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="optimizer groups differ.*weight-decay tag"):
        train(config, quiet=True)


def test_resume_with_another_thread_count_says_it_is_not_bit_exact(cache_env, capsys):
    """CPU kernels split their sums by thread count: the resumed run drifts from the original (review
    D20: weights 0.19 apart), so it must say so, as it does for another process count."""
    run, values = cache_env / "a", apply_overrides(TINY, {"run.keep_last": 10})
    train(RunConfig.from_dict({**values, "out_dir": str(run)}), quiet=True)  # threads 1
    died_after_step(run)
    capsys.readouterr()
    train(RunConfig.from_dict({**values, "out_dir": str(run)}))
    assert "CPU thread(s)" not in capsys.readouterr().err
    died_after_step(run)
    train(RunConfig.from_dict({**apply_overrides(values, {"run.threads": 2}), "out_dir": str(run)}))
    assert (
        "note: resuming a run trained with 1 CPU thread(s) per process with 2: training continues, but not "
        "bit-identically to the original run (run.threads: 1 keeps it exact)"
    ) in capsys.readouterr().err


def test_resume_accepts_changes_that_train_the_same_weights(cache_env):
    """How often to save, the evaluation batch, logging and pruning change no trained weight."""
    values = apply_overrides(TINY, {"run.keep_last": 10})
    reference = cache_env / "reference"
    train(RunConfig.from_dict({**values, "out_dir": str(reference)}), quiet=True)
    run = cache_env / "a"
    train(RunConfig.from_dict({**values, "out_dir": str(run)}), quiet=True)
    died_after_step(run)
    changed = apply_overrides(
        values, {"train.save_every": 3, "train.eval_batch_size": 4, "run.log_every": 1, "run.keep_last": 5}
    )
    result = train(RunConfig.from_dict({**changed, "out_dir": str(run)}), quiet=True)
    assert result["step"] == 12 and result["trained_on"][0]["from_step"] == 0
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*"))][:2] == ["step-00000004", "step-00000006"]
    assert_identical(final_weights(reference), final_weights(run))


def test_only_a_second_sigint_stops_a_run_at_once():
    """A sweep passes SIGTERM on to its run, and under Ctrl-C to the process group that SIGTERM can
    reach the run before its own SIGINT: that SIGINT must still wait for the step's checkpoint."""
    from lcsm.engine.trainer import _StopRequest

    with _StopRequest() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
    with _StopRequest() as stop, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
        signal.raise_signal(signal.SIGINT)
