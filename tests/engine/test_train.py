"""The training loop: loss falls, no-decay groups, schedules, accumulation, early stopping."""

import copy
import io
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lcsm import tasks
from lcsm.engine import RunConfig, apply_overrides, build_optimizer, lr_factor, train
from lcsm.engine import checkpoint as ckpt
from lcsm.engine.config import EarlyStopConfig, OptimConfig, load_config, metric_mode
from lcsm.engine.monitor import Progress
from lcsm.engine.trainer import Trainer
from lcsm.models import ModelConfig, build_model
from lcsm.tasks import SegmentBatchSampler
from lcsm.testing import assert_close

from .conftest import TINY


def config(tmp_path, name="run", **overrides):
    values = apply_overrides(TINY, {"out_dir": str(tmp_path / name), **overrides})
    return RunConfig.from_dict(values)


def weights(run_dir):
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    return load_file(str(ckpts[-1] / "model.safetensors"))


@pytest.mark.parametrize("mixer", ["gla", "metala", "attention", "hgrn", "mamba", "lcsm:1-9-1-0"])
def test_tiny_models_learn_mqar(cache_env, mixer):
    """The loss falls well below its start (about ln 32 = 3.47, uniform; predicting some value
    of the right half of the vocabulary gives ln 16 = 2.77)."""
    cfg = config(
        cache_env,
        **{
            "model.mixer": mixer,
            "optim.lr": 1e-2,
            "train.batch_size": 16,
            "train.max_steps": 80,
            "train.eval_every": 0,
            "train.save_every": 0,
            "run.log_every": 1,
        },
    )
    result = train(cfg, quiet=True)
    losses = [
        r["loss"]
        for r in map(json.loads, (cache_env / "run" / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert result["status"] == "completed" and result["step"] == 80 and len(losses) == 80
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 3.2 and last < first - 0.7, (first, last)
    assert result["metrics"]["loss"] < first - 0.5


def test_no_weight_decay_tags_are_honoured():
    model = build_model(ModelConfig(mixer="mamba", vocab_size=32, d_model=16, n_layers=1), verbose=False)
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    decayed, exempt = opt.param_groups
    assert decayed["weight_decay"] == 0.5 and exempt["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    exempt_names = {names[id(p)] for p in exempt["params"]}
    assert any(n.endswith("A_log") for n in exempt_names) and any(n.endswith(".D") for n in exempt_names)
    assert all(
        n.endswith(("A_log", ".D", "bias")) or ".norm" in n or "norm" in n.split(".")[-2] for n in exempt_names
    ), exempt_names
    assert not any(n.endswith("A_log") for n in (names[id(p)] for p in decayed["params"]))
    # Behaviour, not just bookkeeping: with zero gradients only weight decay moves a parameter.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in exempt_names:
            assert torch.equal(p, before[n]), n
        else:
            assert torch.allclose(p, before[n] * (1 - 0.1 * 0.5)), n


def test_schedules():
    total = 100
    cos = lr_factor(OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), total)
    assert [cos(s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert cos(9) == 1.0 and cos(10) == 1.0
    assert 0.1 < cos(99) < 0.11 and cos(55) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-12)
    inv = lr_factor(OptimConfig(schedule="inverse_sqrt", warmup_steps=16), total)
    assert inv(15) == 1.0 and inv(63) == pytest.approx(0.5)
    lin = lr_factor(OptimConfig(schedule="linear", warmup_steps=0), total)
    assert lin(0) == 1.0 and lin(50) == pytest.approx(0.5) and lin(99) == pytest.approx(0.01)
    const = lr_factor(OptimConfig(schedule="constant", warmup_steps=4), total)
    assert const(0) == 0.25 and const(99) == 1.0


def train_log(run_dir, key):
    """The ``key`` column of a run's logged training rows, as a float32 tensor (the precision the
    runs computed it in)."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return torch.tensor([r[key] for r in rows if r["kind"] == "train"], dtype=torch.float32)


def test_gradient_accumulation_matches_one_big_batch(cache_env):
    """grad_accum splits the same global batch: same loss normalisation (the logged loss and
    gradient norm, which AdamW's scale invariance would hide from the weights), same update."""
    common = {"train.max_steps": 6, "train.eval_every": 0, "train.save_every": 0, "run.log_every": 1}
    train(config(cache_env, "one", **common), quiet=True)
    train(config(cache_env, "four", **common, **{"train.grad_accum": 4}), quiet=True)
    assert_close(weights(cache_env / "four"), weights(cache_env / "one"), context="grad_accum 4 vs 1")
    assert_close(
        {k: train_log(cache_env / "four", k) for k in ("loss", "grad_norm")},
        {k: train_log(cache_env / "one", k) for k in ("loss", "grad_norm")},
        context="grad_accum 4 vs 1 logs",
    )


def test_gradient_clipping_bounds_the_update(cache_env):
    """grad_clip rescales the gradient to that norm before AdamW: with betas (0, 0) and eps large
    against the gradient, Adam's step is about lr * g / eps, so the first update's size follows the
    clipped norm (one tenth of it at grad_clip = norm / 10); the logged norm is the one before."""
    common = {
        "train.max_steps": 1,
        "train.eval_every": 0,
        "train.save_every": 1,
        "run.log_every": 1,
        "optim.warmup_steps": 0,
        "optim.weight_decay": 0.0,
        "optim.betas": [0.0, 0.0],
        "optim.eps": 1e3,
        "optim.grad_clip": None,
    }
    start = {
        n: p.detach().clone()
        for n, p in Trainer(config(cache_env, "init", **common), quiet=True).model.state_dict().items()
    }
    train(config(cache_env, "free", **common), quiet=True)
    norm = float(train_log(cache_env / "free", "grad_norm")[0])
    train(config(cache_env, "clipped", **{**common, "optim.grad_clip": norm / 10}), quiet=True)
    assert float(train_log(cache_env / "clipped", "grad_norm")[0]) == pytest.approx(norm, rel=1e-6)
    step = {
        run: torch.cat([(w - start[n]).flatten() for n, w in weights(cache_env / run).items()]).norm()
        for run in ("free", "clipped")
    }
    assert float(step["clipped"] / step["free"]) == pytest.approx(0.1, rel=1e-2)


def test_every_epoch_draws_its_own_batch_order(cache_env, monkeypatch):
    """The loop trains on the sampler's order of each epoch in turn (16 batches an epoch here),
    so a second epoch is not the first one again."""
    seen = []
    step = Trainer.train_step

    def recording(self, indices):
        seen.append(indices)
        return step(self, indices)

    monkeypatch.setattr(Trainer, "train_step", recording)
    cfg = config(cache_env, **{"train.max_steps": 32, "train.eval_every": 0, "train.save_every": 0})
    train(cfg, quiet=True)
    sampler = SegmentBatchSampler(cfg.build_task().dataset("train"), 8, shuffle=True, seed=0, drop_last=True)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append(sampler.batches())
    assert len(orders[0]) == 16 and orders[0] != orders[1]
    assert seen == orders[0] + orders[1]


def test_evaluations_leave_the_dropout_masks_alone(cache_env):
    """The weights trained with dropout do not depend on how often the run evaluates."""
    runs = {}
    for every in (2, 0):
        cfg = config(
            cache_env,
            name=f"eval{every}",
            **{"model.dropout": 0.2, "train.max_steps": 6, "train.eval_every": every, "train.save_every": 6},
        )
        train(cfg, quiet=True)
        runs[every] = weights(cache_env / f"eval{every}")
    assert all(torch.equal(runs[2][k], runs[0][k]) for k in runs[0])


def test_the_training_rate_leaves_out_evaluations_and_checkpoints(cache_env, monkeypatch):
    slow = Trainer.evaluate

    def evaluate(self, *args, **kwargs):
        time.sleep(0.5)  # hundreds of training steps' time at this size
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    cfg = config(cache_env, **{"train.max_steps": 8, "train.eval_every": 3, "train.save_every": 2, "run.log_every": 1})
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (cache_env / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r["kind"] == "train"]
    # the steps after an evaluation (4, 7) or a checkpoint: within noise of the others, not ~100x below
    assert min(rates) > 0.1 * sorted(rates)[len(rates) // 2], rates


def test_early_stopping_and_best_checkpoint(cache_env):
    cfg = config(
        cache_env,
        **{
            "optim.lr": 1e-9,
            "optim.warmup_steps": 0,
            "train.max_steps": 60,
            "train.eval_every": 2,
            "train.early_stop": {"metric": "accuracy", "mode": "max", "patience": 2, "min_delta": 0.5},
        },
    )
    result = train(cfg, quiet=True)
    assert result["status"] == "early_stopped"
    assert result["step"] == 6  # best at step 2, no gain at 4 and 6
    assert result["best"]["step"] == 2 and result["best"]["metric"] == "accuracy"
    best = json.loads((cache_env / "run" / "checkpoints" / "best" / "run.json").read_text())
    assert best["step"] == 2


def test_early_stopping_takes_the_metrics_direction():
    """early_stop's mode defaulted to "min": {metric: accuracy} kept the worst checkpoint and
    stopped a run that improved. Every metric of every task has a direction."""
    assert EarlyStopConfig(metric="accuracy/L16-kv2").mode == "max" and EarlyStopConfig().mode == "min"
    assert EarlyStopConfig(metric="perplexity", mode="min").mode == "min"
    with pytest.raises(ValueError, match=r"train.early_stop.mode: 'min' for 'accuracy', which is better higher"):
        EarlyStopConfig(metric="accuracy", mode="min")
    for name in tasks.available():
        names = tasks.resolve(name).evaluator().metric_names()
        assert all(metric_mode("m", metric, None) in ("max", "min") for metric in names), (name, names)


def test_patience_running_out_at_the_last_step_is_a_completed_run(cache_env):
    patient = {"metric": "loss", "patience": 1, "min_delta": 1.0}  # no evaluation after the first gains 1.0
    result = train(config(cache_env, **{"train.eval_every": 6, "train.early_stop": patient}), quiet=True)
    assert (result["status"], result["step"], result["best"]["step"]) == ("completed", 12, 6)
    longer = train(
        config(cache_env, "longer", **{"train.max_steps": 18, "train.eval_every": 6, "train.early_stop": patient}),
        quiet=True,
    )
    assert (longer["status"], longer["step"]) == ("early_stopped", 12)


def test_early_stop_metric_is_checked_before_training(cache_env):
    """A name any data gives is checked with the config, before any data is made; a segment's or a
    slice's once the evaluation data exists, before the first step."""
    with pytest.raises(
        ValueError,
        match=r"train.early_stop.metric: 'acuracy' is not a metric of task 'mqar'; "
        r"its metrics: accuracy, loss \(.*\(did you mean 'accuracy'\?\)",
    ):
        config(cache_env, **{"train.early_stop": {"metric": "acuracy", "mode": "max"}})
    assert not (cache_env / "cache").exists()
    cfg = config(cache_env, **{"train.early_stop": {"metric": "accuracy/L16-kv3", "mode": "max"}})
    with pytest.raises(
        ValueError,
        match=r"'accuracy/L16-kv3' is not a metric of task 'mqar'; its metrics: "
        r"accuracy, accuracy/L16-kv2, accuracy/kv_pairs=2, loss",
    ):
        train(cfg, quiet=True)
    assert not (cache_env / "run" / "metrics.jsonl").exists()
    for name in ("accuracy/L16-kv2", "accuracy/kv_pairs=2"):
        Trainer(config(cache_env, **{"train.early_stop.metric": name}), quiet=True)


def test_a_line_says_when_data_is_generated_and_cached(cache_env, capsys):
    """Generating data can take minutes (Path-X): a line says so, and none once it is cached."""
    Trainer(config(cache_env))
    err = capsys.readouterr().err
    assert (
        f"data: generating task 'mqar', split(s) train, test (cached in {cache_env / 'cache' / 'tasks'} for next time)"
        in err
    )
    Trainer(config(cache_env))
    Trainer(config(cache_env, **{"task.seed": 1}), quiet=True)
    assert "data:" not in capsys.readouterr().err
    # a run that selects on validation makes its test split at the end, for the final test
    train(config(cache_env, **{"task.validation_examples": 8, "train.max_steps": 2, "train.eval_every": 2}))
    err = capsys.readouterr().err
    assert "split(s) train, validation (cached" in err and "data: generating task 'mqar', split(s) test (cached" in err


def test_batch_must_split_over_accumulation(cache_env):
    """Refused when the config is read (a sweep's runs are all read before any starts), not when
    its run starts."""
    with pytest.raises(ValueError, match="train.batch_size: 8 .* grad_accum 3"):
        RunConfig.from_dict(apply_overrides(TINY, {"train.grad_accum": 3}))


def test_batchnorm_over_micro_batches_is_said(cache_env, capsys):
    for accum in (2, 1):
        overrides = {"model.norm": "batchnorm", "train.grad_accum": accum, "train.max_steps": 2}
        train(config(cache_env, name=f"bn{accum}", **overrides))
        said = "BatchNorm normalises each of the step's 2 micro-batches" in capsys.readouterr().err
        assert said == (accum == 2)


def test_a_learning_rate_that_overflows_the_update_is_named(cache_env):
    cfg = config(cache_env, **{"optim.lr": 1e300, "train.max_steps": 2})
    with pytest.raises(ValueError, match=r"^optim.lr: 1e\+300 \(5e\+299 at step 1\) makes AdamW's update overflow"):
        train(cfg, quiet=True)


def test_metrics_files(cache_env):
    result = train(config(cache_env), quiet=True)
    run = cache_env / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12]
    assert (run / "train.csv").read_text().splitlines()[0].startswith("step,")
    assert json.loads((run / "result.json").read_text())["metrics"] == result["metrics"]
    assert json.loads((run / "result.json").read_text())["model_revisions"] == {"mixer:gla": 1}
    # keep_last 2: steps 8 and 12 remain (4 was pruned), plus the best evaluation's.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step-00000008", "step-00000012"]


def test_log_every_0_logs_the_last_step_only(cache_env):
    """0 means at the end only (TrainConfig), where the run ends: max_steps or an early stop."""

    def train_steps(name, **overrides):
        train(config(cache_env, name, **{"run.log_every": 0, **overrides}), quiet=True)
        records = map(json.loads, (cache_env / name / "metrics.jsonl").read_text().splitlines())
        return [r["step"] for r in records if r["kind"] == "train"]

    assert train_steps("full") == [12]
    assert train_steps(
        "stopped",
        **{
            "optim.lr": 1e-9,
            "train.eval_every": 2,
            "train.early_stop": {"metric": "accuracy", "mode": "max", "patience": 2, "min_delta": 0.5},
        },
    ) == [6]
    lines = io.StringIO()
    progress = Progress(3, log_every=0, stream=lines)
    for step in (1, 2, 3):
        progress.update(step, 1.0, 1e-3, 100.0)
    assert [line.split()[:2] for line in lines.getvalue().splitlines()] == [["step", "3/3"]]


def test_run_config_validation():
    with pytest.raises(ValueError, match="unknown key.*'trian'.*did you mean 'train'"):
        RunConfig.from_dict({**copy.deepcopy(TINY), "trian": {}})
    with pytest.raises(ValueError, match="train: unknown key.*'max_step'.*did you mean 'max_steps'"):
        RunConfig.from_dict(apply_overrides(TINY, {"train.max_step": 3}))
    with pytest.raises(ValueError, match="exactly one"):
        RunConfig.from_dict(apply_overrides(TINY, {"train.epochs": 2}))
    with pytest.raises(ValueError, match="optim.schedule.*'cosine'"):
        RunConfig.from_dict(apply_overrides(TINY, {"optim.schedule": "cosin"}))
    with pytest.raises(ValueError, match="optim.min_lr_ratio: schedule 'constant' has no floor .* got 0.1"):
        RunConfig.from_dict(apply_overrides(TINY, {"optim.schedule": "constant", "optim.min_lr_ratio": 0.1}))
    with pytest.raises(ValueError, match="task 'mqar'.*unknown option.*'vocab'"):
        RunConfig.from_dict(apply_overrides(TINY, {"task.vocab": 3}))
    with pytest.raises(ValueError, match="model.vocab_size: task 'mqar' fixes it to 32, got 16"):
        RunConfig.from_dict(apply_overrides(TINY, {"model.vocab_size": 16}))
    with pytest.raises(ValueError, match="mixer_options: mixer 'gla' has no option"):
        RunConfig.from_dict(apply_overrides(TINY, {"model.mixer_options": {"headz": 2}}))
    with pytest.raises(ValueError, match="run.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"):
        RunConfig.from_dict(apply_overrides(TINY, {"run.device": "cuda:x"}))
    for section in ("task", "model", "optim", "train", "train.early_stop", "run"):
        with pytest.raises(ValueError, match=rf"^{section}: expected a mapping"):
            RunConfig.from_dict(apply_overrides(TINY, {section: 5}))


def test_engine_docs_config_example_loads(tmp_path):
    """The example config of docs/engine.md is a config the engine accepts (task options included)."""
    doc = (Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    example = re.search(r"## Configs\n\n```yaml\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "mqar-gla.yaml").write_text(example)
    config = load_config(tmp_path / "mqar-gla.yaml")
    assert config.name == "mqar-gla" and config.model["mixer"] == "gla"


def test_overrides_parse_yaml_values():
    out = apply_overrides(
        TINY, ["train.max_steps=7", "optim.betas=[0.8, 0.9]", "model.mixer_options.heads=2", "task.train_grid=16:2"]
    )
    assert out["train"]["max_steps"] == 7 and out["optim"]["betas"] == [0.8, 0.9]
    assert out["model"]["mixer_options"] == {"heads": 2} and out["task"]["train_grid"] == "16:2"
    assert TINY["train"]["max_steps"] == 12  # a copy, the input is untouched
    with pytest.raises(ValueError, match="expected 'section.key=value'"):
        apply_overrides(TINY, ["train.max_steps"])
    with pytest.raises(ValueError, match="train.max_steps is 12, not a section"):
        apply_overrides(TINY, ["train.max_steps.x=1"])


def test_mapping_overrides_merge():
    out = apply_overrides(TINY, {"model": {"mixer": "attention", "mixer_options": {"heads": 2}}})
    assert out["model"] == {"mixer": "attention", "d_model": 16, "n_layers": 1, "mixer_options": {"heads": 2}}


@pytest.mark.parametrize("mixer", ["gla", "s4", "tnn"])
def test_bfloat16_autocast_trains(cache_env, mixer):
    """S4's and TNN's kernels are computed outside autocast (inside it they raised)."""
    result = train(
        config(cache_env, **{"train.precision": "bf16", "train.eval_every": 0, "model.mixer": mixer}), quiet=True
    )
    assert result["status"] == "completed" and math.isfinite(result["metrics"]["loss"])


def test_tensorboard_needs_its_package(cache_env):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the 'tensorboard' package"):
            train(config(cache_env, **{"run.tensorboard": True}), quiet=True)
    else:
        train(config(cache_env, **{"run.tensorboard": True}), quiet=True)
        assert list((cache_env / "run" / "tensorboard").iterdir())


def test_final_test_uses_the_best_checkpoint(cache_env):
    """A task with a validation split: the run selects on validation, then reports the test split
    of the best checkpoint (as the papers do), and records the machine it ran on."""
    from lcsm.engine import load_run
    from lcsm.engine.trainer import evaluate

    values = {
        **copy.deepcopy(TINY),
        "out_dir": str(cache_env / "run"),
        "task": {
            "name": "listops",
            "max_length": 24,
            "min_length": 8,
            "train_examples": 64,
            "validation_examples": 16,
            "test_examples": 16,
        },
    }
    values["train"]["early_stop"] = {"metric": "accuracy", "mode": "max"}
    cfg = RunConfig.from_dict(values)
    result = train(cfg, quiet=True)
    assert result["eval_split"] == "validation"
    assert result["test"]["checkpoint"] == "best" and result["test"]["step"] == result["best"]["step"]
    _, task, model, _ = load_run(cache_env / "run", which="best")
    expected = evaluate(model, task, "test", 8, torch.device("cpu"), "fp32")
    assert result["test"]["metrics"] == expected
    assert result["machine"]["device"] == "cpu" and "cpu" in result["machine"] and result["git_commit"]
    assert result["machine"]["host_allocator"].split()[0] in ("retain", "system")


def test_a_best_checkpoint_of_steps_the_run_did_not_keep_is_not_tested(cache_env, capsys):
    """A resumed run that does not repeat its steps bit for bit (another machine or thread count)
    can leave checkpoints/best from the steps after its resume point: the final test takes the last
    weights and says so, not weights of another step under the run's best step."""
    values = {**copy.deepcopy(TINY), "out_dir": str(cache_env / "run")}
    values["task"] = {"name": "listops", "max_length": 24, "min_length": 8, "train_examples": 64}
    values["task"].update(validation_examples=16, test_examples=16)
    # the first evaluation stays the best (step 6 of 12): the final one does not rewrite best/
    values["train"]["early_stop"] = {"metric": "loss", "min_delta": 10.0}
    cfg = RunConfig.from_dict(values)
    first = train(cfg, quiet=True)
    assert first["best"]["step"] == 6 and first["test"]["checkpoint"] == "best"
    assert ckpt.resolve_checkpoint(cache_env / "run", "best").name == ckpt.BEST
    info = cache_env / "run" / "checkpoints" / "best" / "run.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "step": first["best"]["step"] + 1}))
    (cache_env / "run" / "result.json").unlink()  # the run stopped in its final evaluation
    again = train(cfg, quiet=True)
    assert again["test"]["checkpoint"] == "last" and again["test"]["step"] == again["step"]
    assert f"holds step {first['best']['step'] + 1}, not the run's best step" in capsys.readouterr().err
    # and `lcsm eval --best` / `lcsm export --best` refuse it
    with pytest.raises(ValueError, match=r"holds step 7, but the run's best step is 6 \(step-00000012\)"):
        ckpt.resolve_checkpoint(cache_env / "run", "best")


def test_a_run_that_is_all_warm_up_says_so(cache_env, capsys):
    train(config(cache_env, "short", **{"optim.warmup_steps": 2, "train.max_steps": 3}), quiet=True)
    assert "warmup_steps" not in capsys.readouterr().err
    train(config(cache_env, "warm", **{"optim.warmup_steps": 8, "train.max_steps": 2}), quiet=True)
    assert (
        "warning: optim.warmup_steps (8) >= the run's 2 steps: the whole run warms up, its last update at "
        "0.25 x optim.lr, and the cosine schedule never starts"
    ) in capsys.readouterr().err


def test_no_final_test_when_the_run_evaluates_on_test(cache_env):
    assert train(config(cache_env), quiet=True)["test"] is None


def test_the_removed_elementwise_form_option_is_read_and_ignored(cache_env):
    """train.elementwise_form chose a since-removed form of eos's elementwise kernel; run configs
    committed under results/ carry its default, "step", which is read and dropped; the removed
    "cumulative" is refused rather than silently run as "step"."""
    values = apply_overrides(TINY, {"out_dir": str(cache_env / "run")})
    default = RunConfig.from_dict(values)
    old = RunConfig.from_dict(apply_overrides(values, {"train.elementwise_form": "step"}))
    assert old == default and not hasattr(old.train, "elementwise_form")
    with pytest.raises(ValueError, match=r"train.elementwise_form: this option was removed.*got 'cumulative'"):
        RunConfig.from_dict(apply_overrides(values, {"train.elementwise_form": "cumulative"}))


def test_mqar_with_validation_selects_there_and_tests_the_best_checkpoint(cache_env):
    cfg = config(
        cache_env, **{"task.validation_examples": 16, "train.early_stop": {"metric": "accuracy", "mode": "max"}}
    )
    result = train(cfg, quiet=True)
    assert result["eval_split"] == "validation"
    assert result["test"]["checkpoint"] == "best" and result["test"]["step"] == result["best"]["step"]
    assert set(result["test"]["metrics"]) >= {"accuracy", "loss"}


def test_test_examples_are_the_reported_test_metrics(cache_env):
    """test_examples.csv holds the reported test evaluation per example: MQAR evaluates on test, so
    its examples give the final metrics back (accuracy a mean of per-example accuracies, loss a mean
    over labelled positions)."""
    import csv

    from lcsm.engine.trainer import EXAMPLES_FILE

    result = train(config(cache_env), quiet=True)
    rows = list(csv.DictReader((cache_env / "run" / EXAMPLES_FILE).open()))
    assert rows and {r["segment"] for r in rows} == {"L16-kv2"}
    total = [int(r["total"]) for r in rows]
    correct = [int(r["correct"]) for r in rows]
    accuracy = sum(c / t for c, t in zip(correct, total, strict=True)) / len(rows)
    loss = sum(float(r["loss"]) for r in rows) / sum(total)
    assert abs(accuracy - result["metrics"]["accuracy"]) < 1e-9
    assert abs(loss - result["metrics"]["loss"]) < 1e-5 * result["metrics"]["loss"]
    # run again once finished: the final evaluation is redone for its examples, not counted again
    written = (cache_env / "run" / EXAMPLES_FILE).read_text()
    evals = (cache_env / "run" / "metrics.jsonl").read_text().count('"kind": "eval"')
    assert train(config(cache_env), quiet=True)["metrics"] == result["metrics"]
    assert (cache_env / "run" / EXAMPLES_FILE).read_text() == written
    assert (cache_env / "run" / "metrics.jsonl").read_text().count('"kind": "eval"') == evals
