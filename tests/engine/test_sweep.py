"""Sweeps: grid expansion, cached runs not redone, interrupted sweeps resumed, select, report."""

import csv
import errno
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from lcsm.cli import main
from lcsm.engine import report as report_mod
from lcsm.engine import sweep as sweep_mod
from lcsm.engine.report import plot, write_report
from lcsm.engine.sweep import EXPERIMENT_COPY, collect, load_experiment, select_best, sweep
from lcsm.engine.sweep.grid import parse_grid_override

from .conftest import TINY, cli_env

SWEEP_BASE = {**TINY, "train": {**TINY["train"], "max_steps": 4, "eval_every": 0, "save_every": 2}}


def experiment(tmp_path, **extra):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(SWEEP_BASE))
    spec = {
        "name": "tiny",
        "base": "base.yaml",
        "grid": {"model.mixer": ["gla", "hgrn"], "optim.lr": [1e-3, 1e-2]},
        "select": {"metric": "accuracy", "mode": "max", "over": ["optim.lr"]},
        "report": {
            "table": {"rows": "model.mixer", "value": "accuracy"},
            "plots": [{"x": "optim.lr", "y": "loss", "series": "model.mixer", "file": "loss.png"}],
        },
        **extra,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def fake_train(calls):
    """Stands in for the subprocess: writes the result a finished run leaves, loss from the lr."""

    def execute(runs, parallel=1, log=print):
        for run in runs:
            calls.append(run.id)
            run.out_dir.mkdir(parents=True, exist_ok=True)
            lr = run.config["optim"]["lr"]
            result = {
                "status": "completed",
                "step": 4,
                "n_params": 100,
                "wall_time_s": 1.0,
                "config": run.config,
                "metrics": {"loss": 1 + lr, "accuracy": lr * (2 if run.config["model"]["mixer"] == "gla" else 1)},
            }
            (run.out_dir / "result.json").write_text(json.dumps(result))
        return {r.id: 0 for r in runs}

    return execute


def test_grid_runs_cache_and_select(tmp_path, monkeypatch):
    exp = load_experiment(experiment(tmp_path), out_dir=tmp_path / "out")
    runs = exp.runs()
    assert [r.labels for r in runs] == [
        {"model.mixer": m, "optim.lr": lr} for m in ("gla", "hgrn") for lr in ("0.001", "0.01")
    ]
    assert runs[0].id.startswith("mixer=gla,lr=0.001-") and len({r.id for r in runs}) == 4
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    rows, ok = sweep(exp, log=lambda *_: None)
    assert ok and len(calls) == 4 and all(r["status"] == "completed" for r in rows)
    rows, ok = sweep(exp, log=lambda *_: None)
    assert len(calls) == 4  # nothing redone
    best = select_best(exp, rows)
    assert sorted((r["model.mixer"], r["optim.lr"]) for r in best) == [("gla", "0.01"), ("hgrn", "0.01")]
    tied = [{**r, "metric:accuracy": 1.0} for r in rows]  # of runs that tie, the first in the grid
    assert [(r["model.mixer"], r["optim.lr"]) for r in select_best(exp, tied)] == [("gla", "0.001"), ("hgrn", "0.001")]
    # a nan metric (a diverged run) loses to any number, also when it comes first in the grid
    nan_first = [{**r, "metric:accuracy": math.nan if r["optim.lr"] == "0.001" else 0.5} for r in rows]
    assert [(r["model.mixer"], r["optim.lr"]) for r in select_best(exp, nan_first)] == [
        ("gla", "0.01"),
        ("hgrn", "0.01"),
    ]
    assert (tmp_path / "out" / "results.csv").read_text().startswith("run,model.mixer,optim.lr,status")
    # a changed base config is a different run: not taken from the cache
    changed = load_experiment(experiment(tmp_path), overrides=["train.max_steps=5"], out_dir=tmp_path / "out")
    assert {r.id for r in changed.runs()}.isdisjoint(r.id for r in runs)


def test_select_takes_the_metrics_direction_and_refuses_the_other(tmp_path, monkeypatch):
    """select.mode defaulted to "max": {metric: loss} kept the worst run of each cell."""
    exp = load_experiment(experiment(tmp_path, select={"metric": "loss", "over": ["optim.lr"]}), out_dir=tmp_path / "o")
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    rows, _ = sweep(exp, log=lambda *_: None)
    assert sorted((r["model.mixer"], r["optim.lr"]) for r in select_best(exp, rows)) == [
        ("gla", "0.001"),
        ("hgrn", "0.001"),
    ]
    wrong = experiment(tmp_path, select={"metric": "accuracy", "mode": "min"})
    with pytest.raises(ValueError, match=r"select.mode: 'min' for 'accuracy', which is better higher \(mode 'max'\)"):
        load_experiment(wrong, out_dir=tmp_path / "o")


def test_a_diverged_run_keeps_the_sweep_failing_when_it_comes_from_the_cache(tmp_path, monkeypatch):
    """A rerun found the diverged run's result cached and exited 0; it still fails, and says how to
    finish the run."""
    exp = load_experiment(experiment(tmp_path), out_dir=tmp_path / "out")
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    assert sweep(exp, log=lambda *_: None)[1]
    diverged = exp.runs()[1]
    result = json.loads((diverged.out_dir / "result.json").read_text())
    (diverged.out_dir / "result.json").write_text(json.dumps({**result, "status": "diverged"}))
    lines = []
    rows, ok = sweep(exp, log=lines.append)
    assert not ok and len(rows) == 4
    assert any(f"cached {diverged.id} ended diverged: resume it with `lcsm train" in line for line in lines)
    # a sweep beside it copies its finished runs, not the diverged one (it trains that one itself)
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    beside = load_experiment(experiment(tmp_path), out_dir=tmp_path / "beside")
    assert sweep(beside, log=lambda *_: None)[1] and calls == [diverged.id]


def test_skipped_steps_are_shown_and_a_loss_that_is_not_finite_fails_the_sweep(tmp_path, monkeypatch, capsys):
    """A diverged run resumed with run.on_nonfinite: skip, as the sweep advises, completed with 59
    of its 60 steps skipped and a nan loss: the rerun exited 0 with the run "completed", and
    neither the table, results.csv nor the report said that a step was skipped."""
    spec, out = experiment(tmp_path), tmp_path / "out"
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert "skipped" not in capsys.readouterr().out.replace(str(tmp_path), "")
    assert "skipped" not in (out / "results.csv").read_text().replace(str(tmp_path), "")
    exp = load_experiment(spec, out_dir=out)
    run = exp.runs()[1]
    result = json.loads((run.out_dir / "result.json").read_text())

    def finish(skipped, loss):
        metrics = {"loss": loss, "accuracy": 0.0}  # result.json writes nan as null
        (run.out_dir / "result.json").write_text(
            json.dumps({**result, "step": 60, "skipped_steps": skipped, "metrics": metrics})
        )
        status = main(["sweep", str(spec), "--out", str(out), "--report"])
        return status, capsys.readouterr().out

    status, printed = finish(59, None)
    assert status == 1
    assert "| 0.0000 | nan | 60 (59 skipped) |" in printed
    note = (
        f"note: run {run.id} skipped 59 of its 60 steps (run.on_nonfinite: skip) and ended with loss nan: no "
        "result, and the sweep fails while its grid has this run"
    )
    assert note in printed and printed.index(note) > printed.rindex("| 60 (59 skipped) |")
    status, printed = finish(2, 0.5)
    assert status == 0
    assert f"note: run {run.id} skipped 2 of its 60 steps (run.on_nonfinite: skip)\n" in printed
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO((out / "results.csv").read_text()))}
    assert [r["skipped_steps"] for r in rows.values()] == ["", "2", "", ""]
    assert "| 0.0000 | 0.5000 | 60 (2 skipped) |" in (out / "report.md").read_text()


