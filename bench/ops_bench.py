"""Operator benchmark: lcsm's chunkwise EOS against its peers, on CPU, side by side in one run.

Every timing is forward + backward (``y.backward(cotangent)`` with a fixed random cotangent),
float32, ``torch.set_num_threads(--threads)``, the median of ``--repeats`` runs after warm-up, host
memory kept in glibc's heap as lcsm's training processes keep it (``--allocator``).
Cases (select with ``--only``; see bench/README.md for the method and the targets):

    matmul     fp32 matmul throughput of this machine (n x n @ n x n, forward only)
    row_decay  eos chunk with a GLA-like row decay vs fla naive_chunk_simple_gla / naive_recurrent_gla
    no_decay   eos chunk without decay vs fla naive_chunk_linear_attn
    delta      lcsm.ops.delta.eos_delta chunk vs fla delta_rule_chunkwise
    sdpa       eos chunk (row decay) vs causal scaled_dot_product_attention at T and T_long
    scaling    time per token of eos chunk (row decay) from T = 1K to 64K
    memory     peak memory of the custom backward vs autograd through the chunk form, measured
               in fresh subprocesses (peak resident set size above the pre-run baseline)
    mamba      H=1, K=16, D=256 with a full data-dependent K x D decay vs a per-step Python loop; the
               decay as LogProduct(dt, A) (formed block by block) vs dt * A formed first, for the
               operator and for a whole Mamba layer at a training batch (B=64, T=256, d_model=128)
               and at MetaLA's hard MQAR batch (B=256, T=512)
    outer      LCSM code 1's separable decay a_t (x) b_t (H=1, K=64, D=128): the matmul kernel on the
               pair vs the elementwise kernel on the materialised K x D sum, T = 256 and 2048
    decay      LCSM codes 6-9's full decay logsigmoid(a * b) / tau (B=64, T=256, K=64, D=128):
               lcsm.ops.decay.log_sigmoid_product vs the same as plain tensor expressions, alone
               and inside a whole 1-8-1-0 layer
    kxd        LCSM's K x D codes at a training batch (B=64, T=64, H=1, K=64, D=128), where the
               elementwise kernel serves: a K x D e with the separable decay (code 0-1-1-0), a
               time-invariant K x D decay (1-0-1-0) and a per-step one (1-9-1-0), against code
               1-1-1-0 (vector e and s, the matmul kernel)
    rotating   a rotation exp(i theta) per head and key (LRPE-shaped, H=4, K=D=64, T=2048), alone and
               with a GLA-like row decay: eos chunk on the complex system vs eos_rotating (real
               kernels in the rotating frame)
    fft        a time-invariant system shaped like S4D (H heads of K complex modes, D=1, real input,
               real part kept): eos fft against eos chunk on the same system
    gflops     achieved matmul GFLOP/s of the chunk kernel vs the machine's matmul throughput
    limit      the chunk kernel (none, scalar, row, column decay) against the batched C x K @ K x D
               matmul it is made of (the two in turn, paired by round) and against causal SDPA at T
               and T_long, under each host allocator (retain, system), each in a fresh worker
               process of its own
    parity     the limit case's system / retain time ratio of the chunk cases, paired within one
               fresh process: rounds that time each case under both host-memory states in turn
               (the order alternating), with the 95% interval of the ratio over the rounds

Shape glossary: B batch, T time, H heads, K expand width (keys), D input width (values),
C chunk size. Inputs of eos are in its public layout [B, T, H, *]; each peer gets its own native
layout (built before timing, so layout changes inside an operator are part of its time).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from bench._common import Check, provenance_header, run_allocator_worker, run_memory_worker, write_out
from bench._common import proc_status_kib as _proc_status_kib
from lcsm import layers
from lcsm.engine.host_memory import (
    _INT_MAX,
    HOST_ALLOCATORS,
    M_MMAP_MAX,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    RETAIN,
    mallopt,
    use_host_allocator,
)
from lcsm.engine.stats import ratio_interval
from lcsm.layers import lcsm as lcsm_module
from lcsm.layers import mamba
from lcsm.layers.lcsm import LCSMFamily
from lcsm.ops import LogProduct, eos, eos_rotating
from lcsm.ops._host_heap import _BLOCK as _PRIMED_BLOCK
from lcsm.ops._inputs import canonicalize
from lcsm.ops.chunk import eos_chunk
from lcsm.ops.decay import log_sigmoid_product, log_sigmoid_product_reference
from lcsm.ops.native_scan import native_unavailable
from lcsm.testing import RTOL, rel_rms

Tensor = torch.Tensor

CASES = (
    "matmul",
    "row_decay",
    "no_decay",
    "delta",
    "sdpa",
    "scaling",
    "memory",
    "mamba",
    "outer",
    "decay",
    "kxd",
    "rotating",
    "fft",
    "gflops",
    "limit",
    "parity",
)
# Scale of logsigmoid(x) in the log decays. "gla": GLA's normaliser 1/16 (a chunk of 64 decays
# by ~e^-3, kept in lcsm's one-matmul-per-chunk path); "strong": unscaled (~e^-0.8 per step),
# which sends a row decay through lcsm's sub-chunked path; the memory case measures both.
GATES = {"gla": 1 / 16, "strong": 1.0}
FLA_MISSING = "fla-core not installed"
# The decays the matmul kernel takes with vector e and s, as the ``limit`` case times them.
LIMIT_DECAYS = ("none", "scalar", "row", "col")
# Timed runs of the batched matmul reference (each well under a millisecond at the full sizes).
BMM_REPEATS = 50
# "As fast without the trainer's mallopt as with it": a ratio of medians taken in two processes
# moves by a few percent between reruns on a quiet machine, so "as fast" is read as within this.
ALLOCATOR_NOISE = 0.05
# glibc's default M_MMAP_MAX (``malloc_state``)
_DEFAULT_MMAP_MAX = 65536
FLA_HINT = "install the peers with pip install -e '.[bench]'"


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one benchmark configuration (see the module glossary)."""

    B: int
    H: int
    T: int
    K: int
    D: int
    C: int
    T_long: int  # the second SDPA comparison point
    scaling: tuple[int, ...]  # sequence lengths of the time-per-token sweep
    memory: tuple[int, ...]  # sequence lengths of the peak-memory sweep
    mamba_K: int
    mamba_D: int
    mamba_T: int
    mamba_layer: tuple[tuple[int, int, int], ...]  # (B, T, d_model) of each Mamba layer comparison
    outer_K: int
    outer_D: int
    outer_T: tuple[int, ...]  # sequence lengths of the separable-decay comparison
    kxd: tuple[int, int, int, int]  # B, T, K, D of the K x D codes' comparison
    decay: tuple[int, int, int, int]  # B, T, K, D of codes 6-9's decay formation
    fft: tuple[int, int, int]  # H, K, T of the time-invariant (S4D-shaped) comparison
    matmul_n: int
    repeats: int
    warmup: int
    parity_rounds: int  # rounds of the parity case (each times every chunk case under both states)
    limit_rounds: int  # rounds of the limit case's shares (each times every chunk case and the batched matmul)


FULL = Sizes(
    B=1,
    H=4,
    T=2048,
    K=64,
    D=64,
    C=64,
    T_long=16384,
    scaling=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
    memory=(2048, 8192, 32768),
    mamba_K=16,
    mamba_D=256,
    mamba_T=2048,
    mamba_layer=((64, 256, 128), (256, 512, 128)),
    outer_K=64,
    outer_D=128,
    outer_T=(256, 2048),
    kxd=(64, 64, 64, 128),
    decay=(64, 256, 64, 128),
    fft=(128, 32, 1024),
    matmul_n=2048,
    repeats=5,
    warmup=1,
    # an equivalence check needs an interval narrower than its margin (5%): over 6 rounds the
    # intervals spanned +-6-8% on the 2-core machines (bench/results/ops.md at d85cbd8 and 2174b30)
    parity_rounds=16,
    # a share's kernel and matmul timed in turn, paired by round: timed once each, seconds apart, the
    # machine's drift entered the share (the row decay's 0.43 and 0.61 in one run's two workers at
    # d65be1a, 2026-12-06)
    limit_rounds=8,
)
# T must stay a multiple of 64: fla's naive_chunk_linear_attn hard-codes chunks of 64.
QUICK = Sizes(
    B=1,
    H=2,
    T=128,
    K=16,
    D=16,
    C=32,
    T_long=256,
    scaling=(128, 256),
    memory=(256, 1024),
    mamba_K=4,
    mamba_D=16,
    mamba_T=128,
    mamba_layer=((4, 16, 8),),
    outer_K=8,
    outer_D=16,
    outer_T=(64, 128),
    kxd=(4, 16, 8, 16),
    decay=(4, 16, 8, 16),
    fft=(4, 4, 128),
    matmul_n=256,
    repeats=2,
    warmup=1,
    parity_rounds=2,
    limit_rounds=2,
)


# ----------------------------------------------------------------------------- records


