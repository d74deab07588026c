"""Results of a sweep as tables: where each run trained, the best run per cell of the grid, the
experiment's main metric and a markdown table of rows. ``lcsm.engine.sweep`` (which collects the
rows from the runs' cached results) and ``lcsm.engine.report`` (which writes them up) both import
this module; it imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the annotations only: at run time this module imports no other of the engine
    from .sweep.grid import Experiment

# The statuses of a run that ended as its config asked (the others: "diverged").
FINISHED = ("completed", "early_stopped")


def machine_label(result: dict[str, Any]) -> str:
    """Where a run trained: its machine, or its machines in order when it was resumed on another
    one (``trained_on`` in result.json, which also holds each one's steps)."""

    def name(m: dict[str, Any]) -> str:
        return f"{m.get('device')}; {m.get('cpu')}; torch {m.get('torch')}"

    names: list[str] = []
    for stretch in result.get("trained_on") or []:
        if not names or names[-1] != name(stretch):
            names.append(name(stretch))
    return " then ".join(names) if len(names) > 1 else name(result["machine"])


def select_best(exp: Experiment, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per combination of the axes not in ``select.over``, the finished row with the best metric
    (a nan metric, a diverged run's perplexity, loses to any number; of ties, the first row)."""
    if not exp.select:
        return [r for r in rows if r["status"] != "missing"]
    metric = f"metric:{exp.select['metric']}"
    from .config import metric_mode  # the engine's config, only where a selection is made

    sign = 1 if metric_mode("select.mode", exp.select["metric"], exp.select.get("mode")) == "max" else -1
    over = set(exp.select.get("over", []))
    groups: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        if row["status"] == "missing" or metric not in row:
            continue
        key = tuple(row[a.key] for a in exp.axes if a.key not in over)
        best = groups.get(key)
        if (
            best is None
            or (math.isnan(best[metric]) and not math.isnan(row[metric]))
            or sign * row[metric] > sign * best[metric]
        ):
            groups[key] = row
    return list(groups.values())


def main_metric(exp: Experiment) -> str:
    return exp.select["metric"] if exp.select else exp.report.get("metric", "accuracy")


def format_table(exp: Experiment, rows: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """A markdown table: the grid labels, status, the given metrics, steps (with those skipped,
    ``run.on_nonfinite: skip``) and wall time."""
    header = [a.key for a in exp.axes] + ["status"] + list(metrics) + ["step", "params", "wall s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        values = [r.get(a.key, "") for a in exp.axes] + [r["status"]]
        values += [f"{r[f'metric:{m}']:.4f}" if f"metric:{m}" in r else "—" for m in metrics]
        values += [
            f"{r['step']} ({r['skipped_steps']} skipped)" if r.get("skipped_steps") else r.get("step", "—"),
            f"{r['n_params']:,}" if "n_params" in r else "—",
            f"{r['wall_time_s']:.0f}" if "wall_time_s" in r else "—",
        ]
        lines.append("| " + " | ".join(map(str, values)) + " |")
    return "\n".join(lines)
