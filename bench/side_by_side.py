"""Fwd+bwd times of one case in two source trees, side by side in one run: each (tree, case) cell
runs in a fresh process (so the trees' ``lcsm`` never share one), the cells in turns, ``--rounds``
times, each cell the median of ``--repeats`` timed calls after one untimed call. Host memory as
lcsm's training processes keep it (``--allocator retain``, the default) or as a library caller's
process has it (``system``: glibc's own thresholds), float32, ``--threads`` threads (default 2).
The table gives the ratio of the two medians and, over two or more rounds, the ratio paired by
round (the geometric mean of each round's old / new) with its 95% interval.

    python -m bench.side_by_side --old PATH [--new PATH] [--cases ...] [--rounds 3] [--allocator A] [--out FILE]

Cases (issue 68's CPU targets for the elementwise kernel, Mamba and S4):
    kxd       eos chunk with a full K x D decay tensor, B=1 T=2048 H=1 K=16 D=256, chunk 64
    product   the same with log_o = LogProduct(dt, A) (Mamba's form)
    kxd-auto, product-auto  kxd and product with mode "auto" (the native scan on the CPU where it exists)
    product-packed  product-auto on 8 packed documents (cu_seqlens), final states asked for
    invariant-packed  a time-invariant system (e, s [H, K], a full K x D decay, B=1 T=2048 H=4 K=16
              D=64) on 8 packed documents, mode "auto", final states asked for
    mamba     the Mamba layer, B=64 T=256 d_model=128
    eos-KIND-T[-BxHxK]  eos chunk with no, a scalar, a row or a column decay (KIND none, scalar,
              row, col), chunk 64, GLA's gates, at length T: the ops bench's limit case, B=1 H=4
              K=D=64, or B, H and K = D as given (eos-row-4096-1x8x128)
    glu-T     the SwiGLU channel mixer alone (d_model 128, hidden 344, the efficiency bench's), forward
              and backward of the sum of its output, B=1 at length T
    lm-NAME-T one training step (forward + backward of the cross-entropy, batch 1) of the efficiency
              bench's model NAME (transformer, s4, mamba, ...) at length T; s4 with l_max = T (the
              official code's C~ parametrization, as the bench builds it), s4default lcsm's default
              S4 (the parameter C, any T)
    layer-NAME-T  the mixer NAME alone (lcsm.layers.build with d_model 128; s4 with l_max = T),
              forward and backward of the sum of its output, B=1 at length T
    decode-NAME-N N one-token decoding steps (no gradients, the state carried) of the efficiency
              bench's model NAME after a 16-token prefill: the per-call overhead of the layers

A tree that cannot run a case (an option it lacks) gets "-" and the error's last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lcsm.engine.stats import ratio_interval

CASES = (
    "kxd",
    "product",
    "kxd-auto",
    "product-auto",
    "product-packed",
    "invariant-packed",
    "mamba",
    "lm-transformer-512",
    "lm-s4-512",
)


def _case(name: str):
    import torch
    import torch.nn.functional as F

    from lcsm.ops import LogProduct, eos

    g = torch.Generator().manual_seed(5)
    if name in ("kxd", "product", "kxd-auto", "product-auto", "product-packed"):
        B, T, K, D = 1, 2048, 16, 256
        A = (-torch.arange(1, K + 1, dtype=torch.float32)[:, None].expand(K, D)).unsqueeze(0).contiguous()
        dt = F.softplus(torch.randn(B, T, 1, 1, D, generator=g) - 4)
        x = [torch.randn(B, T, 1, D, generator=g), torch.randn(B, T, 1, K, generator=g)]
        x.append(torch.randn(B, T, 1, K, generator=g))
        x += [dt * A] if name.startswith("kxd") else [dt, A]
        x = [t.requires_grad_() for t in x]

        packed = name == "product-packed"
        cu = torch.linspace(0, T, 9).round().long() if packed else None

        def run():
            log_o = x[3] if name.startswith("kxd") else LogProduct(x[3], x[4])
            mode = "chunk" if name in ("kxd", "product") else "auto"
            y, m = eos(x[0], x[1], x[2], log_o, mode=mode, chunk_size=64, cu_seqlens=cu, output_final_state=packed)
            (y.sum() + (m.sum() if packed else 0)).backward()

        return run
    if name == "invariant-packed":
        # a time-invariant system (S4D's shapes: e, s [H, K], a full K x D decay) over 8 packed
        # documents under auto, whose memory restarts make it time-varying
        B, T, H, K, D = 1, 2048, 4, 16, 64
        i = torch.randn(B, T, H, D, generator=g, requires_grad=True)
        e, s = (torch.randn(H, K, generator=g, requires_grad=True) for _ in range(2))
        log_o = (-torch.rand(H, K, D, generator=g) / 16).requires_grad_()
        cu = torch.linspace(0, T, 9).round().long()

        def run():
            y, m = eos(i, e, s, log_o, cu_seqlens=cu, output_final_state=True)
            (y.sum() + m.sum()).backward()

        return run
    if name.startswith("eos-"):
        _, kind, T, *shape = name.split("-")
        B, H, K = (int(n) for n in shape[0].split("x")) if shape else (1, 4, 64)
        T, D = int(T), K
        i, e, s = (torch.randn(B, T, H, X, generator=g) for X in (D, K, K))
        tail = {"none": None, "scalar": (1, 1), "row": (K, 1), "col": (1, D)}[kind]
        log_o = None if tail is None else F.logsigmoid(torch.randn(B, T, H, *tail, generator=g)) / 16
        leaves = [t.requires_grad_() for t in (i, e, s, log_o) if t is not None]
        cot = torch.randn(B, T, H, D, generator=g)

        def run():
            for t in leaves:
                t.grad = None
            eos(i, e, s, log_o, mode="chunk", chunk_size=64)[0].backward(cot)

        return run
    if name == "mamba":
        from lcsm import layers

        torch.manual_seed(5)
        layer = layers.build("mamba", 128)
        u = torch.randn(64, 256, 128, generator=g, requires_grad=True)

        def run():
            layer(u).backward(torch.ones(64, 256, 128))

        return run
    if name.startswith("lm-"):
        from bench.efficiency_bench import FULL, model_config, tokens, train_step
        from lcsm.models import build_model

        _, model_name, T = name.split("-")
        T = int(T)
        # S4's options are set here, not taken from the tree's bench, so that both trees build the
        # same S4 (the bench built lcsm's default S4 before 7b1240f, with l_max = T since).
        if model_name == "s4":
            cfg = dataclasses.replace(model_config("s4", FULL), mixer_options={"l_max": T})
        elif model_name == "s4default":
            cfg = dataclasses.replace(model_config("s4", FULL), mixer_options={})
        else:
            cfg = model_config(model_name, FULL)
        torch.manual_seed(5)
        model = build_model(cfg)
        ids = tokens(T, FULL.vocab, 5, torch.device("cpu"))
        return lambda: train_step(model, ids)
    if name.startswith("glu-"):
        from lcsm.models.blocks import GLU

        torch.manual_seed(5)
        glu = GLU(128, 344)
        u = torch.randn(1, int(name.split("-")[1]), 128, generator=g, requires_grad=True)
        return lambda: glu(u).sum().backward()
    if name.startswith("layer-"):
        from lcsm import layers

        _, mixer, T = name.split("-")
        T = int(T)
        torch.manual_seed(5)
        layer = layers.build(mixer, 128, **({"l_max": T} if mixer == "s4" else {}))
        u = torch.randn(1, T, 128, generator=g, requires_grad=True)
        return lambda: layer(u).sum().backward()
    if name.startswith("decode-"):
        from bench.efficiency_bench import FULL, model_config, tokens
        from lcsm.models import build_model

        _, model_name, steps = name.split("-")
        torch.manual_seed(5)
        model = build_model(model_config(model_name, FULL)).eval()
        token = tokens(1, FULL.vocab, 5, torch.device("cpu"))[:, :1]
        with torch.no_grad():
            _, prefilled = model(tokens(16, FULL.vocab, 6, torch.device("cpu"))[:, :16], return_state=True)

        @torch.no_grad()
        def run():
            state = prefilled
            for _ in range(int(steps)):
                _, state = model(token, state=state, return_state=True)

        return run
    patterns = "eos-KIND-T[-BxHxK], glu-T, lm-NAME-T, layer-NAME-T or decode-NAME-N"
    raise ValueError(f"case: expected one of {', '.join(CASES)}, {patterns}, got {name!r}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def worker(name: str, repeats: int, allocator: str) -> None:
    from lcsm.engine.host_memory import use_host_allocator

    use_host_allocator(allocator)
    run = _case(name)
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times) * 1e3}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the other source tree (e.g. a git worktree of the previous commit)")
    p.add_argument("--new", default=".", help="this source tree (default: the current directory)")
    p.add_argument("--cases", nargs="+", default=list(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--allocator", choices=("retain", "system"), default="retain", help="as run.host_allocator")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.repeats, a.allocator)
        return 0
    trees = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve()}
    for label, tree in trees.items():
        if not (tree / "lcsm").is_dir():
            raise ValueError(f"--{label}: expected a source tree holding lcsm/, got {tree}")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    cells: dict[tuple[str, str], list[float]] = {}
    failed: dict[tuple[str, str], str] = {}
    for round_ in range(a.rounds):
        for case in a.cases:
            for label, tree in trees.items():
                # The script comes from this tree; lcsm (and the efficiency bench's models) from the
                # tree being timed.
                cmd = [sys.executable, str(Path(__file__).resolve()), "--old", ".", "--worker", case]
                cmd += ["--repeats", str(a.repeats), "--allocator", a.allocator]
                env["PYTHONPATH"] = str(tree)
                out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
                if out.returncode:
                    failed[case, label] = (out.stderr.strip().splitlines() or ["no output"])[-1]
                    continue
                ms = json.loads(out.stdout.strip().splitlines()[-1])["ms"]
                cells.setdefault((case, label), {})[round_] = ms
    lines = [
        "| case | old ms | new ms | old / new | paired by round [95% interval] |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for case in a.cases:
        old, new = (cells.get((case, k), {}) for k in ("old", "new"))
        ratio, paired = "-", "-"
        if old and new:
            ratio = f"{statistics.median(old.values()) / statistics.median(new.values()):.2f}x"
        rounds = sorted(old.keys() & new.keys())
        if len(rounds) >= 2:
            r, low, high = ratio_interval([old[k] for k in rounds], [new[k] for k in rounds])
            paired = f"{r:.2f}x [{low:.2f}, {high:.2f}]"
        old_ms, new_ms = (statistics.median(c.values()) if c else None for c in (old, new))
        lines.append(f"| {case} | {_ms(old_ms)} | {_ms(new_ms)} | {ratio} | {paired} |")
    lines += [f"\n{label} tree, {case}: {error}" for (case, label), error in failed.items()]
    report = "\n".join(lines)
    print(report)
    if a.out:
        Path(a.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
