"""Reports: markdown tables and PNG plots of a sweep, from its cached results only.

The experiment's ``report`` section::

    report:
      metrics: [accuracy, loss]                  # table columns (default: the select metric, loss)
      table: {rows: model.mixer, columns: model.d_model, value: accuracy}   # a pivot of the best runs
      plots:
        - {x: model.d_model, y: accuracy, series: model.mixer, facet: task.train_grid, file: accuracy.png}
        - {x: model, y: [accuracy/L64-kv4, accuracy/L256-kv4], file: lengths.png}   # a series per metric
      compare:                                   # ours beside the paper's numbers, with Spearman's rho
        - {axis: model.mixer_options.code, metric: perplexity, paper: {1-1-1-0: 24.26, 0-0-0-0: 29.62},
           where: {task: wikitext}, title: "Table 4, valid ppl"}
      curves:                                    # a metric at every evaluation (eval.csv), one line per series
        - {y: accuracy, series: model.mixer, where: {task: L128-kv8}, file: curves.png}

``rows``, ``columns``, ``x``, ``series``, ``facet`` and ``axis`` name grid axes; ``value``, ``y`` and
``metric`` metrics (``test/<metric>`` for the test split of the best checkpoint, see
``Trainer.final_test``). A plot's ``y`` may list several metrics of the same runs, such as the
accuracy at each test length: one series per metric, so no ``series`` axis beside it. A
``compare`` entry lists, per label of ``axis`` (among the selected runs matching ``where``), our
metric and the paper's, and the Spearman rank correlation of the two. A
``curves`` entry tabulates and plots a metric at every evaluation of each selected run (its
``eval.csv``): where final numbers saturate, how soon each model got there still tells them apart.
Tables and plots use the runs ``select`` keeps (best of its grid), the full table lists every run.

A report reads top down: a verdict box (the paper's claim, ours, and whether ours supports it),
the experiment's ``description``, the hand-written verdict, the tables and plots, every run, then a
generated provenance footer (the command that writes this report, commits, dates, machines, wall
time). The claim is the experiment's ``paper`` (at most 5 lines); ours, the status and the verdict's
bullets are hand-written in ``VERDICT.md`` in the report's directory (``read_verdict``), so they
survive regeneration. Beside the report, ``write_report`` generates ``RUNLOG.md``: where, when and
at which commit each run trained, from the runs' own records (``result.json``, ``train.csv``).
An experiment's older ``reading`` (prose) still closes its report. ``write_report`` never trains:
runs without a result show as missing.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import shlex
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lcsm._checks import check_keys

from . import stats
from .monitor import write_atomic
from .results import format_table, main_metric, select_best

REPORT_KEYS = ("title", "metrics", "table", "plots", "compare", "curves", "differences")
# What a ``differences`` entry may name as the alternative its interval must exclude to resolve it.
ALTERNATIVES = ("a <= b", "a >= b", "a = b")
# Seeds each cell needs before its interval can resolve a comparison: with fewer, the interval
# leaves out (one seed) or barely samples (two: three distinct resamples) the seed's noise.
MIN_SEEDS = 3


def check_report_spec(report: Mapping[str, Any], axes: Sequence[str]) -> None:
    check_keys("report", report, REPORT_KEYS)
    metrics = report.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ValueError(f"report.metrics: expected a list of metric names, got {metrics!r}")

    def axis(where: str, key: Any, optional: bool = False) -> None:
        if key is None and optional:
            return
        if key not in axes:
            raise ValueError(f"{where}: expected a grid axis ({', '.join(axes) or 'none'}), got {key!r}")

    def metric(where: str, value: Any) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a metric name, got {value!r}")

    def png(where: str, value: Any) -> None:
        # a name, not a path: a report writes its plots into its own directory only
        if not isinstance(value, str) or not value.endswith(".png") or value != Path(value).name or value == ".png":
            raise ValueError(f"{where}: expected a file name ending in .png (no directory), got {value!r}")

    def entries(section: str, keys: Sequence[str]):
        """(path, entry) of the list ``report[section]``, each entry's keys checked."""
        items = report.get(section, [])
        if not isinstance(items, list):
            raise ValueError(f"report.{section}: expected a list, got {items!r}")
        for i, item in enumerate(items):
            check_keys(f"report.{section}[{i}]", item, keys)
            yield f"report.{section}[{i}]", item

    table = report.get("table")
    if table is not None:
        check_keys("report.table", table, ("rows", "columns", "value"))
        axis("report.table.rows", table.get("rows"))
        axis("report.table.columns", table.get("columns"), optional=True)
        metric("report.table.value", table.get("value"))
    for where, plot in entries("plots", ("x", "y", "series", "facet", "file", "logx", "title")):
        axis(f"{where}.x", plot.get("x"))
        axis(f"{where}.series", plot.get("series"), optional=True)
        axis(f"{where}.facet", plot.get("facet"), optional=True)
        ys = plot.get("y")
        if isinstance(ys, list):
            if not ys:
                raise ValueError(f"{where}.y: expected a metric name or a non-empty list of them, got []")
            if plot.get("series") is not None:
                raise ValueError(
                    f"{where}.series: a plot whose y lists several metrics draws one series per metric, "
                    f"got series {plot['series']!r} too"
                )
            for i, name in enumerate(ys):
                metric(f"{where}.y[{i}]", name)
        else:
            metric(f"{where}.y", ys)
        png(f"{where}.file", plot.get("file"))
    for where, comp in entries("compare", ("axis", "metric", "paper", "where", "title")):
        axis(f"{where}.axis", comp.get("axis"))
        metric(f"{where}.metric", comp.get("metric"))
        paper = comp.get("paper")
        if (
            not isinstance(paper, Mapping)
            or not paper
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in paper.values())
        ):
            raise ValueError(f"{where}.paper: expected a mapping of axis label to the paper's number, got {paper!r}")
        for key in comp.get("where") or {}:
            axis(f"{where}.where", key)
    for where, diff in entries("differences", ("a", "b", "metric", "alternative", "title")):
        for side in ("a", "b"):
            cell = diff.get(side)
            if isinstance(cell, Mapping) and cell:
                for key in cell:
                    axis(f"{where}.{side}", key)
            elif not isinstance(cell, (str, int, float)) or isinstance(cell, bool):
                raise ValueError(
                    f"{where}.{side}: expected a cell, a label of a grid axis or a mapping of axis to label, "
                    f"got {cell!r}"
                )
        metric(f"{where}.metric", diff.get("metric"))
        if diff.get("alternative") not in ALTERNATIVES:
            raise ValueError(
                f"{where}.alternative: expected one of {', '.join(map(repr, ALTERNATIVES))}, "
                f"got {diff.get('alternative')!r}"
            )
    for where, curve in entries("curves", ("y", "series", "where", "file", "title")):
        axis(f"{where}.series", curve.get("series"))
        metric(f"{where}.y", curve.get("y"))
        png(f"{where}.file", curve.get("file"))
        for key in curve.get("where") or {}:
            axis(f"{where}.where", key)