@dataclass
class Timing:
    key: str
    label: str
    shape: str
    tokens: int
    times: list[float]
    faults: int = 0  # minor page faults over the timed runs: fresh pages the OS had to map
    sys_s: float = 0.0  # system (kernel) CPU seconds over the timed runs, all threads
    cpu_s: float = 0.0  # user + system CPU seconds over the timed runs, all threads

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass
class Report:
    timings: dict[str, Timing] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    info: list[tuple[str, str]] = field(default_factory=list)  # (what, value) rows without target
    memory: list[dict] = field(default_factory=list)
    limit: list[dict] = field(default_factory=list)  # rows of the matmul-limit table (case_limit)
    throughput: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaf(x: Tensor) -> Tensor:
    return x.detach().contiguous().requires_grad_()


def patched_layer(
    make_layer: Callable[[], torch.nn.Module], x_shape: tuple[int, ...], module, name: str, replacement, seed: int
):
    """A ``build`` for ``Runner.time``: a layer's forward on a random input with ``module.name``
    replaced (a fast piece by its plain twin, or the piece itself), the input and the layer's
    parameters as the leaves."""

    def make():
        torch.manual_seed(seed)
        layer = make_layer()
        x = _leaf(torch.randn(*x_shape, generator=_gen(seed + 1)))

        def run():
            with mock.patch.object(module, name, replacement):
                return layer(x)

        return run, [x, *layer.parameters()]

    return make


def gla_inputs(z: Sizes, T: int, decay: str, seed: int = 0, gates: str = "gla") -> dict[str, Tensor | None]:
    """EOS inputs in the public layout: i [B,T,H,D], e (keys) and s (queries) [B,T,H,K], log_o
    [B,T,H,K,1] ('row'), [B,T,H,1,D] ('col'), [B,T,H,1,1] ('scalar') or None ('none'). Gates (see
    GATES) are logsigmoid(x) / 16 as in GLA by default, so cumulative decays stay far from float32
    denormals."""
    g = _gen(seed)
    B, H, K, D = z.B, z.H, z.K, z.D
    out = {
        "i": torch.randn(B, T, H, D, generator=g),
        "e": torch.randn(B, T, H, K, generator=g) / math.sqrt(K),
        "s": torch.randn(B, T, H, K, generator=g) / math.sqrt(K),
        "log_o": None,
    }
    if decay != "none":
        tail = {"row": (K, 1), "col": (1, D), "scalar": (1, 1)}[decay]
        out["log_o"] = F.logsigmoid(torch.randn(B, T, H, *tail, generator=g)) * GATES[gates]
    return {k: (_leaf(v) if v is not None else None) for k, v in out.items()}


def _leaves(d: dict[str, Tensor | None]) -> list[Tensor]:
    return [v for v in d.values() if v is not None]


def time_fwd_bwd(
    fn: Callable[[], Tensor], leaves: Sequence[Tensor], repeats: int, warmup: int
) -> tuple[list[float], dict[str, float]]:
    """Wall-clock seconds of forward + backward, one entry per timed run (warm-up runs dropped),
    and this process's resource use summed over the timed runs (``faults``, ``sys_s``, ``cpu_s``).
    The first (warm-up) run also checks that the output and every gradient are finite."""
    cot = None
    times = []
    usage = {"faults": 0, "sys_s": 0.0, "cpu_s": 0.0}
    for r in range(warmup + repeats):
        for x in leaves:
            x.grad = None
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        y = fn()
        if cot is None:
            cot = torch.randn(y.shape, generator=_gen(1), dtype=y.dtype)
        y.backward(cot)
        elapsed = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        if r == 0:
            bad = [
                n
                for n, x in [("output", y)] + [(f"grad {j}", x.grad) for j, x in enumerate(leaves)]
                if x is None or not torch.isfinite(x).all()
            ]
            if bad:
                raise FloatingPointError(f"non-finite or missing {', '.join(bad)}")
        if r >= warmup:
            times.append(elapsed)
            usage["faults"] += after.ru_minflt - before.ru_minflt
            usage["sys_s"] += after.ru_stime - before.ru_stime
            usage["cpu_s"] += after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return times, usage


def _fla():
    """fla's pure-PyTorch reference functions, or the reason they cannot be imported."""
    try:
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.linear_attn.naive import naive_chunk_linear_attn
        from fla.ops.simple_gla.naive import naive_chunk_simple_gla
    except ImportError as exc:
        return None, FLA_MISSING, f"{FLA_MISSING} ({exc}); {FLA_HINT}"
    return (
        {
            "naive_chunk_simple_gla": naive_chunk_simple_gla,
            "naive_recurrent_gla": naive_recurrent_gla,
            "naive_chunk_linear_attn": naive_chunk_linear_attn,
            "delta_rule_chunkwise": delta_rule_chunkwise,
        },
        "",
        "",
    )


def _eos_delta():
    try:
        from lcsm.ops.delta import eos_delta
    except ImportError as exc:
        return None, "lcsm eos_delta not available", f"lcsm.ops.delta.eos_delta not available: {exc}"
    return eos_delta, "", ""


# ----------------------------------------------------------------------------- the harness


