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

One job per module: ``grid`` reads the experiment file into runs and their ids, ``reuse`` decides
which runs are done already (cached here, or equal to a finished run beside the sweep), ``runner``
trains the rest in subprocesses; this module ties them together (``sweep``) and collects the
results (tables and selection: ``lcsm.engine.results``).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import yaml

from ..config import RunConfig
from ..lock import DirectoryLock
from ..monitor import write_atomic
from ..results import FINISHED, format_table, machine_label, main_metric, select_best
from .grid import EXPERIMENT_COPY, Experiment, Run, load_experiment
from .reuse import (
    Equivalents,
    _equivalence_key,  # noqa: F401 (the tests compare runs' keys)
    cached_result,
    copy_run,
    stale_data,
    stale_model,
)
from .runner import SweepStopped, execute, log_prefix

# What the CLI, the report and the tests import from ``lcsm.engine.sweep``. ``sweep`` calls
# ``execute`` through this module's namespace, so a test that replaces ``sweep.execute`` replaces
# the runs' training.
__all__ = [
    "EXPERIMENT_COPY",
    "Equivalents",
    "Experiment",
    "Run",
    "SweepStopped",
    "cached_result",
    "check_buildable",
    "collect",
    "execute",
    "format_table",
    "load_experiment",
    "log_prefix",
    "machine_label",
    "main_metric",
    "run_notes",
    "select_best",
    "stale_data",
    "stale_model",
    "sweep",
    "write_results",
]


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
            if result.get("skipped_steps"):  # a column of results.csv once a run has skipped steps
                row["skipped_steps"] = result["skipped_steps"]
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


def no_result(row: dict[str, Any]) -> bool:
    """Whether a finished run's final loss is not finite: its weights no longer give numbers."""
    loss = row.get("metric:loss")
    return row["status"] in FINISHED and isinstance(loss, float) and not math.isfinite(loss)


def run_notes(rows: list[dict[str, Any]]) -> list[str]:
    """A note for each run that skipped steps (``run.on_nonfinite: skip``) or finished with a loss
    that is not finite, for after the results table."""
    notes = []
    for r in rows:
        skipped = (
            f" skipped {r['skipped_steps']} of its {r['step']} steps (run.on_nonfinite: skip)"
            if r.get("skipped_steps")
            else ""
        )
        if no_result(r):
            notes.append(
                f"note: run {r['run']}{skipped}{' and' if skipped else ''} ended with loss {r['metric:loss']}: no "
                "result, and the sweep fails while its grid has this run (trained again it trains the same: "
                "change its optim.lr or optim.grad_clip, or leave it out of the grid)"
            )
        elif skipped:
            notes.append(f"note: run {r['run']}{skipped}")
    return notes


def write_results(exp: Experiment, rows: list[dict[str, Any]]) -> None:
    exp.out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(exp.out_dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns))
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(exp.out_dir / "results.csv", buf.getvalue())
    # The experiment as run (base, overrides and grid options resolved), so ``lcsm report`` on the
    # sweep directory rebuilds the same runs without the original file.
    resolved = {k: v for k, v in exp.spec.items() if k not in ("base", "set", "grid")}
    resolved.update(
        name=exp.name, config=exp.base, grid={a.key: dict(zip(a.labels, a.values, strict=False)) for a in exp.axes}
    )
    write_atomic(exp.out_dir / EXPERIMENT_COPY, yaml.safe_dump(resolved, sort_keys=False))


def check_buildable(runs: Sequence[Run]) -> None:
    """Build each run's model (on the meta device, no memory), so that a clash only the model's
    constructor sees (a mixer option another one rules out, a malformed model code) stops the sweep
    before anything runs, not hours into it. The fields the task fixes come from its config alone
    (``tasks.config_model_fields``), as ``RunConfig.from_dict`` checks them: building the task
    would train an LM's tokenizer on its corpus before the first run starts."""
    import torch

    from lcsm import tasks
    from lcsm.models import build_model

    for run in runs:
        try:
            config = RunConfig.from_dict(run.config)
            model_config = config.model_config_with(
                tasks.config_model_fields(config.task["name"], **config.task_options())
            )
            with torch.device("meta"):
                build_model(model_config, verbose=False)
        except ValueError as err:
            raise ValueError(f"run {run.id}: {err}") from None


def sweep(
    exp: Experiment, *, parallel: int = 1, dry_run: bool = False, reuse_runs: bool = True, log=print
) -> tuple[list[dict[str, Any]], bool]:
    """Run every run of ``exp`` that has no cached result; returns (result rows, all succeeded: none
    failed, diverged or finished with a loss that is not finite).
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
    # a diverged run keeps its result (and its last good checkpoints): the sweep fails until it is
    # finished another way
    unfinished = [r for r in runs if cached[r.id] and cached[r.id].get("status") not in FINISHED]
    for r in unfinished:
        log(
            f"  note: cached {r.id} ended {cached[r.id].get('status')}: resume it with `lcsm train {r.out_dir} "
            "--set run.on_nonfinite=skip`, or train it again with --restart"
        )
    if dry_run:
        for r in runs:
            status = "to copy" if r in reused else "to run " if r in todo else "cached "
            log(f"  {status} {r.id}" + (f" (from {sources[r.id]})" if r in reused else ""))
        return collect(exp), True
    # Two sweeps on one directory would start the same runs twice (each run also locks its own).
    with DirectoryLock(exp.out_dir, "lcsm sweep", note=log):
        try:
            for r in reused:
                copy_run(r, sources[r.id])
                log(f"--- run {r.id}: copied from {sources[r.id]} (the same training config)")
            codes = execute(todo, parallel=parallel, log=log) if todo else {}
        finally:
            # a stopped sweep's results too: `lcsm report` on its directory reports the runs done
            rows = collect(exp)
            write_results(exp, rows)
    # ``run.on_nonfinite: skip`` is what the note above advises for a diverged run; where every
    # step after the divergence was skipped the run completes with a nan loss, which must not
    # count as a result the way the diverged run did not. A run that skipped a few steps and
    # ended with a finite loss is a result, with a note (``run_notes``).
    failed = any(no_result(r) for r in rows)
    return rows, all(c == 0 for c in codes.values()) and not unfinished and not failed
