"""An experiment file read into its grid of runs: the base config with its overrides, the axes,
and each run's config and id (readable labels plus a hash of the training config)."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lcsm._checks import check_keys

from ..config import RunConfig, apply_overrides, check_metric_name, metric_mode, read_yaml, yaml_load

EXPERIMENT_COPY = "experiment.yaml"
# command_overrides: the --set / --grid a sweep ran with, recorded in the sweep directory's copy
EXPERIMENT_KEYS = (
    "name",
    "base",
    "config",
    "set",
    "grid",
    "select",
    "report",
    "description",
    "paper",
    "reading",
    "command_overrides",
)


@dataclass
class Axis:
    key: str  # dotted config key
    labels: list[str]
    values: list[Any]


@dataclass
class Run:
    id: str
    labels: dict[str, str]  # axis key -> label of this run's value
    config: dict[str, Any]  # the full run config (out_dir set)

    @property
    def out_dir(self) -> Path:
        return Path(self.config["out_dir"])


@dataclass
class Experiment:
    name: str
    path: Path | None
    base: dict[str, Any]
    axes: list[Axis]
    select: dict[str, Any] | None
    report: dict[str, Any]
    out_dir: Path
    spec: dict[str, Any] = field(default_factory=dict)  # the file's content (for the report)

    def runs(self) -> list[Run]:
        runs = []
        for combo in itertools.product(*[list(zip(a.labels, a.values, strict=False)) for a in self.axes]):
            overrides: dict[str, Any] = {}
            for a, (_, value) in zip(self.axes, combo, strict=False):
                # An "@name" axis sets several keys together (a task and the model options that go with it).
                overrides.update(value if a.key.startswith("@") else {a.key: value})
            labels = {a.key: label for a, (label, _) in zip(self.axes, combo, strict=False)}
            config = apply_overrides(self.base, overrides)
            config.pop("out_dir", None)
            config["name"] = f"{self.name}/" + (",".join(f"{k}={v}" for k, v in labels.items()) or "base")
            readable = ",".join(f"{_short(k)}={v}" for k, v in labels.items()) or "base"
            try:  # the run's id hashes its validated config, so a bad one is named by its labels
                training = _training_part(config)
            except ValueError as err:
                raise ValueError(f"run {readable}: {err}") from None
            digest = hashlib.sha256(json.dumps(training, sort_keys=True).encode()).hexdigest()[:8]
            run_id = f"{re.sub(r'[^A-Za-z0-9=,.+_-]+', '_', readable)[:120]}-{digest}"
            config["out_dir"] = str(self.out_dir / run_id)
            runs.append(Run(run_id, labels, config))
        return runs


def _short(key: str) -> str:
    return key.split(".")[-1]


def _run_config(config: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_dict({**config, "out_dir": "x"})


def _training_part(config: Mapping[str, Any]) -> dict[str, Any]:
    """What determines a run's weights (as ``RunConfig.training_dict``), canonical JSON."""
    return json.loads(json.dumps(_run_config(config).training_dict()))