def report_metric_names(report: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """(config key, metric name, whether test/<metric> may be given) of every metric a checked
    ``report`` names; a curve reads eval.csv, which has no test split."""
    found = [(f"report.metrics[{i}]", m, True) for i, m in enumerate(report.get("metrics", []))]
    if report.get("table") is not None:
        found.append(("report.table.value", report["table"]["value"], True))
    for i, plot in enumerate(report.get("plots", [])):
        ys = plot["y"] if isinstance(plot["y"], list) else [plot["y"]]
        found += [(f"report.plots[{i}].y", y, True) for y in ys]
    found += [(f"report.compare[{i}].metric", c["metric"], True) for i, c in enumerate(report.get("compare", []))]
    found += [
        (f"report.differences[{i}].metric", d["metric"], True) for i, d in enumerate(report.get("differences", []))
    ]
    found += [(f"report.curves[{i}].y", c["y"], False) for i, c in enumerate(report.get("curves", []))]
    return found


def _number(label: str) -> float | None:
    try:
        return float(label)
    except ValueError:
        return None


def _ordered(labels: Sequence[str]) -> list[str]:
    """Distinct labels, numerically when all are numbers, else in order of first appearance."""
    distinct = list(dict.fromkeys(labels))
    if all(_number(x) is not None for x in distinct):
        return sorted(distinct, key=float)
    return distinct


def table_seed_axes(exp) -> list[str]:
    """The seed axes a ``report.table`` cell averages over: those not in ``select.over`` (a seed
    axis there is selected, one seed a cell) and not the table's rows or columns (one seed a row
    or column)."""
    table = exp.report.get("table") or {}
    shown = {*(exp.select or {}).get("over", []), table.get("rows"), table.get("columns")}
    return [key for key in seed_axes(exp) if key not in shown]


def pivot(rows: list[dict[str, Any]], spec: Mapping[str, Any], exp) -> str:
    """The ``report.table`` of the selected rows: a cell's value, or with seed axes the mean over
    the cell's finished seeds (how many, where fewer than the grid plans). With ``select.over``
    each seed's own best run is the one averaged (the selection is made per seed)."""
    r_key, c_key, metric = spec["rows"], spec.get("columns"), f"metric:{spec['value']}"
    seeds = table_seed_axes(exp)
    loose = {*seeds, *(exp.select or {}).get("over", [])}
    configs: dict[tuple, tuple] = {}
    cells: dict[tuple, list[float]] = {}
    for row in rows:
        cell = (row[r_key], row[c_key] if c_key else spec["value"])
        config = tuple(row[a.key] for a in exp.axes if a.key not in loose)
        if configs.setdefault(cell, config) != config:
            raise ValueError(
                f"report.table: several selected runs fall in the cell {cell}; put the other grid "
                "axes in select.over, or use them as rows/columns"
            )
        if metric in row:
            cells.setdefault(cell, []).append(row[metric])
    planned = math.prod(len(a.labels) for a in exp.axes if a.key in seeds)

    def value(cell: tuple) -> str:
        if cell not in cells:
            return "—"
        mean = f"{float(np.mean(cells[cell])):.4f}"
        return mean if len(cells[cell]) == planned else f"{mean} ({len(cells[cell])} of {planned} seeds)"

    r_labels = _ordered([row[r_key] for row in rows])
    c_labels = _ordered([row[c_key] for row in rows]) if c_key else [spec["value"]]
    head = f"{r_key} \\ {c_key}" if c_key else r_key
    lines = [f"| {head} | " + " | ".join(c_labels) + " |", "|" + "---|" * (len(c_labels) + 1)]
    for r in r_labels:
        lines.append(f"| {r} | " + " | ".join(value((r, c)) for c in c_labels) + " |")
    return "\n".join(lines)


def check_table_cells(exp) -> None:
    """Before any run trains: a ``report.table`` cell holds one selected run, or the seeds of one
    config (averaged), so every other grid axis of more than one label must be in select.over."""
    table = exp.report.get("table")
    if table is None:
        return
    placed = {table["rows"], table.get("columns"), *seed_axes(exp), *(exp.select or {}).get("over", [])}
    loose = [a.key for a in exp.axes if a.key not in placed and len(a.labels) > 1]
    if loose:
        raise ValueError(
            f"report.table: the selected runs of a cell would differ in {', '.join(loose)}, and a cell "
            f"holds one run (or the mean over the seeds of one); make {'them' if len(loose) > 1 else 'it'} "
            "the table's rows or columns, or put "
            f"{'them' if len(loose) > 1 else 'it'} in select.over (the best run of them per cell)"
        )


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None for fewer than 3 pairs or a
    constant side."""
    if len(a) != len(b):
        raise ValueError(f"spearman: expected two sequences of one length, got {len(a)} and {len(b)}")
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=False))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / (va * vb) ** 0.5


def compare(rows: list[dict[str, Any]], spec: Mapping[str, Any], exp=None) -> str:
    """Markdown: per label of ``spec['axis']``, our metric beside the paper's (the mean over seeds
    where the grid has a seed axis), then Spearman's rho over the labels both have, with its 95%
    interval (``stats.spearman_interval``) when ``exp``'s runs give one: seeds, or test examples.
    A rho of single runs without their examples is printed with the note that it has none."""
    key, metric = spec["axis"], f"metric:{spec['metric']}"
    paper = {(f"{k:g}" if isinstance(k, float) else str(k)): float(v) for k, v in spec["paper"].items()}
    seeds = seed_axes(exp) if exp is not None else []
    if seeds:
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if metric in row and all(row.get(k) == str(v) for k, v in (spec.get("where") or {}).items()):
                groups.setdefault(row[key], []).append(row)
    else:
        groups = {label: [row] for label, row in _matching(rows, spec, key, "compare").items() if metric in row}
    ours = {label: float(np.mean([r[metric] for r in group])) for label, group in groups.items()}
    lines = [f"| {key} | ours: {spec['metric']} | paper |", "|---|---:|---:|"]
    for label in [*paper, *[k for k in _ordered(list(ours)) if k not in paper]]:
        lines.append(
            f"| {label} | "
            + (f"{ours[label]:.4g}" if label in ours else "—")
            + " | "
            + (f"{paper[label]:g}" if label in paper else "—")
            + " |"
        )
    both = [k for k in paper if k in ours]
    rho = spearman([ours[k] for k in both], [paper[k] for k in both])
    text = f"Spearman's rho between our ordering and the paper's over the {len(both)} labels both have: " + (
        f"{rho:+.2f}" if rho is not None else "not defined (fewer than 3 labels, or a constant column)"
    )
    if rho is not None and exp is not None:
        try:
            cells = {k: _scores(exp, groups[k], spec["metric"]) for k in both}
            ci = stats.spearman_interval(cells, {k: paper[k] for k in both})
            text += f", 95% interval [{ci.low:+.2f}, {ci.high:+.2f}] (resampled: {ci.over}; {_over_cells(cells)})"
        except ValueError as err:
            text += f"; no interval ({err}): not evidence of agreement or disagreement"
    if rho is not None:
        chance = stats.spearman_chance([ours[k] for k in both], [paper[k] for k in both])
        text += (
            f". A random order of {len(both)} labels reaches |rho| >= {abs(rho):.2f} with probability {chance:.2f}"
            " (the interval, if any, is over our resampling only and does not say this)"
        )
    return "\n".join(lines + ["", text])


def _over_cells(cells: Mapping[str, Sequence[stats.RunScore]]) -> str:
    runs = [r for cell in cells.values() for r in cell]
    seeds = min(len(cell) for cell in cells.values())
    with_examples = sum(r.examples is not None for r in runs)
    return f"{seeds}+ seeds a label, test examples of {with_examples} of {len(runs)} runs"


def planned_seeds(exp) -> int:
    """The runs of one cell the grid holds: the product of its seed axes' sizes (1 without any)."""
    return math.prod(len(a.labels) for a in exp.axes if a.key in seed_axes(exp))