class Bench:
    def __init__(self, sizes: Sizes, threads: int, log: Callable[[str], None]):
        self.z = sizes
        self.threads = threads
        self.log = log
        self.r = Report()
        self._fla_cache = None
        self._delta_cache = None

    def fla(self):
        if self._fla_cache is None:
            self.log("importing fla-core (slow: it imports triton)")
            fns, short, long = _fla()
            self._fla_cache = (fns, short)
            if fns is None:
                self.r.notes.append(long)
        return self._fla_cache

    def eos_delta(self):
        if self._delta_cache is None:
            fn, short, long = _eos_delta()
            self._delta_cache = (fn, short)
            if fn is None:
                self.r.notes.append(long)
        return self._delta_cache

    def time(
        self,
        key: str,
        label: str,
        shape: str,
        tokens: int,
        build: Callable[[], tuple[Callable[[], Tensor], list[Tensor]]],
    ) -> Timing | None:
        """Time ``build()``'s (fn, leaves) once per key; a failure becomes a note, not a crash."""
        if key in self.r.timings:
            return self.r.timings[key]
        self.log(f"timing {label} [{shape}]")
        fn, leaves = build()
        try:
            times, usage = time_fwd_bwd(fn, leaves, self.z.repeats, self.z.warmup)
        except (FloatingPointError, RuntimeError) as exc:
            self.r.notes.append(f"{label} [{shape}] failed: {type(exc).__name__}: {exc}")
            self.log(f"  failed: {exc}")
            return None
        t = Timing(key, label, shape, tokens, times, **usage)
        self.r.timings[key] = t
        self.log(f"  median {t.median * 1e3:.2f} ms over {len(times)} runs")
        return t

    def ratio_check(
        self, name: str, num: Timing | None, den: Timing | None, op: str, target: float, skip_note: str = ""
    ):
        measured = num.median / den.median if (num is not None and den is not None) else None
        self.r.checks.append(Check(name, measured, op, target, skip_note if measured is None else ""))

    def agreement(self, what: str, mine: Callable[[], Tensor], peer: Callable[[], Tensor]):
        """Record whether a peer computes the same function as lcsm (one forward each on the same
        values), so that the timing ratios compare like with like."""
        with torch.no_grad():
            err = rel_rms(mine(), peer())
        verdict = "agrees" if err <= RTOL[torch.float32] else "DISAGREES"
        self.r.notes.append(
            f"{what}: {verdict} with lcsm (relative RMS {err:.1e}, float32 tolerance {RTOL[torch.float32]:.0e})"
        )

    # ---- shared measurements

    def eos_chunk_time(self, decay: str, T: int) -> Timing | None:
        z = self.z
        name = {
            "row": "row decay [B,T,H,K,1]",
            "col": "column decay [B,T,H,1,D]",
            "scalar": "scalar decay [B,T,H,1,1]",
            "none": "no decay",
        }[decay]

        def build():
            x = gla_inputs(z, T, decay)
            return (lambda: eos(x["i"], x["e"], x["s"], x["log_o"], mode="chunk", chunk_size=z.C)[0]), _leaves(x)

        return self.time(f"eos_{decay}@{T}", f"lcsm eos chunk, {name}", self.shape(T), z.B * T, build)

    def shape(self, T: int, D: int | None = None) -> str:
        z = self.z
        return f"B={z.B} T={T} H={z.H} K={z.K} D={D or z.D}"

    # ---- cases

    def case_matmul(self):
        n = self.z.matmul_n
        if "matmul" in self.r.timings:
            return self.r.timings["matmul"]
        self.log(f"timing fp32 matmul {n} x {n}")
        g = _gen(2)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        times = []
        for r in range(self.z.warmup + max(self.z.repeats, 3)):
            t0 = time.perf_counter()
            torch.mm(a, b)
            if r >= self.z.warmup:
                times.append(time.perf_counter() - t0)
        t = Timing("matmul", "torch.mm fp32 (forward only)", f"{n} x {n} @ {n} x {n}", 0, times)
        self.r.timings["matmul"] = t
        self.r.info.append(("fp32 matmul throughput (peak reference)", f"{2 * n**3 / t.median / 1e9:.1f} GFLOP/s"))
        return t

    def case_row_decay(self):
        z, T = self.z, self.z.T
        row = self.eos_chunk_time("row", T)
        self.eos_chunk_time("scalar", T)
        fla, why = self.fla()
        simple = recurrent = None
        if fla is not None:

            def build_simple():
                x = gla_inputs(z, T, "scalar")
                q, k, v = _leaf(x["s"]), _leaf(x["e"]), _leaf(x["i"])
                gate = _leaf(x["log_o"][..., 0, 0])  # [B, T, H]
                return (lambda: fla["naive_chunk_simple_gla"](q, k, v, gate, chunk_size=z.C)[0]), [q, k, v, gate]

            def build_recurrent():
                x = gla_inputs(z, T, "row")
                q, k, v = _leaf(x["s"]), _leaf(x["e"]), _leaf(x["i"])
                gk = _leaf(x["log_o"][..., 0])  # [B, T, H, K]
                return (lambda: fla["naive_recurrent_gla"](q, k, v, gk)[0]), [q, k, v, gk]

            simple = self.time(
                f"fla_simple_gla@{T}", "fla naive_chunk_simple_gla (scalar decay)", self.shape(T), z.B * T, build_simple
            )
            recurrent = self.time(
                f"fla_recurrent_gla@{T}",
                "fla naive_recurrent_gla (row decay, loop)",
                self.shape(T),
                z.B * T,
                build_recurrent,
            )
            Ts = min(T, 256)
            x, xr = gla_inputs(z, Ts, "scalar"), gla_inputs(z, Ts, "row")
            scale = z.K**-0.5  # fla scales q by K^-1/2 inside
            self.agreement(
                "fla naive_chunk_simple_gla",
                lambda: eos(x["i"], x["e"], x["s"] * scale, x["log_o"], mode="chunk", chunk_size=z.C)[0],
                lambda: fla["naive_chunk_simple_gla"](x["s"], x["e"], x["i"], x["log_o"][..., 0, 0], chunk_size=z.C)[0],
            )
            self.agreement(
                "fla naive_recurrent_gla",
                lambda: eos(xr["i"], xr["e"], xr["s"] * scale, xr["log_o"], mode="chunk", chunk_size=z.C)[0],
                lambda: fla["naive_recurrent_gla"](xr["s"], xr["e"], xr["i"], xr["log_o"][..., 0])[0],
            )
        self.ratio_check(f"row-decay chunk / fla naive_chunk_simple_gla, T={T}", row, simple, "<=", 1.0, why)
        self.ratio_check(
            f"fla naive_recurrent_gla / row-decay chunk (speed-up), T={T}", recurrent, row, ">=", 30.0, why
        )

    def case_no_decay(self):
        z, T = self.z, self.z.T
        mine = self.eos_chunk_time("none", T)
        fla, why = self.fla()
        peer = None
        if fla is not None:

            def build():
                x = gla_inputs(z, T, "none")
                q, k, v = _leaf(x["s"]), _leaf(x["e"]), _leaf(x["i"])
                return (lambda: fla["naive_chunk_linear_attn"](q, k, v)), [q, k, v]

            peer = self.time(
                f"fla_linear_attn@{T}", "fla naive_chunk_linear_attn (chunk 64)", self.shape(T), z.B * T, build
            )
            x = gla_inputs(z, min(T, 256), "none")
            self.agreement(
                "fla naive_chunk_linear_attn",
                lambda: eos(x["i"], x["e"], x["s"] * z.K**-0.5, None, mode="chunk", chunk_size=z.C)[0],
                lambda: fla["naive_chunk_linear_attn"](x["s"], x["e"], x["i"]),
            )
        self.ratio_check(f"no-decay chunk / fla naive_chunk_linear_attn, T={T}", mine, peer, "<=", 1.0, why)

    def delta_inputs(self, T: int):
        """DeltaNet inputs: L2-normalised keys k, queries q [B,T,H,K], values v [B,T,H,D], beta in (0,1)."""
        z, g = self.z, _gen(3)
        k = F.normalize(torch.randn(z.B, T, z.H, z.K, generator=g), dim=-1)
        q = torch.randn(z.B, T, z.H, z.K, generator=g) / math.sqrt(z.K)
        v = torch.randn(z.B, T, z.H, z.D, generator=g)
        beta = torch.sigmoid(torch.randn(z.B, T, z.H, generator=g))
        return q, k, v, beta

    def case_delta(self):
        z, T = self.z, self.z.T
        eos_delta, why_mine = self.eos_delta()
        mine = peer = None
        if eos_delta is not None:

            def build_mine():
                q, k, v, beta = (_leaf(x) for x in self.delta_inputs(T))

                def fn():
                    bk = beta.unsqueeze(-1) * k  # DeltaNet: e = a = beta k, b = k
                    return eos_delta(v, bk, q, bk, k, mode="chunk", chunk_size=z.C)[0]

                return fn, [q, k, v, beta]

            mine = self.time(f"eos_delta@{T}", f"lcsm eos_delta chunk (C={z.C})", self.shape(T), z.B * T, build_mine)
        fla, why_fla = self.fla()
        if fla is not None:

            def build_peer():
                q, k, v, beta = (_leaf(x.transpose(1, 2)) for x in self.delta_inputs(T))  # head-major
                return (lambda: fla["delta_rule_chunkwise"](q, k, v, beta)[0]), [q, k, v, beta]

            peer = self.time(
                f"fla_delta@{T}", "fla delta_rule_chunkwise (chunk 32)", self.shape(T), z.B * T, build_peer
            )
        if eos_delta is not None and fla is not None:
            q, k, v, beta = self.delta_inputs(min(T, 256))
            bk = beta.unsqueeze(-1) * k
            self.agreement(
                "fla delta_rule_chunkwise",
                lambda: eos_delta(v, bk, q * z.K**-0.5, bk, k, mode="chunk", chunk_size=z.C)[0],
                lambda: fla["delta_rule_chunkwise"](*(t.transpose(1, 2) for t in (q, k, v, beta)))[0].transpose(1, 2),
            )
        self.ratio_check(
            f"delta chunk / fla delta_rule_chunkwise, T={T}",
            mine,
            peer,
            "<=",
            1.0,
            "; ".join(w for w in (why_mine, why_fla) if w),
        )

    def sdpa_time(self, T: int) -> Timing | None:
        z = self.z

        def build():
            g = _gen(4)
            q, k, v = (_leaf(torch.randn(z.B, z.H, T, z.K, generator=g)) for _ in range(3))
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v]

        return self.time(f"sdpa@{T}", "causal scaled_dot_product_attention", self.shape(T, D=z.K), z.B * T, build)

    def case_sdpa(self):
        for T, target in ((self.z.T, 0.6), (self.z.T_long, 0.2)):
            row = self.eos_chunk_time("row", T)
            attn = self.sdpa_time(T)
            self.ratio_check(f"row-decay chunk / causal SDPA, T={T}", row, attn, "<=", target)

    def case_scaling(self):
        Ts = self.z.scaling
        per_token = {}
        for T in Ts:
            t = self.eos_chunk_time("row", T)
            if t is not None:
                per_token[T] = t.median / (self.z.B * T)
        first, last = Ts[0], Ts[-1]
        measured = per_token[last] / per_token[first] if first in per_token and last in per_token else None
        self.r.checks.append(
            Check(
                f"time per token growth, row-decay chunk, T={first} -> {last}",
                measured,
                "<=",
                1.3,
                "" if measured is not None else "a run failed",
            )
        )

    def case_memory(self):
        z = self.z
        custom = self.eos_chunk_time("row", z.T)

        def build_autograd():
            x = gla_inputs(z, z.T, "row")

            def p():
                return canonicalize(x["i"], x["e"], x["s"], x["log_o"])

            return (lambda: eos_chunk(p(), z.C, backward="autograd")[0]), _leaves(x)

        autograd = self.time(
            f"eos_row_autograd@{z.T}",
            "lcsm chunk, row decay, autograd backward (y head-major)",
            self.shape(z.T),
            z.B * z.T,
            build_autograd,
        )
        if custom is not None and autograd is not None:
            self.r.info.append(
                (f"time of custom / autograd backward (row decay), T={z.T}", f"{custom.median / autograd.median:.3f}x")
            )
        modes = ("custom", "autograd")
        self.log(
            f"peak memory at T = {', '.join(map(str, z.memory))}, gates {' and '.join(GATES)}: "
            "one fresh subprocess per backward, both at once"
        )
        # Peak RSS is per process, so the two concurrent workers do not disturb each other's numbers.
        with ThreadPoolExecutor(max_workers=len(modes)) as pool:
            peaks = dict(
                zip(modes, pool.map(lambda m: peak_memory_subprocess(z, m, self.threads), modes), strict=False)
            )
        cells = [(gates, T) for gates in GATES for T in z.memory]
        rows = [
            {"gates": gates, "T": T, **{m: (peaks[m][j] if isinstance(peaks[m], list) else peaks[m]) for m in modes}}
            for j, (gates, T) in enumerate(cells)
        ]
        for row in rows:
            self.log(
                f"  gates {row['gates']}, T={row['T']}: "
                + ", ".join(
                    f"{m} " + (f"{row[m] / 2**20:.1f} MiB" if isinstance(row[m], int) else row[m]) for m in modes
                )
            )
        self.r.memory = rows
        for m in modes:
            if isinstance(peaks[m], str):
                self.r.notes.append(f"peak memory, backward={m}: {peaks[m]}")
        for r in rows:
            ratio, why = memory_ratio(r)
            self.r.checks.append(
                Check(f"peak memory custom / autograd backward, {r['gates']} gates, T={r['T']}", ratio, "<=", 1.0, why)
            )
        for mode in modes:
            good = [
                r
                for r in rows
                if r["gates"] == "gla" and isinstance(r[mode], int) and r[mode] >= MEMORY_RESOLUTION_BYTES
            ]
            if len(good) >= 2:
                lo, hi = good[0], good[-1]
                growth = (hi[mode] / hi["T"]) / (lo[mode] / lo["T"])
                self.r.checks.append(
                    Check(
                        f"peak memory per token growth ({mode} backward), gla gates, T={lo['T']} -> {hi['T']}",
                        growth,
                        "<=",
                        1.3,
                    )
                )

    def case_mamba(self):
        z = self.z
        T, K, D = z.mamba_T, z.mamba_K, z.mamba_D
        shape = f"B={z.B} T={T} H=1 K={K} D={D}, log_o [B,T,H,K,D]"

        def inputs():
            g = _gen(5)
            A = -torch.arange(1, K + 1, dtype=torch.float32)[:, None].expand(K, D)  # S4D-real A = -(1..K)
            dt = F.softplus(torch.randn(z.B, T, 1, 1, D, generator=g) - 4)  # Mamba's dt, ~0.02
            return {
                "i": _leaf(torch.randn(z.B, T, 1, D, generator=g)),
                "e": _leaf(torch.randn(z.B, T, 1, K, generator=g)),
                "s": _leaf(torch.randn(z.B, T, 1, K, generator=g)),
                "log_o": _leaf(dt * A),
                "dt": _leaf(dt),
                "A": _leaf(A.unsqueeze(0).contiguous()),
            }

        def build(log_o, mode="chunk"):
            def make():
                x = inputs()
                names = ("i", "e", "s", "log_o") if log_o is None else ("i", "e", "s", "dt", "A")
                decay = (lambda: x["log_o"]) if log_o is None else (lambda: log_o(x["dt"], x["A"]))
                return (lambda: eos(x["i"], x["e"], x["s"], decay(), mode=mode, chunk_size=z.C)[0]), [
                    x[n] for n in names
                ]

            return make

        def build_loop():
            x = inputs()
            return (lambda: python_loop(x["i"], x["e"], x["s"], x["log_o"])), [x[n] for n in ("i", "e", "s", "log_o")]

        chunk = self.time(
            f"mamba_chunk@{T}", "lcsm eos chunk, full K x D decay (elementwise kernel)", shape, z.B * T, build(None)
        )
        loop = self.time(f"mamba_loop@{T}", "per-step Python loop (unbind / stack)", shape, z.B * T, build_loop)
        x = inputs()
        self.agreement(
            "per-step Python loop",
            lambda: eos(x["i"], x["e"], x["s"], x["log_o"], mode="chunk", chunk_size=z.C)[0],
            lambda: python_loop(x["i"], x["e"], x["s"], x["log_o"]),
        )
        if chunk is not None and loop is not None:
            self.r.info.append((f"Mamba-shaped: chunk / per-step loop, T={T}", f"{chunk.median / loop.median:.3f}x"))

        # The decay Delta_t A given as its operands, formed block by block in the kernel, against
        # the product formed first (both timed with the product's backward to dt and A).
        product = self.time(
            f"mamba_product@{T}", "lcsm eos chunk, log_o = LogProduct(dt, A)", shape, z.B * T, build(LogProduct)
        )
        formed = self.time(
            f"mamba_formed@{T}",
            "lcsm eos chunk, log_o = dt * A formed first",
            shape,
            z.B * T,
            build(lambda dt, A: dt * A),
        )

        def with_decay(log_o):
            return eos(x["i"], x["e"], x["s"], log_o, mode="chunk", chunk_size=z.C)[0]

        self.agreement(
            "the decay dt * A formed first",
            lambda: with_decay(LogProduct(x["dt"], x["A"])),
            lambda: with_decay(x["dt"] * x["A"]),
        )
        if product is not None and formed is not None:
            self.r.info.append(
                (
                    f"Mamba-shaped: dt * A formed / LogProduct (speed-up), T={T}",
                    f"{formed.median / product.median:.2f}x",
                )
            )

        # The same product in the C kernel (mode "native", what auto takes on the CPU), where it builds.
        why = native_unavailable()
        if why is not None:
            self.r.notes.append(f"lcsm eos native: not timed ({why})")
        else:
            native = self.time(
                f"mamba_native@{T}",
                "lcsm eos native (C kernel), log_o = LogProduct(dt, A)",
                shape,
                z.B * T,
                build(LogProduct, mode="native"),
            )
            self.agreement(
                "the native scan (C kernel)",
                lambda: eos(x["i"], x["e"], x["s"], LogProduct(x["dt"], x["A"]), mode="native")[0],
                lambda: with_decay(LogProduct(x["dt"], x["A"])),
            )
            if product is not None and native is not None:
                self.r.info.append(
                    (
                        f"Mamba-shaped: chunk / native with LogProduct (speed-up), T={T}",
                        f"{product.median / native.median:.2f}x",
                    )
                )

        # What a training step sees: a whole Mamba layer at a training batch, and at MetaLA's hard
        # MQAR batch (256 x 512 tokens), where the formed decays are 2 GiB a tensor.
        for B, T, d_model in z.mamba_layer:

            def build_layer(log_product, B=B, T=T, d_model=d_model):
                return patched_layer(
                    lambda: layers.build("mamba", d_model), (B, T, d_model), mamba, "LogProduct", log_product, seed=5
                )

            layer_shape = f"B={B} T={T} d_model={d_model} K=16 D={2 * d_model}"
            product = self.time(
                f"mamba_layer_product@{B}x{T}",
                "Mamba layer, log_o = LogProduct(Delta, A)",
                layer_shape,
                B * T,
                build_layer(LogProduct),
            )
            formed = self.time(
                f"mamba_layer_formed@{B}x{T}",
                "Mamba layer, log_o = Delta * A formed first",
                layer_shape,
                B * T,
                build_layer(lambda delta, A: delta * A),
            )
            if product is not None and formed is not None:
                self.r.info.append(
                    (
                        f"Mamba layer: Delta * A formed / LogProduct (speed-up), {layer_shape}",
                        f"{formed.median / product.median:.2f}x",
                    )
                )

    def case_outer(self):
        """LCSM o code 1, o_t = a_t (x) b_t with both factors logsigmoid(.) / 16 as the layer builds
        them: the same problem through the matmul kernel (the pair) and through the elementwise
        kernel (the materialised [B,T,H,K,D] sum, what the layer passed before). Both sums are
        formed inside the timed function, so both backwards reach the two factors. Then the pair
        with LCSM's tau 1 (logsigmoid(.) unscaled) on logits of standard deviation 2, about
        -1.4 per step, which sends the chunks through the sub-chunked path at every level."""
        z = self.z
        K, D = z.outer_K, z.outer_D

        def inputs(T, scale=GATES["gla"], spread=1.0):
            g = _gen(6)
            return {
                "i": _leaf(torch.randn(z.B, T, 1, D, generator=g)),
                "e": _leaf(torch.randn(z.B, T, 1, K, generator=g) / math.sqrt(K)),
                "s": _leaf(torch.randn(z.B, T, 1, K, generator=g) / math.sqrt(K)),
                "log_row": _leaf(F.logsigmoid(spread * torch.randn(z.B, T, 1, K, 1, generator=g)) * scale),
                "log_col": _leaf(F.logsigmoid(spread * torch.randn(z.B, T, 1, 1, D, generator=g)) * scale),
            }

        def pair(x):
            return eos(x["i"], x["e"], x["s"], (x["log_row"], x["log_col"]), mode="chunk", chunk_size=z.C)[0]

        def summed(x):
            return eos(x["i"], x["e"], x["s"], x["log_row"] + x["log_col"], mode="chunk", chunk_size=z.C)[0]

        for T in z.outer_T:
            shape = f"B={z.B} T={T} H=1 K={K} D={D}"

            def build(fn, T=T, **gates):
                def make():
                    x = inputs(T, **gates)
                    return (lambda: fn(x)), _leaves(x)

                return make

            fast = self.time(
                f"outer_matmul@{T}", "lcsm eos chunk, separable decay pair (matmul kernel)", shape, z.B * T, build(pair)
            )
            slow = self.time(
                f"outer_elementwise@{T}",
                "lcsm eos chunk, the same decay as a K x D sum (elementwise kernel)",
                shape,
                z.B * T,
                build(summed),
            )
            strong = self.time(
                f"outer_matmul_strong@{T}",
                "lcsm eos chunk, separable decay pair, tau 1 gates on logits of std 2 (sub-chunked)",
                shape,
                z.B * T,
                build(pair, scale=GATES["strong"], spread=2.0),
            )
            if fast is not None and slow is not None:
                self.r.info.append(
                    (
                        f"separable decay (LCSM code 1): elementwise / matmul kernel (speed-up), T={T}",
                        f"{slow.median / fast.median:.2f}x",
                    )
                )
            if fast is not None and strong is not None:
                self.r.info.append(
                    (
                        f"separable decay (LCSM code 1): tau-1 gates / GLA gates (sub-chunking's cost), T={T}",
                        f"{strong.median / fast.median:.2f}x",
                    )
                )
        x = inputs(min(z.outer_T))
        self.agreement("separable decay, elementwise kernel on the K x D sum", lambda: pair(x), lambda: summed(x))

    def case_decay(self):
        """LCSM o codes 6-9 build their [B, T, K, D] log decay as logsigmoid(a * b) / tau from a
        data-dependent vector and a learned factor (the layer's shapes, tau 16, at the LCSM MQAR
        cell of 256 tokens, d 128): the fused, cache-blocked op against the plain expressions."""
        z = self.z
        B, T, K, D = z.decay
        shape = f"B={B} T={T} K={K} D={D}"
        factors = {
            6: ((B, T, K, 1), (K, D)),
            7: ((B, T, 1, D), (K, D)),
            8: ((K, 1), (B, T, 1, D)),
            9: ((B, T, K, 1), (D,)),
        }

        def inputs(code):
            # the data-dependent factor [B, T, ...] is a projection's output; the learned one is
            # initialised randn * 0.1 as in the layer
            g = _gen(8)
            return [_leaf(torch.randn(*sh, generator=g) * (1.0 if len(sh) == 4 else 0.1)) for sh in factors[code]]

        def build(code, fn):
            def make():
                a, b = inputs(code)
                return (lambda: fn(a, b, 16.0)), [a, b]

            return make

        for code in factors:
            fused = self.time(
                f"decay_fused_{code}",
                f"LCSM code 1-{code}-1-0 decay, lcsm.ops.decay.log_sigmoid_product",
                shape,
                B * T,
                build(code, log_sigmoid_product),
            )
            plain = self.time(
                f"decay_plain_{code}",
                f"LCSM code 1-{code}-1-0 decay, plain tensor expressions",
                shape,
                B * T,
                build(code, log_sigmoid_product_reference),
            )
            if fused is not None and plain is not None:
                self.r.info.append(
                    (
                        f"LCSM code 1-{code}-1-0 decay: plain / fused (speed-up), {shape}",
                        f"{plain.median / fused.median:.2f}x",
                    )
                )
        a, b = inputs(8)
        self.agreement(
            "code 8's decay as plain tensor expressions",
            lambda: log_sigmoid_product(a, b, 16.0),
            lambda: log_sigmoid_product_reference(a, b, 16.0),
        )

        # What a training step sees: the whole layer (projections, decay, elementwise kernel, norm)
        def build_layer(fn):
            return patched_layer(
                lambda: LCSMFamily(D, code="1-8-1-0", expand=K),
                (B, T, D),
                lcsm_module,
                "log_sigmoid_product",
                fn,
                seed=8,
            )

        layer_shape = f"B={B} T={T} d_model={D} K={K}"
        fused = self.time(
            "decay_layer_fused", "LCSM 1-8-1-0 layer, fused decay", layer_shape, B * T, build_layer(log_sigmoid_product)
        )
        plain = self.time(
            "decay_layer_plain",
            "LCSM 1-8-1-0 layer, decay as plain tensor expressions",
            layer_shape,
            B * T,
            build_layer(log_sigmoid_product_reference),
        )
        if fused is not None and plain is not None:
            self.r.info.append(
                (
                    f"LCSM 1-8-1-0 layer: plain / fused decay (speed-up), {layer_shape}",
                    f"{plain.median / fused.median:.2f}x",
                )
            )

    def case_kxd(self):
        """LCSM's codes with a K x D state at the LCSM MQAR base's training shape (batch 64, 64
        tokens, d 128), with the layer's own gate scales (logsigmoid(.) / tau, tau 16), each against
        code 1-1-1-0: the cost of the elementwise kernel where training meets it."""
        z = self.z
        B, T, K, D = z.kxd
        shape = f"B={B} T={T} H=1 K={K} D={D}"

        def gate(*tail, g):
            return _leaf(F.logsigmoid(torch.randn(*tail, generator=g)) / 16)

        def inputs(code):
            g = _gen(7)

            def vec():
                return _leaf(torch.randn(B, T, 1, K, generator=g) / math.sqrt(K))

            def pair():
                return (gate(B, T, 1, K, 1, g=g), gate(B, T, 1, 1, D, g=g))

            x = {"i": _leaf(torch.randn(B, T, 1, D, generator=g)), "e": vec(), "s": vec()}
            if code == "0-1-1-0":
                x["e"] = _leaf(torch.randn(1, K, D, generator=g) / math.sqrt(K))
            x["log_o"] = {
                "1-1-1-0": pair,
                "0-1-1-0": pair,
                "1-0-1-0": lambda: gate(1, K, D, g=g),
                "1-9-1-0": lambda: gate(B, T, 1, K, D, g=g),
            }[code]()
            return x

        def build(code):
            def make():
                x = inputs(code)

                def run():
                    return eos(x["i"], x["e"], x["s"], x["log_o"], mode="chunk", chunk_size=z.C)[0]

                leaves = _leaves({k: v for k, v in x.items() if k != "log_o"})
                return run, leaves + list(x["log_o"] if isinstance(x["log_o"], tuple) else [x["log_o"]])

            return make

        what = {
            "1-1-1-0": "vector e and s, separable decay (matmul kernel)",
            "0-1-1-0": "K x D e, separable decay (elementwise kernel)",
            "1-0-1-0": "time-invariant K x D decay (elementwise kernel)",
            "1-9-1-0": "per-step K x D decay (elementwise kernel)",
        }
        base = self.time("kxd_1-1-1-0", f"LCSM code 1-1-1-0: {what['1-1-1-0']}", shape, B * T, build("1-1-1-0"))
        for code in ("0-1-1-0", "1-0-1-0", "1-9-1-0"):
            t = self.time(f"kxd_{code}", f"LCSM code {code}: {what[code]}", shape, B * T, build(code))
            if base is not None and t is not None:
                self.r.info.append((f"LCSM code {code} / code 1-1-1-0, {shape}", f"{t.median / base.median:.2f}x"))

    def case_rotating(self):
        """LRPE's system (theta per head and key, its init's spread over [1e-8, 1]), with no decay
        and with GLA's row decay: the complex chunk kernel against the rotating frame."""
        z, T = self.z, self.z.T

        def inputs(decay, T=T):
            x = gla_inputs(z, T, decay)
            channels = torch.arange(z.H * z.K, dtype=torch.float32)
            x["theta"] = _leaf((10000.0 ** (-2.0 * channels / (z.H * z.K))).view(z.H, z.K))
            return x

        def run(x, form):
            if form == "rotating":
                return eos_rotating(x["i"], x["e"], x["s"], x["theta"], x["log_o"], mode="chunk", chunk_size=z.C)[0]
            rotation = 1j * x["theta"][..., None]
            log_o = rotation if x["log_o"] is None else x["log_o"] + rotation
            return eos(x["i"], x["e"], x["s"], log_o, mode="chunk", chunk_size=z.C, real_output=True)[0]

        def build(decay, form):
            def make():
                x = inputs(decay)
                return (lambda: run(x, form)), _leaves(x)

            return make

        for decay, words in (("none", "rotation"), ("row", "rotation and row decay")):
            label = f"lcsm eos chunk, {words}"
            cplx = self.time(
                f"rot_complex_{decay}@{T}", f"{label}: complex kernel", self.shape(T), z.B * T, build(decay, "complex")
            )
            frame = self.time(
                f"rot_frame_{decay}@{T}",
                f"lcsm eos_rotating, {words}: rotating frame",
                self.shape(T),
                z.B * T,
                build(decay, "rotating"),
            )
            x = inputs(decay, min(T, 256))
            self.agreement(f"eos_rotating ({words})", partial(run, x, "rotating"), partial(run, x, "complex"))
            if cplx is not None and frame is not None:
                self.r.info.append(
                    (
                        f"{words}: complex kernel / rotating frame (speed-up), T={T}",
                        f"{cplx.median / frame.median:.2f}x",
                    )
                )

    def case_fft(self):
        """S4D's system (ZOH-discretised complex modes: decay e^(-0.5 dt), rotation pi n dt) through
        the two forms that serve a time-invariant system; the real part kept, as S4D does."""
        z = self.z
        H, K, T = z.fft
        shape = f"B={z.B} T={T} H={H} K={K} D=1, complex row decay, real_output"

        def inputs():
            g = _gen(8)
            dt = torch.exp(torch.rand(H, 1, 1, generator=g) * math.log(100) + math.log(1e-3))
            n = torch.arange(K, dtype=torch.float32).view(1, K, 1)

            def cplx(*shape):
                return torch.complex(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))

            return {
                "i": _leaf(torch.randn(z.B, T, H, 1, generator=g)),
                "e": _leaf(cplx(H, K) / math.sqrt(K)),
                "s": _leaf(cplx(H, K) / math.sqrt(K)),
                "log_o": _leaf(torch.complex(-0.5 * dt, math.pi * n * dt)),
            }

        def run(x, mode):
            return eos(x["i"], x["e"], x["s"], x["log_o"], mode=mode, chunk_size=z.C, real_output=True)[0]

        def build(mode):
            def make():
                x = inputs()
                return (lambda: run(x, mode)), _leaves(x)

            return make

        fft = self.time(f"fft@{T}", "lcsm eos fft (time-invariant, real FFTs)", shape, z.B * T, build("fft"))
        chunk = self.time(f"fft_chunk@{T}", "lcsm eos chunk on the same system", shape, z.B * T, build("chunk"))
        x = inputs()
        self.agreement("eos chunk on the S4D-shaped system", lambda: run(x, "fft"), lambda: run(x, "chunk"))
        if fft is not None and chunk is not None:
            self.r.info.append(
                (
                    f"S4D-shaped time-invariant system: chunk / fft (speed-up), T={T}",
                    f"{chunk.median / fft.median:.2f}x",
                )
            )

    def batched_matmul_time(self) -> Timing:
        """The products the chunk kernel is made of, alone: B·H·N (N = T / C chunks) batched
        [C, K] @ [K, D] matmuls (128 of 64 x 64 @ 64 x 64 at the full sizes), contiguous, forward
        only; the throughput the kernel's share of the limit is measured against."""
        z = self.z
        if "bmm" in self.r.timings:
            return self.r.timings["bmm"]
        batch = z.B * z.H * -(-z.T // z.C)
        self.log(f"timing batched matmul {batch} x [{z.C}, {z.K}] @ [{z.K}, {z.D}]")
        g = _gen(5)
        a, b = torch.randn(batch, z.C, z.K, generator=g), torch.randn(batch, z.K, z.D, generator=g)
        times = []
        for r in range(3 + BMM_REPEATS):
            t0 = time.perf_counter()
            torch.bmm(a, b)
            if r >= 3:
                times.append(time.perf_counter() - t0)
        t = Timing("bmm", "torch.bmm fp32 (forward only)", f"{batch} x [{z.C}, {z.K}] @ [{z.K}, {z.D}]", 0, times)
        self.r.timings["bmm"] = t
        return t

    def case_limit(self):
        """Each host allocator in a fresh worker process (``allocator_worker``): the chunk kernel at
        T for every decay the matmul kernel takes with vector e and s, the batched matmul it is
        made of (the two in turn, ``limit_rounds`` rounds), and the row-decay chunk against causal
        SDPA at T and T_long. Targets (system allocator, what a library caller's process has): the
        kernel's FLOP rate at least half the batched matmul's (paired by round) and the SDPA ratios;
        the allocators' times go to the table (the parity case compares them, paired)."""
        z = self.z
        runs, rounds = {}, {}
        for allocator in HOST_ALLOCATORS:
            self.log(f"limit: worker with the {allocator} allocator")
            out = limit_subprocess(z, allocator, self.threads)
            if isinstance(out, str):
                self.r.notes.append(f"limit, {allocator} allocator: {out}")
                continue
            runs[allocator] = {k: Timing(**v) for k, v in out["timings"].items()}
            rounds[allocator] = out["rounds"]
            self.r.notes.extend(f"limit, {allocator} allocator: {n}" for n in out["notes"])
            self.r.notes.append(f"limit, {allocator} allocator worker: {out['allocator']}")
            for key, t in runs[allocator].items():
                if t.tokens:
                    self.r.timings[f"{allocator}:{key}"] = replace(t, label=f"{t.label} ({allocator} allocator)")

        def get(allocator: str, key: str) -> Timing | None:
            return runs.get(allocator, {}).get(key)

        def share(allocator: str, decay: str) -> tuple[float, float, float] | None:
            """The kernel's FLOP rate over the batched matmul's, paired by round: (estimate, low, high)."""
            times, ref = (rounds.get(allocator, {}).get(k, []) for k in (f"eos_{decay}@{z.T}", "bmm"))
            if len(times) < 2 or len(times) != len(ref):
                return None
            scale = chunk_fwd_bwd_flops(z.B, z.H, z.T, z.K, z.D, z.C, decay != "none") / bmm_flops(z)
            est, low, high = ratio_interval(ref, times)
            return scale * est, scale * low, scale * high

        for decay in LIMIT_DECAYS:
            measured = share("system", decay)
            paired = "" if measured is None else f", paired over {z.limit_rounds} rounds: " + _interval(*measured)
            self.r.checks.append(
                Check(
                    f"{decay} decay chunk fwd+bwd / batched matmul throughput, T={z.T} (system allocator){paired}",
                    None if measured is None else measured[0],
                    ">=",
                    0.5,
                    "" if measured is not None else "a run failed",
                )
            )
        for T, target in ((z.T, 0.5), (z.T_long, 0.15)):
            self.ratio_check(
                f"row-decay chunk / causal SDPA, T={T} (system allocator)",
                get("system", f"eos_row@{T}"),
                get("system", f"sdpa@{T}"),
                "<=",
                target,
                "a run failed",
            )
        keys = [f"eos_{decay}@{z.T}" for decay in LIMIT_DECAYS] + [f"eos_row@{z.T_long}"]
        for key in keys:  # the allocators' times side by side; the parity case compares them, paired
            t = get("system", key) or get("retain", key)
            what = t.label if t is not None else key
            row = {"label": what, "shape": t.shape if t is not None else ""}
            for allocator in HOST_ALLOCATORS:
                tt = get(allocator, key)
                row[allocator] = None if tt is None else tt.median
                row[f"{allocator} faults"] = None if tt is None else tt.faults / (len(tt.times) * tt.tokens)
                decay = key.split("_")[1].split("@")[0]
                paired = share(allocator, decay) if key.endswith(f"@{z.T}") else None
                row[f"{allocator} share"] = None if paired is None else paired[0]
            self.r.limit.append(row)
        for allocator in HOST_ALLOCATORS:
            ref = get(allocator, "bmm")
            if ref is not None:
                self.r.info.append(
                    (
                        f"batched matmul throughput, {ref.shape} ({allocator} allocator)",
                        f"{bmm_flops(z) / ref.median / 1e9:.1f} GFLOP/s",
                    )
                )

    def case_parity(self):
        """``case_limit``'s allocator comparison without the spread between worker processes: one
        fresh process times every chunk case under both host-memory states, ``parity_rounds``
        times (``parity_worker``). Target, per case: the upper end of the 95% interval of the
        system / retain time ratio (``ratio_interval`` over the rounds) within ALLOCATOR_NOISE of 1."""
        z = self.z
        if platform.libc_ver()[0] != "glibc":
            self.r.notes.append("parity: needs glibc (mallopt)")
            return
        self.log(f"parity: one worker, {z.parity_rounds} rounds of both host-memory states")
        spec = {"sizes": _sizes_spec(z), "threads": self.threads, "rounds": z.parity_rounds}
        out = run_allocator_worker("bench.ops_bench", spec, timeout=1800)
        if isinstance(out, str):
            self.r.notes.append(f"parity: {out}")
            return
        for key, system in out["times"]["system"].items():
            retain = out["times"]["retain"].get(key, [])
            decay, T = key[len("eos_") :].split("@")
            what = f"{decay} decay chunk, T={T}"
            if len(system) < 2 or len(system) != len(retain):
                self.r.notes.append(f"parity, {what}: {len(system)} system and {len(retain)} retain timings")
                continue
            est, low, high = ratio_interval(system, retain)
            self.r.checks.append(
                Check(
                    f"system / retain allocator time, {what}, paired in one process over {len(system)} rounds: "
                    f"{est:.3f}x [{low:.3f}, {high:.3f}], the interval's upper end",
                    high,
                    "<=",
                    1 + ALLOCATOR_NOISE,
                )
            )
        for key, untrimmed in out["times"]["untrimmed"].items():
            retain = out["times"]["retain"].get(key, [])
            if len(untrimmed) >= 2 and len(untrimmed) == len(retain):
                est, low, high = ratio_interval(untrimmed, retain)
                self.r.info.append(
                    (
                        f"system allocator with glibc's trimming off / retain, {key[len('eos_') :].split('@')[0]} "
                        f"decay chunk, T={key.split('@')[1]}, paired in one process (what the system allocator's "
                        "cost there is made of)",
                        f"{est:.3f}x [{low:.3f}, {high:.3f}]",
                    )
                )

    def case_gflops(self):
        z = self.z
        peak_t = self.case_matmul()
        peak = 2 * z.matmul_n**3 / peak_t.median
        for decay in ("row", "none"):
            t = self.eos_chunk_time(decay, z.T)
            if t is None:
                continue
            analytic = chunk_fwd_bwd_flops(z.B, z.H, z.T, z.K, z.D, z.C, decay != "none")
            counted = counted_matmul_flops(z, decay, z.T)
            self.r.throughput.append(
                {
                    "label": t.label,
                    "shape": t.shape,
                    "ms": t.median * 1e3,
                    "analytic": analytic,
                    "counted": counted,
                    "gflops": analytic / t.median / 1e9,
                    "peak": peak / 1e9,
                }
            )


# ----------------------------------------------------------------------------- FLOP model


def chunk_fwd_bwd_flops(B: int, H: int, T: int, K: int, D: int, C: int, decay: bool = True) -> int:
    """Matmul FLOPs (2 per multiply-add) of the chunkwise algorithm, forward + custom backward,
    T a multiple of C (ChunkMatmulFunction in lcsm/ops/chunk_matmul.py; moderate decays, whose
    backward is the factorised one). Per token and head:
        forward    chunk-start memories U = k^T v                 2KD
                   inter-chunk q S_n                              2KD
                   intra-chunk (q k^T) and (scores) v             2C(K + D)
        backward   adjoint memories' inputs q^T dy                2KD
                   the maps q k^T and dy v^T                      2C(K + D)
                   ds = (dy v^T) k + dy S^T                       2CK + 2KD
                   de = (dy v^T)^T q + v R^T                      2CK + 2KD
                   di = (q k^T)^T dy + k R                        2CD + 2KD
    i.e. 12KD + 8CK + 6CD. With a decay the forward also forms the final memory without its last
    input (for the decay gradient's boundary term): one chunk's k^T v, 2CKD per head and sequence.
    Elementwise work (decay factors, masks, the state recurrence) is not counted. Without decay
    the chunk-start memories are a prefix sum done as one small triangular matmul (N x N per
    segment, and one more for the adjoints), which FlopCounterMode also counts; the general
    backward of strong decays (three EOS problems) does more, and its sub-chunked path skips
    masked blocks. torch's FlopCounterMode reports what the kernel actually issued (the "counted"
    column)."""
    return B * H * (T * (12 * K * D + 8 * C * K + 6 * C * D) + (2 * C * K * D if decay else 0))


def bmm_flops(z: Sizes) -> int:
    """FLOPs of ``Bench.batched_matmul_time``'s product."""
    return 2 * z.B * z.H * -(-z.T // z.C) * z.C * z.K * z.D


def counted_matmul_flops(z: Sizes, decay: str, T: int) -> int:
    """The same quantity counted by torch's FlopCounterMode over one real forward + backward of the
    PyTorch chunk form (the C kernel, ``native_chunk``, is opaque to the counter: it is switched off
    here; it issues the same products less the zero triangles of its C x C maps, which it skips)."""
    import importlib

    from torch.utils.flop_counter import FlopCounterMode

    chunk = importlib.import_module("lcsm.ops.chunk")
    unsupported = chunk.native_chunk_unsupported
    chunk.native_chunk_unsupported = lambda p: "counted in its PyTorch form"
    try:
        x = gla_inputs(z, T, decay)
        with FlopCounterMode(display=False) as counter:
            y = eos(x["i"], x["e"], x["s"], x["log_o"], mode="chunk", chunk_size=z.C)[0]
            y.backward(torch.ones_like(y))
    finally:
        chunk.native_chunk_unsupported = unsupported
    return counter.get_total_flops()


# ----------------------------------------------------------------------------- Mamba-shaped loop


def python_loop(i: Tensor, e: Tensor, s: Tensor, log_o: Tensor) -> Tensor:
    """The EOS recurrence one step at a time (i [B,T,H,D], e/s [B,T,H,K], log_o [B,T,H,K,D]).
    unbind / stack rather than x[:, t] slicing: slicing makes the backward O(T^2) (each step's
    gradient is written into a full-size zero tensor)."""
    B, T, H, D = i.shape
    K = e.shape[-1]
    m = i.new_zeros(B, H, K, D)
    ys = []
    for i_t, e_t, s_t, o_t in zip(i.unbind(1), e.unbind(1), s.unbind(1), log_o.exp().unbind(1), strict=False):
        m = o_t * m + e_t.unsqueeze(-1) * i_t.unsqueeze(-2)
        ys.append((s_t.unsqueeze(-1) * m).sum(-2))
    return torch.stack(ys, 1)


# ----------------------------------------------------------------------------- peak memory

# Repeated measurements of one cell agree within this much (see ``memory_worker``); a peak below it
# is allocator noise, and a ratio over it says nothing. The quick sizes' peaks fall in this range.
MEMORY_RESOLUTION_BYTES = 1 << 20


def memory_ratio(row: dict) -> tuple[float | None, str]:
    """Custom / autograd peak of one memory cell, or None and the reason it has no ratio."""
    c, a = row["custom"], row["autograd"]
    if not (isinstance(c, int) and isinstance(a, int)):
        return None, "worker failed"
    if a < MEMORY_RESOLUTION_BYTES:
        return None, (
            f"autograd peak {a / 2**20:.1f} MiB is below the measurement resolution "
            f"({MEMORY_RESOLUTION_BYTES / 2**20:g} MiB)"
        )
    return c / a, ""


def memory_worker(spec: dict) -> dict:
    """Runs inside a fresh process: for each (gates, T) cell in turn, one forward + backward of
    the row-decay chunk form with the given backward; returns each run's peak resident set size above its own
    pre-run baseline, in bytes. The peak counter is reset before every run, and with the fixed
    mmap threshold (see ``bench._common.run_memory_worker``) freed tensors leave the resident set at once,
    so earlier runs do not leak into later ones (checked: the same T measured again after a larger
    one, and in a process of its own, agrees within 1 MiB)."""
    z = _sizes_from_spec(spec["sizes"])
    torch.set_num_threads(spec["threads"])
    mode = spec["backward"]

    def fwd_bwd(x, cot):
        p = canonicalize(x["i"], x["e"], x["s"], x["log_o"])
        y, _ = eos_chunk(p, z.C, backward=mode)
        y.backward(cot)

    def inputs(T, gates):
        return gla_inputs(z, T, "row", gates=gates), torch.randn(z.B, z.H, T, z.D, generator=_gen(1))

    for gates in GATES:  # load lazily initialised kernels before any baseline
        fwd_bwd(*inputs(2 * z.C, gates))
    peaks = []
    for gates, T in spec["cells"]:
        x, cot = inputs(T, gates)
        gc.collect()
        base = _proc_status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
        fwd_bwd(x, cot)
        peaks.append((_proc_status_kib("VmHWM") - base) * 1024)
        del x, cot
    return {"peak_bytes": peaks}


def _sizes_spec(z: Sizes) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in z.__dict__.items()}


def _sizes_from_spec(spec: dict) -> Sizes:
    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return Sizes(**{k: tuples(v) for k, v in spec.items()})


def allocator_worker(spec: dict) -> dict:
    """Runs inside a fresh process (``case_limit``): applies the host allocator, then times what
    ``case_limit`` compares; returns the timings, the allocator applied and any notes."""
    z = _sizes_from_spec(spec["sizes"])
    torch.set_num_threads(spec["threads"])
    applied = use_host_allocator(spec["allocator"])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    bench = Bench(z, spec["threads"], log)
    # Each round times the chunk kernels, then the matmul reference (after the operators' first
    # call: timed before it under "system", while glibc's mmap threshold was still low
    # (lcsm/ops/_host_heap.py), each product's 2 MiB output was mapped and faulted in afresh, about
    # half the throughput, and the kernel's share doubled). The first round's timings are the table's.
    rounds: dict[str, list[float]] = {}
    for r in range(z.limit_rounds):
        b = bench if r == 0 else Bench(z, spec["threads"], log)
        for t in [b.eos_chunk_time(decay, z.T) for decay in LIMIT_DECAYS] + [b.batched_matmul_time()]:
            if t is not None:
                rounds.setdefault(t.key, []).append(t.median)
    for T in (z.T, z.T_long):
        bench.eos_chunk_time("row", T)
        bench.sdpa_time(T)
    timings = {k: {f: getattr(t, f) for f in t.__dataclass_fields__} for k, t in bench.r.timings.items()}
    return {"allocator": applied, "timings": timings, "rounds": rounds, "notes": bench.r.notes}


def malloc_state(state: str) -> None:
    """Sets this process's glibc thresholds to those of ``state``, so that one process can time
    them all (the parity case; benchmark-only): "retain" as ``use_host_allocator`` sets it,
    "system" as the operators' priming leaves glibc's own dynamic thresholds (mmap served again
    above the primed block's size, trimming above twice it), "untrimmed" system's with trimming
    off (which of the two differences costs). mallopt turns glibc's dynamic adjustment off, which
    changes nothing here: primed, the threshold is at its ceiling already."""
    mapped = ((M_MMAP_MAX, _DEFAULT_MMAP_MAX), (M_MMAP_THRESHOLD, _PRIMED_BLOCK))
    states = {"retain": RETAIN, "system": (*mapped, (M_TRIM_THRESHOLD, 2 * _PRIMED_BLOCK))}
    states["untrimmed"] = (*mapped, (M_TRIM_THRESHOLD, _INT_MAX))
    if not mallopt(states[state]):
        raise OSError(f"malloc_state: glibc refused the {state} thresholds")


def parity_worker(spec: dict) -> dict:
    """Runs inside a fresh process (``case_parity``): ``rounds`` rounds, each timing every chunk
    case of ``case_limit`` under both host-memory states in turn, and the long case under
    "untrimmed" too, the order reversed every other round; the first state of the first round is
    glibc's own (primed by the first operator call), later ones set by ``malloc_state``. Returns
    each state's median time per case and round, each over three times the sizes' repeats."""
    # each state's time the median of 3x the usual repeats: medians of 5 moved by up to 10% from
    # round to round at T 2048, as wide as the difference the check looks for (2026-12-05)
    z = replace(_sizes_from_spec(spec["sizes"]), repeats=3 * spec["sizes"]["repeats"])
    torch.set_num_threads(spec["threads"])
    states = ("system", "retain", "untrimmed")
    times: dict[str, dict[str, list[float]]] = {state: {} for state in states}
    for r in range(spec["rounds"]):
        for state in states if r % 2 == 0 else states[::-1]:
            if r or state != "system":
                malloc_state(state)
            bench = Bench(z, spec["threads"], lambda msg: print(msg, file=sys.stderr, flush=True))
            cases = [(decay, z.T) for decay in LIMIT_DECAYS if state != "untrimmed"] + [("row", z.T_long)]
            for decay, T in cases:
                t = bench.eos_chunk_time(decay, T)
                if t is not None:
                    times[state].setdefault(t.key, []).append(t.median)
    return {"times": times}


def limit_subprocess(z: Sizes, allocator: str, threads: int) -> dict | str:
    """``allocator_worker``'s result for one allocator, or a string saying why there is none."""
    spec = {"sizes": _sizes_spec(z), "allocator": allocator, "threads": threads}
    return run_allocator_worker("bench.ops_bench", spec, timeout=900)


def peak_memory_subprocess(z: Sizes, mode: str, threads: int):
    """Peak extra memory (bytes) of one run per (gates, T) for gates in GATES and T in z.memory,
    measured in one fresh process for this backward; a list of ints, or a string saying why not."""
    cells = [(gates, T) for gates in GATES for T in z.memory]
    peaks = run_memory_worker(
        "bench.ops_bench", {"sizes": _sizes_spec(z), "cells": cells, "backward": mode, "threads": threads}, timeout=600
    )
    return peaks if isinstance(peaks, str) else [int(v) for v in peaks]


# ----------------------------------------------------------------------------- output


def _interval(est: float, low: float, high: float) -> str:
    return f"{est:.3f} [{low:.3f}, {high:.3f}]"


def _fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}x"


