"""Run configuration: one YAML file (or mapping) with four sections and an output directory.

    name: mqar-gla                      # optional label (default: the file's stem)
    out_dir: runs/mqar-gla              # checkpoints, metrics, result.json
    task:  {name: mqar, vocab_size: 256, train_grid: "64:4,128:8"}    # task name + its options
    model: {mixer: gla, d_model: 64, n_layers: 2}                     # ModelConfig fields
    optim: {lr: 1.0e-3, weight_decay: 0.1, schedule: cosine, warmup_steps: 100}
    train: {max_steps: 2000, batch_size: 64, eval_every: 200}
    run:   {device: cuda, threads: 4, log_every: 50}                 # how it runs (optional)

``task``, ``model``, ``optim`` and ``train`` say what is trained: they make up the training config
that a run's id hashes and a resumed run must match (``RunConfig.training_dict``). ``run`` says
how it runs (device, threads, logging, checkpoints kept, ...), which leaves the trained weights
alone; it may change between runs and resumes and is never part of the training config. An
older config gives these settings in ``train`` (``train.threads``): read as ``run.threads``.

``model`` may name a ``preset`` (``lcsm.models.PRESETS``; ``preset_options`` go to it) whose
fields the other keys override (the head's field by field). The fields a task fixes (vocab_size
or input_dim, head.kind, head.n_classes: ``Task.model_fields``) are filled in from the task. The
head is a nested mapping (``head: {kind: classifier, hidden: 256}``); ``head: classifier`` is
shorthand for ``{kind: classifier}``, and the older flat spelling (``head_hidden: 256``,
``n_classes``, ...) is read as the nested field, the section left as written so that run ids keep
hashing it. Every section is a typed
dataclass validated when built; an unknown key fails naming the closest valid ones.
``apply_overrides`` implements ``--set section.key=value`` (values parsed as YAML).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lcsm._checks import check_choice, check_float, check_int, check_keys, with_older_spelling
from lcsm._names import did_you_mean
from lcsm.engine.host_memory import HOST_ALLOCATORS

SCHEDULES = ("cosine", "inverse_sqrt", "linear", "constant")
PRECISIONS = ("fp32", "bf16")
MODES = ("max", "min")
NONFINITE = ("stop", "skip")
PARALLEL = ("ddp", "fsdp")  # under torchrun: DistributedDataParallel or FSDP2 sharding
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # run.compile: torch.compile's backends; true = inductor


def check_device(name: str, value) -> None:
    """A device option: "auto", "cpu", "cuda" or "cuda:N" (errors name the option ``name``)."""
    if not isinstance(value, str) or not (value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value)):
        raise ValueError(f"{name}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def check_eval_split(split: str, task) -> None:
    """``train.eval_split`` must be a split of ``task`` (built: its splits may follow its options,
    as MQAR's validation split)."""
    if split not in task.splits:
        raise ValueError(f"train.eval_split: task {task.registry_name!r} has splits {list(task.splits)}, got {split!r}")


def check_early_stop_metric(metric: str, task, dataset=None) -> None:
    """``train.early_stop.metric`` must be a metric of ``task``'s evaluator (``task``: a task, or
    its class when no task is built yet). Without ``dataset`` (the config, before any data is
    made) only the names any data gives are known, so a name with a '/' (a segment's or a slice's,
    such as accuracy/<segment>) waits, beyond its metric before the '/', for the check with the
    evaluation split's data, which the trainer makes before its first step."""
    check_metric_name("train.early_stop.metric", metric, [task], dataset)


# The direction in which the tasks' metrics improve, by the name before any '/' (a segment's or a
# slice's): every metric an lcsm evaluator computes
METRIC_MODES = {"loss": "min", "perplexity": "min", "accuracy": "max", "exact": "max", "sequence_accuracy": "max"}


def metric_mode(key: str, metric: str, mode: str | None) -> str | None:
    """The mode ("max" or "min") config key ``key`` selects ``metric`` by: ``mode`` where given,
    else the metric's own direction (``METRIC_MODES``; None for a name no evaluator computes, which
    the metric's own check refuses). A mode against the metric's direction is refused: it would
    keep the worst checkpoint or run (``early_stop: {metric: accuracy}`` kept the worst while the
    default was "min")."""
    name = metric.removeprefix("test/").split("/")[0] if isinstance(metric, str) else None
    known = METRIC_MODES.get(name)
    if mode is None:
        return known
    check_choice(key, mode, MODES)
    if known is not None and mode != known:
        better = "higher" if known == "max" else "lower"
        raise ValueError(f"{key}: {mode!r} for {metric!r}, which is better {better} (mode {known!r})")
    return mode


def check_metric_name(key: str, metric: str, tasks: Sequence, dataset=None, *, test_split: bool = False) -> None:
    """The metric name that config key ``key`` gives must be a metric of the evaluator of one of
    ``tasks`` (tasks or their classes), as ``check_early_stop_metric`` checks it for one task.
    With ``test_split`` a name may also be ``test/<metric>`` (a sweep's row of the test split of
    the best checkpoint, ``Trainer.final_test``)."""
    names = list(dict.fromkeys(n for task in tasks for n in task.evaluator().metric_names(dataset)))
    name = metric[len("test/") :] if test_split and metric.startswith("test/") else metric
    if name in names or (dataset is None and "/" in name and name.split("/")[0] in names):
        return
    per_data = (
        ""
        if dataset is not None
        else (" (and, once its data is made, names with a '/' for its segments and slices, e.g. accuracy/<segment>)")
    )
    test = ", each also as test/<metric> for the test split" if test_split else ""
    owners = ", ".join(repr(t.registry_name) for t in tasks)
    raise ValueError(
        f"{key}: {metric!r} is not a metric of task{'s' if len(tasks) > 1 else ''} {owners}; "
        f"{'its' if len(tasks) == 1 else 'their'} metrics: {', '.join(sorted(names))}{per_data}{test}"
        f"{did_you_mean(name, names)}"
    )


class _Section:
    """from_dict / to_dict for the dataclass sections."""

    section = ""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None):
        values = {} if values is None else values
        check_keys(cls.section, values, [f.name for f in dataclasses.fields(cls)])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class OptimConfig(_Section):
    """AdamW and the learning-rate schedule.

    lr: peak learning rate. weight_decay: decoupled decay of every parameter except the
    no-weight-decay ones (``Model.no_weight_decay_parameters``: decays, A_log, skips, norms,
    biases). betas, eps: Adam's. schedule (per optimizer step, after ``warmup_steps`` of linear
    warm-up from lr / warmup_steps):
      cosine        lr -> lr * min_lr_ratio along a half cosine until the last step;
      inverse_sqrt  lr * sqrt(warmup_steps / step) (LCSM Table 8, fairseq's inverse_sqrt);
      linear        lr -> lr * min_lr_ratio linearly (ETSMLP);
      constant      lr.
    grad_clip: clip the global gradient norm to this value (null: no clipping).
    """

    section = "optim"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0

    def __post_init__(self):
        check_float("optim.lr", self.lr, 0, low_open=True)
        check_float("optim.weight_decay", self.weight_decay, 0)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ValueError(f"optim.betas: expected two numbers in [0, 1), got {self.betas!r}")
        for b in self.betas:
            check_float("optim.betas", b, 0, 1, high_open=True)
        self.betas = tuple(float(b) for b in self.betas)
        check_float("optim.eps", self.eps, 0, low_open=True)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        check_float("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_float("optim.grad_clip", self.grad_clip, 0, low_open=True, allow_none=True)
        if self.schedule in ("inverse_sqrt", "constant") and self.min_lr_ratio != 0:
            raise ValueError(
                f"optim.min_lr_ratio: schedule {self.schedule!r} has no floor (only cosine and linear decay "
                f"to lr * min_lr_ratio); expected 0, got {self.min_lr_ratio!r}"
            )
        if self.schedule == "inverse_sqrt" and self.warmup_steps == 0:
            raise ValueError(
                "optim.warmup_steps: schedule 'inverse_sqrt' decays as sqrt(warmup_steps / step) "
                "and needs warmup_steps >= 1, got 0"
            )


@dataclass
class EarlyStopConfig(_Section):
    """Stop when the evaluation ``metric`` has not improved (by more than ``min_delta``, in the
    direction ``mode``: "max" or "min", by default the metric's own, ``METRIC_MODES``) for
    ``patience`` evaluations in a row; patience 0 never stops. The best
    evaluation's weights are kept in ``<out_dir>/checkpoints/best`` either way."""

    section = "train.early_stop"
    metric: str = "loss"
    mode: str | None = None
    patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"train.early_stop.metric: expected a metric name (e.g. 'accuracy'), got {self.metric!r}")
        self.mode = metric_mode("train.early_stop.mode", self.metric, self.mode)
        check_int("train.early_stop.patience", self.patience, 0)
        check_float("train.early_stop.min_delta", self.min_delta, 0)


