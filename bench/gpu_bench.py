"""GPU benchmark: lcsm's operators against fla's Triton kernels and causal attention, and training
tokens/s of a ~100M-parameter model, on one CUDA device (the run of ``bench/gpu.sh``).

Side by side in one process: for each T in 2K ... 32K and each dtype (bf16, fp32), forward +
backward of

    gla          lcsm.ops.eos, row decay [B, T, H, K, 1]    vs  fla chunk_gla
    simple_gla   lcsm.ops.eos, scalar decay [B, T, H, 1, 1] vs  fla chunk_simple_gla
    delta        lcsm.ops.eos_delta, no gate                vs  fla chunk_delta_rule
    gated_delta  lcsm.ops.eos_delta, scalar gate            vs  fla chunk_gated_delta_rule
    kda          lcsm.ops.eos_dplr, per-row decay (KDA)     vs  fla chunk_kda
    attention    torch SDPA, causal (flash in bf16)

Every op runs twice on the lcsm side: mode "chunk" (the PyTorch chunk form) and mode "triton"
(gla and simple_gla: lcsm/ops/triton_chunk.py, the Triton kernels of the same form; delta,
gated_delta and kda: the same chunk forms with their carry across chunks in Triton,
lcsm/ops/triton_delta.py).

at B1 H16 K = D = 128 (medians of wall-clock timings with the device synchronised, after
warm-up), the targets' lengths (8K, 32K) in both dtypes first. Next, Mamba's selective scan
(``--scan-lengths``; one head, K = N = 16, D = d_inner = ``--scan-dim``, LogProduct(Delta_t, A)),
mode "triton" (lcsm/ops/triton_scan.py) against the chunk form's elementwise kernel (a few PyTorch
operations a step, at T <= ``--scan-chunk-max`` only) and causal SDPA at the operators' shape; next,
for a few cases (``--profile``), the kernels of one forward + backward of each form with their
device times (torch.profiler), so that a loan also says where the time goes; then training steps
of ~100M-parameter language models (lcsm gla, gated_deltanet, a Transformer and Mamba; fla's GLA
and Gated DeltaNet models of the same width and depth where fla's model package is installed,
with fla's untied embeddings), in bf16 autocast; last, for a few (``--shapes``), mode "triton"
under other launch shapes (warps, pipeline stages, block widths) than the kernel modules' own.
Every case runs under a time budget (``--budget``): once it is spent the rest are marked SKIP, and
the report is rewritten after every case so that a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import Check, provenance_header
from lcsm.ops import LogProduct, eos, eos_delta, eos_dplr

LENGTHS = (2048, 4096, 8192, 16384, 32768)
TARGET_LENGTHS = (8192, 32768)
OPS = ("gla", "simple_gla", "delta", "gated_delta", "kda")
# the ops mode "triton" serves: eos's Triton kernels, and the delta-rule chunk forms (eos_delta's,
# eos_dplr's) with their carry across chunks in Triton (lcsm/ops/triton_delta.py)
TRITON_OPS = OPS


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# "cuda" for the benchmark; "cpu" only for the smoke test of this script (--device cpu).
DEVICE = "cuda"


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def cuda_time(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` (synchronised wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_inputs(op: str, T: int, dtype: torch.dtype, B: int, H: int, K: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, device=DEVICE, generator=g, dtype=torch.float32)

    q = r(B, T, H, K) * K**-0.5
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, K)
    x = {"q": q, "k": k, "v": v}
    if op == "gla":
        x["g"] = F.logsigmoid(r(B, T, H, K)) / 16
    elif op == "simple_gla":
        x["g"] = F.logsigmoid(r(B, T, H))
    elif op == "delta":
        x["beta"] = torch.sigmoid(r(B, T, H))
    elif op == "gated_delta":
        x["g"] = F.logsigmoid(r(B, T, H))
        x["beta"] = torch.sigmoid(r(B, T, H))
    elif op == "kda":
        x["g"] = F.logsigmoid(r(B, T, H, K)) / 16
        x["beta"] = torch.sigmoid(r(B, T, H))
    return {n: t.to(dtype).requires_grad_() for n, t in x.items()}


def lcsm_op(op: str, x: dict, mode: str = "chunk") -> torch.Tensor:
    q, k, v = x["q"], x["k"], x["v"]
    if op == "gla":
        return eos(v, k, q, x["g"].unsqueeze(-1), mode=mode)[0]
    if op == "simple_gla":
        return eos(v, k, q, x["g"][..., None, None], mode=mode)[0]
    bk = x["beta"].unsqueeze(-1) * k
    if op == "kda":
        # KDA: (I - beta k k^T) D(alpha) = D(alpha) - (beta k)(alpha k)^T, the decay per key row
        return eos_dplr(v, bk, q, bk, x["g"].exp() * k, x["g"], mode=mode)[0]
    return eos_delta(v, bk, q, bk, k, x["g"] if op == "gated_delta" else None, mode=mode)[0]


def fla_op(op: str, x: dict) -> torch.Tensor:
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.kda import chunk_kda
    from fla.ops.simple_gla import chunk_simple_gla

    q, k, v = x["q"], x["k"], x["v"]
    if op == "gla":
        return chunk_gla(q, k, v, x["g"], scale=1.0)[0]
    if op == "simple_gla":
        return chunk_simple_gla(q, k, v, x["g"], scale=1.0)[0]
    if op == "delta":
        return chunk_delta_rule(q, k, v, x["beta"], scale=1.0)[0]
    if op == "kda":
        return chunk_kda(q, k, v, x["g"], x["beta"], scale=1.0)[0]
    return chunk_gated_delta_rule(q, k, v, x["g"], x["beta"], scale=1.0)[0]


def sdpa(x: dict) -> torch.Tensor:
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fwd_bwd(f: Callable[[dict], torch.Tensor], x: dict) -> Callable[[], None]:
    dy = None

    def step():
        nonlocal dy
        y = f(x)
        if dy is None:
            dy = torch.randn_like(y)
        for t in x.values():
            t.grad = None
        y.backward(dy)

    return step


def peak_bytes(step: Callable[[], None]) -> int | None:
    if DEVICE == "cpu":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


class Report:
    def __init__(self, header: dict[str, str], out: str | None):
        self.header, self.out = header, out
        self.sections: list[tuple[str, list[str]]] = []
        self.checks: list[Check] = []

    def section(self, title: str, lines: list[str]) -> list[str]:
        self.sections.append((title, lines))
        return lines

    def render(self) -> str:
        lines = ["# GPU benchmark", ""]
        lines += [f"- {k}: {v}" for k, v in self.header.items()]
        if self.checks:
            lines += ["", "## Targets", "", "| target | measured | wanted | result |", "| --- | --- | --- | --- |"]
            for c in self.checks:
                m = "-" if c.measured is None else f"{c.measured:.3f}"
                lines.append(f"| {c.name} | {m} | {c.op} {c.target} | {c.result} |")
        for title, body in self.sections:
            lines += ["", f"## {title}", "", *body]
        return "\n".join(lines) + "\n"

    def flush(self) -> None:
        text = self.render()
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(text)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_ops(report: Report, budget: Budget, args) -> None:
    try:
        import fla  # noqa: F401

        have_fla = True
    except Exception as exc:  # fla missing or its import failing: lcsm and SDPA still run
        have_fla = False
        log(f"fla unavailable: {exc!r}")
    rows = report.section(
        f"Operators, forward + backward (B{args.batch} H{args.heads} K = D = {args.dim}; ms, median of "
        f"{args.repeats}; peak MiB above the inputs; in the order measured, the targets' lengths first)",
        [
            "| op | dtype | T | lcsm chunk ms | lcsm triton ms | fla ms | lcsm / fla | triton / fla | SDPA ms | "
            "lcsm / SDPA | lcsm MiB | triton MiB | fla MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ],
    )
    ratios: dict[tuple[str, str, int], tuple[float | None, float | None]] = {}
    triton_ratios: dict[tuple[str, str, int], float | None] = {}
    # the targets' lengths first (lcsm / fla at 8K, lcsm / SDPA at 32K), in both dtypes before any
    # other length: a loan's budget may end before the rest, fla's first calls autotuning for minutes
    cases = [(dtype, T) for dtype in (torch.bfloat16, torch.float32) for T in args.lengths]
    cases.sort(key=lambda case: (case[1] not in TARGET_LENGTHS, case[1]))
    for dtype, T in cases:
        dname = str(dtype).removeprefix("torch.")
        sdpa_ms = None
        for op in OPS:
            if budget.left() < 0:
                rows.append(f"| {op} | {dname} | {T} | SKIP (budget spent) | | | | | | | | | |")
                continue
            cells = {}
            for name, f in (
                ("lcsm", lambda x, op=op: lcsm_op(op, x)),
                ("triton", lambda x, op=op: lcsm_op(op, x, "triton")),
                ("fla", lambda x, op=op: fla_op(op, x)),
                ("sdpa", sdpa),
            ):
                if (
                    (name == "fla" and not have_fla)
                    or (name == "sdpa" and sdpa_ms is not None)
                    or (name == "triton" and op not in TRITON_OPS)
                ):
                    continue
                shape = (op, T, dtype, args.batch, args.heads, args.dim)
                cells[name] = measure(f, lambda shape=shape: op_inputs(*shape), args, f"{op} {dname} T={T} {name}")
            if "sdpa" in cells:
                sdpa_ms = cells["sdpa"][0]
            lc, fl = cells.get("lcsm", (None, None)), cells.get("fla", (None, None))
            tr = cells.get("triton", (None, None))

            def fmt(v, p=2):
                return "-" if v is None else f"{v:.{p}f}"

            r_fla = lc[0] / fl[0] if lc[0] and fl[0] else None
            r_triton = tr[0] / fl[0] if tr[0] and fl[0] else None
            r_sdpa = lc[0] / sdpa_ms if lc[0] and sdpa_ms else None
            ratios[(op, dname, T)] = (r_fla, r_sdpa)
            triton_ratios[(op, dname, T)] = r_triton
            rows.append(
                f"| {op} | {dname} | {T} | {fmt(lc[0])} | {fmt(tr[0])} | {fmt(fl[0])} | {fmt(r_fla)} | "
                f"{fmt(r_triton)} | {fmt(sdpa_ms)} | {fmt(r_sdpa)} | {fmt(lc[1], 0)} | {fmt(tr[1], 0)} | "
                f"{fmt(fl[1], 0)} |"
            )
            log(rows[-1])
            report.flush()
    for op in OPS:
        for dname in ("bfloat16", "float32"):
            r_fla = ratios.get((op, dname, TARGET_LENGTHS[0]), (None, None))[0]
            r_sdpa = ratios.get((op, dname, TARGET_LENGTHS[1]), (None, None))[1]
            report.checks.append(Check(f"{op} {dname} T=8K: lcsm / fla", r_fla, "<=", 1.2))
            report.checks.append(Check(f"{op} {dname} T=32K: lcsm / SDPA", r_sdpa, "<=", 1 / 3))
            if op in TRITON_OPS:
                r_triton = triton_ratios.get((op, dname, TARGET_LENGTHS[0]))
                report.checks.append(Check(f"{op} {dname} T=8K: lcsm triton / fla", r_triton, "<=", 1.2))
    report.flush()


def measure(f: Callable[[dict], torch.Tensor], inputs: Callable[[], dict], args, case: str):
    """(ms, peak MiB) of ``f``'s forward + backward on fresh ``inputs()``, or (None, None) where it
    fails (the failure logged under ``case``); the device's cache emptied after."""
    try:
        x = inputs()
        step = fwd_bwd(f, x)
        ms = cuda_time(step, args.warmup, args.repeats) * 1e3
        peak = peak_bytes(step)
        del x, step
        result = (ms, None if peak is None else peak / 2**20)
    except Exception as exc:
        log(f"{case}: {exc!r}")
        result = (None, None)
    if DEVICE != "cpu":
        torch.cuda.empty_cache()
    return result


