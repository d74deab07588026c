"""A non-finite loss or gradient norm stops the run (status "diverged", no checkpoint of it) or is
skipped without touching the weights or AdamW's state; result.json stays strict JSON; a nan model
cannot generate."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from lcsm.cli import main
from lcsm.engine import RunConfig, apply_overrides, train
from lcsm.engine.trainer import Trainer

from .conftest import TINY, write_config


def strict_json(path):
    def refuse(constant):
        raise AssertionError(f"{path}: bare {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def nan_gradients_at_step_6(monkeypatch):
    """The sixth step's gradients (and so its norm) turn nan, as an overflow would make them."""
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def poisoned(parameters, *args, **kwargs):
        parameters = list(parameters)
        calls.append(1)
        if len(calls) == 6:
            for p in parameters:
                p.grad.fill_(math.nan)
        return clip(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)


def test_a_nonfinite_step_stops_the_run_as_diverged(cache_env, capsys, nan_gradients_at_step_6):
    cfg = write_config(cache_env / "tiny.yaml", TINY)
    run = cache_env / "run"
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "lcsm train: error: step 6: loss " in err and "gradient norm nan" in err and "diverged" in err
    assert "its newest checkpoint is of step 4" in err and len(err.strip().splitlines()) == 1
    result = strict_json(run / "result.json")
    assert (result["status"], result["step"], result["diverged_at_step"]) == ("diverged", 5, 6)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
    weights = load_file(str(run / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_run_diverging_before_its_first_checkpoint_says_it_left_none(cache_env, capsys, nan_gradients_at_step_6):
    cfg = write_config(cache_env / "tiny.yaml", TINY)
    assert main(["train", str(cfg), "--out", str(cache_env / "run"), "--quiet", "--set", "train.save_every=8"]) == 1
    assert "it wrote no checkpoint" in capsys.readouterr().err


def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(cache_env, capsys, nan_gradients_at_step_6):
    values = apply_overrides(TINY, {"run.on_nonfinite": "skip", "train.save_every": 1, "run.keep_last": 20})
    result = train(RunConfig.from_dict({**values, "out_dir": str(cache_env / "run")}), quiet=True)
    assert (result["status"], result["step"], result["skipped_steps"]) == ("completed", 12, 1)
    assert "warning: step 6: loss" in capsys.readouterr().err
    ckpts = cache_env / "run" / "checkpoints"
    before, after = (load_file(str(ckpts / f"step-0000000{n}" / "model.safetensors")) for n in (5, 6))
    assert all(torch.equal(before[k], after[k]) for k in before)
    adam5, adam6 = (torch.load(ckpts / f"step-0000000{n}" / "trainer.pt")["optimizer"]["state"] for n in (5, 6))
    assert all(torch.equal(adam5[i][k], adam6[i][k]) for i in adam5 for k in adam5[i])
    seven = load_file(str(ckpts / "step-00000007" / "model.safetensors"))
    assert not all(torch.equal(after[k], seven[k]) for k in after)  # training goes on
    records = [json.loads(line) for line in (cache_env / "run" / "metrics.jsonl").open()]
    assert [r["skipped_steps"] for r in records if r["kind"] == "train" and r["step"] >= 6][0] == 1


def test_result_json_is_strict_json_with_a_nonfinite_metric(cache_env, monkeypatch):
    evaluate = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self, split=None: {**evaluate(self, split), "loss": math.nan})
    train(RunConfig.from_dict({**TINY, "out_dir": str(cache_env / "run")}), quiet=True)
    result = strict_json(cache_env / "run" / "result.json")
    assert result["metrics"]["loss"] is None and result["test"] is None


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_nonfinite_learning_rate_is_refused(value):
    with pytest.raises(ValueError, match=r"optim.lr: expected a positive finite number, got"):
        RunConfig.from_dict(apply_overrides(TINY, {"optim.lr": value}))


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_generating_from_a_nan_model_is_a_clear_error(cache_env, capsys, temperature):
    cfg = write_config(cache_env / "tiny.yaml", apply_overrides(TINY, {"train.max_steps": 2}))
    run = cache_env / "run"
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 0
    weights_file = run / "checkpoints" / "step-00000002" / "model.safetensors"
    save_file({k: torch.full_like(v, math.nan) for k, v in load_file(str(weights_file)).items()}, str(weights_file))
    capsys.readouterr()
    args = ["generate", str(run), "--prompt-ids", "3 20 5", "--max-new-tokens", "4", "--temperature", temperature]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("lcsm generate: error: generate: the model's logits for position 3 are not finite")
