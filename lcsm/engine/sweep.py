"""Sweeps: a grid of runs over one base config, each run cached, the results in one table.

An experiment file (see docs/sweeps.md)::

    name: mqar_demo
    base: configs/mqar_demo.yaml           # a run config, relative to this file (or `config:` inline)
    set: {train.max_steps: 800}            # overrides of the base
    grid:                                  # the cartesian product of these axes
      model.mixer: [metala, gla]           # a list of values ...
      model:                               # ... or labelled values (a mapping value is merged)
        attention: {mixer: attention, mixer_options: {positions: rotary, heads: 2}}
      optim.lr: [1.0e-3, 3.0e-3]
      "@setting":                          # an '@name' axis sets several dotted keys per label
        short: {task.train_grid: "64:4", model.d_model: 64}
    select: {metric: accuracy, mode: max, over: [optim.lr]}   # best of the lr grid per cell
    report: {...}                          # tables and plots, see lcsm.engine.report
    paper: ...                             # the paper's numbers and findings (markdown)
    reading: ...                           # what our runs say about them (markdown, ends the report)

Every run gets a directory ``<sweep dir>/<run id>/`` (id: the grid labels, readable, plus a hash of
the whole config) and is run by ``lcsm train`` in a subprocess, so a run is exactly what its
``config.yaml`` says. A run whose ``result.json`` holds the same training config is not run again
(compared with the mixer's options resolved, ``_equivalence_key``), nor one that a sweep beside it
has finished with that config (copied, ``Equivalents``); an interrupted run resumes from its
checkpoints; a sweep stopped with Ctrl-C or SIGTERM stops its runs cleanly (they checkpoint) and
continues where it stopped when started again.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import inspect
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lcsm._checks import check_choice, check_keys
from lcsm.tasks import recorded_task_data, task_data

from .config import OptimConfig, RunConfig, TrainConfig, apply_overrides, read_yaml, yaml_load
from .lock import DirectoryLock
from .results import format_table, machine_label, main_metric, select_best  # noqa: F401 (the last three: re-exported)

EXPERIMENT_COPY = "experiment.yaml"
EXPERIMENT_KEYS = ("name", "base", "config", "set", "grid", "select", "report", "description", "paper", "reading")


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
            digest = hashlib.sha256(json.dumps(_training_part(config), sort_keys=True).encode()).hexdigest()[:8]
            readable = ",".join(f"{_short(k)}={v}" for k, v in labels.items()) or "base"
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


def _equivalence_key(config: Mapping[str, Any]) -> dict[str, Any]:
    """The training part with the mixer's options resolved, layer by layer: its registered name,
    and per layer every option of its constructor, with the defaults, the options a
    ``family:spec`` name implies and those the model sets by the layer's position (HGRN's lower
    bound k / n_layers unless one is given, ``Mixer.layer_options``) filled in. Two configs with equal
    keys train the same weights however they were written (``lcsm:1-1-1-0`` or ``lcsm`` with
    ``code: 1-1-1-0``; ``tau: 16`` written out or left to its default), and HGRN without a bound
    differs from HGRN with ``lower_bound: 0.0`` (0 in every layer). Run ids keep hashing the config
    as written, so committed runs keep their ids; caching and reuse compare these keys (dicts, so
    16 and 16.0 are equal)."""
    from lcsm.layers.base import resolve
    from lcsm.models import ModelConfig
    from lcsm.models.blocks import layer_options

    run = _run_config(config)
    part = json.loads(json.dumps(run.training_dict()))
    merged, _ = run.model_keys()
    if isinstance(merged.get("mixer"), str):
        cls, implied = resolve(merged["mixer"])
        defaults = {
            name: p.default
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in ("self", "d_model") and p.default is not inspect.Parameter.empty
        }
        n_layers = merged.get("n_layers", ModelConfig.n_layers)
        bidirectional = bool(merged.get("bidirectional", ModelConfig.bidirectional))
        given = merged.get("mixer_options") or {}
        part["model"]["mixer"] = cls.registry_name
        part["model"]["mixer_options"] = json.loads(
            json.dumps(
                [
                    {**defaults, **implied, **layer_options(cls, given, k, n_layers, bidirectional)}
                    for k in range(n_layers)
                ],
                default=repr,
            )
        )
    return part


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
    values = yaml_load(raw) if raw.startswith("[") else [yaml_load(v) for v in raw.split(",") if v.strip()]
    if not isinstance(values, list) or not values:
        raise ValueError(f"--grid {key}: expected one or more comma-separated values, got {raw!r}")
    return key, values


def load_experiment(
    path: str | Path, *, overrides: Sequence[str] = (), grid: Sequence[str] = (), out_dir: str | Path | None = None
) -> Experiment:
    """Read and validate an experiment file; ``overrides`` ("key=value") apply to the base config,
    ``grid`` ("key=v1,v2") replaces or adds an axis."""
    path = Path(path)
    spec = read_yaml(path)
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
        base = read_yaml(base_path)
    else:
        base = copy.deepcopy(spec["config"])
        if not isinstance(base, dict):
            raise ValueError(f"config: expected a run config mapping, got {base!r}")
    sets = spec.get("set") or {}
    if not isinstance(sets, Mapping):
        raise ValueError(f"set: expected a mapping of dotted keys to values, got {sets!r}")
    base = apply_overrides(apply_overrides(base, sets), list(overrides))
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
        check_choice("select.mode", select.get("mode", "max"), ("max", "min"))
        over = select.get("over", [])
        unknown = [k for k in over if k not in grid_spec]
        if unknown:
            raise ValueError(f"select.over: {unknown} are not grid axes ({', '.join(grid_spec) or 'none'})")
    report = spec.get("report") or {}
    if not isinstance(report, Mapping):
        raise ValueError(f"report: expected a mapping, got {report!r}")
    from .report import check_report_spec

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
    for run in exp.runs():  # every run's config validates before anything runs
        try:
            RunConfig.from_dict(run.config)
        except ValueError as err:
            raise ValueError(f"run {run.id}: {err}") from None
    return exp


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


def stale_data(result: Mapping[str, Any]) -> str | None:
    """How a finished run's task data differ from what this lcsm makes for its config, or None."""
    name = result["config"]["task"]["name"]
    then, now = recorded_task_data(result, name), task_data(name)
    if then == now:
        return None
    return f"task {name!r} data of generator version {then['generator_version']}, now {now['generator_version']}"