def scan_inputs(T: int, dtype: torch.dtype, B: int, D: int, K: int = 16, seed: int = 0) -> dict:
    """Mamba's selective-scan operands (``lcsm.layers.mamba``'s eos call): x = Delta u, B_t, C_t,
    Delta_t = softplus(.) and A^T = -exp(A_log)^T with S4D-real's A_log = log(1..K)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, device=DEVICE, generator=g, dtype=torch.float32)

    delta = F.softplus(r(B, T, 1, D) - 4.0)
    A = -torch.arange(1, K + 1, device=DEVICE, dtype=torch.float32)[:, None].expand(K, D)
    x = {"x": delta * r(B, T, 1, D), "Bt": r(B, T, 1, K), "Ct": r(B, T, 1, K), "delta": delta, "A": A[None]}
    return {n: t.to(dtype).contiguous().requires_grad_() for n, t in x.items()}


def lcsm_scan(x: dict, mode: str) -> torch.Tensor:
    log_o = LogProduct(x["delta"].unsqueeze(3), x["A"])
    return eos(x["x"], x["Bt"], x["Ct"], log_o, mode=mode)[0]


def bench_scan(report: Report, budget: Budget, args) -> None:
    D = args.scan_dim
    rows = report.section(
        f"Mamba's selective scan, forward + backward (B{args.batch}, one head, K = N = 16, D = d_inner = {D}; "
        f"ms, median of {args.repeats}; SDPA at B{args.batch} H{args.heads} d {args.dim}; peak MiB above the inputs)",
        [
            "| dtype | T | lcsm triton ms | lcsm chunk ms | chunk / triton | SDPA ms | triton / SDPA | triton MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ],
    )

    def fmt(v, p=2):
        return "-" if v is None else f"{v:.{p}f}"

    for dtype in (torch.bfloat16, torch.float32):
        dname = str(dtype).removeprefix("torch.")
        for T in args.scan_lengths:
            if budget.left() < 0:
                rows.append(f"| {dname} | {T} | SKIP (budget spent) | | | | | |")
                continue
            cells = {}

            def scan(T=T, dtype=dtype):
                return scan_inputs(T, dtype, args.batch, D)

            def attention(T=T, dtype=dtype):
                x = op_inputs("gla", T, dtype, args.batch, args.heads, args.dim)
                return {n: x[n] for n in ("q", "k", "v")}

            cases = [("triton", lambda x: lcsm_scan(x, "triton"), scan), ("sdpa", sdpa, attention)]
            if args.scan_chunk_max >= T:
                cases.append(("chunk", lambda x: lcsm_scan(x, "chunk"), scan))
            for name, f, inputs in cases:
                cells[name] = measure(f, inputs, args, f"scan {dname} T={T} {name}")
            tr, ch, sd = (cells.get(n, (None, None)) for n in ("triton", "chunk", "sdpa"))
            r_chunk = ch[0] / tr[0] if ch[0] and tr[0] else None
            r_sdpa = tr[0] / sd[0] if tr[0] and sd[0] else None
            rows.append(
                f"| {dname} | {T} | {fmt(tr[0])} | {fmt(ch[0])} | {fmt(r_chunk)} | {fmt(sd[0])} | {fmt(r_sdpa)} | "
                f"{fmt(tr[1], 0)} |"
            )
            log(rows[-1])
            report.flush()


def _self_time_us(event) -> float:
    """An averaged profiler event's own time on the device (CUDA) or, on the CPU, on the host."""
    if DEVICE == "cpu":
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "self_cuda_time_total"):  # the second before torch 2.4
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def _profile_cases(text: str, ops: tuple[str, ...] = OPS) -> list[str]:
    """``--profile``'s OP:DTYPE:T cases (``--shapes``' with ``ops``), checked."""
    cases = [c for c in text.split(",") if c]
    for case in cases:
        parts = case.split(":")
        if len(parts) != 3 or parts[0] not in ops or parts[1] not in ("bfloat16", "float32") or not parts[2].isdigit():
            raise argparse.ArgumentTypeError(
                f"expected OP:DTYPE:T with OP one of {', '.join(ops)}, DTYPE bfloat16 or float32, got {case!r}"
            )
    return cases