def _label(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        return "+".join(_label(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return "_".join(_label(v) for v in value)
    return str(value)


def _axis(key: str, spec: Any) -> Axis:
    if key.startswith("@") and (
        not re.fullmatch(r"@[A-Za-z0-9_.-]+", key)
        or not isinstance(spec, Mapping)
        or not spec
        or not all(isinstance(v, Mapping) and v for v in spec.values())
    ):
        raise ValueError(
            f"grid.{key}: an '@name' axis expects labelled values, each a mapping of dotted keys "
            f"to values (label: {{task.name: listops, model.d_model: 64}}), got {spec!r}"
        )
    if isinstance(spec, Mapping):
        if not spec:
            raise ValueError(f"grid.{key}: expected a non-empty list of values or mapping of label: value")
        return Axis(key, [str(k) for k in spec], list(spec.values()))
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"grid.{key}: expected a non-empty list of values or mapping of label: value, got {spec!r}")
    labels = [_label(v) for v in spec]
    if len(set(labels)) != len(labels):
        raise ValueError(f"grid.{key}: values must be distinct, got {list(spec)}")
    return Axis(key, labels, list(spec))


def parse_grid_override(text: str) -> tuple[str, list[Any]]:
    """``"model.mixer=gla,hgrn"`` -> ("model.mixer", ["gla", "hgrn"]); ``"k=[[1, 2], [3]]"`` for values
    that contain commas (each value parsed as YAML)."""
    if "=" not in text or text.startswith("="):
        raise ValueError(f"--grid: expected 'section.key=value1,value2', got {text!r}")
    key, raw = (part.strip() for part in text.split("=", 1))
    try:
        values = yaml_load(raw) if raw.startswith("[") else [yaml_load(v) for v in raw.split(",") if v.strip()]
    except yaml.YAMLError as err:
        raise ValueError(
            f"--grid {key}: cannot parse {raw!r} as YAML values ({getattr(err, 'problem', None) or err}); a value "
            "holding commas goes in a list: key=[value1, value2]"
        ) from None
    if not isinstance(values, list) or not values:
        raise ValueError(f"--grid {key}: expected one or more comma-separated values, got {raw!r}")
    return key, values


def load_experiment(
    path: str | Path, *, overrides: Sequence[str] = (), grid: Sequence[str] = (), out_dir: str | Path | None = None
) -> Experiment:
    """Read and validate an experiment file; ``overrides`` ("key=value") apply to the base config,
    ``grid`` ("key=v1,v2") replaces or adds an axis."""
    path = Path(path)
    spec = read_yaml(path, "experiment")
    run = sorted({"task", "model", "optim", "train"} & spec.keys())
    if run and not {"base", "config", "grid"} & spec.keys():
        raise ValueError(
            f"experiment {str(path)!r}: a run config (it has {', '.join(run)}), not an experiment file; "
            f"train it with `lcsm train {path}`, or name it as an experiment's base (docs/sweeps.md)"
        )
    check_keys(f"experiment {str(path)!r}", spec, EXPERIMENT_KEYS)
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"name: expected letters, digits, '_', '.' or '-', got {name!r}")
    if ("base" in spec) == ("config" in spec):
        raise ValueError(
            f"experiment {str(path)!r}: expected exactly one of 'base' (a run config file) or "
            "'config' (an inline run config)"
        )
    if "base" in spec:
        base_path = (path.parent / spec["base"]) if not Path(spec["base"]).is_absolute() else Path(spec["base"])
        base = read_yaml(base_path, "base")
    else:
        base = copy.deepcopy(spec["config"])
        if not isinstance(base, dict):
            raise ValueError(f"config: expected a run config mapping, got {base!r}")
    sets = spec.get("set") or {}
    if not isinstance(sets, Mapping):
        raise ValueError(f"set: expected a mapping of dotted keys to values, got {sets!r}")
    base = apply_overrides(apply_overrides(base, sets), list(overrides))
    recorded = spec.get("command_overrides") or []
    if not isinstance(recorded, list) or not all(isinstance(o, str) for o in recorded):
        raise ValueError(f"command_overrides: expected a list of '--set KEY=VALUE' strings, got {recorded!r}")
    given = [f"--set {o}" for o in overrides] + [f"--grid {g}" for g in grid]
    if given:
        # what the file's own text (its description) does not say: the report names them
        spec = {**spec, "command_overrides": recorded + given}
    grid_spec = dict(spec.get("grid") or {})
    renamed: dict[str, str] = {}
    if not isinstance(spec.get("grid") or {}, Mapping):
        raise ValueError(f"grid: expected a mapping of dotted keys to value lists, got {spec.get('grid')!r}")
    for text in grid:
        key, values = parse_grid_override(text)
        labelled = grid_spec.get(key)
        if isinstance(labelled, Mapping) and all(isinstance(v, str) for v in values):
            # Labels of a labelled axis pick those of its values (--grid model=attention): the
            # runs keep their ids, so a part of a sweep can be run into the same directory.
            missing = [v for v in values if v not in labelled]
            if missing:
                raise ValueError(
                    f"--grid {key}: {missing} are not labels of the axis ({', '.join(map(str, labelled))})"
                )
            grid_spec[key] = {v: labelled[v] for v in values}
            continue
        if key in grid_spec:
            # Replaced in place and alone: --grid model.d_model=64 keeps a labelled `model` axis
            # beside it, and the axis order, hence the run ids, stay those of the full sweep.
            grid_spec[key] = values
            continue
        # The new axis replaces every axis it overlaps: --grid model.mixer=gla,hgrn replaces a
        # `model` axis of labelled model sections, and the other way round.
        for old in [k for k in grid_spec if k.startswith(key + ".") or key.startswith(k + ".")]:
            del grid_spec[old]
            renamed[old] = key
        grid_spec[key] = values
    axes = [_axis(k, v) for k, v in grid_spec.items()]
    # References to a replaced axis (select.over; the report's rows, x, series, facet, compare axes
    # and where-filters) follow it.
    spec = _rename_axes(spec, renamed)
    select = spec.get("select")
    if select is not None:
        check_keys("select", select, ("metric", "mode", "over"))
        if not isinstance(select.get("metric"), str):
            raise ValueError(f"select.metric: expected a metric name, got {select.get('metric')!r}")
        metric_mode("select.mode", select["metric"], select.get("mode"))
        over = select.get("over", [])
        unknown = [k for k in over if k not in grid_spec]
        if unknown:
            raise ValueError(f"select.over: {unknown} are not grid axes ({', '.join(grid_spec) or 'none'})")
    report = spec.get("report") or {}
    if not isinstance(report, Mapping):
        raise ValueError(f"report: expected a mapping, got {report!r}")
    from ..report import check_report_spec, check_table_cells

    check_report_spec(report, [a.key for a in axes])
    exp = Experiment(
        name,
        path,
        base,
        axes,
        select,
        dict(report),
        Path(out_dir) if out_dir is not None else Path("runs") / name,
        spec,
    )
    _check_metric_names(exp, exp.runs())  # every run's config validates before anything runs
    check_table_cells(exp)
    return exp


def _check_metric_names(exp: Experiment, runs: Sequence[Run]) -> None:
    """The metrics that select and the report name must be metrics of the grid's tasks: rows that
    lack one are left out of the selection, and a report column of a misspelt one stays empty. The
    selection's must be one of every task, or the runs of a task without it are never selected."""
    from lcsm import tasks

    from ..report import report_metric_names

    grid_tasks = [tasks.resolve(name) for name in dict.fromkeys(run.config["task"]["name"] for run in runs)]
    if exp.select:
        for task in grid_tasks:
            check_metric_name("select.metric", exp.select["metric"], [task], test_split=True)
    for key, metric, test_split in report_metric_names(exp.report):
        check_metric_name(key, metric, grid_tasks, test_split=test_split)


def _rename_axes(spec: dict[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    if not renamed:
        return spec
    spec = copy.deepcopy(spec)
    if spec.get("select"):
        spec["select"]["over"] = [renamed.get(k, k) for k in spec["select"].get("over", [])]
    report = spec.get("report") or {}
    parts = [
        report.get("table") or {},
        *(report.get("plots") or []),
        *(report.get("compare") or []),
        *(report.get("curves") or []),
    ]
    for part in parts:
        if not isinstance(part, dict):
            continue  # check_report_spec names the malformed entry
        for field_name in ("rows", "columns", "x", "series", "facet", "axis"):
            if part.get(field_name) in renamed:
                part[field_name] = renamed[part[field_name]]
        if isinstance(part.get("where"), dict):
            part["where"] = {renamed.get(k, k): v for k, v in part["where"].items()}
    return spec
