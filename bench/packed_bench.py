"""``lcsm bench packed``: the cost of packed sequences in the chunk forms of ``eos`` and ``eos_delta``.

One row of T tokens holding N documents (``cu_seqlens``) against one sequence of the same T,
forward and backward of the GLA-like row decay (``--op eos``) or of DeltaNet (``--op delta``:
unit keys, a = e = beta k, the ``fwp`` mixer's call), with and without per-document initial and
final states. The packed and the plain call alternate repeat by repeat, so a drift of the machine's
speed bends both alike; the table gives each median and their ratio, against the target of at
most 1.2x one sequence's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch.nn.functional import logsigmoid, normalize

from bench._common import Check, provenance_header, write_out
from lcsm.ops import eos, eos_delta

TARGET = 1.2


SHAPES = {"eos": "row decay", "delta": "DeltaNet (unit keys, a = e = beta k)"}


def _inputs(op: str, T: int, H: int, K: int, D: int, seed: int) -> list[torch.Tensor]:
    """The leaves: eos (i, e, s, log_o); delta (i, k, beta, q)."""
    g = torch.Generator().manual_seed(seed)
    i, e, s = (torch.randn(1, T, H, n, generator=g) for n in (D, K, K))
    if op == "delta":
        beta = torch.rand(1, T, H, 1, generator=g)
        return [x.requires_grad_() for x in (i, e, beta, s)]
    log_o = logsigmoid(torch.randn(1, T, H, K, 1, generator=g)) / 16
    return [x.requires_grad_() for x in (i, e, s, log_o)]


def _call(op: str, x: list[torch.Tensor], **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if op == "eos":
        return eos(*x, mode="chunk", **kwargs)
    i, k, beta, q = x
    k, q = normalize(k, dim=-1), normalize(q, dim=-1)
    bk = beta * k  # one object as a and e: the chunk form's DeltaNet path
    return eos_delta(i, bk, q, bk, k, mode="chunk", **kwargs)


def _step(op: str, x: list[torch.Tensor], chunk: int, cu_seqlens: torch.Tensor | None, states: bool) -> float:
    """Seconds of one forward and backward, random cotangents on every output. The initial states
    and the cotangents are drawn before the clock starts: with states they hold N H K D numbers
    each (8.4M at N 512, H 4, K = D = 64), and drawing them is no part of the operator's cost."""
    n = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    T, H, K, D = x[0].shape[1], x[0].shape[2], x[1].shape[3], x[0].shape[3]
    init = torch.randn(n, H, K, D, requires_grad=True) if states else None
    dy = torch.randn(1, T, H, D)
    dm = torch.randn(n, H, K, D) if states else None
    start = time.perf_counter()
    y, m = _call(op, x, chunk_size=chunk, cu_seqlens=cu_seqlens, initial_state=init, output_final_state=states)
    torch.autograd.backward([y, m] if states else [y], [dy, dm] if states else [dy])
    return time.perf_counter() - start


def _boundaries(T: int, N: int, seed: int) -> torch.Tensor:
    """N documents of random lengths (at least one token each) filling T tokens."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=g)[: N - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([T])])


def measure(
    T: int, docs: Sequence[int], H: int, K: int, D: int, chunk: int, repeats: int, op: str = "eos", log=print
) -> list[dict]:
    rows = []
    x = _inputs(op, T, H, K, D, seed=0)
    for states in (False, True):
        _step(op, x, chunk, None, states)  # warm-up: first-call allocations
        for N in docs:
            cu = _boundaries(T, N, seed=N)
            _step(op, x, chunk, cu, states)
            plain, packed = [], []
            for _ in range(repeats):
                plain.append(_step(op, x, chunk, None, states))
                packed.append(_step(op, x, chunk, cu, states))
            row = {
                "N": N,
                "states": states,
                "plain": statistics.median(plain),
                "packed": statistics.median(packed),
            }
            row["ratio"] = row["packed"] / row["plain"]
            rows.append(row)
            log(
                f"N={N:5d} states={states!s:5s}: {row['plain'] * 1e3:8.1f} ms one sequence, "
                f"{row['packed'] * 1e3:8.1f} ms packed, {row['ratio']:.2f}x"
            )
    return rows


def render(header: dict[str, str], shape: str, rows: list[dict], op: str = "eos") -> str:
    name = {"eos": "eos", "delta": "eos_delta"}[op]
    lines = [f"# Packed sequences: {name} chunk form, N documents in one row against one sequence", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [
        f"- shape: {shape}",
        "",
        "| documents N | initial and final states | one sequence (ms) | packed (ms) | ratio |",
    ]
    lines += ["|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['N']} | {'yes' if r['states'] else 'no'} | {r['plain'] * 1e3:.2f} | {r['packed'] * 1e3:.2f} "
            f"| {r['ratio']:.3g}x |"
        )
    checks = [
        Check(f"packed / one sequence, N={r['N']}, states={'yes' if r['states'] else 'no'}", r["ratio"], "<=", TARGET)
        for r in rows
    ]
    lines += ["", "| check | measured | target | result |", "|---|---:|---:|---|"]
    lines += [f"| {c.name} | {c.measured:.2f}x | {c.op} {c.target}x | {c.result} |" for c in checks]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lcsm bench packed", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=4096, help="tokens in the row (default 4096)")
    p.add_argument("--docs", default="8,64,512", help="numbers of documents, comma-separated")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=64, help="K = D per head (default 64)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--op", choices=list(SHAPES), default="eos", help="eos (row decay) or delta (DeltaNet)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.T, args.docs, args.heads, args.width, args.chunk, args.repeats = 96, "4,16", 2, 8, 16, 2
    docs = [int(n) for n in args.docs.split(",")]
    if any(not 1 <= n <= args.T for n in docs):
        raise SystemExit(f"--docs: expected numbers of documents in [1, T={args.T}], got {args.docs!r}")
    header = provenance_header(
        "lcsm bench packed", list(sys.argv[1:] if argv is None else argv), torch.get_num_threads(), args.out
    )
    shape = f"B=1 T={args.T} H={args.heads} K=D={args.width}, chunk {args.chunk}, {SHAPES[args.op]}, fp32, fwd+bwd"
    rows = measure(args.T, docs, args.heads, args.width, args.width, args.chunk, args.repeats, args.op)
    text = render(header, shape, rows, args.op)
    print(text)
    write_out(text, args.out, print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
