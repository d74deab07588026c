"""``eos_dplr``'s chunk form against fla-core's pure-PyTorch chunk references, on CPU, in one run.

Every timing is forward + backward (``backward`` of a fixed random cotangent), float32,
``torch.set_num_threads(--threads)``, the minimum of ``--repeats`` runs after one warm-up run (the
minimum, not the median: this machine is shared, and the least-disturbed run is the comparable one).
Cases (B = 1, H = 4, K = D = 64 unless said; the targets of issue 66):

    gdn       Gated DeltaNet: eos_dplr chunk as the mixer calls it (a = e = beta k, b = alpha k,
              scalar decay) vs fla naive_chunk_gated_delta_rule, T = 2048. Target: ratio <= 1.
    delta     DeltaNet: eos_dplr chunk (a = e = beta k, one tensor; no decay) vs fla
              delta_rule_chunkwise, T = 2048. Target: ratio <= 1.
    kda       KDA (per-row decay): eos_dplr chunk vs fla naive_chunk_kda, T = 2048 (information).
    routed    the calls the mixers made before and make now, side by side, T = 2048, C = 64:
              eos_delta vs eos_dplr (which runs eos_delta's kernel for these structures) for
              DeltaNet (no decay), a scalar gate (gate_first, the same a; and Gated DeltaNet's own
              call, a = e = beta k, b = alpha k), and packed rows of 8 documents (cu_seqlens) with
              and without a gate; eos_dplr's own WY / UT form (its recomputing backward, what it
              ran for these structures before routing). Information: new recomputes its spans
              of 8 chunks in the backward (T 2048 is four), old keeps every intermediate.
    autograd  eos_dplr's own form: its recomputing backward vs autograd through it (Gated
              DeltaNet), T = 2048 (information: the price of the recomputation).
    scaling   time per token of eos_dplr chunk (Gated DeltaNet) from T = 1K to --max-T. Target: the
              largest T within 1.25x of T = 1K per token (flat).
    memory    peak resident memory of one Gated DeltaNet forward + backward at T = --memory-T, each
              in a fresh process: eos_dplr's own form with its recomputing backward vs autograd
              through it (target: <= 1), and eos_dplr as called (eos_delta's kernel, its spans
              recomputed) against the same autograd run (target: <= 1).

Peers get their own layouts, built before timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.functional import logsigmoid, normalize

from bench._common import Check, proc_status_kib, provenance_header, run_memory_worker, write_out
from lcsm.ops import dplr as _dplr
from lcsm.ops import eos_delta, eos_dplr

B, H, K, D = 1, 4, 64, 64
CASES = ("gdn", "delta", "kda", "routed", "autograd", "scaling", "memory")
# The documents of the packed rows of case "routed" (they sum to 2048).
PACKED = (300, 17, 512, 1, 640, 77, 250, 251)


def inputs(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, T, H, K, generator=g),
        "k": normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
        "v": torch.randn(B, T, H, D, generator=g),
        "beta": torch.rand(B, T, H, generator=g),
        "g": logsigmoid(torch.randn(B, T, H, generator=g) + 3),
        "gk": logsigmoid(torch.randn(B, T, H, K, generator=g) + 3),
        "cot": torch.randn(B, T, H, D, generator=g),
    }


def leaves(x: dict[str, torch.Tensor], names: str) -> list[torch.Tensor]:
    return [x[n].detach().clone().requires_grad_() for n in names.split()]


def ours_gdn(x, chunk_size=None, backward="routed"):
    """backward: "routed" (eos_dplr as called: eos_delta's kernel, autograd through it),
    "recompute" (eos_dplr's own WY / UT form with its recomputing backward) or "autograd" (the
    own form differentiated by autograd, every intermediate kept)."""
    q, k, v, beta, g = leaves(x, "q k v beta g")
    bk = beta[..., None] * k
    # The gated_deltanet mixer's call (lcsm/layers/_gated_delta.py): a = e = beta k, b = alpha k.
    args = (v, bk, q * K**-0.5, bk, g.exp()[..., None] * k, g)
    if backward == "routed":
        y, _ = eos_dplr(*args, mode="chunk", chunk_size=chunk_size)
    else:
        canonical = _dplr._canonicalize(*args, None)[:7]
        y, _ = _dplr.dplr_chunk(*canonical, chunk_size, recompute=backward == "recompute")
    y.backward(x["cot"])


def fla_gdn(x):
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    q, k, v, beta, g = leaves(x, "q k v beta g")
    y, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    y.backward(x["cot"])


def ours_delta(x):
    q, k, v, beta = leaves(x, "q k v beta")
    bk = beta[..., None] * k
    y, _ = eos_dplr(v, bk, q * K**-0.5, bk, k, mode="chunk")
    y.backward(x["cot"])


def fla_delta(x):
    from fla.ops.delta_rule.naive import delta_rule_chunkwise

    q, k, v, beta = (t.transpose(1, 2).contiguous().requires_grad_() for t in (x["q"], x["k"], x["v"], x["beta"]))
    o = delta_rule_chunkwise(q, k, v, beta, chunk_size=32)
    (o[0] if isinstance(o, tuple) else o).backward(x["cot"].transpose(1, 2))


def ours_kda(x):
    q, k, v, beta, gk = leaves(x, "q k v beta gk")
    bk = beta[..., None] * k
    y, _ = eos_dplr(v, bk, q * K**-0.5, bk, gk.exp() * k, gk, mode="chunk")
    y.backward(x["cot"])


def fla_kda(x):
    from fla.ops.kda.naive import naive_chunk_kda

    q, k, v, beta, gk = leaves(x, "q k v beta gk")
    y, _ = naive_chunk_kda(q, k, v, gk, beta)
    y.backward(x["cot"])


def routed_calls(x: dict[str, torch.Tensor], gate: str, packed: bool) -> dict[str, object]:
    """Forward + backward closures of one structure eos_dplr routes to eos_delta's kernel, C = 64:
    "old" the eos_delta call the mixers made, "new" the eos_dplr call they make now, "own"
    eos_dplr's own WY / UT form (its recomputing backward). gate: "none" (DeltaNet), "first" (a
    scalar gate, a given before it: gate_first) or "gdn" (Gated DeltaNet's call, a = e = beta k,
    b = alpha k; the same transition as "first")."""
    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()]) if packed else None
    C = 64

    def prepared():
        q, k, v, beta, g = leaves(x, "q k v beta g")
        return q * K**-0.5, k, v, beta[..., None] * k, (None if gate == "none" else g)

    def old():
        q, k, v, bk, g = prepared()
        y, _ = eos_delta(v, bk, q, bk, k, g, mode="chunk", chunk_size=C, cu_seqlens=cu)
        y.backward(x["cot"])

    def new():
        q, k, v, bk, g = prepared()
        if gate == "gdn":
            y, _ = eos_dplr(v, bk, q, bk, g.exp()[..., None] * k, g, mode="chunk", chunk_size=C, cu_seqlens=cu)
        else:
            y, _ = eos_dplr(v, bk, q, bk, k, g, mode="chunk", chunk_size=C, cu_seqlens=cu, gate_first=True)
        y.backward(x["cot"])

    def own():
        q, k, v, bk, g = prepared()
        a = bk if g is None else g.exp()[..., None] * bk
        canonical = _dplr._canonicalize(v, bk, q, a, k, g, None)[:7]
        bounds = None if cu is None else cu.tolist()
        y, _ = _dplr.dplr_chunk(*canonical, C, bounds, a_is_e=g is None, recompute=True)
        y.backward(x["cot"])

    return {"old": old, "new": new, "own": own}


def alternating_best(fns: dict[str, object], x, repeats: int) -> dict[str, float]:
    """The minimum over ``repeats`` rounds, each running every fn once in turn (after one warm-up
    round), so a disturbance of the shared machine falls on all of them alike. Each round starts
    one fn later: no fn always follows the same one (the allocator's state after a fn that keeps
    much memory would otherwise fall on one of them only)."""
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for fn in fns.values():
        fn()
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def best_time(fn, x, repeats: int) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_worker(spec: dict) -> dict:
    """In a fresh process: one Gated DeltaNet forward + backward at T with the given backward;
    the peak resident set above the pre-run baseline, in bytes."""
    torch.set_num_threads(spec["threads"])
    ours_gdn(inputs(256), backward=spec["backward"])  # load lazily initialised kernels first
    x = inputs(spec["T"])
    gc.collect()
    base = proc_status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    ours_gdn(x, backward=spec["backward"])
    return {"peak_bytes": (proc_status_kib("VmHWM") - base) * 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lcsm bench dplr", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=CASES, default=list(CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-T", type=int, default=32768)
    p.add_argument("--memory-T", type=int, default=8192)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "scaling" in args.only and args.max_T < 1024:
        p.error(f"--max-T: the scaling case doubles T from 1024; expected at least 1024, got {args.max_T}")
    if args.memory_worker is not None:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return 0
    torch.set_num_threads(args.threads)
    header = provenance_header("lcsm bench dplr", argv if argv is not None else sys.argv[1:], args.threads, args.out)
    checks: list[Check] = []
    rows: list[str] = []

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    def pair(name, ours, peer, target):
        x = inputs(2048)
        a, b = best_time(ours, x, args.repeats), best_time(peer, x, args.repeats)
        rows.append(f"| {name} | T 2048 | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f}x |")
        if target is not None:
            checks.append(Check(f"{name}: eos_dplr / {peer.__name__}", a / b, "<=", target))
        log(rows[-1])

    if "gdn" in args.only:
        pair("Gated DeltaNet", ours_gdn, fla_gdn, 1.0)
    if "delta" in args.only:
        pair("DeltaNet", ours_delta, fla_delta, 1.0)
    if "kda" in args.only:
        pair("KDA (per-row decay)", ours_kda, fla_kda, None)
    routed = []
    if "routed" in args.only:
        x = inputs(2048)
        for packed in (False, True):
            for gate in ("none", "first", "gdn"):
                best = alternating_best(routed_calls(x, gate, packed), x, args.repeats)
                name = {"none": "no decay", "first": "scalar gate (gate_first)", "gdn": "scalar gate (GDN's call)"}
                case = f"{name[gate]}{', packed' if packed else ''}"
                # No target: new recomputes spans beyond 8 chunks in its backward (docs/eos_dplr.md).
                routed.append((case, best))
                log(f"routed {case}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()))
    if "autograd" in args.only:
        x = inputs(2048)
        a = best_time(lambda x: ours_gdn(x, backward="recompute"), x, args.repeats)
        b = best_time(lambda x: ours_gdn(x, backward="autograd"), x, args.repeats)
        rows.append(
            f"| recomputing vs autograd backward (GDN) | T 2048 | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f}x |"
        )
        log(rows[-1])
    scaling = []
    if "scaling" in args.only:
        T = 1024
        while args.max_T >= T:
            t = best_time(ours_gdn, inputs(T), max(1, min(args.repeats, 3)))
            scaling.append((T, t / T * 1e6))
            log(f"scaling T={T}: {scaling[-1][1]:.2f} us/token")
            T *= 2
        checks.append(
            Check(f"time per token, T = {scaling[-1][0]} / T = 1024", scaling[-1][1] / scaling[0][1], "<=", 1.25)
        )
    memory = None
    if "memory" in args.only:
        spec = {"T": args.memory_T, "threads": args.threads}
        backwards = ("recompute", "autograd", "routed")
        peaks = {m: run_memory_worker("bench.dplr_bench", {**spec, "backward": m}, 600) for m in backwards}
        memory = peaks
        if all(isinstance(v, int) for v in peaks.values()):
            checks.append(
                Check(
                    f"peak memory at T = {args.memory_T}, recomputing / autograd",
                    peaks["recompute"] / peaks["autograd"],
                    "<=",
                    1.0,
                )
            )
            checks.append(
                Check(
                    f"peak memory at T = {args.memory_T}, routed (spans recomputed) / autograd",
                    peaks["routed"] / peaks["autograd"],
                    "<=",
                    1.0,
                )
            )
        log(f"memory {peaks}")

    lines = ["# eos_dplr chunk form vs fla-core's pure-PyTorch chunk references", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [
        "",
        f"Forward + backward, float32, B {B} H {H} K {K} D {D}, minimum of {args.repeats} runs after a warm-up run.",
        "",
    ]
    lines += ["## Targets", "", "| check | measured | target | result |", "| --- | --- | --- | --- |"]
    lines += [f"| {c.name} | {c.measured:.3f} | {c.op} {c.target:g} | {c.result} |" for c in checks]
    if rows:
        lines += [
            "",
            "## Side by side",
            "",
            "| case | shape | eos_dplr ms | peer ms | ratio |",
            "| --- | --- | ---: | ---: | ---: |",
            *rows,
        ]
    if routed:
        lines += [
            "",
            "## The routed structures: the mixers' old call (eos_delta) vs the new one (eos_dplr)",
            "",
            f"T 2048, C = 64, alternating rounds; packed: documents {list(PACKED)}. own: eos_dplr's WY / UT",
            "form with its recomputing backward (what eos_dplr ran for these structures before routing).",
            "",
            "| case | eos_delta ms | eos_dplr ms | new / old | own form ms | own / old |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {case} | {b['old'] * 1e3:.1f} | {b['new'] * 1e3:.1f} | {b['new'] / b['old']:.3f}x "
            f"| {b['own'] * 1e3:.1f} | {b['own'] / b['old']:.3f}x |"
            for case, b in routed
        ]
    if scaling:
        lines += ["", "## Time per token (Gated DeltaNet, chunk form)", "", "| T | µs / token |", "| ---: | ---: |"]
        lines += [f"| {T} | {us:.2f} |" for T, us in scaling]
    if memory is not None:
        lines += [
            "",
            f"## Peak memory at T = {args.memory_T} (peak RSS above the pre-run baseline, fresh process each)",
            "",
        ]
        lines += [f"- {m}: {v / 2**20:.1f} MiB" if isinstance(v, int) else f"- {m}: {v}" for m, v in memory.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    write_out(text, args.out, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
