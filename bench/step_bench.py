"""Seconds per training step of a run config in several variants, measured side by side.

What a sweep's runs will cost on this machine, before running them: each variant is the run config
with its own ``--set`` overrides; every variant is built (task data and model) and warmed up by
one step, then the measured steps go round-robin over the variants, so a change in machine load
falls on all of them alike. Reports the median seconds per step of the config's batch size, each
variant's ratio to the first, and a run of ``train.max_steps`` steps extrapolated from it. Run:

    lcsm bench step experiments/lcsm_mqar/base.yaml --set model.d_model=128 \\
        --variant code1=model.mixer_options.code=1-1-1-0 --variant row=model.mixer_options.code=1-3-1-0

A variant is ``label=key=value[,key=value...]``; without ``--variant`` the config is timed alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench._common import provenance_header, write_out
from lcsm.cli.train import TRAIN_DEFAULTS
from lcsm.engine.config import load_config, parse_override
from lcsm.engine.trainer import Trainer


def _top_level_parts(text: str) -> list[str]:
    """``text`` split at its commas outside brackets, braces and quotes (a value may be a YAML
    mapping or list: ``model.mixer_options={expand: 32, chunk_size: 16}``)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [part.strip() for part in [*parts, text[start:]] if part.strip()]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``label=key=value[,key=value...]`` -> (label, ["key=value", ...])."""
    label, sep, rest = text.partition("=")
    overrides = _top_level_parts(rest)
    if not sep or not label.strip() or not overrides:
        raise ValueError(f"--variant: expected LABEL=KEY=VALUE[,KEY=VALUE...], got {text!r}")
    for item in overrides:
        try:
            parse_override(item)
        except ValueError as err:
            raise ValueError(f"--variant {label.strip()}: {err}") from None
    return label.strip(), overrides


def time_steps(
    config_path: str, common: Sequence[str], variants: Sequence[tuple[str, list[str]]], steps: int, log
) -> list[dict[str, object]]:
    """Median seconds per step of each variant, measured round-robin after one warm-up step each."""
    configs = [load_config(config_path, [*common, *overrides], defaults=TRAIN_DEFAULTS) for _, overrides in variants]
    allocators = {c.run.host_allocator for c in configs}
    if len(allocators) > 1:
        raise ValueError(
            f"--variant: run.host_allocator acts on the whole process, so variants timed side by "
            f"side must share it; got {', '.join(sorted(allocators))} (time each in its own run)"
        )
    trainers = []
    with tempfile.TemporaryDirectory(prefix="lcsm-step-bench-") as tmp:
        for n, ((label, overrides), config) in enumerate(zip(variants, configs, strict=False)):
            config = dataclasses.replace(config, out_dir=str(Path(tmp) / str(n)))
            log(f"building {label}")
            trainer = Trainer(config, quiet=True)
            batch = list(range(config.train.batch_size))
            trainer.train_step(batch)
            trainers.append((label, overrides, config, trainer, batch))
        times: dict[str, list[float]] = {label: [] for label, *_ in trainers}
        for step in range(steps):
            for label, _, _, trainer, batch in trainers:
                start = time.perf_counter()
                trainer.train_step(batch)
                _synchronize(trainer)  # the optimizer's step is still queued on a GPU
                times[label].append(time.perf_counter() - start)
            log(f"round {step + 1}/{steps}")
    rows = []
    for label, overrides, config, trainer, _ in trainers:
        median = statistics.median(times[label])
        rows.append(
            {
                "label": label,
                "overrides": " ".join(overrides) or "(none)",
                "s_step": median,
                "batch": config.train.batch_size,
                "params": sum(p.numel() for p in trainer.model.parameters()),
                "max_steps": config.train.max_steps,
                "host_allocator": trainer.host_allocator,
            }
        )
    return rows


def render(rows: list[dict[str, object]], header: dict[str, str]) -> str:
    first = rows[0]["s_step"]
    lines = [
        "# Seconds per training step",
        "",
        *[f"- {k}: {v}" for k, v in header.items()],
        "",
        "| variant | overrides | params | batch | s / step (median) | ratio to first | run of max_steps |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        run = f"{r['s_step'] * r['max_steps'] / 60:.1f} min ({r['max_steps']} steps)" if r["max_steps"] else "—"
        lines.append(
            f"| {r['label']} | {r['overrides']} | {r['params']:,} | {r['batch']} | {r['s_step']:.3f} | "
            f"{r['s_step'] / first:.2f}x | {run} |"
        )
    return "\n".join(lines) + "\n"


def _synchronize(trainer) -> None:
    device = next(trainer.trained.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="lcsm bench step", description=__doc__.splitlines()[0])
    p.add_argument("config", help="run config YAML (e.g. an experiment's base.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=KEY=VALUE[,...]",
        help="a variant with its own overrides (repeatable; the first is the reference)",
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a sweep's run)")
    p.add_argument("--out", help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: expected an integer >= 1, got {args.steps}")
    if args.threads < 1:
        p.error(f"--threads: expected an integer >= 1, got {args.threads}")
    try:
        for item in args.set:
            parse_override(item)
        variants = [parse_variant(v) for v in args.variant] or [("config", [])]
    except ValueError as err:
        p.error(str(err))
    labels = [label for label, _ in variants]
    if len(set(labels)) != len(labels):
        p.error(f"--variant: labels must differ, got {', '.join(labels)}")

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def log(msg):
        return print(f"[step bench {time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    header = provenance_header(p.prog, argv, args.threads, out=args.out)
    try:
        rows = time_steps(args.config, args.set, variants, args.steps, log)
    finally:
        torch.set_num_threads(threads)
    header["host allocator"] = rows[0]["host_allocator"]
    header["wall time"] = f"{time.perf_counter() - start:.0f} s"
    text = render(rows, header)
    print(text, end="")
    write_out(text, args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
