"""run.parallel: fsdp (FSDP2 on 2 CPU processes, gloo) trains like DDP up to summation order,
resumes bit-exactly, and its checkpoints resume under DDP or one process and the other way round;
run.activation_checkpointing changes no number."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lcsm.engine import RunConfig, apply_overrides, train
from lcsm.models import ModelConfig, build_model
from lcsm.models.blocks import blocks, checkpoint_blocks
from lcsm.testing import assert_close

from .conftest import TINY, cli_env, write_config
from .test_resume import died_after_step

# 2 layers (two sharded Blocks besides the root), dropout on (each rank's RNG must be restored),
# grad_accum 2 (gradients reduced on the last micro-batch only).
VALUES = apply_overrides(
    TINY,
    {
        "model.n_layers": 2,
        "model.dropout": 0.1,
        "train.max_steps": 6,
        "train.batch_size": 16,
        "train.grad_accum": 2,
        "train.eval_every": 3,
        "train.save_every": 3,
        "run.log_every": 1,
        "run.keep_last": 10,
    },
)
# Measured on CPU: FSDP's losses within 2e-6 of DDP's over 6 steps (the gradients are reduced by
# reduce-scatter instead of all-reduce: another summation order).
TOLERANCE = 1e-5


def torchrun(config, out, tmp_path, *settings):
    env = cli_env(tmp_path)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args += ["-m", "lcsm", "train", str(config), "--out", str(out), "--quiet"]
    for setting in settings:
        args += ["--set", setting]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r["loss"]) for r in rows]


def weights(run, step=6):
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def assert_losses_close(a, b):
    assert [(kind, step) for kind, step, _ in a] == [(kind, step) for kind, step, _ in b]
    for (_, _, x), (_, _, y) in zip(a, b, strict=True):
        assert abs(x - y) <= TOLERANCE * abs(x), (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 2-process runs: ddp, fsdp, fsdp with activation checkpointing."""
    tmp = tmp_path_factory.mktemp("fsdp")
    config = write_config(tmp / "run.yaml", VALUES)
    torchrun(config, tmp / "ddp", tmp)
    torchrun(config, tmp / "fsdp", tmp, "run.parallel=fsdp")
    torchrun(config, tmp / "fsdp-ac", tmp, "run.parallel=fsdp", "run.activation_checkpointing=true")
    return tmp, config