@pytest.mark.parametrize("value", ["{mixer: gla, d_model: 16}", "[1e-3", "1e-3,{a", "\x07"])
def test_a_grid_value_that_is_not_yaml_is_one_error_naming_the_key(value):
    with pytest.raises(ValueError, match=r"--grid optim.lr: cannot parse .* as YAML values"):
        parse_grid_override(f"optim.lr={value}")


def test_report_from_cached_results(tmp_path, monkeypatch):
    exp = load_experiment(
        experiment(tmp_path, paper="| model | acc |\n|---|---|\n| gla | 0.5 |"), out_dir=tmp_path / "out"
    )
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    rows, _ = sweep(exp, log=lambda *_: None)
    monkeypatch.setattr(sweep_mod, "execute", lambda *a, **k: pytest.fail("report must not train"))
    assert main(["report", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    assert "| gla | 0.0200 |" in text and "| hgrn | 0.0100 |" in text  # the pivot of the best runs
    assert "report's git commit:" in text and "report written on, cpu:" in text and "The paper's numbers" in text
    assert "- runs ran on: not recorded (4 runs)" in text  # the fake results name no machine
    assert "- runs' git commit: not recorded (4 runs)" in text
    assert text.count("| completed |") == 4 + 2  # every run, then the selected ones


def test_report_compares_with_the_paper(tmp_path, monkeypatch):
    """Ours beside the paper's numbers per label, and Spearman's rho over the shared labels:
    our best accuracies are gla 0.02 > hgrn 0.01, so a paper ordering gla > hgrn > x gives
    rho over two labels (undefined) and one with a third label reverses it."""
    from lcsm.engine.report import spearman

    compare = [
        {
            "axis": "model.mixer",
            "metric": "accuracy",
            "paper": {"hgrn": 0.9, "gla": 0.5, "mamba": 0.7},
            "title": "Paper table",
        }
    ]
    exp = load_experiment(experiment(tmp_path, report={"compare": compare}), out_dir=tmp_path / "out")
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    assert "## Paper table" in text and "| gla | 0.02 | 0.5 |" in text and "| mamba | — | 0.7 |" in text
    assert "over the 2 labels both have: not defined" in text
    assert spearman([1, 2, 3], [30, 20, 10]) == -1.0 and spearman([1, 2, 2, 4], [1, 3, 3, 4]) == 1.0
    assert abs(spearman([1, 2, 3, 4], [1, 3, 2, 4]) - 0.8) < 1e-12
    with pytest.raises(ValueError, match=r"report.compare\[0\].axis: expected a grid axis"):
        load_experiment(experiment(tmp_path, report={"compare": [{**compare[0], "axis": "model.d_model"}]}))
    with pytest.raises(ValueError, match=r"report.compare\[0\].paper: expected a mapping"):
        load_experiment(experiment(tmp_path, report={"compare": [{**compare[0], "paper": {"gla": "high"}}]}))


def test_plot_series_stay_distinct_past_the_colour_cycle(tmp_path, monkeypatch):
    """Twelve series (the o-types figure's codes) get twelve distinct colour-marker pairs, though
    matplotlib's colour cycle has ten colours."""
    rows = [
        {"status": "completed", "model": f"1-{i}-1-0", "model.d_model": "64", "metric:accuracy": i / 12}
        for i in range(12)
    ]
    drawn = {}
    monkeypatch.setattr(report_mod, "_legend_and_save", lambda fig, axes, series, path: drawn.update(ax=axes[-1]))
    plot(rows, {"x": "model.d_model", "y": "accuracy", "series": "model"}, tmp_path / "a.png", "o types")
    lines = drawn["ax"].get_lines()
    assert len(lines) == 12 and len({(line.get_color(), line.get_marker()) for line in lines}) == 12
    report_mod._pyplot().close("all")


def test_plot_facets_share_series_styles_and_one_legend(tmp_path, monkeypatch):
    """A facet that lacks some series (the o-types figure's 128-token cell, run for four codes of
    twelve) draws each series in the style it has in the others, and the legend names them all."""
    rows = [
        {"status": "completed", "task": task, "model": f"1-{i}-1-0", "model.d_model": "64", "metric:accuracy": i / 12}
        for task, codes in (("L64", range(6)), ("L128", (3, 4)))
        for i in codes
    ]
    drawn, save = {}, report_mod._legend_and_save
    monkeypatch.setattr(
        report_mod,
        "_legend_and_save",
        lambda fig, axes, series, path: (drawn.update(axes=axes), save(fig, axes, series, path)),
    )
    plot(rows, {"x": "model.d_model", "y": "accuracy", "series": "model", "facet": "task"}, tmp_path / "a.png", "o")
    every, some = drawn["axes"]
    style = {line.get_label(): (line.get_color(), line.get_marker()) for line in every.get_lines()}
    assert [line.get_label() for line in some.get_lines()] == ["1-3-1-0", "1-4-1-0"]
    assert all(style[line.get_label()] == (line.get_color(), line.get_marker()) for line in some.get_lines())
    assert [text.get_text() for text in some.get_legend().get_texts()] == [f"1-{i}-1-0" for i in range(6)]
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_plot_of_several_metrics_draws_a_series_per_metric(tmp_path, monkeypatch):
    """The demo's plot: per model, the accuracy at the trained length and at a longer one, as
    grouped bars, one colour per metric, named in the legend; a run lacking a metric lacks its bar."""
    rows = [
        {"status": "completed", "model": "gla", "metric:accuracy/L64-kv4": 0.9, "metric:accuracy/L256-kv4": 0.5},
        {"status": "completed", "model": "attention", "metric:accuracy/L64-kv4": 1.0},
    ]
    drawn, save = {}, report_mod._legend_and_save
    monkeypatch.setattr(
        report_mod,
        "_legend_and_save",
        lambda fig, axes, series, path: (drawn.update(axes=axes, series=series), save(fig, axes, series, path)),
    )
    spec = {"x": "model", "y": ["accuracy/L64-kv4", "accuracy/L256-kv4"]}
    plot(rows, spec, tmp_path / "a.png", "demo")
    (ax,) = drawn["axes"]
    bars = [(round(b.get_height(), 3), b.get_facecolor()) for b in ax.patches]
    assert [h for h, _ in bars] == [0.9, 1.0, 0.5]
    assert bars[0][1] == bars[1][1] != bars[2][1]
    assert drawn["series"] == "metric" and ax.get_ylabel() == "accuracy"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == spec["y"]
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_report_curves_from_each_selected_runs_evaluations(tmp_path, monkeypatch):
    """A curve per series label, read from the selected (best-lr) run's eval.csv; a run without one
    has no curve (the report says so when none has), a metric eval.csv lacks is named, and two
    selected runs under one label are an error, as in `compare`."""
    curves = [{"y": "accuracy", "series": "model.mixer", "file": "curves.png", "title": "Learning"}]
    exp = load_experiment(experiment(tmp_path, report={"curves": curves}), out_dir=tmp_path / "out")
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    sweep(exp, log=lambda *_: None)
    for run in exp.runs():
        if run.labels["model.mixer"] == "gla":
            lr = run.config["optim"]["lr"]
            (run.out_dir / "eval.csv").write_text(f"step,split,loss,accuracy\n2,test,1.0,{lr / 4}\n4,test,0.5,{lr}\n")
    text = write_report(exp, collect(exp)).read_text()
    assert "## Learning" in text and "| model.mixer \\ step (accuracy) | 2 | 4 |" in text
    assert "| gla | 0.0025 | 0.0100 |" in text and "| hgrn |" not in text.split("## Learning")[1].split("##")[0]
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000
    # a segment's metric is known once the data is made: the report names it if eval.csv lacks it
    segment = load_experiment(
        experiment(tmp_path, report={"curves": [{**curves[0], "y": "accuracy/L9"}]}), out_dir=tmp_path / "out"
    )
    with pytest.raises(
        ValueError, match=r"eval.csv has no column 'accuracy/L9' \(its columns: step, split, loss, accuracy\)"
    ):
        write_report(segment, collect(segment))
    hgrn = load_experiment(
        experiment(tmp_path, report={"curves": [{**curves[0], "where": {"model.mixer": "hgrn"}}]}),
        out_dir=tmp_path / "out",
    )
    assert "No selected run recorded an evaluation" in write_report(hgrn, collect(hgrn)).read_text()
    exp = load_experiment(experiment(tmp_path, select=None, report={"curves": curves}), out_dir=tmp_path / "out")
    with pytest.raises(ValueError, match="report.curves: several selected runs have model.mixer = gla"):
        write_report(exp, collect(exp))
    with pytest.raises(ValueError, match=r"report.curves\[0\].series: expected a grid axis"):
        load_experiment(experiment(tmp_path, report={"curves": [{**curves[0], "series": "model.d_model"}]}))


def test_grid_override_replaces_overlapping_axes(tmp_path):
    exp = load_experiment(experiment(tmp_path), grid=["model=[{mixer: gla}, {mixer: hgrn, d_model: 8}]"])
    assert [a.key for a in exp.axes] == ["optim.lr", "model"]
    assert exp.report["table"]["rows"] == "model"
    exp = load_experiment(experiment(tmp_path), grid=["optim.lr=0.1"])
    assert len(exp.runs()) == 2
    # the comparisons and curves of a replaced axis follow it too (committed: MetaLA Table A7's)
    hard = load_experiment(
        Path(__file__).parents[2] / "experiments" / "metala" / "mqar_hard.yaml", grid=["model.mixer=gla,metala"]
    )
    assert [c["axis"] for c in hard.report["compare"]] == ["model.mixer"] * len(hard.report["compare"])
    curves = {"y": "accuracy", "series": "model.mixer", "where": {"model.mixer": "gla"}, "file": "c.png"}
    exp = load_experiment(experiment(tmp_path, report={"curves": [curves]}), grid=["model=[{mixer: gla}]"])
    assert exp.report["curves"] == [{**curves, "series": "model", "where": {"model": "gla"}}]


def test_grid_labels_pick_part_of_a_labelled_axis(tmp_path):
    """--grid on a labelled axis with its labels keeps those values, and the runs keep their ids."""
    models = {"gla": {"mixer": "gla"}, "small-hgrn": {"mixer": "hgrn", "d_model": 8}}
    path = experiment(tmp_path, grid={"model": models, "optim.lr": [1e-3, 1e-2]}, select=None, report={})
    full = {r.id for r in load_experiment(path).runs()}
    part = load_experiment(path, grid=["model=small-hgrn"]).runs()
    assert len(part) == 2 and {r.labels["model"] for r in part} == {"small-hgrn"} and {r.id for r in part} < full
    with pytest.raises(ValueError, match=r"--grid model: \['hgrn'\] are not labels of the axis \(gla, small-hgrn\)"):
        load_experiment(path, grid=["model=hgrn"])


def test_grid_override_of_an_existing_axis_keeps_the_axes_it_overlaps(tmp_path):
    """--grid model.d_model=8 beside a labelled `model` axis narrows the d_model axis only."""
    models = {"gla": {"mixer": "gla"}, "hgrn": {"mixer": "hgrn"}}
    path = experiment(
        tmp_path, grid={"model": models, "model.d_model": [8, 16], "optim.lr": [1e-3, 1e-2]}, select=None, report={}
    )
    full = {r.id for r in load_experiment(path).runs()}
    part = load_experiment(path, grid=["model.d_model=8"])
    assert [a.key for a in part.axes] == ["model", "model.d_model", "optim.lr"]
    runs = part.runs()
    assert len(runs) == 4 and {r.config["model"]["d_model"] for r in runs} == {8} and {r.id for r in runs} < full


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"grdi": {}}, "unknown key(s) 'grdi' (did you mean 'grid'?)"),
        ({"grid": {"model.mixer": []}}, "grid.model.mixer: expected a non-empty list"),
        ({"grid": {"model.mixer": ["glaa"], "optim.lr": [1e-3]}}, "unknown mixer 'glaa'"),
        ({"select": {"metric": "accuracy", "over": ["optim.beta"]}}, "select.over: ['optim.beta'] are not grid axes"),
        (
            {"report": {"plots": [{"x": "model.d_model", "y": "loss", "file": "a.png"}]}},
            "report.plots[0].x: expected a grid axis",
        ),
        (
            {
                "report": {
                    "plots": [{"x": "optim.lr", "y": ["loss", "accuracy"], "series": "model.mixer", "file": "a.png"}]
                }
            },
            "report.plots[0].series: a plot whose y lists several metrics draws one series per metric",
        ),
        (
            {"report": {"plots": [{"x": "optim.lr", "y": "loss", "file": "../../a.png"}]}},
            "report.plots[0].file: expected a file name ending in .png (no directory), got '../../a.png'",
        ),
        (
            {"report": {"curves": [{"y": "loss", "series": "model.mixer", "file": "/tmp/a.png"}]}},
            "report.curves[0].file: expected a file name ending in .png (no directory), got '/tmp/a.png'",
        ),
        (
            {"report": {"plots": [{"x": "optim.lr", "y": [], "file": "a.png"}]}},
            "report.plots[0].y: expected a metric name or a non-empty list of them",
        ),
        (
            {"report": {"plots": [{"x": "optim.lr", "y": ["loss", 3], "file": "a.png"}]}},
            "report.plots[0].y[1]: expected a metric name",
        ),
        (
            {"report": {"table": {"rows": "model.mixer", "value": "accuracy", "cols": "x"}}},
            "'cols' (did you mean 'columns'?)",
        ),
        ({"set": {"train.early_stop.metric": "acc"}}, "train.early_stop.metric: 'acc' is not a metric of task 'mqar'"),
        # a table cell would hold runs of several learning rates: refused before any run trains
        (
            {"select": {"metric": "accuracy", "over": []}},
            "report.table: the selected runs of a cell would differ in optim.lr, and a cell holds one run "
            "(or the mean over the seeds of one); make it the table's rows or columns, or put it in select.over",
        ),
        # misspelt metrics, refused before any run trains rather than leaving rows or cells out
        (
            {"select": {"metric": "acuracy", "over": ["optim.lr"]}},
            "select.metric: 'acuracy' is not a metric of task 'mqar'; its metrics: accuracy, loss",
        ),
        ({"report": {"metrics": ["accuracy", "perplexity"]}}, "report.metrics[1]: 'perplexity' is not a metric"),
        (
            {"report": {"table": {"rows": "model.mixer", "value": "test/acuracy"}}},
            "report.table.value: 'test/acuracy' is not a metric of task 'mqar'; its metrics: accuracy, loss "
            "(and, once its data is made, names with a '/' for its segments and slices, e.g. accuracy/<segment>), "
            "each also as test/<metric> for the test split (did you mean 'accuracy'?)",
        ),
        (
            {"report": {"curves": [{"y": "test/accuracy", "series": "model.mixer", "file": "c.png"}]}},
            "report.curves[0].y: 'test/accuracy' is not a metric",
        ),
        # a value only one run of the grid takes: the error names that run by its labels
        ({"grid": {"model.mixer": ["gla"], "optim.lr": [1e-3, -1.0]}}, "run mixer=gla,lr=-1: optim.lr"),
    ],
)
def test_bad_experiment_files(tmp_path, extra, message):
    with pytest.raises(ValueError) as err:
        load_experiment(experiment(tmp_path, **extra))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "base, message",
    [
        ("missing.yaml", "base: no such file '{tmp}/missing.yaml'"),
        (".", "base: '{tmp}' is a directory, not a YAML file"),
    ],
)
def test_a_base_that_is_not_a_file_is_named(tmp_path, base, message):
    with pytest.raises(ValueError) as err:
        load_experiment(experiment(tmp_path, base=base))
    assert str(err.value) == message.format(tmp=tmp_path)