def _shape_cases(text: str) -> list[str]:
    """``--shapes``' cases: the operators', and "scan" (Mamba's selective scan, ``bench_scan``'s shape)."""
    return _profile_cases(text, (*OPS, "scan"))


def bench_kernels(report: Report, budget: Budget, args) -> None:
    """Where one forward + backward spends its time, kernel by kernel (torch.profiler, after one
    unprofiled call that compiles and warms the kernels): the ``--top`` longest of each case, so
    that a loan says which of a form's kernels to work on."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    where = "device time of each kernel" if DEVICE == "cuda" else "host time of each op (CPU smoke test)"
    rows = report.section(
        f"Kernels of one forward + backward (B{args.batch} H{args.heads} K = D = {args.dim}; torch.profiler, {where}; "
        f"the {args.top} longest)",
        ["| case | kernel | calls | ms | share of the case |", "| --- | --- | ---: | ---: | ---: |"],
    )
    forms = [("lcsm triton", "triton"), ("lcsm chunk", "chunk"), ("fla", None)]
    for spec in args.profile:
        op, dname, T = spec.split(":")
        for label, mode in forms:
            case = f"{op} {dname} T={T} {label}"
            if budget.left() < 0:
                rows.append(f"| {case} | SKIP (budget spent) | | | |")
                continue
            try:
                x = op_inputs(op, int(T), getattr(torch, dname), args.batch, args.heads, args.dim)
                if mode is None:
                    step = fwd_bwd(lambda x, op=op: fla_op(op, x), x)
                else:
                    step = fwd_bwd(lambda x, op=op, mode=mode: lcsm_op(op, x, mode), x)
                step()
                sync()
                with profile(activities=activities) as prof:
                    step()
                    sync()
                events = [(e.key, e.count, _self_time_us(e)) for e in prof.key_averages()]
                events = sorted((e for e in events if e[2] > 0), key=lambda e: -e[2])
                total = sum(e[2] for e in events)
                for key, count, us in events[: args.top]:
                    name = key if len(key) <= 70 else key[:67] + "..."
                    rows.append(f"| {case} | `{name}` | {count} | {us / 1e3:.2f} | {us / total:.1%} |")
                rows.append(f"| {case} | all {len(events)} | | {total / 1e3:.2f} | 100% |")
                del x, step
            except Exception as exc:
                log(f"{case}: {exc!r}")
                rows.append(f"| {case} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | |")
            if DEVICE != "cpu":
                torch.cuda.empty_cache()
            log(rows[-1])
            report.flush()


# Launch shapes tried by ``--shapes``, each as overrides of the kernel module's constants (the
# first: the module's own). Chosen from ptxas's reports on the CPU (bench/results/triton_registers.md),
# where variants near the edge of spilling cannot be told apart without timing them.
SHAPES = {
    "triton_chunk": (
        {},
        {"WARPS_OUTPUT": 4},
        {"DIAGONAL_K": 16},
        {"WARPS_STATES": 4},
        {"STAGES_STATES": 3},
        {"BLOCK_K": 32},
    ),
    "triton_delta": ({}, {"BLOCK_D": 64}, {"NUM_WARPS": 4}, {"NUM_STAGES": 2}),
    # MIN_PROGRAMS 1: no segments (Mamba's scan at batch 1 has 96 programs, short of an H100's 264)
    "triton_scan": (
        {},
        {"WARPS": 8},
        {"BLOCK_VALUES": 2048},
        {"WARPS_BACKWARD": 4},
        {"BLOCK_VALUES_BACKWARD": 1024},
        {"MIN_PROGRAMS": 1},
        {"MIN_SEGMENT_STEPS": 1024},
    ),
}


def _kernel_module(op: str):
    """The module whose Triton kernels serve ``op`` in mode "triton"."""
    import importlib

    name = "triton_scan" if op == "scan" else "triton_chunk" if op in ("gla", "simple_gla") else "triton_delta"
    return importlib.import_module("lcsm.ops." + name)


def bench_shapes(report: Report, budget: Budget, args) -> None:
    """Mode "triton"'s forward + backward under each of ``SHAPES``' launch shapes for the
    ``--shapes`` cases, side by side in one process: the evidence for the modules' own shapes."""
    rows = report.section(
        f"Launch shapes of the Triton kernels, forward + backward (B{args.batch} H{args.heads} K = D = {args.dim}; "
        f"ms, median of {args.repeats}; against the module's own shape, the first row of each case)",
        ["| case | module | shape | ms | / own |", "| --- | --- | --- | ---: | ---: |"],
    )
    for spec in args.shapes:
        op, dname, T = spec.split(":")
        module = _kernel_module(op)
        name = module.__name__.rsplit(".", 1)[-1]
        own = None
        for overrides in SHAPES[name]:
            label = ", ".join(f"{k} {v}" for k, v in overrides.items()) or "own: " + ", ".join(
                f"{k} {getattr(module, k)}" for k in sorted({k for o in SHAPES[name] for k in o})
            )
            case = f"{op} {dname} T={T}"
            if budget.left() < 0:
                rows.append(f"| {case} | {name} | {label} | SKIP (budget spent) | |")
                continue
            saved = {k: getattr(module, k) for k in overrides}
            x = None
            try:
                for k, v in overrides.items():
                    setattr(module, k, v)
                if op == "scan":
                    x = scan_inputs(int(T), getattr(torch, dname), args.batch, args.scan_dim)
                    f = lambda x: lcsm_scan(x, "triton")  # noqa: E731
                else:
                    x = op_inputs(op, int(T), getattr(torch, dname), args.batch, args.heads, args.dim)
                    f = lambda x, op=op: lcsm_op(op, x, "triton")  # noqa: E731
                ms = cuda_time(fwd_bwd(f, x), args.warmup, args.repeats) * 1e3
                own = ms if not overrides else own
                ratio = "-" if own is None else f"{ms / own:.3f}"
                rows.append(f"| {case} | {name} | {label} | {ms:.2f} | {ratio} |")
            except Exception as exc:
                log(f"{case} {label}: {exc!r}")
                rows.append(f"| {case} | {name} | {label} | failed: {type(exc).__name__}: {str(exc)[:120]} | |")
            finally:
                for k, v in saved.items():
                    setattr(module, k, v)
                del x  # before the next shape's inputs, also after a failure (out of memory)
            if DEVICE != "cpu":
                torch.cuda.empty_cache()
            log(rows[-1])
            report.flush()