def stale_model(result: Mapping[str, Any]) -> str | None:
    """Why a finished run's model is not the one its config builds today (a mixer or preset whose
    revision was bumped since), or None. A record without revisions predates them: revision 1."""
    then = result.get("model_revisions") or {}
    now = _run_config(result["config"]).model_revisions()
    changed = [
        f"{name} revision {then.get(name, 1)}, now {rev}" for name, rev in now.items() if then.get(name, 1) != rev
    ]
    return "; ".join(changed) or None


def cached_result(run: Run) -> dict[str, Any] | None:
    """The run's result if it finished with exactly this training config."""
    path = run.out_dir / "result.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
        same = _equivalence_key(result["config"]) == _equivalence_key(run.config)
    except (ValueError, KeyError, TypeError):
        return None
    return result if same else None


class Equivalents:
    """Finished runs of the sweeps beside a sweep directory (``<its parent>/*/<run>/result.json``,
    itself included), found by their training config, so a run that another experiment has made
    already is copied instead of trained again (the LCSM tables share runs: the tau table's tau 16
    is the activation table's 1-1-1-0). Read once, on the first lookup."""

    def __init__(self, sweep_dir: Path):
        self.root = Path(sweep_dir).resolve().parent
        self._runs: list[dict[str, Any]] | None = None

    @staticmethod
    def _typed_sections(config: Mapping[str, Any]) -> Any:
        """The task's name and the optimiser and loop settings, defaults filled in: cheap to
        compare, where the whole key builds the task (an LM task reads its corpus to do so)."""
        train = TrainConfig.from_dict(config["train"]).to_dict()
        for key in TrainConfig.BOOKKEEPING:
            del train[key]
        return json.loads(
            json.dumps([config["task"]["name"], OptimConfig.from_dict(config.get("optim")).to_dict(), train])
        )

    def _index(self) -> list[dict[str, Any]]:
        if self._runs is None:
            self._runs = []
            for path in sorted(self.root.glob("*/*/result.json")):
                try:
                    result = json.loads(path.read_text())
                    config = result["config"]
                    if stale_data(result) or stale_model(result):
                        continue  # trained on other data, or another model, than the same config gives now
                    self._runs.append({"dir": path.parent, "config": config, "typed": self._typed_sections(config)})
                except (ValueError, KeyError, TypeError, OSError):
                    continue  # unreadable, or from a config this version no longer reads
        return self._runs

    def find(self, run: Run) -> Path | None:
        """The directory of a finished run with ``run``'s training config, or None. Only for a run
        that has not started here: an interrupted run resumes from its own checkpoints instead."""
        if run.out_dir.exists() and any(run.out_dir.iterdir()):
            return None
        typed, key = self._typed_sections(run.config), None
        for entry in self._index():
            if entry["typed"] != typed or entry["dir"].resolve() == run.out_dir.resolve():
                continue
            if "key" not in entry:
                try:
                    entry["key"] = _equivalence_key(entry["config"])
                except (ValueError, KeyError, TypeError):
                    entry["key"] = None
            key = key or _equivalence_key(run.config)
            if entry["key"] == key:
                return entry["dir"]
        return None