def render(r: Report, z: Sizes, header: dict[str, str], selected: Sequence[str]) -> str:
    lines = ["# lcsm operator benchmark", ""]
    for k, v in header.items():
        lines.append(f"- {k}: {v}")
    lines += [
        "",
        f"Forward + backward, float32, median of {z.repeats} runs after {z.warmup} warm-up run(s). "
        f"Cases: {', '.join(selected)}.",
        "",
    ]
    if r.checks or r.info:
        lines += ["## Targets", "", "| check | measured | target | result |", "| --- | --- | --- | --- |"]
        for c in r.checks:
            lines.append(f"| {c.name} | {_fmt_ratio(c.measured)} | {c.op} {c.target:g}x | {c.result} |")
        for what, value in r.info:
            lines.append(f"| {what} | {value} | — | info |")
        lines.append("")
    timed = [t for t in r.timings.values() if t.tokens]
    if timed:
        lines += [
            "## Timings",
            "",
            "Page faults: minor faults per token and run (fresh memory the OS maps and "
            "zeroes); sys: the kernel's share of the process's CPU time over the timed runs.",
            "",
            "| operator | shape | median ms | min ms | µs / token | page faults / token | sys % |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in timed:
            runs = len(t.times)
            sys_share = f"{100 * t.sys_s / t.cpu_s:.0f}" if t.cpu_s > 0 else "—"
            lines.append(
                f"| {t.label} | {t.shape} | {t.median * 1e3:.2f} | {min(t.times) * 1e3:.2f} | "
                f"{t.median / t.tokens * 1e6:.3f} | {t.faults / (runs * t.tokens):.2f} | {sys_share} |"
            )
        lines.append("")
    if r.memory:
        lines += [
            "## Peak memory (row decay; peak RSS above the pre-run baseline, one fresh process per backward)",
            "",
            "| gates | T | custom backward MiB | autograd backward MiB | custom / autograd | custom bytes / token |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in r.memory:
            c, a = row["custom"], row["autograd"]

            def mib(v):
                return f"{v / 2**20:.1f}" if isinstance(v, int) else "n/a"

            ratio, why = memory_ratio(row)
            ratio = f"{ratio:.3f}" if ratio is not None else f"n/a ({why})"
            per_tok = f"{c / (z.B * row['T']):.0f}" if isinstance(c, int) else "n/a"
            lines.append(f"| {row['gates']} | {row['T']} | {mib(c)} | {mib(a)} | {ratio} | {per_tok} |")
        lines.append("")
    if r.limit:
        lines += [
            "## Against the batched matmul limit, by host allocator",
            "",
            "Each allocator in a fresh worker process, one after the other: their times are not paired "
            "(the parity rows of Targets compare the allocators in one process, paired by round). Share: the "
            "chunk kernel's matmul FLOP rate (forward + custom backward, FLOP model below) over the batched "
            f"matmul's, the two timed in turn over {z.limit_rounds} rounds in the worker and paired by "
            "round (Targets give the interval). "
            "On the CPU the chunk form runs in C (`native_chunk`), which skips the zero triangles of its "
            "C x C maps: at C = K = D = 64 it issues about 77% of the model's FLOPs, so its share is an "
            "effective rate (the model's FLOPs over its time).",
            "",
            "| operator | shape | retain ms | system ms | system / retain | page faults / token retain, system | "
            "share of batched matmul retain | share system |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]

        def ms(v):
            return "n/a" if v is None else f"{v * 1e3:.2f}"

        def pct(v):
            return "—" if v is None else f"{100 * v:.1f}%"

        def faults(v):
            return "n/a" if v is None else f"{v:.2f}"

        for row in r.limit:
            ratio = row["system"] / row["retain"] if row["system"] and row["retain"] else None
            lines.append(
                f"| {row['label']} | {row['shape']} | {ms(row['retain'])} | {ms(row['system'])} | "
                f"{_fmt_ratio(ratio)} | {faults(row['retain faults'])}, {faults(row['system faults'])} | "
                f"{pct(row['retain share'])} | {pct(row['system share'])} |"
            )
        lines.append("")
    if r.throughput:
        lines += [
            "## Throughput (matmul FLOPs of the chunk kernel, forward + custom backward)",
            "",
            "| operator | shape | median ms | analytic GFLOP | counted GFLOP | achieved GFLOP/s | "
            "% of fp32 matmul peak |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in r.throughput:
            lines.append(
                f"| {t['label']} | {t['shape']} | {t['ms']:.2f} | {t['analytic'] / 1e9:.3f} | "
                f"{t['counted'] / 1e9:.3f} | {t['gflops']:.1f} | {100 * t['gflops'] / t['peak']:.1f}% |"
            )
        lines.append("")
    if r.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in r.notes] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lcsm bench ops",
        description="Benchmark lcsm's EOS operator against its peers (CPU, fp32, "
        "forward + backward). Writes a markdown report to stdout.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 5, quick 2)")
    p.add_argument("--only", default=None, help=f"comma-separated cases out of: {', '.join(CASES)}")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", default=None, help="also write the report to this file")
    p.add_argument(
        "--allocator",
        choices=HOST_ALLOCATORS,
        default="retain",
        help="host memory, as run.host_allocator: retain (default, what lcsm's training processes use: "
        "freed blocks stay in glibc's heap for reuse) or system (glibc's defaults: its adaptive mmap "
        "threshold, lifted to its ceiling by the operators' first call; bench/README.md, Noise)",
    )
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--allocator-worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.memory_worker is not None:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return 0
    if args.allocator_worker is not None:
        spec = json.loads(args.allocator_worker)
        print(json.dumps(parity_worker(spec) if "rounds" in spec else allocator_worker(spec)))
        return 0
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    if args.threads < 1:
        parser.error(f"--threads: expected an integer >= 1, got {args.threads}")
    selected = list(CASES)
    if args.only is not None:
        selected = [c.strip() for c in args.only.split(",") if c.strip()]
        unknown = [c for c in selected if c not in CASES]
        if unknown or not selected:
            parser.error(
                f"--only: unknown case(s) {', '.join(unknown) or '(none given)'}; "
                f"expected names out of {', '.join(CASES)}"
            )
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)

    torch.set_num_threads(args.threads)
    allocator = use_host_allocator(args.allocator)
    start = time.perf_counter()

    def log(msg):
        return print(f"[bench {time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    header = provenance_header(parser.prog, argv, args.threads, out=args.out)
    header["allocator"] = allocator
    bench = Bench(sizes, args.threads, log)
    for case in selected:
        log(f"case {case}")
        getattr(bench, f"case_{case}")()
    header["wall time"] = f"{time.perf_counter() - start:.0f} s"
    text = render(bench.r, sizes, header, selected)
    print(text)
    write_out(text + "\n", args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
