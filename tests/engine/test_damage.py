"""Damaged files never strand a run: a cut-off last metrics line is dropped (and the file repaired),
a damaged newest checkpoint is reported by its path and resume, eval and generate fall back to the
newest intact one."""

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lcsm.cli import main
from lcsm.engine import RunConfig, apply_overrides, train
from lcsm.engine.checkpoint import DamagedCheckpoint, load_trainer

from .conftest import TINY

VALUES = apply_overrides(TINY, {"run.keep_last": 3})


def run_config(out):
    return RunConfig.from_dict({**VALUES, "out_dir": str(out)})


@pytest.fixture
def finished(cache_env):
    """A finished run (checkpoints at steps 4, 8 and 12) and its final weights."""
    run = cache_env / "reference"
    train(run_config(run), quiet=True)
    return run, load_file(str(run / "checkpoints" / "step-00000012" / "model.safetensors"))


def test_a_cut_off_last_metrics_line_is_dropped_and_repaired(finished, cache_env, capsys):
    reference, _ = finished
    run = cache_env / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step-00000012")
    (run / "result.json").unlink()
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "step": 99')
    capsys.readouterr()
    result = train(run_config(run), quiet=True)
    assert result["step"] == 12
    err = capsys.readouterr().err
    assert f"warning: {metrics}: dropped its cut-off last line" in err
    # every line a record again, the same records as the uninterrupted run's
    steps = [(r["kind"], r["step"]) for r in map(json.loads, metrics.read_text().splitlines())]
    assert steps == [(r["kind"], r["step"]) for r in map(json.loads, (reference / "metrics.jsonl").open())]


def test_a_bad_metrics_line_before_the_last_is_an_error_naming_the_file(finished, cache_env):
    run = cache_env / "run"
    shutil.copytree(finished[0], run)
    (run / "result.json").unlink()  # stopped during its final evaluation: it resumes
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"{run / 'metrics.jsonl'}: line 2 is not a JSON record"):
        train(run_config(run), quiet=True)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated-weights": lambda ck: truncate(ck / "model.safetensors"),
    "empty-weights": lambda ck: (ck / "model.safetensors").write_bytes(b""),
    "missing-weights": lambda ck: (ck / "model.safetensors").unlink(),
    "truncated-trainer": lambda ck: truncate(ck / "trainer.pt"),
    "missing-run-json": lambda ck: (ck / "run.json").unlink(),
}


def test_a_scrambled_trainer_state_is_passed_over_for_the_older_checkpoint(finished, cache_env, capsys):
    """The zip whole, its pickle not (bit rot): found only when read, so resume reads the trainer
    state of the checkpoint it takes, passes over one that does not read back with a warning naming
    it, and redoes the steps after the older one exactly (it was a traceback, then an error that
    stranded the run)."""
    reference, weights = finished
    run = cache_env / "run"
    shutil.copytree(reference, run)
    (run / "result.json").unlink()
    trainer = run / "checkpoints" / "step-00000012" / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    start = data.find(b"data.pkl") + 64
    data[start : start + 200] = bytes(b ^ 0x5A for b in data[start : start + 200])
    trainer.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"warning: checkpoint {trainer.parent} is damaged: trainer.pt is" in err
    assert f"using the older {run / 'checkpoints' / 'step-00000008'} instead" in err
    redone = load_file(str(trainer.parent / "model.safetensors"))
    assert all(torch.equal(redone[k], weights[k]) for k in weights)


@pytest.mark.parametrize(
    "error", [KeyError(174), UnicodeDecodeError("utf-8", b"\xdc", 0, 1, "invalid"), ValueError("x")]
)
def test_whatever_a_damaged_pickle_raises_is_damage(tmp_path, monkeypatch, error):
    """Bytes flipped inside the pickle decode to KeyError, UnicodeDecodeError, ValueError, ...
    (an audit's scan of 1,159 offsets), each a DamagedCheckpoint naming the file."""
    (tmp_path / "trainer.pt").write_bytes(b"x")

    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(DamagedCheckpoint, match=rf"trainer.pt is unreadable \({type(error).__name__}: ") as err:
        load_trainer(tmp_path)
    assert err.value.problem.startswith("trainer.pt is unreadable")


def test_an_intact_trainer_state_holding_an_unknown_object_is_not_called_damaged(tmp_path):
    torch.save({"x": pathlib.PurePosixPath("/a")}, tmp_path / "trainer.pt")
    with pytest.raises(ValueError, match=r"trainer.pt holds an object lcsm does not load .*PurePosixPath") as err:
        load_trainer(tmp_path)
    assert not isinstance(err.value, DamagedCheckpoint)


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_past_a_damaged_newest_checkpoint(finished, cache_env, capsys, damage):
    reference, weights = finished
    run = cache_env / "run"
    shutil.copytree(reference, run)
    (run / "result.json").unlink()
    newest = run / "checkpoints" / "step-00000012"
    DAMAGE[damage](newest)
    capsys.readouterr()
    result = train(run_config(run), quiet=True)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {newest} is damaged: " in err
    assert f"using the older {run / 'checkpoints' / 'step-00000008'} instead" in err
    # the steps after the older checkpoint are redone, exactly, and the damaged one replaced
    assert result["step"] == 12
    redone = load_file(str(newest / "model.safetensors"))
    assert all(torch.equal(redone[k], weights[k]) for k in weights)


@pytest.mark.parametrize("damage", ["truncated-weights", "empty-weights", "missing-weights"])
def test_eval_and_generate_fall_back_past_a_damaged_newest_checkpoint(finished, cache_env, capsys, damage):
    run = cache_env / "run"
    shutil.copytree(finished[0], run)
    newest = run / "checkpoints" / "step-00000012"
    DAMAGE[damage](newest)
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["checkpoint"] == str(run / "checkpoints" / "step-00000008")
    assert f"warning: checkpoint {newest} is damaged" in err and "Traceback" not in err
    assert main(["generate", str(run), "--prompt-ids", "3 20 5", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert f"using the older {run / 'checkpoints' / 'step-00000008'}" in capsys.readouterr().err
    # the damaged checkpoint named directly: one line naming it, no traceback
    assert main(["eval", str(newest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lcsm eval: error: checkpoint '{newest}' is damaged: model.safetensors")
    assert len(err.strip().splitlines()) == 1


def test_only_damaged_checkpoints_is_an_error_that_offers_more_than_restart(finished, cache_env, capsys):
    run = cache_env / "run"
    shutil.copytree(finished[0], run)
    for ck in (run / "checkpoints").glob("step-*"):
        truncate(ck / "model.safetensors")
    assert main(["train", str(run / "config.yaml"), "--out", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "lcsm train: error: checkpoint: no intact checkpoint in" in err and "Traceback" not in err
    assert "restore them from a copy, or, to train the run again from scratch, move them elsewhere" in err


def test_the_best_checkpoint_serves_when_every_step_checkpoint_is_damaged(finished, cache_env, capsys):
    """--best checks its checkpoint against the newest intact step checkpoint's record of the best
    step; with none intact there is nothing to check it against, and the best one still loads."""
    run = cache_env / "run"
    shutil.copytree(finished[0], run)
    for ck in (run / "checkpoints").glob("step-*"):
        truncate(ck / "model.safetensors")
    capsys.readouterr()
    assert main(["eval", str(run), "--best", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(run / "checkpoints" / "best")