def reuse(run: Run, source: Path) -> None:
    """Copy the finished run ``source`` (every file: results, logs, checkpoints) to ``run``'s
    directory, atomically: an interrupted copy leaves no half run behind. The copy is exact, so its
    ``config.yaml`` and ``result.json`` keep the source's ``name`` and ``out_dir``, which say where
    it came from."""
    staging = run.out_dir.with_name(run.out_dir.name + ".reusing")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    if run.out_dir.exists():
        run.out_dir.rmdir()  # empty (``Equivalents.find``)
    staging.rename(run.out_dir)


# ----------------------------------------------------------------------------- running


def _train_command(run: Run) -> list[str]:
    return [sys.executable, "-m", "lcsm", "train", str(run.out_dir / "config.yaml")]


def log_prefix(run_id: str, width: int = 48) -> str:
    """The tag of a run's lines in parallel output: ids share their leading labels (task, width, ...)
    and differ towards the end, so a long id keeps its tail (last labels and hash)."""
    return run_id if len(run_id) <= width else "..." + run_id[-(width - 3) :]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        for part in line.replace("\r", "\n").splitlines():
            if part.strip():
                sink.write(f"[{prefix}] {part}\n")
                sink.flush()


class SweepStopped(KeyboardInterrupt):
    """SIGINT or SIGTERM (``signum``) stopped the sweep after its running runs checkpointed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise SweepStopped(signum)


def execute(runs: Sequence[Run], *, parallel: int = 1, log=print) -> dict[str, int]:
    """Run ``runs`` (N at a time), each ``lcsm train`` in a subprocess; returns exit codes by id.
    With N > 1 each run gets cores / N torch threads and its output is prefixed with its id."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // parallel)
    codes: dict[str, int] = {}
    pending = list(runs)
    active: list[tuple[Run, subprocess.Popen, list[threading.Thread]]] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # SIGINT and SIGTERM stop the sweep as they stop each run (the trainer takes both whatever it
    # inherited): a shell's background job starts with SIGINT ignored, and the sweep would go on to
    # the next run; SIGTERM sent to the sweep alone would kill it and leave its runs training.
    main_thread = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in stops}
    try:
        while pending or active:
            while pending and len(active) < parallel:
                run = pending.pop(0)
                run.out_dir.mkdir(parents=True, exist_ok=True)
                config = copy.deepcopy(run.config)
                if parallel > 1:
                    config.setdefault("train", {})["threads"] = threads
                (run.out_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                log(f"--- run {run.id} ({len(codes) + len(active) + 1}/{len(codes) + len(active) + 1 + len(pending)})")
                if parallel == 1:
                    proc = subprocess.Popen(_train_command(run), env=env)
                    pumps = []
                else:
                    proc = subprocess.Popen(
                        _train_command(run),
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        bufsize=1,
                    )
                    pumps = [
                        threading.Thread(target=_pump, args=(proc.stdout, log_prefix(run.id), sys.stdout), daemon=True)
                    ]
                    pumps[0].start()
                active.append((run, proc, pumps))
            for item in list(active):
                run, proc, pumps = item
                if proc.poll() is not None:
                    for t in pumps:
                        t.join()
                    codes[run.id] = proc.returncode
                    if proc.returncode != 0:
                        log(f"--- run {run.id} failed (exit {proc.returncode}); the other runs go on")
                    active.remove(item)
            time.sleep(0.05)
    except KeyboardInterrupt:
        # Ctrl-C reached the runs too (one process group), a SIGTERM to the sweep did not. SIGTERM
        # asks a run to stop after its step whether or not it was already asked; a second SIGINT
        # would stop it at once, without the checkpoint of that step.
        for _, proc, _ in active:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in active:
            proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return codes


# ----------------------------------------------------------------------------- results


def _metric_value(value: Any) -> Any:
    return math.nan if value is None else value


def collect(exp: Experiment) -> list[dict[str, Any]]:
    """One row per run of the grid: its labels, status and final metrics (missing runs: status
    "missing")."""
    rows = []
    for run in exp.runs():
        result = cached_result(run)
        row: dict[str, Any] = {"run": run.id, **run.labels}
        if result is None:
            row["status"] = "missing"
        else:
            row.update(
                {
                    "status": result["status"],
                    "step": result["step"],
                    "n_params": result["n_params"],
                    "wall_time_s": result["wall_time_s"],
                }
            )
            # result.json writes a nan or infinite metric as null (JSON has no such numbers)
            row.update({f"metric:{k}": _metric_value(v) for k, v in (result.get("metrics") or {}).items()})
            if result.get("test"):
                row.update({f"metric:test/{k}": _metric_value(v) for k, v in result["test"]["metrics"].items()})
            if result.get("machine"):
                row["machine"] = machine_label(result)
            if result.get("git_commit"):
                row["git_commit"] = result["git_commit"]
            if result.get("best"):
                row["best_step"] = result["best"]["step"]
        rows.append(row)
    return rows


def write_results(exp: Experiment, rows: list[dict[str, Any]]) -> None:
    exp.out_dir.mkdir(parents=True, exist_ok=True)
    (exp.out_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns))
    writer.writeheader()
    writer.writerows(rows)
    (exp.out_dir / "results.csv").write_text(buf.getvalue())
    # The experiment as run (base, overrides and grid options resolved), so ``lcsm report`` on the
    # sweep directory rebuilds the same runs without the original file.
    resolved = {k: v for k, v in exp.spec.items() if k not in ("base", "set", "grid")}
    resolved.update(
        name=exp.name, config=exp.base, grid={a.key: dict(zip(a.labels, a.values, strict=False)) for a in exp.axes}
    )
    (exp.out_dir / EXPERIMENT_COPY).write_text(yaml.safe_dump(resolved, sort_keys=False))