def seed_axes(exp) -> list[str]:
    """The grid axes that vary only a seed (``train.seed``, ``task.seed``): runs that differ in
    them alone are seeds of one config, a cell."""
    return [a.key for a in exp.axes if a.key.rsplit(".", 1)[-1] == "seed"]


def _cell_name(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return str(row[keys[0]])
    return ", ".join(f"{k}={row[k]}" for k in keys) or "all runs"


def seed_cells(exp, rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The finished rows by cell (their labels of every axis but the seed axes), in grid order."""
    seeds = seed_axes(exp)
    keys = [a.key for a in exp.axes if a.key not in seeds]
    cells: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["status"] != "missing":
            cells.setdefault(_cell_name(row, keys), []).append(row)
    return cells


def _csv_records(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str | None]]]]:
    """(column names, [(line number, record)]) of a run's CSV file, header on line 1."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(enumerate(reader, start=2))


def _csv_number(path: Path, line: int, record: Mapping[str, str | None], key: str) -> float:
    """``record[key]`` as a number; a cell cut off or garbled (a damaged file) is an error naming
    the file and the line, not a traceback from float()."""
    try:
        return float(record[key])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path}: line {line}: {key} {record.get(key)!r} is not a number (the file is damaged: restore it "
            "from a copy, or train the run again)"
        ) from None


def read_examples(run_dir: Path) -> dict[str, np.ndarray] | None:
    """A run's ``test_examples.csv`` (``Trainer.finish``) as columns, or None for a run without one
    (runs trained before runs recorded their examples)."""
    from .trainer import EXAMPLES_FILE

    path = Path(run_dir) / EXAMPLES_FILE
    if not path.is_file():
        return None
    _, records = _csv_records(path)
    columns = {k: np.array([_csv_number(path, i, r, k) for i, r in records]) for k in ("total", "correct", "loss")}
    return {"segment": np.array([r["segment"] for _, r in records]), **columns}


def metric_examples(columns: Mapping[str, np.ndarray], metric: str, block: int = 1) -> stats.Examples | None:
    """The examples of ``metric`` (a name without ``test/``): accuracy as a mean of per-example
    accuracies (Evaluator), per segment with ``accuracy/<segment>``; loss and perplexity over
    labelled positions; resampled in blocks of ``block`` (the task's ``example_block``). None for a
    metric the examples do not give (a slice ``accuracy/<key>=<v>``)."""
    labelled = columns["total"] > 0
    name, _, segment = metric.partition("/")
    if segment:
        if name != "accuracy" or segment not in set(columns["segment"].tolist()):
            return None
        labelled = labelled & (columns["segment"] == segment)
    if name == "accuracy":
        n = int(labelled.sum())
        return stats.Examples(columns["correct"][labelled] / columns["total"][labelled], np.ones(n), block=block)
    if name in ("loss", "perplexity"):
        return stats.Examples(
            columns["loss"][labelled],
            columns["total"][labelled],
            "exp" if name == "perplexity" else "identity",
            block,
        )
    return None


def run_score(run_dir: Path, row: Mapping[str, Any], metric: str, seeds: Sequence[str]) -> stats.RunScore:
    """One run's ``metric`` with the test examples behind it, when it recorded them and the metric
    is of the test split (``test/<m>``, or ``<m>`` of a run that evaluated on test)."""
    value = row.get(f"metric:{metric}")
    if value is None:
        raise ValueError(f"run {row['run']}: no metric {metric!r} in its result")
    seed = tuple(row.get(k) for k in seeds)
    columns = read_examples(run_dir)
    examples = None
    if columns is not None:
        from lcsm.tasks import resolve

        result = json.loads((Path(run_dir) / "result.json").read_text())
        block = resolve(result["config"]["task"]["name"]).example_block
        if metric.startswith("test/"):
            examples = metric_examples(columns, metric[len("test/") :], block)
        elif result.get("eval_split") == "test":
            examples = metric_examples(columns, metric, block)
    if examples is not None and math.isfinite(float(value)):
        # the intervals resample these examples: a cut-off file would give them over what is left
        got = float(examples.value())
        if not math.isclose(got, float(value), rel_tol=1e-4, abs_tol=1e-6):
            raise ValueError(
                f"{Path(run_dir) / 'test_examples.csv'}: its {len(examples.numerator)} examples give {metric} "
                f"{got:.6g}, not the {float(value):.6g} of the run's result (the file is damaged or cut off: "
                "restore it from a copy, or train the run again)"
            )
    return stats.RunScore(seed, float(value), examples)


def _scores(exp, rows: list[dict[str, Any]], metric: str) -> list[stats.RunScore]:
    seeds = seed_axes(exp)
    return [run_score(exp.out_dir / row["run"], row, metric, seeds) for row in rows]


# The values each metric can take (by its name without the split and segment): intervals are
# clipped to them, and differences to the range of a difference of two of them.
_METRIC_RANGES = {"accuracy": (0.0, 1.0), "loss": (0.0, math.inf), "perplexity": (1.0, math.inf)}


def metric_range(metric: str, difference: bool = False) -> tuple[float, float]:
    """[low, high] of ``metric`` (``test/accuracy``, ``accuracy/L64-kv4``, ...), or of a difference
    of two values of it; unbounded for a metric not in ``_METRIC_RANGES``."""
    name = metric.removeprefix("test/").partition("/")[0]
    low, high = _METRIC_RANGES.get(name, (-math.inf, math.inf))
    return (low - high, high - low) if difference else (low, high)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def interval_table(exp, rows: list[dict[str, Any]], metric: str) -> str:
    """Markdown: per cell, its seeds, the mean of ``metric`` over them, the standard deviation
    across seeds, and the 95% interval of the mean (``stats.cell_interval``) and its width."""
    lines = [
        f"| cell | seeds | mean {metric} | sd over seeds | 95% interval | width | resampled |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for name, cell in seed_cells(exp, rows).items():
        scores = _scores(exp, cell, metric)
        values = [s.value for s in scores]
        sd = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
        try:
            ci = stats.cell_interval(scores).clipped(*metric_range(metric))
            shown = f"[{_fmt(ci.low)}, {_fmt(ci.high)}] | {_fmt(ci.width)} | {ci.over}"
        except ValueError as err:
            shown = f"none | — | {err}"
        lines.append(
            f"| {name} | {len(values)} | {_fmt(float(np.mean(values)))} | "
            + (_fmt(sd) if math.isfinite(sd) else "—")
            + f" | {shown} |"
        )
    return "\n".join(lines)


def _cell_rows(exp, rows: list[dict[str, Any]], cell: Any, where: str) -> list[dict[str, Any]]:
    """The finished rows of a ``differences`` side: a mapping of axis to label, or one label of the
    one axis (besides the seed axes) that has it; every other non-seed axis must be constant. None
    finished yet gives []: the report names the comparison as missing."""
    seeds = seed_axes(exp)
    others = [a for a in exp.axes if a.key not in seeds]
    if isinstance(cell, Mapping):
        wanted = {k: str(v) for k, v in cell.items()}
        axes = {a.key: a for a in others}
        # a typo would otherwise match no run and read as a cell not run yet
        for k, v in wanted.items():
            if k not in axes or v not in axes[k].labels:
                known = sorted(axes[k].labels) if k in axes else sorted(axes)
                raise ValueError(
                    f"{where}: expected a grid axis and one of its labels, got {k}: {v!r} (known: {known})"
                )
    else:
        holders = [a.key for a in others if str(cell) in a.labels]
        if len(holders) != 1:
            raise ValueError(
                f"{where}: expected a label of exactly one grid axis, got {cell!r} (found on "
                f"{holders or 'none'}); write it as a mapping of axis to label"
            )
        wanted = {holders[0]: str(cell)}
    chosen = [r for r in rows if r["status"] != "missing" and all(r.get(k) == v for k, v in wanted.items())]
    for a in others:
        labels = sorted({r[a.key] for r in chosen})
        if len(labels) > 1:
            raise ValueError(f"{where}: the runs of {cell!r} differ in {a.key} ({labels}); name its label too")
    return chosen


def differences(exp, rows: list[dict[str, Any]], specs: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """Markdown: per ``differences`` entry, mean(a) - mean(b) of its metric with the 95% interval
    (``stats.difference_interval``) and whether it excludes the entry's alternative (then the
    comparison is resolved); and how many are resolved."""
    lines = [
        "| a | b | metric | a - b | 95% interval | alternative | resolved? | resampled |",
        "|---|---|---|---:|---|---|---|---|",
    ]
    resolved = 0
    for i, spec in enumerate(specs):
        where = f"report.differences[{i}]"
        metric, alternative = spec["metric"], spec["alternative"]
        a_rows = _cell_rows(exp, rows, spec["a"], f"{where}.a")
        b_rows = _cell_rows(exp, rows, spec["b"], f"{where}.b")
        if not a_rows or not b_rows:
            # A sweep not finished yet: the comparison is named, not dropped.
            unrun = " and ".join(repr(c) for c, r in ((spec["a"], a_rows), (spec["b"], b_rows)) if not r)
            lines.append(
                f"| {spec['a']} | {spec['b']} | {metric} | — | none | {alternative} | no | "
                f"missing: no finished run of {unrun} |"
            )
            continue
        a = _scores(exp, a_rows, metric)
        b = _scores(exp, b_rows, metric)
        try:
            ci = stats.difference_interval(a, b).clipped(*metric_range(metric, difference=True))
        except ValueError as err:
            lines.append(f"| {spec['a']} | {spec['b']} | {metric} | — | none | {alternative} | no | {err} |")
            continue
        excluded = {"a <= b": ci.low > 0, "a >= b": ci.high < 0, "a = b": ci.excludes(0.0)}[alternative]
        seeds = min(len(a), len(b))
        planned = planned_seeds(exp)
        if excluded and seeds < planned:
            # the experiment's seeds are fixed before its runs: reading it before they are all in
            # and stopping when the interval clears would be optional stopping
            verdict = f"no: excluded, but {seeds} of the grid's {planned} seeds a cell have finished"
        elif excluded and seeds >= MIN_SEEDS:
            verdict = "yes: excluded"
        elif excluded:
            verdict = f"no: excluded, but {seeds} seed{'s' if seeds > 1 else ''} a cell (resolving takes {MIN_SEEDS})"
        else:
            verdict = "no: inside"
        resolved += verdict.startswith("yes")
        lines.append(
            f"| {spec['a']} | {spec['b']} | {metric} | {ci.estimate:+.4g} | [{ci.low:+.4g}, {ci.high:+.4g}] | "
            f"{alternative} | {verdict} | {ci.over} |"
        )
    lines += [
        "",
        f"Resolved: {resolved} of {len(specs)} (the interval excludes the alternative, with {MIN_SEEDS} or more "
        "seeds a cell).",
    ]
    return "\n".join(lines), resolved


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# (marker, bar hatch) of each further ten series: matplotlib's colour cycle repeats after ten, and
# the o-types figure has twelve codes
_VARIANTS = [("o", ""), ("s", "//"), ("D", ".."), ("^", "xx")]


def series_style(i: int) -> dict[str, Any]:
    """Colour, marker and bar hatch of the i-th series of a plot: distinct for 40 series."""
    marker, hatch = _VARIANTS[(i // 10) % len(_VARIANTS)]
    return {"color": f"C{i % 10}", "marker": marker, "hatch": hatch}


def _legend_and_save(fig, axes: list[Any], series: str | None, path: Path) -> None:
    """One legend, beside the last of ``axes``, naming every series drawn on any of them (a facet
    may lack some); no legend when ``axes`` is empty."""
    if axes:
        entries: dict[str, Any] = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=False):
                entries.setdefault(label, handle)
        # outside the axes: inside, the legend hid points wherever a series saturated near it
        axes[-1].legend(
            list(entries.values()),
            list(entries),
            title=series,
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)


def _matching(rows: list[dict[str, Any]], spec: Mapping[str, Any], key: str, what: str) -> dict[str, dict[str, Any]]:
    """The rows matching ``spec['where']``, by their label of ``key`` (one row per label)."""
    chosen: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not all(row.get(k) == str(v) for k, v in (spec.get("where") or {}).items()):
            continue
        if row[key] in chosen:
            raise ValueError(
                f"report.{what}: several selected runs have {key} = {row[key]}; narrow them with "
                "'where' or put the other axes in select.over"
            )
        chosen[row[key]] = row
    return chosen


def eval_curves(rows: list[dict[str, Any]], spec: Mapping[str, Any], run_root: Path) -> dict[str, dict[int, float]]:
    """Per label of ``spec['series']``: step -> ``spec['y']`` at every evaluation of that selected run,
    read from ``run_root/<run>/eval.csv`` (a run without one has no curve)."""
    curves: dict[str, dict[int, float]] = {}
    for label, row in _matching(rows, spec, spec["series"], "curves").items():
        path = run_root / row["run"] / "eval.csv"
        if not path.exists():
            continue
        names, records = _csv_records(path)
        if spec["y"] not in names:
            raise ValueError(f"report.curves: {path} has no column {spec['y']!r} (its columns: {', '.join(names)})")
        points = {
            int(_csv_number(path, i, r, "step")): _csv_number(path, i, r, spec["y"]) for i, r in records if r[spec["y"]]
        }
        if points:
            curves[label] = points
    return curves


def curve_table(curves: dict[str, dict[int, float]], series: str, y: str) -> str:
    steps = sorted({step for points in curves.values() for step in points})
    lines = [f"| {series} \\ step ({y}) | " + " | ".join(map(str, steps)) + " |", "|" + "---|" * (len(steps) + 1)]
    for label in _ordered(list(curves)):
        points = curves[label]
        lines.append(f"| {label} | " + " | ".join(f"{points[s]:.4f}" if s in points else "—" for s in steps) + " |")
    return "\n".join(lines)


def plot_curves(curves: dict[str, dict[int, float]], spec: Mapping[str, Any], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for i, label in enumerate(_ordered(list(curves))):
        steps = sorted(curves[label])
        style = series_style(i)
        ax.plot(steps, [curves[label][s] for s in steps], color=style["color"], marker=style["marker"], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(spec["y"])
    ax.set_title(spec.get("title", title), fontsize=9)
    ax.grid(alpha=0.3)
    _legend_and_save(fig, [ax], spec["series"], path)


def provenance(rows: list[dict[str, Any]], key: str) -> list[str]:
    """The distinct values of ``key`` (the machine, the commit) over the finished runs, with run counts."""
    counts = Counter(row.get(key, "not recorded") for row in rows if row["status"] != "missing")
    return [f"{name} ({n} run{'' if n == 1 else 's'})" for name, n in counts.items()]


def plot_label(y: str | list[str]) -> str:
    """The y axis label of a plot: the metric, or the name that several metrics share before their
    slices (``accuracy`` for ``accuracy/L64-kv4`` and ``accuracy/L256-kv4``)."""
    if isinstance(y, str):
        return y
    stems = {name.split("/")[0] for name in y}
    return stems.pop() if len(stems) == 1 else ", ".join(y)


def plot(rows: list[dict[str, Any]], spec: Mapping[str, Any], path: Path, title: str) -> None:
    plt = _pyplot()
    x_key, y, series, facet = spec["x"], spec["y"], spec.get("series"), spec.get("facet")
    facets = _ordered([row[facet] for row in rows]) if facet else [None]
    fig, axes = plt.subplots(1, len(facets), figsize=(4.2 * len(facets), 3.4), squeeze=False, sharey=True)
    x_labels = _ordered([row[x_key] for row in rows])
    numeric = all(_number(x) is not None for x in x_labels)
    # (legend label, metric column, series label) per series; several metrics are series of their own
    if isinstance(y, list):
        lines = [(name, f"metric:{name}", None) for name in y]
    else:
        metric = f"metric:{y}"
        # series named over every facet, so that a series keeps its style in facets that lack others
        names = _ordered([row[series] for row in rows if metric in row]) if series else [None]
        lines = [(s, metric, s) for s in names]
    for ax, f in zip(axes[0], facets, strict=False):
        chosen = [row for row in rows if f is None or row[facet] == f]
        for i, (label, metric, s) in enumerate(lines):
            points = [row for row in chosen if metric in row and (s is None or row[series] == s)]
            if not points:
                continue
            points.sort(key=lambda row: x_labels.index(row[x_key]))
            ys = [row[metric] for row in points]
            style = series_style(i)
            if numeric:
                ax.plot(
                    [float(row[x_key]) for row in points], ys, color=style["color"], marker=style["marker"], label=label
                )
            else:
                # categories (mixers, ...) have no order to draw a line along: grouped bars
                width = 0.8 / len(lines)
                xs = [x_labels.index(row[x_key]) - 0.4 + width * (i + 0.5) for row in points]
                ax.bar(xs, ys, width=width, color=style["color"], hatch=style["hatch"], label=label)
        if not numeric:
            ax.set_xticks(range(len(x_labels)), x_labels)
        if spec.get("logx") and numeric:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x_key)
        ax.set_title(f"{facet} = {f}" if facet else spec.get("title", title), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(plot_label(y))
    several = isinstance(y, list)
    _legend_and_save(fig, list(axes[0]) if series or several else [], "metric" if several else series, path)


VERDICT_FILE = "VERDICT.md"
RUNLOG_FILE = "RUNLOG.md"
VERDICTS = ("supported", "partly supported", "contradicted", "open")
MAX_CLAIM_LINES, MAX_VERDICT_BULLETS = 5, 10


def read_verdict(path: Path) -> dict[str, Any] | None:
    """The hand-written verdict ``path`` (``VERDICT.md``), or None when there is none::

        ours: what our runs show, in one line
        verdict: open                       # supported, partly supported, contradicted or open

        - at most 10 bullets, each a finding with its numbers
        - ...

    Returns ``{"ours": ..., "verdict": ..., "bullets": [...]}`` (bullets as markdown lines)."""
    if not path.is_file():
        return None
    head, _, body = path.read_text().strip().partition("\n\n")
    fields = {}
    for line in head.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip() not in ("ours", "verdict"):
            raise ValueError(f"{path}: expected 'ours: ...' and 'verdict: ...' lines first, got {line!r}")
        fields[key.strip()] = value.strip()
    if set(fields) != {"ours", "verdict"} or fields["verdict"] not in VERDICTS:
        raise ValueError(f"{path}: expected an 'ours:' line and 'verdict:' one of {', '.join(VERDICTS)}, got {fields}")
    bullets = [line for line in body.splitlines() if line.strip()]
    if sum(line.startswith("- ") for line in bullets) > MAX_VERDICT_BULLETS or (
        bullets and not bullets[0].startswith("- ")
    ):
        raise ValueError(f"{path}: expected at most {MAX_VERDICT_BULLETS} bullets ('- ...') after the blank line")
    return {**fields, "bullets": bullets}


def _short_claim(claim: Any) -> bool:
    """Whether the experiment's ``paper`` is a claim that fits the verdict box: at most
    MAX_CLAIM_LINES lines and no table. A longer one (the paper's numbers) gets its own section."""
    lines = str(claim or "").strip().splitlines()
    return len(lines) <= MAX_CLAIM_LINES and not any(line.lstrip().startswith("|") for line in lines)


def verdict_box(claim: Any, verdict: Mapping[str, Any] | None) -> list[str]:
    """The report's opening table, three lines: the paper's claim, ours, and the verdict."""
    if not claim and not verdict:
        return []

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|") or "—"

    claimed = cell(claim or "") if _short_claim(claim) else "the paper's numbers: below"
    return [
        "| the paper's claim | our runs | verdict |",
        "|---|---|---|",
        f"| {claimed} | {cell(verdict['ours'] if verdict else '')} | "
        + (f"**{verdict['verdict']}** |" if verdict else f"— (no {VERDICT_FILE}) |"),
        "",
    ]


def report_command(exp, out_dir: Path) -> str:
    """The command that writes this report: a sweep's own command line (``lcsm sweep ... --report``
    writes one report), else ``lcsm report`` of this experiment alone, even when one call wrote
    several reports."""
    argv = sys.argv[1:]
    if argv[:1] == ["sweep"]:
        return shlex.join(["lcsm", *argv])

    def shown(path: Path) -> str:
        try:
            return str(Path(path).resolve().relative_to(Path.cwd()))
        except ValueError:
            return str(path)

    if exp.path is None or Path(exp.path).resolve().parent == Path(exp.out_dir).resolve():
        # a sweep directory (its experiment copy inside), the report written there or elsewhere
        elsewhere = Path(out_dir).resolve() != Path(exp.out_dir).resolve()
        return shlex.join(["lcsm", "report", shown(exp.out_dir), *(["--out", shown(out_dir)] if elsewhere else [])])
    return shlex.join(["lcsm", "report", shown(exp.path), "--out", shown(out_dir)])


def _machine(m: Mapping[str, Any]) -> str:
    return f"{m.get('device')}; {m.get('cpu')}; torch {m.get('torch')}"


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def run_log(exp, rows: list[dict[str, Any]]) -> str:
    """``RUNLOG.md``: per run, where (machine, steps on each), when (the times of its first and last
    logged training step, ``train.csv``), at which commit, and the experiment it was copied from
    when another one trained it (a copy keeps that one's run name), all from the run's own files."""
    lines = [
        f"# Run log: {exp.name}",
        "",
        "Generated by `lcsm report` from each run's `result.json` (`trained_on`, `git_commit`, "
        "`wall_time_s`; `config.name` names the experiment a copied run came from) and `train.csv` "
        "(the time of its first and last logged step, pauses included); do not edit.",
        "",
        "| run | status | steps | wall s | first - last logged step (UTC) | trained on (steps) | commit "
        "| copied from |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    machines: Counter = Counter()
    for row in rows:
        path = exp.out_dir / row["run"]
        if row["status"] == "missing" or not (path / "result.json").is_file():
            lines.append(f"| {row['run']} | missing | — | — | — | — | — | — |")
            continue
        result = json.loads((path / "result.json").read_text())
        stretches = result.get("trained_on") or [
            {**(result.get("machine") or {}), "git_commit": result.get("git_commit"), "to_step": result.get("step")}
        ]
        where = " then ".join(f"{_machine(s)} ({s.get('from_step', 0)}-{s.get('to_step', '?')})" for s in stretches)
        machines.update(_machine(s) for s in stretches[-1:])
        commits = " then ".join(dict.fromkeys(str(s.get("git_commit") or "not recorded") for s in stretches))
        when = "—"
        if (path / "train.csv").is_file():
            log = path / "train.csv"
            times = [_csv_number(log, i, r, "time") for i, r in _csv_records(log)[1] if r.get("time")]
            if times:
                when = f"{_utc(min(times))} - {_utc(max(times))}"
        source = str((result.get("config") or {}).get("name", "")).split("/")[0]
        copied = source if source and source != exp.name else ""
        lines.append(
            f"| {row['run']} | {result['status']} | {result.get('step', '—')} | "
            f"{result.get('wall_time_s', 0):.0f} | {when} | {where} | {commits} | {copied} |"
        )
    done = sum(r["status"] != "missing" for r in rows)
    summary = ", ".join(f"{m} ({n})" for m, n in machines.most_common())
    lines[4:4] = [f"{done} of {len(rows)} runs finished; the machine each finished on: {summary or 'none'}.", ""]
    return "\n".join(lines) + "\n"


def write_report(exp, rows: list[dict[str, Any]], out_dir: Path | None = None, commit: str | None = None) -> Path:
    """``report.md``, ``RUNLOG.md`` and the PNG plots of ``exp`` from ``rows`` (``sweep.collect``);
    returns the report's path. ``commit``: the report's git commit, read once before a call that
    writes several reports; default: read now, changes inside ``out_dir`` (the report's own files)
    not counted. The verdict is read from ``out_dir/VERDICT.md`` (``read_verdict``)."""
    from lcsm._provenance import git_commit, machine_info

    out_dir = Path(out_dir) if out_dir is not None else exp.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = exp.report
    main = main_metric(exp)
    metrics = spec.get("metrics") or list(dict.fromkeys([main, "loss"]))
    best = select_best(exp, rows)
    done = [r for r in rows if r["status"] != "missing"]
    title = spec.get("title", f"Experiment {exp.name}")
    verdict = read_verdict(out_dir / VERDICT_FILE)
    lines = [f"# {title}", "", *verdict_box(exp.spec.get("paper"), verdict)]
    if exp.spec.get("description"):
        lines += [str(exp.spec["description"]).strip(), ""]
    if exp.spec.get("command_overrides"):
        given = ", ".join(f"`{o}`" for o in exp.spec["command_overrides"])
        lines += [f"The runs were swept with {given} on the command line, over the experiment file's text above.", ""]
    if verdict and verdict["bullets"]:
        lines += [f"## Verdict (hand-written, {VERDICT_FILE})", "", *verdict["bullets"], ""]
    if spec.get("table") and best:
        lines += [
            f"## {spec['table']['value']}"
            + (
                " (best of " + ", ".join(exp.select.get("over", [])) + ")"
                if exp.select and exp.select.get("over")
                else ""
            )
            + (
                f" (mean over {', '.join(table_seed_axes(exp))}"
                + (" of each seed's best" if exp.select and exp.select.get("over") else "")
                + ")"
                if table_seed_axes(exp)
                else ""
            ),
            "",
            pivot(best, spec["table"], exp),
            "",
        ]
    for p in spec.get("plots", []):
        plot(best, p, out_dir / p["file"], title)
        lines += [f"![{plot_label(p['y'])} against {p['x']}]({p['file']})", ""]
    if seed_axes(exp) and done:
        for m in metrics:
            lines += [f"## {m}: mean over seeds, 95% interval", "", interval_table(exp, rows, m), ""]
    if spec.get("differences") and done:
        table, _ = differences(exp, rows, spec["differences"])
        lines += ["## Differences: 95% intervals", "", table, ""]
    for comp in spec.get("compare", []):
        lines += [f"## {comp.get('title', 'Ours beside the paper')}", "", compare(best, comp, exp), ""]
    for c in spec.get("curves", []):
        curves = eval_curves(best, c, exp.out_dir)
        lines += [f"## {c.get('title', c['y'] + ' at every evaluation')}", ""]
        if curves:
            plot_curves(curves, c, out_dir / c["file"], title)
            lines += [curve_table(curves, c["series"], c["y"]), "", f"![{c['y']} against step]({c['file']})", ""]
        else:
            lines += ["No selected run recorded an evaluation (eval.csv).", ""]
    if exp.select and exp.select.get("over"):
        lines += [
            f"## Selected runs (best {main} over {', '.join(exp.select['over'])})",
            "",
            format_table(exp, best, metrics),
            "",
        ]
    lines += ["## Every run", "", format_table(exp, rows, metrics), ""]
    if exp.spec.get("paper") and not _short_claim(exp.spec["paper"]):
        lines += ["## The paper's numbers", "", str(exp.spec["paper"]).strip(), ""]
    if exp.spec.get("reading"):
        lines += ["## Reading", "", str(exp.spec["reading"]).strip(), ""]
    write_atomic(out_dir / RUNLOG_FILE, run_log(exp, rows))
    lines += [
        "## Provenance (generated)",
        "",
        f"- command: `{report_command(exp, out_dir)}`",
        f"- experiment: `{exp.path}`",
        f"- report's git commit: {commit or git_commit(ignore=[out_dir])}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- runs: {len(done)} of {len(rows)} finished; total training wall time "
        f"{sum(r.get('wall_time_s', 0) for r in done):.0f} s",
        *[f"- runs ran on: {m}" for m in provenance(rows, "machine")],
        "- runs' git commit: " + (", ".join(provenance(rows, "git_commit")) or "—"),
        f"- where, when and at which commit each run trained: [{RUNLOG_FILE}]({RUNLOG_FILE})",
        *[f"- report written on, {k}: {v}" for k, v in machine_info().items()],
        "",
    ]
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path