# train.seed's bound: the batch order's generator (seed * 1_000_003 + epoch) and each rank's (seed +
# rank * 1_000_003) stay within int64.
SEED_LIMIT = 2**32


@dataclass
class TrainConfig(_Section):
    """The training loop.

    max_steps: optimizer steps to run; or epochs: passes over the training split (exactly one of
        them; an epoch is the number of full global batches of the split).
    batch_size: examples per optimizer step, over all processes and accumulation steps together
        (so a run has the same global batch whatever the number of processes); it must divide by
        processes x grad_accum.
    grad_accum: micro-batches accumulated per optimizer step (per process).
    precision: "fp32", or "bf16" (autocast; the EOS operators compute in fp32 inside).
    seed: seeds the model's initialisation, the data order and dropout.
    eval_every / save_every: in optimizer steps (0: only at the end, where max_steps or early
        stopping ends the run).
    eval_batch_size: default batch_size. eval_split: default "validation" if the task has one,
        else "test".
    early_stop: see ``EarlyStopConfig``.

    How the loop runs (device, threads, logging, ...) is the ``run`` section: ``RuntimeConfig``.
    """

    section = "train"
    # Part of a run's training config (and its id) but free to change when it is resumed: neither
    # changes a trained weight (eval_batch_size may move evaluation metrics by rounding alone).
    RESUMABLE = ("save_every", "eval_batch_size")
    # Removed options that committed run configs still carry, with the one value that means what
    # lcsm does today: read and dropped; any other value is refused.
    RETIRED = {"elementwise_form": "step"}
    max_steps: int | None = None
    epochs: int | None = None
    batch_size: int = 32
    grad_accum: int = 1
    precision: str = "fp32"
    seed: int = 0
    eval_every: int = 0
    eval_batch_size: int | None = None
    eval_split: str | None = None
    save_every: int = 0
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)

    @classmethod
    def from_dict(cls, values):
        values = {} if values is None else values
        if isinstance(values, Mapping):
            for key, kept in cls.RETIRED.items():
                if key in values and values[key] != kept:
                    raise ValueError(
                        f"{cls.section}.{key}: this option was removed; only its old default {kept!r} "
                        f"(what lcsm does now) is accepted, got {values[key]!r}"
                    )
            values = {k: v for k, v in values.items() if k not in cls.RETIRED}
        moved = [key for key in values if key in RUNTIME_KEYS] if isinstance(values, Mapping) else []
        if moved:
            # RunConfig.from_dict reads an older config's train.threads as run.threads; this
            # section alone takes the training settings only.
            raise ValueError(
                f"train: {', '.join(moved)}: {'settings' if len(moved) > 1 else 'a setting'} of how the run "
                f"runs, in the run section ({', '.join(f'run.{k}: {values[k]!r}' for k in moved)}), not in train"
            )
        check_keys(cls.section, values, [f.name for f in dataclasses.fields(cls)])
        values = dict(values)
        if "early_stop" in values and not isinstance(values["early_stop"], EarlyStopConfig):
            values["early_stop"] = EarlyStopConfig.from_dict(values["early_stop"])
        return cls(**values)

    def __post_init__(self):
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError(
                f"train.max_steps / train.epochs: expected exactly one, got max_steps={self.max_steps!r}, "
                f"epochs={self.epochs!r}"
            )
        check_int("train.max_steps", self.max_steps, 1, allow_none=True)
        check_int("train.epochs", self.epochs, 1, allow_none=True)
        check_int("train.batch_size", self.batch_size, 1)
        check_int("train.grad_accum", self.grad_accum, 1)
        # (the processes' share is checked when a run starts, where their number is known)
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"train.batch_size: {self.batch_size} examples per step must split evenly into "
                f"grad_accum {self.grad_accum} micro-batches"
            )
        check_choice("train.precision", self.precision, PRECISIONS)
        check_int("train.seed", self.seed, 0)
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"train.seed: expected an integer in [0, 2**32), got {self.seed}")
        for name in ("eval_every", "save_every"):
            check_int(f"train.{name}", getattr(self, name), 0)
        check_int("train.eval_batch_size", self.eval_batch_size, 1, allow_none=True)
        if self.eval_split is not None and not isinstance(self.eval_split, str):
            raise ValueError(f"train.eval_split: expected a split name or null, got {self.eval_split!r}")
        if not isinstance(self.early_stop, EarlyStopConfig):
            raise ValueError(f"train.early_stop: expected a mapping, got {self.early_stop!r}")