def test_sweep_builds_every_run_before_running_any(tmp_path, monkeypatch):
    """A clash only a mixer's constructor sees (lcsm:ssm fixes e, o and s and takes no model code)
    stops the sweep, dry run included, before a single run starts; it names the run."""
    path = experiment(
        tmp_path,
        grid={
            "model": {
                "linear": {"mixer": "lcsm", "mixer_options": {"code": "1-1-1-0"}},
                "ssm": {"mixer": "lcsm:ssm", "mixer_options": {"code": "1-1-1-0"}},
            }
        },
        select=None,
        report={},
    )
    exp = load_experiment(path, out_dir=tmp_path / "out")
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    for dry_run in (True, False):
        with pytest.raises(ValueError, match=r"run model=ssm-\w+: code: param='ssm' .* takes no 'e-o-s-a' code"):
            sweep(exp, dry_run=dry_run, log=lambda *_: None)
    assert calls == [] and not (tmp_path / "out").exists()


def test_sweep_checks_runs_without_reading_a_corpus(tmp_path, monkeypatch):
    """Checking that every run builds takes the fields the task fixes from its config: a BPE LM
    sweep does not read its corpus (to train the tokenizer) before the first run starts, and a
    run that cannot be built still stops it."""
    from lcsm.tasks.lm import LanguageModelling

    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))

    def read(self):
        pytest.fail("checking a sweep's runs read the LM corpus")

    monkeypatch.setattr(LanguageModelling, "documents", read)
    config = {**SWEEP_BASE, "task": {"name": "lm", "tokenizer": "bpe", "bpe_vocab": 512}}
    spec = {"name": "lm", "config": config, "grid": {"model.mixer": ["gla", "hgrn"]}}
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = []
    sweep(load_experiment(path, out_dir=tmp_path / "out"), dry_run=True, log=log.append)
    assert sum(line.startswith("  to run") for line in log) == 2
    spec["grid"] = {"model": {"ssm": {"mixer": "lcsm:ssm", "mixer_options": {"code": "1-1-1-0"}}}}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=r"run model=ssm-\w+: code: .* takes no 'e-o-s-a' code"):
        sweep(load_experiment(path, out_dir=tmp_path / "out"), dry_run=True, log=lambda *_: None)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_real_sweep_is_resumable_after_interruption(tmp_path, stop):
    """Two real runs through `lcsm train`; the sweep is interrupted during the first, then rerun.
    Ctrl-C reaches the sweep and its run (one process group), SIGTERM only the sweep, which passes
    it on; either way the run checkpoints the step it stopped at and the sweep exits 128 + signal.
    The rerun resumes from that checkpoint whatever stopped the run: it is run after SIGTERM only."""
    spec = experiment(tmp_path)
    data = yaml.safe_load(spec.read_text())
    data["grid"] = {"model.mixer": ["gla", "hgrn"]}
    data["select"] = None
    data["report"] = {}
    # the signal follows the first checkpoint (step 10) by milliseconds: 50 steps to spare
    data["set"] = {"train.max_steps": 60, "train.save_every": 10}
    spec.write_text(yaml.safe_dump(data))
    env = cli_env(tmp_path)
    cmd = [sys.executable, "-m", "lcsm", "sweep", str(spec), "--out", str(tmp_path / "out")]
    # Started with SIGINT ignored, as a shell's background job is (`lcsm sweep ... &`): Ctrl-C to
    # the group must still stop the sweep, not only its current run.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.time() + 120
    while not list((tmp_path / "out").glob("*/checkpoints/step-*")) and time.time() < deadline:
        time.sleep(0.02)
    if stop == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + (signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM), out
    assert re.search(r"interrupted at step \d+: checkpoint", out), out
    assert "run the same command again to continue" in out
    assert not list((tmp_path / "out").glob("*/result.json"))
    # what the stopped sweep had done is on record: `lcsm report` reads its directory
    assert (tmp_path / "out" / "experiment.yaml").is_file() and (tmp_path / "out" / "results.csv").is_file()
    if stop == "ctrl-c":
        return
    done = subprocess.run(cmd + ["--report"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming" in done.stderr and done.stdout.count("| completed |") == 2
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert "(2 cached, 0 to run)" in again.stdout
    rows = collect(load_experiment(tmp_path / "out" / "experiment.yaml", out_dir=tmp_path / "out"))
    assert [r["status"] for r in rows] == ["completed", "completed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_killed_sweep_stops_its_run_and_a_rerun_resumes_it(tmp_path):
    """SIGKILL of the sweep runs no handler: its `lcsm train` went on training, holding the run's
    directory, and a rerun failed that run (exit 2) and started the next beside it. The run now
    gets SIGTERM when the sweep dies: it checkpoints, exits and releases its directory."""
    spec = experiment(tmp_path, grid={"model.mixer": ["gla", "hgrn"]}, select=None, report={})
    data = yaml.safe_load(spec.read_text())
    # some 10 s of training, were the run left to go on
    data["set"] = {"train.max_steps": 2000, "train.save_every": 10}
    spec.write_text(yaml.safe_dump(data))
    out, env = tmp_path / "out", cli_env(tmp_path)
    cmd = [sys.executable, "-m", "lcsm", "sweep", str(spec), "--out", str(out)]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    lock, pid = None, None
    try:
        deadline = time.time() + 120
        while not list(out.glob("*/checkpoints/step-*")) and time.time() < deadline:
            time.sleep(0.02)
        (lock,) = out.glob("*/.lcsm.lock")
        pid = json.loads(lock.read_text())["pid"]
        proc.kill()
        proc.wait()
        deadline = time.time() + 5
        while lock.exists() and time.time() < deadline:
            time.sleep(0.02)
        assert not lock.exists(), (tmp_path / "first.log").read_text()
    finally:
        if lock is not None and lock.exists():
            os.kill(pid, signal.SIGKILL)  # the run left training
    assert re.search(r"interrupted at step \d+: checkpoint", (tmp_path / "first.log").read_text())
    stopped = max(int(p.name.split("-")[1]) for p in lock.parent.glob("checkpoints/step-*"))
    assert stopped < 2000 and not (lock.parent / "result.json").exists()
    rerun = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        int(p.name.split("-")[1]) > stopped for p in lock.parent.glob("checkpoints/step-*")
    ):
        time.sleep(0.02)
    rerun.send_signal(signal.SIGTERM)
    printed, _ = rerun.communicate(timeout=120)
    assert rerun.returncode == 128 + signal.SIGTERM, printed
    assert "resuming" in printed, printed
    assert "failed" not in printed and "in use by" not in printed, printed


def test_a_run_held_by_another_process_is_waited_for(tmp_path, monkeypatch, request):
    """A rerun right after a sweep was killed can find a run's directory still held by the run
    that sweep left, writing its last checkpoint: the sweep waits for it (a while) and says why,
    instead of starting an `lcsm train` that fails at once."""
    from lcsm.engine.sweep import runner

    (run,) = load_experiment(
        experiment(tmp_path, grid={"model.mixer": ["gla"]}, select=None, report={}), out_dir=tmp_path / "out"
    ).runs()
    run.out_dir.mkdir(parents=True)
    lock = run.out_dir / ".lcsm.lock"
    # a live process of this host (not this one: a lock naming this process that it does not hold is dead)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    request.addfinalizer(lambda: (other.kill(), other.wait()))
    holder = {"pid": other.pid, "host": socket.gethostname(), "started": "now", "command": "lcsm train"}
    lock.write_text(json.dumps(holder))
    # the run exits 1 where it would find the directory still held
    monkeypatch.setattr(
        runner, "_train_command", lambda r: [sys.executable, "-c", f"import os; exit(os.path.exists({str(lock)!r}))"]
    )
    release = threading.Timer(0.5, lock.unlink)
    release.start()
    lines = []
    assert runner.execute([run], log=lines.append) == {run.id: 0}
    assert lines[0].startswith(
        f"--- run {run.id}: in use by lcsm train (pid {other.pid}, since now), a run of an earlier sweep"
    )
    lock.write_text(json.dumps(holder))
    monkeypatch.setattr(runner, "LOCK_WAIT_S", 0.2)
    assert runner.execute([run], log=lambda *_: None) == {run.id: 1}  # then started, and refused


def test_a_run_finished_by_a_sweep_beside_it_is_copied_not_trained(tmp_path, monkeypatch):
    """Run configs that train the same weights however they are written (a name implying the
    mixer's code, a default written out, 16 against 16.0) are equal for the cache; a missing run
    equal to a finished one of a sibling sweep directory is copied whole, unless it has started
    here (it resumes) or reuse is off. Run ids still hash the config as written."""

    def lcsm_experiment(name, models):
        return experiment(tmp_path, name=name, grid={"model": models}, select=None, report={})

    tau = lcsm_experiment(
        "tau",
        {
            "tau16": {"mixer": "lcsm", "mixer_options": {"code": "1-1-1-0", "tau": 16}},
            "tau4": {"mixer": "lcsm", "mixer_options": {"code": "1-1-1-0", "tau": 4}},
        },
    )
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    sweep(load_experiment(tau, out_dir=tmp_path / "results" / "tau"), log=lambda *_: None)
    assert len(calls) == 2
    source = next((tmp_path / "results" / "tau").glob("model=tau16-*"))
    (source / "train.csv").write_text("step\n1\n")

    codes = lcsm_experiment(
        "codes",
        {
            "named": {"mixer": "lcsm:1-1-1-0", "mixer_options": {"tau": 16.0}},
            "written": {"mixer": "lcsm", "mixer_options": {"code": "1-1-1-0"}},
            "other": {"mixer": "lcsm", "mixer_options": {"code": "1-3-1-0"}},
            "started": {"mixer": "lcsm", "mixer_options": {"code": "1-1-1-0", "expand": 64}},
        },
    )
    exp = load_experiment(codes, out_dir=tmp_path / "results" / "codes")
    runs = {r.labels["model"]: r for r in exp.runs()}
    assert runs["named"].id.split("-")[-1] != runs["written"].id.split("-")[-1]  # ids as written
    runs["started"].out_dir.mkdir(parents=True)
    (runs["started"].out_dir / "config.yaml").write_text("an interrupted run's files")
    log = []
    sweep(exp, dry_run=True, log=log.append)
    assert "(0 cached, 2 to copy from equal runs beside it, 2 to run)" in log[0]
    assert sum("to copy" in line and "results/tau/model=tau16-" in line for line in log) == 2
    del calls[:]
    rows, ok = sweep(exp, log=log.append)
    assert ok and sorted(calls) == sorted([runs["other"].id, runs["started"].id])
    for label in ("named", "written"):
        copied = runs[label].out_dir
        assert sorted(p.name for p in copied.iterdir()) == ["result.json", "train.csv"]
        assert all((copied / f).read_bytes() == (source / f).read_bytes() for f in ("result.json", "train.csv"))
        assert sweep_mod.cached_result(runs[label]) is not None
    assert not list((tmp_path / "results" / "codes").glob("*.reusing"))
    del calls[:]
    sweep(exp, log=lambda *_: None)
    assert calls == []  # all cached now

    assert main(["sweep", str(codes), "--out", str(tmp_path / "results" / "fresh"), "--no-reuse"]) == 0
    assert len(calls) == 4


def test_a_copy_stopped_part_way_is_no_source_and_a_failed_copy_is_one_line(tmp_path, monkeypatch, capsys):
    """A staging copy (``<run>.reusing``) left by a copy that was stopped or ran out of disk holds
    a result.json and was chosen as the source, then deleted as the stale staging before the copy:
    the sweep failed on the missing directory. A copy that fails (a full disk) is one line naming
    the run's directory, not copytree's list of every file's failure."""
    spec = experiment(tmp_path, grid={"model.mixer": ["gla"]}, select=None, report={})
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    sweep(load_experiment(spec, out_dir=tmp_path / "results" / "b"), log=lambda *_: None)
    (source,) = (tmp_path / "results" / "b").glob("mixer=gla-*/")
    (source / "train.csv").write_text("step\n1\n")
    exp = load_experiment(spec, out_dir=tmp_path / "results" / "a")
    (run,) = exp.runs()
    partial = run.out_dir.with_name(run.out_dir.name + ".reusing")
    partial.mkdir(parents=True)
    shutil.copy(source / "result.json", partial)  # stopped before train.csv
    assert sweep_mod.Equivalents(exp.out_dir).find(run) == source

    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(shutil, "copyfile", full)
    assert main(["sweep", str(spec), "--out", str(exp.out_dir)]) == 1
    assert capsys.readouterr().err == f"lcsm sweep: error: {run.out_dir}: disk full\n"
    assert not partial.exists() and not run.out_dir.exists()
    monkeypatch.undo()
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    rows, ok = sweep(exp, log=lambda *_: None)
    assert ok and len(calls) == 1 and (run.out_dir / "train.csv").read_text() == "step\n1\n"


def test_runs_on_other_task_data_are_noted_and_never_copied(tmp_path, monkeypatch):
    """A finished run whose task data differ from what the same config gives now (its task's
    generator version changed; a result.json without task_data is of the versions before runs
    recorded it) stays cached with a note, and is not copied into another sweep as an equal run."""
    from lcsm.tasks import resolve

    path = experiment(tmp_path, select=None, report={})
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    sweep(load_experiment(path, out_dir=tmp_path / "results" / "a"), log=lambda *_: None)
    assert len(calls) == 4
    mqar = resolve("mqar")
    monkeypatch.setattr(mqar, "generator_version", mqar.generator_version + 1)
    log = []
    sweep(load_experiment(path, out_dir=tmp_path / "results" / "a"), dry_run=True, log=log.append)
    assert "(4 cached, 0 to run)" in log[0]
    notes = [line for line in log if "note: cached" in line]
    assert len(notes) == 4 and all("task 'mqar' data of generator version 1, now 2" in n for n in notes), notes
    log = []
    sweep(load_experiment(path, out_dir=tmp_path / "results" / "b"), dry_run=True, log=log.append)
    assert "(0 cached, 4 to run)" in log[0]


def test_equal_runs_are_compared_layer_by_layer():
    """HGRN without a lower bound gets k / n_layers in layer k from the model; with
    ``lower_bound: 0.0`` it gets 0 in every layer: different weights, so not equal runs (a sweep
    copied one for the other)."""

    def config(**options):
        return {
            "task": {"name": "mqar"},
            "model": {"mixer": "hgrn", "n_layers": 2, "mixer_options": options},
            "train": {"max_steps": 4},
        }

    key = sweep_mod._equivalence_key
    assert key(config()) != key(config(lower_bound=0.0))
    assert [o["lower_bound"] for o in key(config())["model"]["mixer_options"]] == [0.0, 0.5]
    assert key(config(lower_bound=0.5)) != key(config())


def test_at_axis_sets_several_keys_together(tmp_path):
    grid = {
        "@size": {"small": {"model.d_model": 8, "train.max_steps": 3}, "big": {"model.d_model": 16, "optim.lr": 0.5}}
    }
    exp = load_experiment(experiment(tmp_path, grid=grid, select=None, report={}))
    runs = {r.labels["@size"]: r for r in exp.runs()}
    small, big = runs.pop("small"), runs.pop("big")
    assert not runs
    assert (small.config["model"]["d_model"], small.config["train"]["max_steps"]) == (8, 3)
    assert (big.config["model"]["d_model"], big.config["optim"]["lr"]) == (16, 0.5)
    with pytest.raises(ValueError, match="grid.@size: an '@name' axis expects labelled values"):
        load_experiment(experiment(tmp_path, grid={"@size": [8, 16]}, select=None, report={}))


def test_parallel_output_tags_tell_runs_with_long_shared_labels_apart(tmp_path):
    grid = {
        "@setting": {"a-long-label-shared-by-every-run-of-the-grid": {"model.d_model": 8}},
        "model.mixer": ["gla", "hgrn"],
        "optim.lr": [1e-3],
    }
    ids = [r.id for r in load_experiment(experiment(tmp_path, grid=grid, select=None, report={})).runs()]
    assert len(ids[0]) > 48
    tags = [sweep_mod.log_prefix(i) for i in ids]
    assert len(set(tags)) == len(ids) and all(len(t) <= 48 for t in tags)
    assert all(t.endswith(i[-20:]) for t, i in zip(tags, ids, strict=False))
    assert sweep_mod.log_prefix("short-1234") == "short-1234"


def test_report_of_several_experiment_files(tmp_path, monkeypatch, capsys):
    """`lcsm report A B --out DIR` reads and writes each in DIR/<name>; one without results is
    skipped, none with results is an error."""
    path = experiment(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(path.read_text().replace("name: tiny", "name: other"))
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    sweep(load_experiment(path, out_dir=tmp_path / "results" / "tiny"), log=lambda *_: None)
    assert main(["report", str(path), str(other), "--out", str(tmp_path / "results")]) == 0
    assert (tmp_path / "results" / "tiny" / "report.md").is_file()
    assert "other: skipped, no finished run" in capsys.readouterr().out
    assert main(["report", str(other), str(other), "--out", str(tmp_path / "results")]) == 2


def test_a_report_names_the_command_line_overrides_its_runs_were_swept_with(tmp_path, monkeypatch, capsys):
    """The experiment file's description says what the file runs; --set and --grid change that, so
    the sweep directory's copy records them and every report of it says so."""
    path = experiment(tmp_path, description="The file's own runs.")
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    out = tmp_path / "out"
    argv = ["sweep", str(path), "--set", "train.max_steps=7", "--grid", "model.mixer=gla", "--out", str(out)]
    assert main([*argv, "--report"]) == 0
    line = "swept with `--set train.max_steps=7`, `--grid model.mixer=gla` on the command line"
    assert line in (out / "report.md").read_text()
    assert yaml.safe_load((out / EXPERIMENT_COPY).read_text())["command_overrides"] == [
        "--set train.max_steps=7",
        "--grid model.mixer=gla",
    ]
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    assert line in (out / "report.md").read_text()


def test_reports_of_one_name_into_one_out_are_refused(tmp_path, monkeypatch, capsys):
    """Two sweep directories of one experiment would write one report over the other."""
    path = experiment(tmp_path)
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    for name in ("a", "b"):
        sweep(load_experiment(path, out_dir=tmp_path / name), log=lambda *_: None)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")]) == 2
    assert "are both experiment 'tiny'" in capsys.readouterr().err and not (tmp_path / "rep").exists()


def test_report_of_a_file_whose_directory_holds_other_runs_points_to_them(tmp_path, monkeypatch, capsys):
    path = experiment(tmp_path)
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    sweep(load_experiment(path, overrides=["train.max_steps=7"], out_dir=tmp_path / "a"), log=lambda *_: None)
    assert main(["report", str(path), "--out", str(tmp_path / "a")]) == 2
    assert f"`lcsm report {tmp_path / 'a'}` reports them" in capsys.readouterr().err


def test_reports_of_one_call_record_the_commit_read_before_the_first(tmp_path, monkeypatch):
    """All reports of one call carry the commit read before any was written, with changes in
    their own folders not counted."""
    import lcsm._provenance as provenance

    path = experiment(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(path.read_text().replace("name: tiny", "name: other"))
    monkeypatch.setattr(sweep_mod, "execute", fake_train([]))
    for p, name in ((path, "tiny"), (other, "other")):
        sweep(load_experiment(p, out_dir=tmp_path / "results" / name), log=lambda *_: None)
    reads = iter(["abc1234", "abc1234 (with uncommitted changes)", "abc1234 (with uncommitted changes)"])
    ignored = []
    monkeypatch.setattr(provenance, "git_commit", lambda ignore=(): ignored.append(list(ignore)) or next(reads))
    assert main(["report", str(path), str(other), "--out", str(tmp_path / "results")]) == 0
    assert ignored == [[tmp_path / "results" / "tiny", tmp_path / "results" / "other"]]
    for name in ("tiny", "other"):
        assert "- report's git commit: abc1234\n" in (tmp_path / "results" / name / "report.md").read_text()


def test_a_run_of_an_earlier_mixer_revision_is_noted_and_never_copied(tmp_path, monkeypatch):
    """A finished run records the revisions of its mixer and preset; one that predates a revision
    bump (here S4D's, whose B lost its weight decay; the fake results record none, as runs before
    the records) stays cached with a note, and a sweep beside it trains its own rather than copy it."""
    models = {"s4d": {"mixer": "s4d"}, "gla": {"mixer": "gla"}}
    first = experiment(tmp_path, name="first", grid={"model": models}, select=None, report={})
    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    sweep(load_experiment(first, out_dir=tmp_path / "results" / "first"), log=lambda *_: None)
    log = []
    sweep(load_experiment(first, out_dir=tmp_path / "results" / "first"), dry_run=True, log=log.append)
    notes = [line for line in log if "earlier model" in line]
    assert len(notes) == 1 and "model=s4d" in notes[0] and "mixer:s4d revision 1, now 2" in notes[0]

    second = experiment(tmp_path, name="second", grid={"model": models}, select=None, report={})
    log = []
    sweep(load_experiment(second, out_dir=tmp_path / "results" / "second"), dry_run=True, log=log.append)
    assert "(0 cached, 1 to copy from equal runs beside it, 1 to run)" in log[0]
    assert any("to copy" in line and "model=gla" in line for line in log)
    assert any("to run" in line and "model=s4d" in line for line in log)


def test_model_revisions_name_the_mixer_and_preset_a_config_builds():
    from lcsm.engine.config import RunConfig
    from lcsm.engine.sweep import stale_model

    def revisions(model):
        return RunConfig.from_dict({**TINY, "model": model}).model_revisions()

    assert revisions({"mixer": "gla", "d_model": 16}) == {"mixer:gla": 1}
    assert revisions({"mixer": "lcsm:ssm", "d_model": 16}) == {"mixer:lcsm": 2}
    assert revisions({"mixer": "lcsm:ssm", "d_model": 16, "mixer_options": {"delta_bias": False}}) == {"mixer:lcsm": 1}
    assert revisions({"mixer": "lcsm:1-9-1-0", "d_model": 16}) == {"mixer:lcsm": 1}
    config = {**TINY, "model": {"mixer": "deltanet", "d_model": 16}}
    assert stale_model({"config": config}) == "mixer:fwp revision 1, now 2"
    assert stale_model({"config": config, "model_revisions": {"mixer:fwp": 2}}) is None


def fake_seeded_train(with_examples):
    """Runs whose test accuracy is gla 0.8, mamba 0.6, hgrn 0.4 (each seed +-0.02), evaluated on
    200 test examples (MQAR evaluates on test), written per example when ``with_examples``."""
    import numpy as np

    def execute(runs, parallel=1, log=print):
        for run in runs:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            seed = run.config["train"]["seed"]
            mixer = run.config["model"]["mixer"]
            rng = np.random.default_rng(seed + 10 * len(mixer))
            p = {"gla": 0.8, "mamba": 0.6, "hgrn": 0.4}[mixer]
            correct = (rng.random(200) < p + 0.02 * (seed - 1)).astype(int)
            if with_examples:
                rows = "".join(f"L16-kv2,1,{c},{1.0 - 0.5 * c}\n" for c in correct)
                (run.out_dir / "test_examples.csv").write_text("segment,total,correct,loss\n" + rows)
            result = {
                "status": "completed",
                "step": 4,
                "n_params": 100,
                "wall_time_s": 1.0,
                "eval_split": "test",
                "config": run.config,
                "metrics": {"accuracy": float(correct.mean()), "loss": float((1.0 - 0.5 * correct).mean())},
            }
            (run.out_dir / "result.json").write_text(json.dumps(result))
        return {r.id: 0 for r in runs}

    return execute


def seeded_experiment(tmp_path, mixers, seeds, report, out):
    """An experiment over mixers x seeds 0..seeds-1 (no select) with the given report section."""
    grid = {"model.mixer": mixers, "train.seed": list(range(seeds))}
    return load_experiment(experiment(tmp_path, grid=grid, select=None, report=report), out_dir=tmp_path / out)


def test_a_report_on_a_full_disk_is_an_error_naming_it_and_leaves_the_old_one(tmp_path, monkeypatch):
    """report.md is written whole or not at all (a full disk left an empty one), and the error
    names it (it said "disk full" alone)."""
    import errno
    import pathlib

    calls = []
    monkeypatch.setattr(sweep_mod, "execute", fake_train(calls))
    exp = load_experiment(experiment(tmp_path), out_dir=tmp_path / "out")
    sweep(exp, log=lambda *_: None)
    before = write_report(exp, collect(exp)).read_text()
    real = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if self.name == ".report.md.tmp":
            real(self, "cut")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OSError) as err:
        write_report(exp, collect(exp))
    assert err.value.filename == str(tmp_path / "out" / "report.md") and err.value.strerror == "disk full"
    assert (tmp_path / "out" / "report.md").read_text() == before and not (tmp_path / "out" / ".report.md.tmp").exists()


def test_a_damaged_test_examples_file_is_named_not_resampled(tmp_path, monkeypatch):
    """A test_examples.csv cut mid-row was a TypeError from float(); one cut at a row's end gave
    intervals over the examples left. Both are errors naming the file."""
    exp = seeded_experiment(
        tmp_path,
        ["gla", "hgrn"],
        3,
        {"differences": [{"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a <= b"}]},
        "out",
    )
    monkeypatch.setattr(sweep_mod, "execute", fake_seeded_train(True))
    sweep(exp, log=lambda *_: None)
    examples = sorted(exp.out_dir.glob("*/test_examples.csv"))[0]
    lines = examples.read_text().splitlines()
    examples.write_text("\n".join(lines[:-1] + [lines[-1].split(",")[0]]) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(examples))}: line {len(lines)}: total None is not a number"):
        write_report(exp, collect(exp))
    examples.write_text("\n".join(lines[:2]) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(examples))}: its 1 examples give accuracy .*, not the"):
        write_report(exp, collect(exp))


@pytest.mark.parametrize("with_examples", [True, False])
def test_report_intervals_over_seeds_and_examples(tmp_path, monkeypatch, with_examples):
    """A seed axis gives each cell's mean with its 95% interval; ``differences`` gives the interval
    of a difference and whether it excludes the alternative. Runs without test_examples.csv (older
    runs) are resampled over seeds only, and the report says so."""
    differences = [
        {"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a <= b"},
        {"a": {"model.mixer": "gla"}, "b": "hgrn", "metric": "loss", "alternative": "a >= b"},
        {"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a >= b"},
    ]
    report = {
        "metrics": ["accuracy", "loss"],
        "differences": differences,
        "compare": [{"axis": "model.mixer", "metric": "accuracy", "paper": {"gla": 3, "mamba": 2, "hgrn": 1}}],
    }
    exp = seeded_experiment(tmp_path, ["gla", "hgrn", "mamba"], 3, report, "out")
    monkeypatch.setattr(sweep_mod, "execute", fake_seeded_train(with_examples))
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    assert "## accuracy: mean over seeds, 95% interval" in text and "## loss: mean over seeds" in text
    over = "3 seeds and test examples" if with_examples else "3 seeds only (no per-example record)"
    gla = re.search(r"^\| gla \| 3 \| (0\.\d+) \| 0\.\d+ \| \[(0\.\d+), (0\.\d+)\] \| 0\.\d+ \| (.+) \|$", text, re.M)
    # 3 seeds: Student's t over the seeds is wider than the percentile bootstrap (stats._widen)
    assert gla and gla[4] == over + "; widened to Student's t over seeds"
    assert float(gla[2]) < float(gla[1]) < float(gla[3])
    rows = re.findall(r"^\| .+ \| (yes: excluded|no: inside) \| (.+) \|$", text, re.M)
    assert [r[0] for r in rows] == ["yes: excluded", "yes: excluded", "no: inside"]
    assert rows[0][1].startswith("paired by seed: " + over)
    assert "Resolved: 2 of 3 (the interval excludes the alternative, with 3 or more seeds a cell)." in text
    assert "over the 3 labels both have: +1.00, 95% interval [+1.00, +1.00] (resampled: 3 cells" in text
    # a narrow interval over our resampling is not evidence against chance: 3 labels agree by chance 1 time in 6
    assert "A random order of 3 labels reaches |rho| >= 1.00 with probability 0.33" in text
    # two seeds: the comparison is not resolved (Student's t with one degree of freedom makes the
    # interval wide; were it to exclude the alternative, MIN_SEEDS still holds it back)
    two = seeded_experiment(tmp_path, ["gla", "hgrn"], 2, {"differences": differences[:1]}, "two")
    sweep(two, log=lambda *_: None)
    text = write_report(two, collect(two)).read_text()
    row = r"^\| gla \| hgrn \| accuracy \| .+ \| a <= b \| no: (inside|excluded, but 2 seeds a cell) "
    assert re.search(row, text, re.M)
    assert "Resolved: 0 of 1" in text


def test_report_table_averages_each_cell_over_its_seeds(tmp_path, monkeypatch):
    """With a seed axis a table cell is one config's seeds: their mean, and how many seeds where
    fewer than the grid plans have finished."""
    table = {"table": {"rows": "model.mixer", "value": "accuracy"}}
    exp = seeded_experiment(tmp_path, ["gla", "hgrn"], 2, table, "out")
    train = fake_seeded_train(False)
    monkeypatch.setattr(
        sweep_mod, "execute", lambda runs, **kw: train([r for r in runs if r.id != exp.runs()[-1].id], **kw)
    )
    sweep(exp, log=lambda *_: None)
    rows = collect(exp)
    text = write_report(exp, rows).read_text()
    gla = [r["metric:accuracy"] for r in rows if r["model.mixer"] == "gla"]
    hgrn = [r["metric:accuracy"] for r in rows if r["model.mixer"] == "hgrn" and "metric:accuracy" in r]
    assert "## accuracy (mean over train.seed)" in text
    assert f"| gla | {sum(gla) / 2:.4f} |" in text and f"| hgrn | {hgrn[0]:.4f} (1 of 2 seeds) |" in text


@pytest.mark.parametrize("seed_selected", [False, True])
def test_report_table_with_seeds_and_select_over(tmp_path, monkeypatch, seed_selected):
    """select.over [optim.lr] with a seed axis: each seed picks its own best lr, so a cell's seeds
    differ in lr (the table refused them after every run had trained); the cell is the mean of
    each seed's best. With the seed axis in select.over too, a cell is that one best run."""
    over = ["optim.lr", "train.seed"] if seed_selected else ["optim.lr"]
    grid = {"model.mixer": ["gla", "hgrn"], "optim.lr": [1e-3, 3e-3], "train.seed": [0, 1]}
    path = experiment(tmp_path, grid=grid, select={"metric": "accuracy", "mode": "max", "over": over})
    exp = load_experiment(path, out_dir=tmp_path / "out")
    # seed 0 does best at lr 1e-3, seed 1 at 3e-3
    accuracy = {(0, 1e-3): 0.9, (0, 3e-3): 0.5, (1, 1e-3): 0.4, (1, 3e-3): 0.7}

    def execute(runs, parallel=1, log=print):
        for run in runs:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            key = (run.config["train"]["seed"], run.config["optim"]["lr"])
            result = {"status": "completed", "step": 4, "n_params": 100, "wall_time_s": 1.0, "config": run.config}
            result["metrics"] = {"accuracy": accuracy[key], "loss": 1 - accuracy[key]}
            (run.out_dir / "result.json").write_text(json.dumps(result))
        return {r.id: 0 for r in runs}

    monkeypatch.setattr(sweep_mod, "execute", execute)
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    if seed_selected:
        assert "## accuracy (best of optim.lr, train.seed)\n" in text and "| gla | 0.9000 |" in text
    else:
        assert "## accuracy (best of optim.lr) (mean over train.seed of each seed's best)" in text
        assert "| gla | 0.8000 |" in text


def test_a_table_whose_columns_are_the_seeds_shows_each_seed(tmp_path, monkeypatch):
    """A seed axis as the table's columns is shown, not averaged: each cell is one run, and no
    cell reads "(1 of 3 seeds)"."""
    report = {"table": {"rows": "model.mixer", "columns": "train.seed", "value": "accuracy"}}
    exp = seeded_experiment(tmp_path, ["gla", "hgrn"], 3, report, "out")
    monkeypatch.setattr(sweep_mod, "execute", fake_seeded_train(False))
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    assert "## accuracy\n" in text  # the heading says no "(mean over train.seed)"
    table = text.split("## accuracy\n")[1].split("\n\n")[0]
    assert "| model.mixer \\ train.seed | 0 | 1 | 2 |" in table and "seeds)" not in table, table


def test_report_names_a_difference_without_finished_runs_as_missing(tmp_path, monkeypatch):
    """A sweep stopped before a compared cell ran: the report names that comparison as missing
    (not resolved) instead of failing, and still resolves the others."""
    differences = [
        {"a": "gla", "b": "mamba", "metric": "accuracy", "alternative": "a <= b"},
        {"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a <= b"},
    ]
    exp = seeded_experiment(tmp_path, ["gla", "hgrn", "mamba"], 3, {"differences": differences}, "out")
    train = fake_seeded_train(True)

    def execute(runs, parallel=1, log=print):
        return train([r for r in runs if r.config["model"]["mixer"] != "mamba"], parallel, log)

    monkeypatch.setattr(sweep_mod, "execute", execute)
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    assert "| gla | mamba | accuracy | — | none | a <= b | no | missing: no finished run of 'mamba' |" in text
    assert re.search(r"^\| gla \| hgrn \| accuracy \| .+ \| yes: excluded \|", text, re.M)
    assert "Resolved: 1 of 2" in text
    # a label that is not in the grid is an error, not a cell still to run
    typo = seeded_experiment(tmp_path, ["gla", "hgrn", "mamba"], 3, {"differences": differences}, "out")
    typo.report["differences"] = [{**differences[0], "b": {"model.mixer": "mamab"}}]
    with pytest.raises(ValueError, match=r"report.differences\[0\].b: expected a grid axis and one of its labels"):
        write_report(typo, collect(typo))


def test_a_difference_is_not_resolved_before_all_its_seeds_have_run(tmp_path, monkeypatch):
    """Seeds are fixed before the runs: 3 of a grid's 5 seeds finished, whatever the interval says,
    do not resolve a comparison (reading it early and stopping when it clears is optional stopping)."""
    differences = [{"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a <= b"}]
    exp = seeded_experiment(tmp_path, ["gla", "hgrn"], 5, {"differences": differences}, "out")
    train = fake_seeded_train(True)

    def execute(runs, parallel=1, log=print):
        return train([r for r in runs if r.config["train"]["seed"] < 3], parallel, log)

    monkeypatch.setattr(sweep_mod, "execute", execute)
    sweep(exp, log=lambda *_: None)
    text = write_report(exp, collect(exp)).read_text()
    assert re.search(
        r"^\| gla \| hgrn \| accuracy \| .+ \| no: excluded, but 3 of the grid's 5 seeds a cell", text, re.M
    )
    assert "Resolved: 0 of 1" in text


def test_report_differences_are_checked(tmp_path):
    base = {"grid": {"model.mixer": ["gla", "hgrn"], "train.seed": [0, 1]}, "select": None}
    good = {"a": "gla", "b": "hgrn", "metric": "accuracy", "alternative": "a <= b"}
    with pytest.raises(ValueError, match=r"report.differences\[0\].alternative: expected one of 'a <= b'"):
        load_experiment(experiment(tmp_path, **base, report={"differences": [{**good, "alternative": "bigger"}]}))
    with pytest.raises(ValueError, match=r"report.differences\[0\].a: expected a grid axis"):
        load_experiment(experiment(tmp_path, **base, report={"differences": [{**good, "a": {"model.d_model": 8}}]}))
    with pytest.raises(ValueError, match=r"report.differences\[0\].b: expected a cell"):
        load_experiment(experiment(tmp_path, **base, report={"differences": [{**good, "b": [1, 2]}]}))


@pytest.mark.parametrize(
    "option", [["--set", "train.max_steps=3"], ["--grid", "model.mixer=gla"], ["--out", "elsewhere"]]
)
def test_a_sweep_directory_refuses_what_only_an_experiment_file_takes(tmp_path, capsys, option):
    """A sweep directory reruns the experiment it holds: --set, --grid and --out, which it would
    leave unapplied, are refused."""
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    shutil.copy(experiment(tmp_path), sweep_dir / EXPERIMENT_COPY)
    assert main(["sweep", str(sweep_dir), *option, "--dry-run"]) == 2
    assert f"{option[0]} apply to an experiment file" in capsys.readouterr().err


def test_a_run_config_given_to_sweep_is_named_as_one(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["sweep", str(tmp_path / "run.yaml"), "--dry-run"]) == 2
    assert "a run config (it has model, optim, task, train), not an experiment file" in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["sweep", str(experiment(tmp_path)), "--out", str(tmp_path / "afile"), "--dry-run"]) == 2
    assert "--out: " in capsys.readouterr().err


@pytest.mark.parametrize("command", ["sweep", "report"])
def test_an_empty_out_is_refused(tmp_path, capsys, command):
    # it meant the current directory, where `lcsm train --out ""` is refused
    assert main([command, str(experiment(tmp_path)), "--out", ""] + (["--dry-run"] if command == "sweep" else [])) == 2
    assert "--out: expected a directory path, got ''" in capsys.readouterr().err
