"""Data size and training time per epoch of every registered task, at its default options.

For each task: examples and tokens of its splits, the time to make (or read) the data, and the
time of one training epoch of a small reference model (GLA, d_model 64, 2 layers, the task's
head; batch 32, AdamW), extrapolated from the median of a few measured steps. Run:

    python -m bench.tasks_bench [--out bench/results/tasks.md] [--only lm,listops] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench._common import provenance_header, write_out
from lcsm import tasks
from lcsm.models import ModelConfig, build_model

BATCH = 32


def measure(name: str, steps: int) -> dict:
    t0 = time.perf_counter()
    task = tasks.build(name)
    data = {s: task.dataset(s) for s in task.splits}
    prepare = time.perf_counter() - t0
    train = data["train"]
    model = build_model(
        ModelConfig.from_dict({"mixer": "gla", "d_model": 64, "n_layers": 2, **task.model_fields()}), verbose=False
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [b for b in train.loader(BATCH, shuffle=True, drop_last=True)]
    times = []
    for batch in batches[: steps + 1]:
        start = time.perf_counter()
        loss = task.loss(task.logits(model, batch), batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:] or times)  # the first step pays one-off costs
    length = max(seg.inputs.shape[1] for seg in train.segments)
    return {
        "task": name,
        "head": task.default_head,
        "sizes": " / ".join(str(len(d)) for d in data.values()),
        "length": length,
        "prepare_s": prepare,
        "step_s": step,
        "steps": len(batches),
        "epoch_s": step * len(batches),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lcsm bench tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated task names (default: every registered task)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per task (default 5)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected an integer >= 1, got {args.steps}")
    names = tasks.available() if not args.only else [n.strip() for n in args.only.split(",")]
    start = time.perf_counter()
    header = provenance_header(parser.prog, argv, torch.get_num_threads(), out=args.out)
    rows = []
    for name in names:
        print(f"[tasks bench] {name}", file=sys.stderr, flush=True)
        rows.append(measure(name, args.steps))
    header["wall time"] = f"{time.perf_counter() - start:.0f} s"
    lines = [
        "# Tasks: data and one training epoch at default options",
        "",
        *[f"- {k}: {v}" for k, v in header.items()],
        f"- model: GLA, d_model 64, 2 layers, the task's head; batch {BATCH}; epoch time = median step "
        f"time x full batches of the training split",
        "",
        "| task | head | examples (splits) | length | data s (make or read) | s / step | steps / epoch | s / epoch |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['task']} | {r['head']} | {r['sizes']} | {r['length']} | {r['prepare_s']:.1f} | "
        f"{r['step_s']:.3f} | {r['steps']} | {r['epoch_s']:.0f} |"
        for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    write_out(text + "\n", args.out, lambda msg: print(f"[tasks bench] {msg}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