@dataclass
class RuntimeConfig(_Section):
    """How a run runs: settings that leave its trained weights alone, so they are no part of its
    training config (``RunConfig.training_dict``), its id or what a resumed run must match.

    device: "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    threads: torch CPU threads per process (null: torch's default). A run resumed with another
        number trains on, but not bit-identically.
    host_allocator: "system" (the library's default: malloc as the process has it) or "retain"
        (``lcsm train``'s default: glibc's malloc keeps freed memory for the next step instead of
        page-faulting it in afresh, for the rest of the process; see ``lcsm.engine.host_memory``).
    log_every: in optimizer steps (0: only the last step, which is logged whatever log_every).
    tensorboard: also log to TensorBoard (needs the ``tensorboard`` package).
    keep_last: checkpoints kept (oldest deleted; "best" is kept apart).
    on_nonfinite: a step whose loss or gradient norm is nan or infinite "stop"s the run (default:
        status "diverged", no checkpoint of it) or is "skip"ped (weights and AdamW state untouched,
        counted in result.json's skipped_steps). A run without such a step trains the same either
        way, so a stopped run may go on with "skip".
    parallel: under torchrun, "ddp" (every process holds the whole model; DistributedDataParallel)
        or "fsdp" (parameters, gradients and AdamW state sharded over the processes; FSDP2's
        ``fully_shard`` per Block, then the root). Both compute the same gradient of the same
        global batch, up to the order of floating-point sums, so the choice is how a run runs, not
        what it trains: a run may be resumed under the other (docs/engine.md, "FSDP").
    activation_checkpointing: recompute each Block's activations in the backward pass instead of
        keeping them (``torch.utils.checkpoint``; the same dropout masks, so the same gradients).
    compile: run the training step's model through ``torch.compile(dynamic=True)``: false (default),
        true (inductor) or a backend, "inductor", "aot_eager" or "eager" (docs/compile.md). The
        same numbers up to rounding, as with another thread count, but for dropout: inductor draws
        its masks from its own generator, so with dropout a compiled run trains on other masks
        (aot_eager and eager keep eager's). An older config's
        ``train.compile`` is read as this.
    """

    section = "run"
    device: str = "auto"
    threads: int | None = None
    host_allocator: str = "system"
    log_every: int = 10
    tensorboard: bool = False
    keep_last: int = 2
    on_nonfinite: str = "stop"
    parallel: str = "ddp"
    activation_checkpointing: bool = False
    compile: bool | str = False

    def __post_init__(self):
        check_device("run.device", self.device)
        check_int("run.threads", self.threads, 1, allow_none=True)
        check_choice("run.host_allocator", self.host_allocator, HOST_ALLOCATORS)
        check_int("run.log_every", self.log_every, 0)
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"run.tensorboard: expected true or false, got {self.tensorboard!r}")
        check_int("run.keep_last", self.keep_last, 1)
        check_choice("run.on_nonfinite", self.on_nonfinite, NONFINITE)
        check_choice("run.parallel", self.parallel, PARALLEL)
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"run.activation_checkpointing: expected true or false, got {self.activation_checkpointing!r}"
            )
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_BACKENDS:
            raise ValueError(
                f"run.compile: expected true, false or a backend ({', '.join(map(repr, COMPILE_BACKENDS))}), "
                f"got {self.compile!r}"
            )

    @property
    def compile_backend(self) -> str | None:
        """torch.compile's backend for the training step, or None (not compiled)."""
        if self.compile is False:
            return None
        return "inductor" if self.compile is True else self.compile


RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(RuntimeConfig))


def runtime_out_of_train(values: Mapping[str, Any]) -> dict[str, Any]:
    """A run config with the runtime settings that an older config gives in ``train`` (the
    committed runs' ``train.threads``, ``train.device``, ...) moved to ``run``, where they are now;
    the other keys as they are. Given in both places, a setting fails rather than one silently
    winning."""
    values = dict(values)
    train = values.get("train")
    if not isinstance(train, Mapping) or not any(key in train for key in RUNTIME_KEYS):
        return values
    run = values.get("run")
    run = {} if run is None else run
    if not isinstance(run, Mapping):
        raise ValueError(f"run: expected a mapping of runtime settings, got {run!r}")
    old = {key: (key, value) for key, value in train.items() if key in RUNTIME_KEYS}
    values["train"] = {key: value for key, value in train.items() if key not in old}
    values["run"] = with_older_spelling(run, old, "train", "run")
    return values


@dataclass
class RunConfig:
    """A whole run: ``task`` and ``model`` stay plain mappings (validated by the task's Config and
    by ``ModelConfig`` when the run is built, see ``build_task`` / ``model_config``); ``run``, how
    it runs, is kept apart from what is trained (the other four)."""

    task: dict[str, Any]
    model: dict[str, Any]
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000))
    run: RuntimeConfig = field(default_factory=RuntimeConfig)
    out_dir: str = "runs/run"
    name: str | None = None

    KEYS = ("name", "out_dir", "task", "model", "optim", "train", "run")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        check_keys("run config", values, cls.KEYS)
        values = runtime_out_of_train(values)
        for required in ("task", "model", "train"):
            if required not in values:
                raise ValueError(f"run config: missing section {required!r} (sections: {', '.join(cls.KEYS[2:])})")
        task = values["task"]
        if not isinstance(task, Mapping) or not isinstance(task.get("name"), str):
            raise ValueError(f"task: expected a mapping with the task's 'name' and its options, got {task!r}")
        if not isinstance(values["model"], Mapping):
            raise ValueError(f"model: expected a mapping of ModelConfig fields, got {values['model']!r}")
        out_dir = values.get("out_dir", "runs/run")
        if not isinstance(out_dir, str) or not out_dir:
            raise ValueError(f"out_dir: expected a directory path, got {out_dir!r}")
        name = values.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name: expected a string, got {name!r}")
        config = cls(
            task=dict(task),
            model=copy.deepcopy(dict(values["model"])),
            optim=OptimConfig.from_dict(values.get("optim")),
            train=TrainConfig.from_dict(values["train"]),
            run=RuntimeConfig.from_dict(values.get("run")),
            out_dir=out_dir,
            name=name,
        )
        # Fail on a bad task option, model field or metric name now, not after the data is generated,
        # and from the configs alone: the task is built (an LM's corpus read to train its tokenizer)
        # only to train or evaluate, where model_config checks the fields its data decides.
        from lcsm import tasks
        from lcsm.models import ModelConfig

        with in_section("task", config.task):
            fields = tasks.config_model_fields(config.task["name"], **config.task_options())
        model_fields = {f.name: None for f in dataclasses.fields(ModelConfig)}
        with in_section("model", model_fields), in_section("model.mixer_options", config.model.get("mixer_options")):
            config.model_config_with(fields)
        check_early_stop_metric(config.train.early_stop.metric, tasks.resolve(config.task["name"]))
        if config.train.eval_split is not None:  # (a task is built without its data: cheap)
            check_eval_split(config.train.eval_split, tasks.build(config.task["name"], **config.task_options()))
        return config

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "out_dir": self.out_dir,
            "task": copy.deepcopy(self.task),
            "model": copy.deepcopy(self.model),
            "optim": self.optim.to_dict(),
            "train": self.train.to_dict(),
            "run": self.run.to_dict(),
        }
        out["optim"]["betas"] = list(out["optim"]["betas"])
        return out

    def training_dict(self) -> dict[str, Any]:
        """Everything that determines the trained weights (a resumed run must match it): the
        ``task``, ``model``, ``optim`` and ``train`` sections."""
        out = self.to_dict()
        del out["name"], out["out_dir"], out["run"]
        return out

    # ------------------------------------------------------------------ building the parts

    def build_task(self, *, use_cache: bool = True):
        """The task (its data is made or read from the cache when first asked for)."""
        from lcsm import tasks

        return tasks.build(self.task["name"], use_cache=use_cache, **self.task_options())

    def task_options(self) -> dict[str, Any]:
        """The task section without its name: the options of the task's Config."""
        return {k: v for k, v in self.task.items() if k != "name"}

    def model_keys(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(preset (if any) <- model keys, the model keys as given), before the task's fields; the
        head in both as a mapping (``lcsm.models.config.nest_head``: the old flat keys read into it)."""
        from lcsm.models import preset
        from lcsm.models.config import merge_model_values, nest_head

        values = nest_head(copy.deepcopy(self.model))
        preset_name = values.pop("preset", None)
        preset_options = values.pop("preset_options", {}) or {}
        if preset_name is not None:
            base = preset(preset_name, **preset_options).to_dict()
        else:
            if preset_options:
                raise ValueError("model.preset_options: given without model.preset")
            base = {}
        return merge_model_values(base, values), values

    def model_revisions(self) -> dict[str, int]:
        """The revisions of the mixer and preset this config builds (``lcsm.models.model_revisions``)."""
        from lcsm.models import model_revisions

        merged, _ = self.model_keys()
        return model_revisions(merged, self.model.get("preset"))

    def model_config(self, task):
        """The ModelConfig: preset (if any) <- model keys <- the fields the built ``task`` fixes."""
        return self.model_config_with(task.model_fields())

    def model_config_with(self, fixed: Mapping[str, Any]):
        """The ModelConfig: preset (if any) <- model keys <- ``fixed``, the fields a task fixes
        (the head's as a mapping: ``{"head": {"kind": "classifier", "n_classes": 10}}``)."""
        from lcsm.models import ModelConfig

        merged, values = self.model_keys()
        for path, value in _leaves(fixed):
            given = values
            for key in path:
                given = given.get(key, value) if isinstance(given, Mapping) else value
            # A larger vocabulary than the task's is harmless (padding rows); anything else the
            # task fixes must agree with it.
            if given != value and not (path == ("vocab_size",) and isinstance(given, int) and given > value):
                raise ValueError(
                    f"model.{'.'.join(path)}: task {self.task['name']!r} fixes it to {value!r}, got {given!r} "
                    "(leave it out; the engine fills it in)"
                )
            node = merged
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = given
        # The input kind comes from the task: a preset's token vocabulary gives way to features.
        merged.pop("input_dim" if "vocab_size" in fixed else "vocab_size", None)
        return ModelConfig.from_dict(merged)


def _leaves(fixed: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterable[tuple[tuple[str, ...], Any]]:
    """(key path, value) of every value under ``fixed``, a task's fixed fields: ``head``'s mapping
    gives ``("head", "kind")``, ``("head", "n_classes")``, ..."""
    for key, value in fixed.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


# ----------------------------------------------------------------------------- files and overrides


class _Loader(yaml.SafeLoader):
    """YAML as people write configs: ``1e-3`` is a float (PyYAML's YAML 1.1 reads a string) and
    ``16:2`` a string (YAML 1.1 reads the base-60 integer 962); decimal integers only; a key given
    twice in one mapping is an error (PyYAML keeps the last silently: a second ``task:`` section
    would replace the first)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge (<<: *base) may repeat keys: the mapping's own win
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"the key {key!r} is given twice",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.max_steps=100"`` -> ("train.max_steps", 100) (the value parsed as YAML)."""
    if not isinstance(text, str) or "=" not in text or text.startswith("="):
        raise ValueError(f"--set: expected 'section.key=value', got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(
            f"--set {key}: cannot parse value {raw!r} as YAML ({getattr(err, 'problem', None) or err})"
        ) from None
    return key.strip(), value


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def apply_overrides(values: Mapping[str, Any], overrides: Mapping[str, Any] | Iterable[str]) -> dict[str, Any]:
    """A deep copy of ``values`` with dotted-key overrides applied (``{"train.max_steps": 100}`` or
    ``["train.max_steps=100"]``); intermediate mappings are created as needed. A mapping value is
    merged into the mapping it overrides (``model={mixer: attention, mixer_options: {heads: 2}}``
    keeps the model's other keys), any other value replaces."""
    out = copy.deepcopy(dict(values))
    items = overrides.items() if isinstance(overrides, Mapping) else (parse_override(o) for o in overrides)
    for key, value in items:
        parts = key.split(".")
        if not all(parts):
            raise ValueError(f"--set: expected a dotted key like 'train.max_steps', got {key!r}")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[: i + 1])} is {child!r}, not a section")
            node = child
        if isinstance(value, Mapping) and isinstance(node.get(parts[-1]), dict):
            _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return out


@contextlib.contextmanager
def in_section(section: str, keys: Mapping[str, Any] | None):
    """Errors of a section's builder ("d_model: expected ...") named by their place in the run
    config ("model.d_model: expected ..."), as --set and the YAML file spell it; ``keys``: the
    section's keys (an error of another key is left as it is)."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        key = re.match(r"([A-Za-z_]\w*)[.\[:]", text)
        # (``keys`` as the config gave it: not a mapping when the section is wrong itself)
        if key is None or not isinstance(keys, Mapping) or key.group(1) not in keys:
            raise
        raise ValueError(f"{section}.{text}") from None


def read_yaml(path: str | Path, key: str = "config") -> dict[str, Any]:
    """The mapping of a YAML file; errors name ``key`` (what gave the file: "base" for an
    experiment's base config) and the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{key}: {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ValueError(f"{key}: no such file {str(path)!r}")
    try:
        values = yaml_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{key} {str(path)!r}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ValueError(f"{key} {str(path)!r}: not valid YAML ({err})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{key} {str(path)!r}: expected a mapping at the top level, got {type(values).__name__}")
    return values


def load_config(
    path: str | Path,
    overrides: Mapping[str, Any] | Iterable[str] = (),
    *,
    out_dir: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Read a YAML run config, apply overrides, validate. ``name`` defaults to the file's stem and
    ``out_dir`` to ``runs/<name>``; an ``out_dir`` given here (``lcsm train --out``) replaces the
    config's and is used as it is, a path, never parsed as YAML. ``defaults``: dotted keys set
    where neither the file nor the overrides set them (a command's own defaults)."""
    # An older config's train.host_allocator is its run.host_allocator: moved first, so that a
    # default for run.host_allocator does not take its place (nor clash with it).
    values = read_yaml(path)
    experiment = sorted({"base", "config", "grid"} & values.keys())
    if experiment:
        raise ValueError(
            f"config {str(path)!r}: an experiment file (it has {', '.join(experiment)}), not a run config; "
            f"run it with `lcsm sweep {path}`"
        )
    values = runtime_out_of_train(apply_overrides(values, overrides))
    for key, value in (defaults or {}).items():
        *sections, last = key.split(".")
        node = values
        for section in sections:
            if isinstance(node, dict) and node.get(section) is None:
                node[section] = {}  # an optional section the file leaves out (run)
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and last not in node:
            node[last] = copy.deepcopy(value)
    if out_dir is not None:
        values["out_dir"] = out_dir
    values.setdefault("name", Path(path).stem)
    values.setdefault("out_dir", f"runs/{values['name']}")
    return RunConfig.from_dict(values)
