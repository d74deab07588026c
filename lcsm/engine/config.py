"""Run configuration: one YAML file (or mapping) with four sections and an output directory.

    name: mqar-gla                      # optional label (default: the file's stem)
    out_dir: runs/mqar-gla              # checkpoints, metrics, result.json
    task:  {name: mqar, vocab_size: 256, train_grid: "64:4,128:8"}    # task name + its options
    model: {mixer: gla, d_model: 64, n_layers: 2}                     # ModelConfig fields
    optim: {lr: 1.0e-3, weight_decay: 0.1, schedule: cosine, warmup_steps: 100}
    train: {max_steps: 2000, batch_size: 64, eval_every: 200}

``model`` may name a ``preset`` (``lcsm.models.PRESETS``; ``preset_options`` go to it) whose
fields the other keys override. The fields a task fixes (head, vocab_size or input_dim,
n_classes: ``Task.model_fields``) are filled in from the task. Every section is a typed
dataclass validated when built; an unknown key fails naming the closest valid ones.
``apply_overrides`` implements ``--set section.key=value`` (values parsed as YAML).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lcsm._checks import check_choice, check_float, check_int, check_keys
from lcsm._names import did_you_mean
from lcsm.engine.host_memory import HOST_ALLOCATORS

SCHEDULES = ("cosine", "inverse_sqrt", "linear", "constant")
PRECISIONS = ("fp32", "bf16")
MODES = ("max", "min")
NONFINITE = ("stop", "skip")


def check_device(name: str, value) -> None:
    """A device option: "auto", "cpu", "cuda" or "cuda:N" (errors name the option ``name``)."""
    if not isinstance(value, str) or not (value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value)):
        raise ValueError(f"{name}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def check_early_stop_metric(metric: str, task, dataset=None) -> None:
    """``train.early_stop.metric`` must be a metric of ``task``'s evaluator (``task``: a task, or
    its class when no task is built yet). Without ``dataset`` (the config, before any data is
    made) only the names any data gives are known, so a name with a '/' (a segment's or a slice's)
    waits for the check with the evaluation split's data, which the trainer makes before its first
    step."""
    names = task.evaluator().metric_names(dataset)
    if metric in names or (dataset is None and "/" in metric):
        return
    per_data = (
        ""
        if dataset is not None
        else (" (and, once its data is made, names with a '/' for its segments and slices, e.g. accuracy/<segment>)")
    )
    raise ValueError(
        f"train.early_stop.metric: {metric!r} is not a metric of task {task.registry_name!r}; its "
        f"metrics: {', '.join(sorted(names))}{per_data}{did_you_mean(metric, names)}"
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
        if self.schedule == "inverse_sqrt" and self.warmup_steps == 0:
            raise ValueError(
                "optim.warmup_steps: schedule 'inverse_sqrt' decays as sqrt(warmup_steps / step) "
                "and needs warmup_steps >= 1, got 0"
            )


@dataclass
class EarlyStopConfig(_Section):
    """Stop when the evaluation ``metric`` has not improved (by more than ``min_delta``, in the
    direction ``mode``) for ``patience`` evaluations in a row; patience 0 never stops. The best
    evaluation's weights are kept in ``<out_dir>/checkpoints/best`` either way."""

    section = "train.early_stop"
    metric: str = "loss"
    mode: str = "min"
    patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"train.early_stop.metric: expected a metric name (e.g. 'accuracy'), got {self.metric!r}")
        check_choice("train.early_stop.mode", self.mode, MODES)
        check_int("train.early_stop.patience", self.patience, 0)
        check_float("train.early_stop.min_delta", self.min_delta, 0)


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
    device: "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    eval_every / save_every / log_every: in optimizer steps (0: only at the end, where max_steps or
        early stopping ends the run; the last step is logged whatever log_every).
    eval_batch_size: default batch_size. eval_split: default "validation" if the task has one,
        else "test".
    keep_last: checkpoints kept (oldest deleted; "best" is kept apart).
    early_stop: see ``EarlyStopConfig``.
    tensorboard: also log to TensorBoard (needs the ``tensorboard`` package).
    threads: torch CPU threads per process (null: torch's default).
    on_nonfinite: a step whose loss or gradient norm is nan or infinite "stop"s the run (default:
        status "diverged", no checkpoint of it) or is "skip"ped (weights and AdamW state untouched,
        counted in result.json's skipped_steps). A run without such a step trains the same either way.
    host_allocator: "system" (the library's default: malloc as the process has it) or "retain"
        (``lcsm train``'s default: glibc's malloc keeps freed memory for the next step instead of
        page-faulting it in afresh, for the rest of the process; see ``lcsm.engine.host_memory``).
    """

    section = "train"
    # how the loop reports, keeps, places and runs its work, not what it computes: not part of a
    # run's training config (``RunConfig.training_dict``)
    BOOKKEEPING = ("log_every", "tensorboard", "keep_last", "threads", "device", "host_allocator")
    # A run that met no non-finite step trained the same under either policy, so a stopped run can
    # go on with "skip"; and run ids, hashed from the training config, stay as they were.
    BOOKKEEPING += ("on_nonfinite",)
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
    device: str = "auto"
    eval_every: int = 0
    eval_batch_size: int | None = None
    eval_split: str | None = None
    save_every: int = 0
    log_every: int = 10
    keep_last: int = 2
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    tensorboard: bool = False
    threads: int | None = None
    on_nonfinite: str = "stop"
    host_allocator: str = "system"

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
        check_choice("train.precision", self.precision, PRECISIONS)
        check_int("train.seed", self.seed, 0)
        check_device("train.device", self.device)
        for name in ("eval_every", "save_every", "log_every"):
            check_int(f"train.{name}", getattr(self, name), 0)
        check_int("train.eval_batch_size", self.eval_batch_size, 1, allow_none=True)
        if self.eval_split is not None and not isinstance(self.eval_split, str):
            raise ValueError(f"train.eval_split: expected a split name or null, got {self.eval_split!r}")
        check_int("train.keep_last", self.keep_last, 1)
        if not isinstance(self.early_stop, EarlyStopConfig):
            raise ValueError(f"train.early_stop: expected a mapping, got {self.early_stop!r}")
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"train.tensorboard: expected true or false, got {self.tensorboard!r}")
        check_int("train.threads", self.threads, 1, allow_none=True)
        check_choice("train.on_nonfinite", self.on_nonfinite, NONFINITE)
        check_choice("train.host_allocator", self.host_allocator, HOST_ALLOCATORS)


@dataclass
class RunConfig:
    """A whole run: ``task`` and ``model`` stay plain mappings (validated by the task's Config and
    by ``ModelConfig`` when the run is built, see ``build_task`` / ``model_config``)."""

    task: dict[str, Any]
    model: dict[str, Any]
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000))
    out_dir: str = "runs/run"
    name: str | None = None

    KEYS = ("name", "out_dir", "task", "model", "optim", "train")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        check_keys("run config", values, cls.KEYS)
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
            out_dir=out_dir,
            name=name,
        )
        # Fail on a bad task option, model field or metric name now, not after the data is generated,
        # and from the configs alone: the task is built (an LM's corpus read to train its tokenizer)
        # only to train or evaluate, where model_config checks the fields its data decides.
        from lcsm import tasks

        config.model_config_with(tasks.config_model_fields(config.task["name"], **config.task_options()))
        check_early_stop_metric(config.train.early_stop.metric, tasks.resolve(config.task["name"]))
        return config

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "out_dir": self.out_dir,
            "task": copy.deepcopy(self.task),
            "model": copy.deepcopy(self.model),
            "optim": self.optim.to_dict(),
            "train": self.train.to_dict(),
        }
        out["optim"]["betas"] = list(out["optim"]["betas"])
        return out

    def training_dict(self) -> dict[str, Any]:
        """Everything that determines the trained weights (a resumed run must match it): the
        config without ``name``, ``out_dir`` and the loop's bookkeeping intervals."""
        out = self.to_dict()
        del out["name"], out["out_dir"]
        for key in TrainConfig.BOOKKEEPING:
            del out["train"][key]
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
        """(preset (if any) <- model keys, the model keys as given), before the task's fields."""
        from lcsm.models import preset

        values = copy.deepcopy(self.model)
        preset_name = values.pop("preset", None)
        preset_options = values.pop("preset_options", {}) or {}
        if preset_name is not None:
            base = preset(preset_name, **preset_options).to_dict()
        else:
            if preset_options:
                raise ValueError("model.preset_options: given without model.preset")
            base = {}
        return {**base, **values}, values

    def model_revisions(self) -> dict[str, int]:
        """The revisions of the mixer and preset this config builds (``lcsm.models.model_revisions``)."""
        from lcsm.models import model_revisions

        merged, _ = self.model_keys()
        return model_revisions(merged, self.model.get("preset"))

    def model_config(self, task):
        """The ModelConfig: preset (if any) <- model keys <- the fields the built ``task`` fixes."""
        return self.model_config_with(task.model_fields())

    def model_config_with(self, fixed: Mapping[str, Any]):
        """The ModelConfig: preset (if any) <- model keys <- ``fixed``, the fields a task fixes."""
        from lcsm.models import ModelConfig

        merged, values = self.model_keys()
        for key, value in fixed.items():
            given = values.get(key, value)
            # A larger vocabulary than the task's is harmless (padding rows); anything else the
            # task fixes must agree with it.
            if given != value and not (key == "vocab_size" and isinstance(given, int) and given > value):
                raise ValueError(
                    f"model.{key}: task {self.task['name']!r} fixes it to {value!r}, got {given!r} "
                    "(leave it out; the engine fills it in)"
                )
            merged[key] = given
        # The input kind comes from the task: a preset's token vocabulary gives way to features.
        merged.pop("input_dim" if "vocab_size" in fixed else "vocab_size", None)
        return ModelConfig.from_dict(merged)


# ----------------------------------------------------------------------------- files and overrides


class _Loader(yaml.SafeLoader):
    """YAML as people write configs: ``1e-3`` is a float (PyYAML's YAML 1.1 reads a string) and
    ``16:2`` a string (YAML 1.1 reads the base-60 integer 962); decimal integers only."""


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
        raise ValueError(f"--set {key}: cannot parse value {raw!r} as YAML ({err.problem})") from None
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


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: no such file {str(path)!r}")
    try:
        values = yaml_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"config {str(path)!r}: not valid YAML ({err})") from None
    if not isinstance(values, dict):
        raise ValueError(f"config {str(path)!r}: expected a mapping at the top level, got {type(values).__name__}")
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
    values = apply_overrides(read_yaml(path), overrides)
    for key, value in (defaults or {}).items():
        *sections, last = key.split(".")
        node = values
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and last not in node:
            node[last] = copy.deepcopy(value)
    if out_dir is not None:
        values["out_dir"] = out_dir
    values.setdefault("name", Path(path).stem)
    values.setdefault("out_dir", f"runs/{values['name']}")
    return RunConfig.from_dict(values)