def test_fsdp_trains_like_ddp(runs):
    tmp, _ = runs
    assert_losses_close(metrics(tmp / "ddp"), metrics(tmp / "fsdp"))
    assert_close(weights(tmp / "fsdp"), weights(tmp / "ddp"), context="fsdp vs ddp")
    # The checkpoint's optimizer state has the unsharded layout: the same keys and groups as DDP's.
    fsdp, ddp = (torch.load(tmp / r / "checkpoints/step-00000006/trainer.pt")["optimizer"] for r in ("fsdp", "ddp"))
    assert fsdp["param_groups"] == ddp["param_groups"]
    assert fsdp["state"].keys() == ddp["state"].keys()
    # AdamW's moments follow the gradients' rounding, which cancellation magnifies in small entries:
    # measured at most 2.1e-3 of each tensor's largest entry apart.
    for i, state in ddp["state"].items():
        assert torch.equal(fsdp["state"][i]["step"], state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            apart = (fsdp["state"][i][key] - state[key]).abs().max()
            assert apart <= 1e-2 * state[key].abs().max(), (i, key, apart)


def test_activation_checkpointing_changes_no_number_under_fsdp(runs):
    tmp, _ = runs
    assert metrics(tmp / "fsdp-ac") == metrics(tmp / "fsdp")
    w, w_ac = weights(tmp / "fsdp"), weights(tmp / "fsdp-ac")
    assert all(torch.equal(w[k], w_ac[k]) for k in w)


def test_fsdp_resume_is_exact(runs):
    tmp, config = runs
    run = tmp / "fsdp-resumed"
    shutil.copytree(tmp / "fsdp", run)
    died_after_step(run, 3)
    torchrun(config, run, tmp, "run.parallel=fsdp")
    assert metrics(run) == metrics(tmp / "fsdp")
    w, resumed = weights(tmp / "fsdp"), weights(run)
    assert all(torch.equal(w[k], resumed[k]) for k in w)


@pytest.mark.parametrize("then, now", [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_checkpoint_resumes_under_the_other(runs, then, now):
    tmp, config = runs
    run = tmp / f"{then}-then-{now}"
    shutil.copytree(tmp / then, run)
    died_after_step(run, 3)
    torchrun(config, run, tmp, f"run.parallel={now}")
    assert_losses_close(metrics(run), metrics(tmp / now))
    assert_close(weights(run), weights(tmp / now), context=f"{then} resumed under {now}")


def test_weights_that_do_not_fit_stop_every_rank(runs):
    """Under FSDP rank 0 alone reads the weights: its refusal must reach the other rank, which would
    otherwise wait for it in the next collective until torchrun's timeout."""
    tmp, config = runs
    run = tmp / "fsdp-misfit"
    shutil.copytree(tmp / "fsdp", run)
    died_after_step(run, 3)
    path = run / "checkpoints" / "step-00000003" / "model.safetensors"
    save_file({f"renamed.{k}": v for k, v in load_file(str(path)).items()}, str(path))
    env = cli_env(tmp)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args += ["-m", "lcsm", "train", str(config), "--out", str(run), "--quiet", "--set", "run.parallel=fsdp"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("weights do not fit the model") == 2, done.stderr[-3000:]


def test_fsdp_checkpoint_resumes_in_one_process(runs, monkeypatch):
    tmp, _ = runs
    monkeypatch.setenv("LCSM_CACHE", str(tmp / "cache"))
    run = tmp / "fsdp-then-one"
    shutil.copytree(tmp / "fsdp", run)
    died_after_step(run, 3)
    result = train(RunConfig.from_dict({**VALUES, "out_dir": str(run)}), quiet=True)
    assert result["status"] == "completed" and result["step"] == 6


def test_bad_parallel_settings_are_refused(cache_env):
    with pytest.raises(ValueError, match=r"run.parallel: expected one of 'ddp', 'fsdp', got 'fsdpp'.*'fsdp'"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.parallel": "fsdpp"}))
    with pytest.raises(ValueError, match="run.activation_checkpointing: expected true or false, got 'yes'"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.activation_checkpointing": "yes"}))
    # One process: no silent fallback to unsharded training.
    config = RunConfig.from_dict({**apply_overrides(TINY, {"run.parallel": "fsdp"}), "out_dir": str(cache_env / "a")})
    with pytest.raises(ValueError, match=r"run.parallel: 'fsdp' .* one process \(WORLD_SIZE unset or 1\).*torchrun"):
        train(config, quiet=True)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    config = ModelConfig(mixer="gla", d_model=16, n_layers=2, vocab_size=32, dropout=0.1)
    ids = torch.randint(0, 32, (4, 16))
    grads, runs = [], []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model(config, verbose=False)
        if checkpointed:
            checkpoint_blocks(model)
        loss = model(ids).float().logsumexp(-1).mean()
        runs.append(mixer_runs(model, loss.backward))
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, plain), (loss_ac, checkpointed) = grads
    assert len(blocks(model)) == 2
    # the backward pass recomputes each Block (its mixer runs again), and only when checkpointed
    assert runs == [[0, 0], [1, 1]]
    # Dropout draws the same masks in the recomputation: equal, not merely close.
    assert torch.equal(loss, loss_ac)
    assert plain.keys() == checkpointed.keys() and all(torch.equal(plain[n], checkpointed[n]) for n in plain)


def mixer_runs(model, action) -> list[int]:
    """How often each Block's mixer runs during ``action()``."""
    counts = [0] * len(blocks(model))
    hooks = [
        block.mixer.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, block in enumerate(blocks(model))
    ]
    action()
    for hook in hooks:
        hook.remove()
    return counts


def test_checkpointing_every_other_block_and_turning_it_off():
    model = build_model(ModelConfig(mixer="gla", d_model=16, n_layers=3, vocab_size=32), verbose=False)
    ids = torch.randint(0, 32, (2, 8))
    checkpoint_blocks(model, every=2)
    loss = model(ids).sum()
    assert mixer_runs(model, loss.backward) == [1, 0, 1]
    checkpoint_blocks(model, enable=False)
    loss = model(ids).sum()
    assert mixer_runs(model, loss.backward) == [0, 0, 0]


def test_activation_checkpointing_trains_the_same_in_one_process(cache_env):
    values = apply_overrides(TINY, {"model.dropout": 0.1, "train.max_steps": 4})
    plain = train(RunConfig.from_dict({**values, "out_dir": str(cache_env / "a")}), quiet=True)
    values = apply_overrides(values, {"run.activation_checkpointing": True})
    checkpointed = train(RunConfig.from_dict({**values, "out_dir": str(cache_env / "b")}), quiet=True)
    assert checkpointed["metrics"] == plain["metrics"]
    assert metrics(cache_env / "a") == metrics(cache_env / "b")