# Heads of the model comparison, the same in lcsm and fla (fla's GLA default; GDN at 768 / 128).
HEADS = {"gla": 4, "gated_deltanet": 6}


def lcsm_lm(mixer: str, d: int, layers: int, vocab: int) -> torch.nn.Module:
    from lcsm.models import HeadConfig, ModelConfig, build_model

    if mixer == "attention":
        options = dict(heads=d // 64, positions="rotary")
    else:  # Mamba: its defaults (d_state 16, expand 2: one head of d_inner 2 d), no heads to set
        options = dict(num_heads=HEADS[mixer]) if mixer in HEADS else {}
    cfg = ModelConfig(
        mixer=mixer,
        mixer_options=options,
        d_model=d,
        n_layers=layers,
        vocab_size=vocab,
        head=HeadConfig(kind="lm"),
        tie_embeddings=True,
    )
    return build_model(cfg, verbose=False)


def fla_lm(name: str, d: int, layers: int, vocab: int) -> torch.nn.Module:
    if name == "gla":
        from fla.models import GLAConfig, GLAForCausalLM

        cfg = GLAConfig(hidden_size=d, num_hidden_layers=layers, num_heads=HEADS["gla"], vocab_size=vocab)
        return GLAForCausalLM(cfg)
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    # lcsm's key width is expand_k (0.75) x d over the heads; fla names the per-head width.
    heads = HEADS["gated_deltanet"]
    cfg = GatedDeltaNetConfig(
        hidden_size=d, num_hidden_layers=layers, num_heads=heads, head_dim=int(0.75 * d) // heads, vocab_size=vocab
    )
    return GatedDeltaNetForCausalLM(cfg)


def bench_train(report: Report, budget: Budget, args) -> None:
    rows = report.section(
        f"Training a language model (d {args.model_dim}, {args.model_layers} layers, vocab {args.vocab}, "
        f"batch {args.train_batch} x {args.train_len} tokens, bf16 autocast, AdamW; median of {args.repeats} steps)",
        ["| model | parameters (M) | s / step | tokens / s | peak GiB |", "| --- | --- | --- | --- | --- |"],
    )
    cases = [("lcsm " + m, lambda m=m: lcsm_lm(m, args.model_dim, args.model_layers, args.vocab)) for m in args.mixers]
    cases += [
        ("fla " + m, lambda m=m: fla_lm(m, args.model_dim, args.model_layers, args.vocab)) for m in args.fla_models
    ]
    tokens = torch.randint(0, args.vocab, (args.train_batch, args.train_len + 1), device=DEVICE)
    for name, make in cases:
        if budget.left() < 0:
            rows.append(f"| {name} | SKIP (budget spent) | | | |")
            continue
        try:
            model = make().to(DEVICE)
            n_params = sum(p.numel() for p in model.parameters()) / 1e6
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE != "cpu")
            fla_model = name.startswith("fla")

            def step(model=model, opt=opt, fla_model=fla_model):
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    out = model(tokens[:, :-1])
                    logits = out.logits if fla_model else out
                    if isinstance(logits, tuple):
                        logits = logits[0]
                    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if DEVICE != "cpu":
                torch.cuda.reset_peak_memory_stats()
            sec = cuda_time(step, args.warmup, args.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE != "cpu" else float("nan")
            tps = args.train_batch * args.train_len / sec
            rows.append(f"| {name} | {n_params:.1f} | {sec:.3f} | {tps:,.0f} | {peak:.1f} |")
            del model, opt
        except Exception as exc:
            traceback.print_exc()
            rows.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | |")
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
        log(rows[-1])
        report.flush()


SECTIONS = {"ops", "scan", "kernels", "train", "shapes"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lcsm bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")], default=list(LENGTHS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scan-lengths", type=lambda s: [int(t) for t in s.split(",")], default=[2048, 8192, 32768])
    p.add_argument("--scan-dim", type=int, default=1536, help="the selective scan's D (Mamba 130M's d_inner)")
    p.add_argument("--scan-chunk-max", type=int, default=2048, help="the longest T the scan's chunk form runs at")
    p.add_argument("--mixers", type=lambda s: s.split(","), default=["gla", "gated_deltanet", "attention", "mamba"])
    p.add_argument("--fla-models", type=lambda s: [m for m in s.split(",") if m], default=["gla", "gated_deltanet"])
    p.add_argument("--model-dim", type=int, default=768)
    p.add_argument("--model-layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-len", type=int, default=2048)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for all cases; the rest are skipped")
    p.add_argument(
        "--profile",
        type=_profile_cases,
        default=["gla:bfloat16:32768", "simple_gla:float32:32768"],
        help="OP:DTYPE:T cases whose kernels are profiled (comma-separated; empty: none)",
    )
    p.add_argument("--top", type=int, default=8, help="kernels listed per profiled case")
    p.add_argument(
        "--shapes",
        type=_shape_cases,
        default=["gla:bfloat16:32768", "gated_delta:bfloat16:32768", "scan:float32:32768"],
        help="OP:DTYPE:T cases timed under each launch shape of SHAPES (comma-separated; empty: none; OP may "
        "also be scan, the selective scan at --scan-dim)",
    )
    p.add_argument("--skip", default="", help="comma-separated sections to skip: kernels, shapes, ops, scan, train")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of the script")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats / --warmup: expected >= 1 and >= 0, got {args.repeats} and {args.warmup}")
    skip = {name for name in args.skip.split(",") if name}
    if skip - SECTIONS:
        p.error(
            f"--skip: expected sections among {', '.join(sorted(SECTIONS))}, got {', '.join(sorted(skip - SECTIONS))}"
        )
    argv = list(sys.argv[1:] if argv is None else argv)
    header = provenance_header("lcsm bench gpu", argv, torch.get_num_threads(), args.out)
    header["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    try:
        import triton

        header["triton"] = triton.__version__
    except ImportError:
        header["triton"] = "absent"
    report = Report(header, args.out)
    budget = Budget(args.budget)
    torch.backends.cuda.matmul.allow_tf32 = False
    # The operators' table first: it holds the targets, and the kernel profiles' fla case
    # autotunes for minutes on a fresh device (most of a 240 s budget on an H200)
    if "ops" not in skip:
        bench_ops(report, budget, args)
    if "scan" not in skip:  # short (a few cases)
        bench_scan(report, budget, args)
    if "kernels" not in skip:
        bench_kernels(report, budget, args)
    if "train" not in skip:
        bench_train(report, budget, args)
    if "shapes" not in skip:  # last: tuning, where the sections before it are the targets' evidence
        bench_shapes(report, budget, args)
    report.flush()
    print(report.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
