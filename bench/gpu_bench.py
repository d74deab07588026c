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
warm-up; each cell's first call, which compiles lcsm's Triton kernels and autotunes fla's, timed
apart), the targets' lengths (8K, 32K) in both dtypes first. Next, Mamba's selective scan
(``--scan-lengths``; one head, K = N = 16, D = d_inner = ``--scan-dim``, LogProduct(Delta_t, A)),
mode "triton" (lcsm/ops/triton_scan.py) against the chunk form's elementwise kernel (a few PyTorch
operations a step, at T <= ``--scan-chunk-max`` only) and causal SDPA at the operators' shape; next,
for a few cases (``--profile``), the kernels of one forward + backward of each form with their
device times (torch.profiler), so that a loan also says where the time goes; then training steps
of ~100M-parameter language models (lcsm gla, gated_deltanet, a Transformer and Mamba), in bf16
autocast; then, for a few (``--shapes``), mode "triton" under other launch shapes (warps, pipeline
stages, block widths) than the kernel modules' own.

fla comes last, in a pass of its own: its first call of each kernel autotunes every configuration
(minutes for one op on a fresh machine: in the run of 2026-12-04, measured beside lcsm's cells,
it took most of a 240 s budget). The pass fills the operators' fla cells (``--fla-dtypes`` at
``--fla-lengths``, default bf16 at 8K: fla's production dtype at the target's length), profiles
fla's form for the ``--profile`` cases in those dtypes, and trains fla's GLA and Gated DeltaNet
models of the same width and depth (``--fla-models``, with fla's untied embeddings). The sections
before it stop at (1 - ``--fla-share``) of the budget (``--budget``), the pass at its end; a case
started after its deadline is marked SKIP. The report is rewritten after every case (its targets
with it), so that a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
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
DTYPES = ("bfloat16", "float32")
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


Key = tuple[str, str, int]  # (op, dtype name, T)
Cell = tuple[float | None, float | None, float | None]  # (ms, peak MiB, first call s); None where it failed
FAILED: Cell = (None, None, None)


def fmt(v: float | None, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


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


def first_call(fn: Callable[[], object]) -> float:
    """Seconds of ``fn``'s first call (synchronised): lcsm's Triton kernels compile in it and fla's
    autotune, which the medians of ``cuda_time`` leave out."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def release(case: str) -> None:
    """Empty the device's cache after ``case``. A fault in one of its kernels (an illegal address:
    a sticky CUDA error, raised again by every later call) is logged here instead of ending the
    run, so that the report keeps the cases measured and the later ones read "failed"."""
    if DEVICE == "cpu":
        return
    try:
        torch.cuda.empty_cache()
    except Exception as exc:
        log(f"{case}: emptying the device's cache: {exc!r}")


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


def peak_bytes(step: Callable[[], None], x: dict) -> int | None:
    """Peak bytes of one ``step`` above the inputs ``x``, their gradients from the last step freed
    first: ``step`` frees and reallocates them, so a base that held them left them out of the peak."""
    if DEVICE == "cpu":
        return None
    for t in x.values():
        t.grad = None
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
        """Rewrite the report whole: written beside it and renamed over it, so that a run stopped
        during the write (gpu.sh's timeout) leaves the previous report, not a truncated one."""
        if self.out:
            out = Path(self.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(self.render())
            os.replace(tmp, out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fla_unavailable() -> str | None:
    """Why fla's ops cannot be called here (their imports' exception), or None where they import."""
    try:
        import fla.ops.delta_rule  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.gla  # noqa: F401
        import fla.ops.kda  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
    except Exception as exc:  # missing, or failing on its own imports (transformers, einops, packaging)
        return repr(exc)
    return None


class OpsTable:
    """The operators' rows, kept as their cells: fla's cells arrive in the last pass (``bench_ops_fla``)
    and re-render their rows in place, and the targets are recomputed from the cells before every
    flush, so that a report cut off anywhere holds them."""

    def __init__(self, rows: list[str], fla_keys: list[Key]):
        self.rows = rows
        self.index: dict[Key, int] = {}
        self.cells: dict[Key, dict[str, Cell]] = {}
        self.sdpa: dict[tuple[str, int], float | None] = {}
        self.skipped: set[Key] = set()
        # fla's cell of each row the pass will measure: "pending" until it does, then its Cell, or
        # "budget spent" where the pass had no time left for it; rows outside the pass have none
        self.fla: dict[Key, Cell | str] = dict.fromkeys(fla_keys, "pending")

    def put(self, key: Key) -> None:
        line = self.render(key)
        if key in self.index:
            self.rows[self.index[key]] = line
        else:
            self.index[key] = len(self.rows)
            self.rows.append(line)
        log(line)

    def render(self, key: Key) -> str:
        op, dname, T = key
        cells = self.cells.get(key, {})
        lc, tr = cells.get("lcsm", FAILED), cells.get("triton", FAILED)
        fla = self.fla.get(key, "")
        fl = fla if isinstance(fla, tuple) else FAILED
        sd = self.sdpa.get((dname, T))
        skipped = key in self.skipped
        if isinstance(fla, tuple):
            fla_ms, fla_first = fmt(fl[0]), fmt(fl[2], 1)
        else:
            fla_ms, fla_first = "SKIP (budget spent)" if fla == "budget spent" else fla, ""
        cols = [op, dname, str(T), "SKIP (budget spent)" if skipped else fmt(lc[0]), "" if skipped else fmt(tr[0])]
        cols += [fla_ms, fla_first, fmt(ratio(lc[0], fl[0])), fmt(ratio(tr[0], fl[0])), "" if skipped else fmt(sd)]
        cols += [fmt(ratio(lc[0], sd)), fmt(ratio(tr[0], sd)), fmt(lc[1], 0), fmt(tr[1], 0), fmt(fl[1], 0)]
        return "| " + " | ".join(cols) + " |"

    def checks(self, fla_dtypes: list[str]) -> list[Check]:
        """The issue's targets: lcsm against fla at 8K (in the dtypes of fla's pass), and against
        SDPA at 32K, the chunk form's and the better of lcsm's two forms' (mode "auto" takes the
        Triton one on CUDA where it serves the decay)."""
        short, long = TARGET_LENGTHS
        out = []
        for op in OPS:
            for dname in DTYPES:
                if dname in fla_dtypes:
                    cells, fla = self.cells.get((op, dname, short), {}), self.fla.get((op, dname, short), "not run")
                    fl = fla if isinstance(fla, tuple) else FAILED
                    note = fla if isinstance(fla, str) else "fla failed: gpu_bench.log" if fl[0] is None else ""
                    lc, tr = cells.get("lcsm", FAILED)[0], cells.get("triton", FAILED)[0]
                    out.append(Check(f"{op} {dname} T=8K: lcsm / fla", ratio(lc, fl[0]), "<=", 1.2, note))
                    out.append(Check(f"{op} {dname} T=8K: lcsm triton / fla", ratio(tr, fl[0]), "<=", 1.2, note))
                cells, sd = self.cells.get((op, dname, long), {}), self.sdpa.get((dname, long))
                forms = [cells.get(n, FAILED)[0] for n in ("lcsm", "triton")]
                best = min((ms for ms in forms if ms), default=None)
                out.append(Check(f"{op} {dname} T=32K: lcsm / SDPA", ratio(forms[0], sd), "<=", 1 / 3))
                out.append(Check(f"{op} {dname} T=32K: best lcsm form / SDPA", ratio(best, sd), "<=", 1 / 3))
        return out


def bench_ops(report: Report, budget: Budget, args) -> OpsTable:
    """lcsm's two forms and SDPA in every row; fla's cells are left to ``bench_ops_fla``."""
    fla_note = f"fla at T in {', '.join(map(str, args.fla_lengths))}, {', '.join(args.fla_dtypes)}, measured last"
    rows = report.section(
        f"Operators, forward + backward (B{args.batch} H{args.heads} K = D = {args.dim}; ms, median of "
        f"{args.repeats}; fla's first call in s: its autotuning; peak MiB above the inputs; in the order measured, "
        f"the targets' lengths first; {fla_note})",
        [
            "| op | dtype | T | lcsm chunk ms | lcsm triton ms | fla ms | fla first call s | lcsm / fla | "
            "triton / fla | SDPA ms | lcsm / SDPA | triton / SDPA | lcsm MiB | triton MiB | fla MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ],
    )
    # the targets' lengths first (lcsm / fla at 8K, lcsm / SDPA at 32K), in both dtypes before any
    # other length: a loan's budget may end before the rest
    cases = [(dname, T) for dname in DTYPES for T in args.lengths]
    cases.sort(key=lambda case: (case[1] not in TARGET_LENGTHS, case[1]))
    fla_keys = [(op, d, T) for d, T in cases if d in args.fla_dtypes and T in args.fla_lengths for op in OPS]
    table = OpsTable(rows, fla_keys)
    for dname, T in cases:
        dtype = getattr(torch, dname)
        for op in OPS:
            key = (op, dname, T)
            if budget.left() <= 0:
                table.skipped.add(key)
            else:
                cells = table.cells.setdefault(key, {})
                forms = [
                    ("lcsm", lambda x, op=op: lcsm_op(op, x)),
                    ("triton", lambda x, op=op: lcsm_op(op, x, "triton")),
                ]
                if (dname, T) not in table.sdpa:
                    forms.append(("sdpa", sdpa))
                for name, f in forms:
                    if name == "triton" and op not in TRITON_OPS:
                        continue
                    shape = (op, T, dtype, args.batch, args.heads, args.dim)
                    cells[name] = measure(f, lambda shape=shape: op_inputs(*shape), args, f"{op} {dname} T={T} {name}")
                if "sdpa" in cells:
                    table.sdpa[(dname, T)] = cells.pop("sdpa")[0]
            table.put(key)
            report.checks = table.checks(args.fla_dtypes)
            report.flush()
    return table


def bench_ops_fla(report: Report, budget: Budget, args, table: OpsTable) -> None:
    """fla's cells of the operators' rows (``--fla-dtypes`` at ``--fla-lengths``), each row re-rendered as
    its cell arrives; the first call of each op autotunes its kernels, timed in the row."""
    for key in [k for k, v in table.fla.items() if v == "pending"]:
        op, dname, T = key
        if budget.left() <= 0:
            table.fla[key] = "budget spent"
        else:
            shape = (op, T, getattr(torch, dname), args.batch, args.heads, args.dim)
            table.fla[key] = measure(
                lambda x, op=op: fla_op(op, x), lambda shape=shape: op_inputs(*shape), args, f"{op} {dname} T={T} fla"
            )
        table.put(key)
        report.checks = table.checks(args.fla_dtypes)
        report.flush()


def measure(f: Callable[[dict], torch.Tensor], inputs: Callable[[], dict], args, case: str) -> Cell:
    """(ms, peak MiB, first call s) of ``f``'s forward + backward on fresh ``inputs()``, the first call
    one of the warm-up's, or ``FAILED`` where it fails (the failure logged under ``case``); the
    device's cache emptied after."""
    try:
        result = _measure(f, inputs, args, case)
    except Exception as exc:
        log(f"{case}: {exc!r}")
        result = FAILED
    # after the except clause: its traceback, which held the inputs, is gone
    release(case)
    return result


def _measure(f: Callable[[dict], torch.Tensor], inputs: Callable[[], dict], args, case: str) -> Cell:
    x = inputs()
    step = fwd_bwd(f, x)
    first = first_call(step)
    log(f"{case}: first call {first:.1f} s")
    ms = cuda_time(step, max(args.warmup - 1, 0), args.repeats) * 1e3
    peak = peak_bytes(step, x)
    return ms, None if peak is None else peak / 2**20, first


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

    for dtype in (torch.bfloat16, torch.float32):
        dname = str(dtype).removeprefix("torch.")
        for T in args.scan_lengths:
            if budget.left() <= 0:
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
            tr, ch, sd = (cells.get(n, FAILED) for n in ("triton", "chunk", "sdpa"))
            r_chunk, r_sdpa = ratio(ch[0], tr[0]), ratio(tr[0], sd[0])
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


LCSM_FORMS = (("lcsm triton", "triton"), ("lcsm chunk", "chunk"))
FLA_FORMS = (("fla", None),)


def kernels_section(report: Report, args) -> list[str]:
    where = "device time of each kernel" if DEVICE == "cuda" else "host time of each op (CPU smoke test)"
    return report.section(
        f"Kernels of one forward + backward (B{args.batch} H{args.heads} K = D = {args.dim}; torch.profiler, {where}; "
        f"the {args.top} longest; fla's form last, in {', '.join(args.fla_dtypes)} only)",
        ["| case | kernel | calls | ms | share of the case |", "| --- | --- | ---: | ---: | ---: |"],
    )


def bench_kernels(report: Report, budget: Budget, args, rows: list[str], forms, cases: list[str]) -> None:
    """Where one forward + backward spends its time, kernel by kernel (torch.profiler, after one
    unprofiled call that compiles and warms the kernels, its time on the case's total row): the
    ``--top`` longest of each case, so that a loan says which of a form's kernels to work on.
    ``forms``: (label, lcsm mode) pairs, mode None for fla's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    for spec in cases:
        op, dname, T = spec.split(":")
        for label, mode in forms:
            case = f"{op} {dname} T={T} {label}"
            if budget.left() <= 0:
                rows.append(f"| {case} | SKIP (budget spent) | | | |")
                continue
            try:
                x = op_inputs(op, int(T), getattr(torch, dname), args.batch, args.heads, args.dim)
                if mode is None:
                    step = fwd_bwd(lambda x, op=op: fla_op(op, x), x)
                else:
                    step = fwd_bwd(lambda x, op=op, mode=mode: lcsm_op(op, x, mode), x)
                first = first_call(step)
                with profile(activities=activities) as prof:
                    step()
                    sync()
                events = [(e.key, e.count, _self_time_us(e)) for e in prof.key_averages()]
                events = sorted((e for e in events if e[2] > 0), key=lambda e: -e[2])
                total = sum(e[2] for e in events)
                for key, count, us in events[: args.top]:
                    name = key if len(key) <= 70 else key[:67] + "..."
                    rows.append(f"| {case} | `{name}` | {count} | {us / 1e3:.2f} | {us / total:.1%} |")
                rows.append(f"| {case} | all {len(events)} (first call {first:.1f} s) | | {total / 1e3:.2f} | 100% |")
            except Exception as exc:
                log(f"{case}: {exc!r}")
                rows.append(f"| {case} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | |")
            x = step = None  # before the next case's inputs, also after a failure (out of memory)
            release(case)
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
            if budget.left() <= 0:
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
            release(f"{case} {label}")
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


def train_section(report: Report, args) -> list[str]:
    return report.section(
        f"Training a language model (d {args.model_dim}, {args.model_layers} layers, vocab {args.vocab}, "
        f"batch {args.train_batch} x {args.train_len} tokens, bf16 autocast, AdamW; median of {args.repeats} steps; "
        "the first step in s: compiling and autotuning; fla's models last)",
        [
            "| model | parameters (M) | s / step | tokens / s | peak GiB | first step s |",
            "| --- | --- | --- | --- | --- | --- |",
        ],
    )


def bench_train(report: Report, budget: Budget, args, rows: list[str], fla: bool) -> None:
    """Training steps of lcsm's models (``--mixers``), or with ``fla`` of fla's (``--fla-models``)."""
    library, make, models = ("fla", fla_lm, args.fla_models) if fla else ("lcsm", lcsm_lm, args.mixers)
    tokens = torch.randint(0, args.vocab, (args.train_batch, args.train_len + 1), device=DEVICE)
    for mixer in models:
        name = f"{library} {mixer}"
        if budget.left() <= 0:
            rows.append(f"| {name} | SKIP (budget spent) | | | | |")
            continue
        try:
            model = make(mixer, args.model_dim, args.model_layers, args.vocab).to(DEVICE)
            n_params = sum(p.numel() for p in model.parameters()) / 1e6
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE != "cpu")

            def step(model=model, opt=opt):
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    out = model(tokens[:, :-1])
                    logits = out.logits if fla else out
                    if isinstance(logits, tuple):
                        logits = logits[0]
                    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if DEVICE != "cpu":
                torch.cuda.reset_peak_memory_stats()
            first = first_call(step)
            sec = cuda_time(step, max(args.warmup - 1, 0), args.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE != "cpu" else float("nan")
            tps = args.train_batch * args.train_len / sec
            rows.append(f"| {name} | {n_params:.1f} | {sec:.3f} | {tps:,.0f} | {peak:.1f} | {first:.1f} |")
        except Exception as exc:
            traceback.print_exc()
            rows.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | |")
        model = opt = step = None  # before the next model, also after a failure (out of memory)
        release(name)
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
        "--fla-share",
        type=float,
        default=0.4,
        help="the budget's share held back for fla's pass at the end (where fla's ops import)",
    )
    p.add_argument(
        "--fla-dtypes",
        type=lambda s: [d for d in s.split(",") if d],
        default=["bfloat16"],
        help="dtypes of fla's pass: its operators' cells, its --profile cases (comma-separated)",
    )
    p.add_argument(
        "--fla-lengths",
        type=lambda s: [int(t) for t in s.split(",") if t],
        default=[TARGET_LENGTHS[0]],
        help="lengths of fla's operators' cells (those among --lengths; comma-separated)",
    )
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
    if not 0 <= args.fla_share < 1:
        p.error(f"--fla-share: expected a fraction in [0, 1), got {args.fla_share}")
    if set(args.fla_dtypes) - set(DTYPES):
        p.error(f"--fla-dtypes: expected among {', '.join(DTYPES)}, got {','.join(args.fla_dtypes)}")
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
    fla_missing = fla_unavailable()
    if fla_missing:
        log(f"fla unavailable (its cells will read -, its budget share goes to lcsm's): {fla_missing}")
        header["fla"] = f"unavailable: {fla_missing[:150]}"
    else:
        import fla

        header["fla"] = getattr(fla, "__version__", "imported, no version")
    report = Report(header, args.out)
    budget = Budget(args.budget)
    # lcsm's sections before fla's pass and within their own share: fla's first calls autotune for
    # minutes on a fresh device (most of a 240 s budget on an H200, 2026-12-04)
    lcsm_budget = Budget(args.budget * (1 - args.fla_share)) if not fla_missing else budget
    torch.backends.cuda.matmul.allow_tf32 = False
    table = bench_ops(report, lcsm_budget, args) if "ops" not in skip else None
    if "scan" not in skip:
        bench_scan(report, lcsm_budget, args)
    if "kernels" not in skip:
        kernel_rows = kernels_section(report, args)
        bench_kernels(report, lcsm_budget, args, kernel_rows, LCSM_FORMS, args.profile)
    if "train" not in skip:
        train_rows = train_section(report, args)
        bench_train(report, lcsm_budget, args, train_rows, fla=False)
    if "shapes" not in skip:  # last of lcsm's: tuning, where the sections before it are the targets' evidence
        bench_shapes(report, lcsm_budget, args)
    if table is not None:
        bench_ops_fla(report, budget, args, table)
    if "kernels" not in skip:
        fla_cases = [c for c in args.profile if c.split(":")[1] in args.fla_dtypes]
        bench_kernels(report, budget, args, kernel_rows, FLA_FORMS, fla_cases)
    if "train" not in skip:
        bench_train(report, budget, args, train_rows, fla=True)
    report.flush()
    print(report.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
