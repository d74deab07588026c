"""Compile time and speed of ``torch.compile(fullgraph=True, dynamic=True)`` against eager, on
the CPU, one thread, float32 (docs/compile.md):

    python -m bench.compile_bench [--backend inductor] CASE...

CASE: ``none`` or ``row`` (``lcsm.ops.eos`` chunk mode, B 1, H 4, T 2048, K = D = 64, C 64, no
decay or a GLA-like row decay) or a mixer name (d_model 256, B 2, T 1024). For each: the best of
three eager forward + backward calls; the first compiled call, whose excess over eager is the
compile time; the best of three compiled calls after it.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch.nn.functional import logsigmoid

from lcsm import layers
from lcsm.ops import eos


def _best(step, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def _case(name: str):
    gen = torch.Generator().manual_seed(0)
    if name in ("none", "row"):
        B, T, H, K, D = 1, 2048, 4, 64, 64
        i, e = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, K, generator=gen) / 8
        s = torch.randn(B, T, H, K, generator=gen) / 8
        log_o = logsigmoid(torch.randn(B, T, H, K, 1, generator=gen)) / 16 if name == "row" else None
        args = [x.requires_grad_() for x in (i, e, s)] + [None if log_o is None else log_o.requires_grad_()]

        def fn(i, e, s, log_o):
            return eos(i, e, s, log_o, mode="chunk", chunk_size=64)[0]

        return f"eos chunk, decay {name}, B 1, H 4, T 2048, K = D = 64, C 64", fn, args
    torch.manual_seed(0)
    x = torch.randn(2, 1024, 256, generator=gen).requires_grad_()
    return f"{name} mixer, d_model 256, B 2, T 1024", layers.build(name, 256), [x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.cases:
        label, fn, inputs = _case(name)
        torch._dynamo.reset()

        def step(f, inputs=inputs):
            f(*inputs).sum().backward()

        eager = _best(functools.partial(step, fn))
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=args.backend)
        first = _best(functools.partial(step, compiled), repeats=1)
        steady = _best(functools.partial(step, compiled))
        print(
            f"{args.backend}: {label}: compile {first - eager:.1f} s; fwd+bwd eager {eager * 1e3:.0f} ms, "
            f"compiled {steady * 1e3:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
