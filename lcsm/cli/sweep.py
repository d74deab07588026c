"""``lcsm sweep`` and ``lcsm report``."""

from __future__ import annotations

import signal
from pathlib import Path

from ._common import UsageError


def _experiment(target: str, args, file_only: tuple[str, ...] = ()):
    """The experiment of an experiment file or of a sweep directory; ``file_only``: options that
    apply to an experiment file only (a sweep directory holds its experiment as it ran)."""
    from lcsm.engine.sweep import EXPERIMENT_COPY, load_experiment

    path = Path(target)
    out = getattr(args, "out", None)
    if out == "":  # Path("") is the current directory, which `lcsm train --out ""` refuses too
        raise UsageError("--out: expected a directory path, got ''")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"--out: {out} exists and is not a directory")
    if path.is_dir():
        given = [f"--{name}" for name in file_only if getattr(args, name, None)]
        if given:
            raise UsageError(
                f"{target}: {', '.join(given)} apply to an experiment file, and a sweep directory "
                f"holds its experiment as it ran ({EXPERIMENT_COPY}); give the experiment file with them"
            )
        copy = path / EXPERIMENT_COPY
        if not copy.is_file():
            raise UsageError(
                f"{target}: a directory without {EXPERIMENT_COPY}; give an experiment file or a sweep "
                "directory that `lcsm sweep` wrote"
            )
        return load_experiment(copy, out_dir=path)
    if not path.is_file():
        raise UsageError(f"{target}: no such experiment file or sweep directory")
    return load_experiment(
        path, overrides=getattr(args, "set", None) or (), grid=getattr(args, "grid", None) or (), out_dir=args.out
    )


def cmd_sweep(args) -> int:
    from lcsm.engine.report import write_report
    from lcsm.engine.sweep import SweepStopped, format_table, main_metric, run_notes, select_best, sweep

    exp = _experiment(args.experiment, args, file_only=("set", "grid", "out"))
    try:
        rows, ok = sweep(exp, parallel=args.parallel, dry_run=args.dry_run, reuse_runs=not args.no_reuse)
    except KeyboardInterrupt as stop:
        print(
            f"sweep {exp.name} interrupted: finished runs are cached and interrupted ones checkpointed; "
            "run the same command again to continue"
        )
        return 128 + (stop.signum if isinstance(stop, SweepStopped) else signal.SIGINT)
    if args.dry_run:
        return 0
    metrics = exp.report.get("metrics") or list(dict.fromkeys([main_metric(exp), "loss"]))
    print(f"\nresults of {exp.name}:\n")
    print(format_table(exp, rows, metrics))
    if exp.select and exp.select.get("over"):
        print(f"\nbest over {', '.join(exp.select['over'])}:\n")
        print(format_table(exp, select_best(exp, rows), metrics))
    notes = run_notes(rows)
    if notes:
        print("\n" + "\n".join(notes))
    print(f"\nrun directories (checkpoints, metrics): {exp.out_dir}/<run>/; results: {exp.out_dir / 'results.csv'}")
    if args.report:
        print(f"report: {write_report(exp, rows)} (plots next to it)")
    return 0 if ok else 1


def cmd_report(args) -> int:
    from lcsm._provenance import git_commit
    from lcsm.engine.report import write_report
    from lcsm.engine.sweep import EXPERIMENT_COPY, collect

    jobs = []
    for target in args.targets:
        exp = _experiment(target, args)
        out = Path(args.out) / exp.name if args.out and len(args.targets) > 1 else args.out
        if out is not None and not Path(target).is_dir():
            exp.out_dir = Path(out)  # an experiment file's results are read where its report goes
        clash = next((other for other, done, _ in jobs if out is not None and done.name == exp.name), None)
        if clash is not None:
            raise UsageError(
                f"{clash} and {target} are both experiment {exp.name!r}: their reports would both be "
                f"written to {out}; report them one at a time, each with its own --out"
            )
        jobs.append((target, exp, out))
    commit = git_commit(ignore=[Path(out) if out is not None else exp.out_dir for _, exp, out in jobs])
    written = 0
    for target, exp, out in jobs:
        rows = collect(exp)
        if all(r["status"] == "missing" for r in rows):
            if len(args.targets) == 1:
                other = (
                    f" (it holds the runs of its own {EXPERIMENT_COPY}: `lcsm report {exp.out_dir}` reports them)"
                    if not Path(target).is_dir() and (exp.out_dir / EXPERIMENT_COPY).is_file()
                    else ""
                )
                raise UsageError(
                    f"{target}: no finished run of it in {exp.out_dir}{other}; run `lcsm sweep {target}` first"
                )
            print(f"{exp.name}: skipped, no finished run in {exp.out_dir}")
            continue
        written += 1
        print(f"{exp.name}: {write_report(exp, rows, out, commit)}")
    if not written:
        raise UsageError("no finished run in any of the targets; run `lcsm sweep` first")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a grid of runs from an experiment file (cached, resumable)",
        description="Run every run of an experiment's grid that has no cached result (see "
        "docs/sweeps.md); print the results table. Interrupted sweeps continue where "
        "they stopped.",
    )
    p.add_argument("experiment", help="experiment YAML file (or a sweep directory)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (default 1)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key of the base config")
    p.add_argument(
        "--grid",
        action="append",
        metavar="KEY=V1,V2",
        help="replace or add a grid axis, e.g. --grid model.mixer=gla,hgrn",
    )
    p.add_argument("--out", help="sweep directory (default runs/<experiment name>)")
    p.add_argument("--dry-run", action="store_true", help="list the runs and which are cached; run nothing")
    p.add_argument(
        "--no-reuse",
        action="store_true",
        help="train every missing run, even one that a sweep beside this one (the sweep directory's "
        "siblings) finished with the same training config; by default such a run is copied",
    )
    p.add_argument("--report", action="store_true", help="write the report (tables, plots) at the end")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="markdown tables and PNG plots from cached sweep results (no training)")
    p.add_argument("targets", nargs="+", metavar="EXPERIMENT", help="experiment files or sweep directories")
    p.add_argument(
        "--out",
        help="the sweep directory of an experiment file, where its report is written too "
        "(several targets: <out>/<experiment name>); default: the sweep directory",
    )
    p.set_defaults(func=cmd_report)