def check_buildable(runs: Sequence[Run]) -> None:
    """Build each run's task (no data: tasks load lazily) and model (on the meta device, no
    memory), so that a clash only the model's constructor sees (a mixer option another one rules
    out, a malformed model code) stops the sweep before anything runs, not hours into it."""
    import torch

    from lcsm.models import build_model

    for run in runs:
        try:
            config = RunConfig.from_dict(run.config)
            model_config = config.model_config(config.build_task())
            with torch.device("meta"):
                build_model(model_config, verbose=False)
        except ValueError as err:
            raise ValueError(f"run {run.id}: {err}") from None


def sweep(
    exp: Experiment, *, parallel: int = 1, dry_run: bool = False, reuse_runs: bool = True, log=print
) -> tuple[list[dict[str, Any]], bool]:
    """Run every run of ``exp`` that has no cached result; returns (result rows, all succeeded).
    With ``reuse_runs`` a run that a sweep beside this one has finished with the same training
    config (``Equivalents``) is copied, not trained. The runs to train are built first
    (``check_buildable``), dry run included."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"--parallel: expected a positive integer, got {parallel!r}")
    runs = exp.runs()
    cached = {r.id: cached_result(r) for r in runs}
    missing = [r for r in runs if cached[r.id] is None]
    equivalents = Equivalents(exp.out_dir)
    sources = {r.id: equivalents.find(r) for r in missing} if reuse_runs else {}
    reused = [r for r in missing if sources.get(r.id)]
    todo = [r for r in missing if not sources.get(r.id)]
    check_buildable(todo)
    log(
        f"sweep {exp.name}: {len(runs)} runs in {exp.out_dir}/ ({len(runs) - len(missing)} cached, "
        + (f"{len(reused)} to copy from equal runs beside it, " if reused else "")
        + f"{len(todo)} to run"
        + (f", {parallel} at a time" if parallel > 1 and todo else "")
        + ")"
    )
    for r in runs:
        why = cached[r.id] and stale_data(cached[r.id])
        if why:
            log(
                f"  note: cached {r.id} trained on {why}: its numbers stand for that data (train it again "
                "into another --out with --no-reuse to compare)"
            )
        why = cached[r.id] and stale_model(cached[r.id])
        if why:
            log(
                f"  note: cached {r.id} trained an earlier model ({why}): its numbers stand for that model "
                "(train it again into another --out with --no-reuse to compare)"
            )
    if dry_run:
        for r in runs:
            status = "to copy" if r in reused else "to run " if r in todo else "cached "
            log(f"  {status} {r.id}" + (f" (from {sources[r.id]})" if r in reused else ""))
        return collect(exp), True
    # Two sweeps on one directory would start the same runs twice (each run also locks its own).
    with DirectoryLock(exp.out_dir, "lcsm sweep", note=log):
        for r in reused:
            reuse(r, sources[r.id])
            log(f"--- run {r.id}: copied from {sources[r.id]} (the same training config)")
        codes = execute(todo, parallel=parallel, log=log) if todo else {}
        rows = collect(exp)
        write_results(exp, rows)
    return rows, all(c == 0 for c in codes.values())
