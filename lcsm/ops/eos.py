"""The Expand-Oscillation-Shrink operator (LCSM section 2.2, eq. 2-3 with psi = elementwise).

    m_t = o_t * m_{t-1} + e_t (x) i_t,    y_t = sum_k s_t[k] * m_t[k, :],    o_t = exp(log_o_t)

log_o is one tensor, a separable pair (log_row, log_col), o = exp(log_row + log_col) = a (x) b
(LCSM Table 3, o code 1), which the chunk mode's matmul kernel applies factor by factor, or a
``LogProduct(a, b)``, o = exp(a * b) (Mamba's Delta_t A), which the elementwise kernel forms
step by step.
See docs/eos.md for the semantics, each mode's algorithm and the mapping of the papers' models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lcsm._checks import check_bool

from ._host_heap import prime_host_heap
from ._inputs import (
    MODES,
    EOSProblem,
    LogO,
    canonicalize,
    check_chunk_size,
    check_cu_seqlens,
    check_packed,
    finish,
    real_dtype,
    shape_str,
    triton_unavailable,
    without_autocast,
)
from .chunk import chunk_length, eos_chunk, kernel_for, matmul_operands
from .chunk_matmul import SAFE_SPAN, factorised_segments
from .fft import eos_fft
from .native_scan import chunk_length as native_chunk_length
from .native_scan import eos_native, native_chunk_unsupported, native_unsupported, scan_unsupported, serial_reason
from .packed import Documents, add_states, packed_recurrent, reset_at_starts
from .parallel import eos_parallel
from .reference import eos_recurrent, eos_step_state

Tensor = torch.Tensor


@dataclass(frozen=True)
class Plan:
    """What ``eos`` will do for given inputs: the mode, the kernel inside it, and why."""

    mode: str
    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"mode={self.mode} kernel={self.kernel}: {self.reason}"


_DECAY_WORDS = {
    "none": "no decay",
    "scalar": "a scalar decay",
    "row": "a row decay (varies over K)",
    "col": "a column decay (varies over D)",
    "outer": "a separable decay o = a (x) b, applied as a along K and b along D without forming the K x D decay",
}


def _kernel_reason(p: EOSProblem) -> str:
    """Why ``kernel_for`` picks its kernel for this problem, and for the matmul kernel whether its C
    form (``native_chunk``) runs it."""
    if kernel_for(p) == "matmul":
        reason = f"matmul kernel: vector e/s and {_DECAY_WORDS[p.decay_kind]}"
        why = native_chunk_unsupported(p)
        return reason + (
            ", in C (native_chunk: each chunk's products on register tiles, a decay of any strength in one form)"
            if why is None
            else f", in PyTorch (not the native chunk kernel: {why})"
        )
    why = []
    if p.decay_kind == "full":
        why.append("a full K x D decay")
    if p.decay_kind == "product":
        why.append(
            "a full K x D decay given as a product a * b (each block of steps forms its exp(a * b) "
            "when it runs, in cache)"
        )
    if not (p.e_is_vector and p.s_is_vector):
        why.append("K x D " + "/".join(n for n, vec in (("e", p.e_is_vector), ("s", p.s_is_vector)) if not vec))
    reason = "elementwise kernel: " + " and ".join(why)
    if p.decay_kind == "outer":
        reason += " (the separable decay's two factors multiplied out one block of steps at a time)"
    return reason


_TRITON_DECAYS = ("none", "scalar", "row", "col")
_SCAN_DECAYS = ("full", "product")
# triton_chunk.MAX_WIDTH and triton_scan.MAX_K, here so that planning never imports triton
_TRITON_MAX_WIDTH = 256
_TRITON_SCAN_MAX_K = 256


def _triton_unsupported(p: EOSProblem, packed: bool = False) -> str | None:
    """Why the Triton kernels cannot serve this problem, or None when they can: ``triton_scan`` for
    a full K x D decay, else ``triton_chunk``. Both are traced by torch.compile too (their launches
    are custom ops), the chunk kernels but for packed documents."""
    scan = p.decay_kind in _SCAN_DECAYS
    why = triton_unavailable(p.i, traceable=scan or not packed)
    if why is not None:
        return why + (" (packed documents)" if packed and torch.compiler.is_compiling() else "")
    if p.i.is_complex():
        return "complex inputs (the kernels are real)"
    if scan:
        if p.i.dtype not in (torch.float32, torch.float64):
            return f"compute dtype {p.i.dtype} (the scan computes in float32 or float64)"
        why = scan_unsupported(p)
        if why is None and p.K > _TRITON_SCAN_MAX_K:
            why = f"K = {p.K}: more than {_TRITON_SCAN_MAX_K} (a program holds every memory row)"
        return why
    if p.i.dtype != torch.float32:
        return f"compute dtype {p.i.dtype} (the kernels compute in float32: inputs float32, bfloat16 or float16)"
    if not (p.e_is_vector and p.s_is_vector):
        return "K x D " + "/".join(n for n, vec in (("e", p.e_is_vector), ("s", p.s_is_vector)) if not vec)
    if p.decay_kind not in _TRITON_DECAYS:
        return f"decay {p.decay_kind!r} (the kernels take {', '.join(map(repr, _TRITON_DECAYS))})"
    if max(p.K, p.D) > _TRITON_MAX_WIDTH:
        return (
            f"K = {p.K}, D = {p.D}: more than {_TRITON_MAX_WIDTH} (a block of all K memory rows, D in the "
            "backward's transposed problem, is held in registers)"
        )
    return None


def _triton_plan(p: EOSProblem, chunk_size: int, why: str) -> Plan:
    if p.decay_kind in _SCAN_DECAYS:
        return Plan(
            "triton",
            "triton-scan",
            f"{why}: the Triton selective scan (triton_scan), vector e/s and a full K x D decay"
            f"{' given as a product a * b' if p.decay_kind == 'product' else ''}: one associative scan "
            "a block of 16 steps, the memory kept at each block (chunk_size does not apply); backward "
            "by reverse scans",
        )
    from .triton_chunk import chunk_steps

    return Plan(
        "triton",
        f"triton-{p.decay_kind}",
        f"{why}: Triton kernels, vector e/s and {_DECAY_WORDS[p.decay_kind]}, chunks of "
        f"{chunk_steps(chunk_size, p.T)} steps; backward by the same kernels",
    )


def _plan(p: EOSProblem, mode: str, chunk_size: int, documents: int | None = None) -> Plan:
    """The plan; ``documents``: N of ``cu_seqlens`` for packed sequences (None: not packed)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if documents is None:
        return _plan_one(p, mode, chunk_size, packed=False)
    if mode == "fft":
        raise ValueError(
            "mode='fft' cannot serve cu_seqlens: a convolution with one time-invariant kernel cannot "
            "restart the memory at document boundaries; use mode='chunk' or 'auto'"
        )
    plan = _plan_one(p, mode, chunk_size, packed=True)
    if plan.mode == "recurrent":
        how = "each document alone through the recurrence, a loop over documents"
    elif plan.kernel == "triton-scan":
        how = "one pass over the row, the memory restarted from each document's own initial state at its first token"
    elif plan.mode == "triton":
        how = (
            "each document laid out from a chunk boundary (zeros up to its last chunk's end), the "
            "memory restarted from its own initial state at its first chunk"
        )
    elif plan.mode == "native":
        how = "one pass over the row, the memory restarted from each document's own initial state at its first token"
    else:
        how = (
            "one pass over the packed row with a decay of exactly 0 at each document's first token; "
            "initial states' share and per-document final states by closed forms (packed.py)"
        )
    return Plan(plan.mode, plan.kernel, f"{plan.reason}; cu_seqlens, {documents} documents: {how}")


def _plan_one(p: EOSProblem, mode: str, chunk_size: int, packed: bool) -> Plan:
    """The plan of one mode."""
    structure = (
        f"decay={p.decay_kind}, e={'vector' if p.e_is_vector else 'K x D'}, s={'vector' if p.s_is_vector else 'K x D'}"
    )
    if mode == "fft" and not p.data_independent:
        dd = [n for n, f in (("e", p.e_dd), ("s", p.s_dd), ("log_o", p.g_dd)) if f]
        raise ValueError(
            f"mode='fft' needs data-independent e, s and log_o (a time-invariant system), but "
            f"{', '.join(dd)} {'is' if len(dd) == 1 else 'are'} data-dependent; use mode='chunk' or 'auto'"
        )
    if mode == "recurrent":
        return Plan("recurrent", "loop", "requested: the step-by-step reference")
    if mode == "parallel":
        return Plan("parallel", "attention-map", f"requested: O(T^2) masked map ({structure})")
    if mode == "fft":
        return Plan("fft", "long-convolution", "requested: time-invariant kernel by FFT")
    if mode == "chunk":
        return Plan("chunk", kernel_for(p), f"requested ({structure}); {_kernel_reason(p)}")
    if mode == "triton":
        why = _triton_unsupported(p, packed)
        if why is not None:
            raise ValueError(f"mode='triton' cannot serve these inputs: {why}; use mode='chunk' or 'auto'")
        return _triton_plan(p, chunk_size, "requested")
    if mode == "native":
        why = native_unsupported(p)
        if why is not None:
            raise ValueError(f"mode='native' cannot serve these inputs: {why}; use mode='chunk' or 'auto'")
        return _native_plan(p, chunk_size, "requested")
    # auto
    if p.T <= 1:
        return Plan("recurrent", "loop", "T <= 1: one recurrent step is cheapest (decoding)")
    if p.data_independent and not packed:
        return Plan(
            "fft",
            "long-convolution",
            "e, s and log_o are data-independent: a time-invariant system, computed as an "
            "O(T log T) convolution with an O(T K D) kernel",
        )
    # A time-invariant system becomes time-varying once its memory restarts (packed documents):
    # the modes below, not one convolution.
    invariant = "packed, so not fft, whose one convolution cannot restart the memory; " if p.data_independent else ""
    reason = (
        f"{invariant}linear-time chunkwise form with C={chunk_length(chunk_size, p.T)} ({structure}); "
        f"{_kernel_reason(p)}"
    )
    if p.i.device.type == "cuda":
        why = _triton_unsupported(p, packed)
        if why is None and p.out_dtype == torch.float32 and p.decay_kind in ("none", "scalar"):
            # H200, B1 H16 K = D = 128, fwd+bwd (bench/results/gpu_triton.md): float32 kernels with a
            # scalar decay ran 1.5-2.3x slower than this chunk form (no decay not measured, taken
            # alike); in bfloat16 2.4-5.5x faster. Measured with full-precision matmuls, whose
            # output kernel spilled ~4 KB of registers; the tf32x3 ones since do not
            # (bench/results/triton_registers.md), not yet timed on a GPU.
            why = "float32 inputs with no or a scalar decay, where the PyTorch chunk form was faster on an H200"
        if why is None:
            return _triton_plan(p, chunk_size, f"{invariant}CUDA tensors and triton installed")
        reason += f"; not the Triton kernels: {why}"
    if p.decay_kind in ("full", "product"):
        why = native_unsupported(p)
        if why is None:
            return _native_plan(p, chunk_size, f"{invariant}CPU tensors, vector e/s and a full K x D decay")
        reason += f"; not the native scan: {why}"
    return Plan("chunk", kernel_for(p), reason)


def _native_plan(p: EOSProblem, chunk_size: int, why: str) -> Plan:
    every = native_chunk_length(chunk_size, p.K, p.i.dtype)
    kept = f"memory kept every {every} steps" if every < p.T else "memory kept at the start only"
    return Plan(
        "native",
        "native-scan",
        f"{why}: one C kernel (native_scan), the decay's exp formed step by step, {kept}; backward by the same kernel"
        + (f" ({serial_reason()})" if serial_reason() else ""),
    )


def explain(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    log_o: LogO = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> Plan:
    """The plan ``eos`` follows for these arguments (validated exactly as ``eos`` does).

    Auto rules, in order: T <= 1 -> recurrent; e, s and log_o all data-independent (both parts
    of a separable pair or a product), not packed -> fft; on CUDA tensors with triton installed, where the
    Triton kernels serve the inputs (K-vector e and s, no, scalar, row or column decay, real,
    float32 compute; traced by torch.compile too, but not for packed documents) -> triton
    (``triton_chunk``), except float32 inputs with no or a scalar decay (a scalar one slower there
    than the chunk form, bench/results/gpu_triton.md); on CUDA tensors with triton installed, K-vector
    e and s and a full K x D decay (one tensor, or a product log_o = a * b with one operand
    time-invariant), real, float32 or float64 compute, K <= 256 -> triton (``triton_scan``, the
    selective scan; packed documents and traced graphs too); on CPU tensors
    with K-vector e and s and a full K x D decay (one tensor, or a product log_o = a * b with one
    operand time-invariant: Mamba's Delta_t A), real, float32 or float64 compute, where the C kernel
    builds -> native (``native_scan``); otherwise chunk (kernel
    ``matmul`` when e and s are K-vectors and the decay is none/scalar/row/column or a separable
    pair, else ``elementwise``, which multiplies a separable pair's factors out a block at a time and forms a
    product's exp(a * b) block by block). ``parallel`` is never chosen automatically: it is the
    O(T^2) attention-map form, for analysis and tests. The recurrent, parallel and fft modes also
    take a separable pair as its materialised sum and a product as a * b: they are the plain,
    obviously correct forms.
    With ``cu_seqlens`` (packed sequences) the plan says how the documents are kept apart; fft
    is refused, and auto takes chunk where it would take fft. Without them, a plan of the matmul
    kernel in PyTorch with a decay also says, from the decays' values, in how many of the kernel's
    segments every chunk factorises through its start, the rest taking the slower form of strong
    decays (a chunk whose decay falls below exp(-SAFE_SPAN); ``chunk_matmul.factorised_segments``);
    its C form (no, a scalar, a row or a column decay on real CPU tensors, ``native_chunk``) takes
    any decay in one form.
    """
    chunk_size = check_chunk_size(chunk_size)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens)
    n = None if bounds is None else len(bounds) - 1
    p = canonicalize(i, e, s, log_o, initial_state, states=n)
    if bounds is not None:
        check_packed(bounds, p.B, p.T)
    plan = _plan(p, mode, chunk_size, n)
    if plan.kernel == "matmul" and p.decay_kind != "none" and n is None and native_chunk_unsupported(p) is not None:
        plan = Plan(plan.mode, plan.kernel, f"{plan.reason}; {_decay_form(p, chunk_size)}")
    return plan


def _decay_form(p: EOSProblem, chunk_size: int) -> str:
    """The matmul kernel's choice for these decays' values: each chunk factorised through its start
    while every chunk's decay spans at most exp(+-SAFE_SPAN), else the strong decays' form."""
    s, _, i, g, _ = matmul_operands(p)
    C = chunk_length(chunk_size, p.T)
    done, parts = factorised_segments(s, i, g, C)
    if done == parts:
        return f"decays: factorised through each chunk's start in all {parts} segment(s)"
    return (
        f"decays: factorised in {done} of {parts} segment(s); in the rest some chunk's decay spans beyond "
        f"exp(-{SAFE_SPAN[real_dtype(s.dtype)]:g}), which takes the strong decays' pairwise (or sub-chunk) "
        "form, slower (bench/results/mamba2_chunk.md): a smaller chunk_size shortens the spans"
    )


@without_autocast
def eos(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    log_o: LogO = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    real_output: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run the EOS recurrence over a sequence.

    Args:
        i: input state [B, T, H, D].
        e, s: expand / shrink states: data-dependent [B, T, H, K], or data-independent [H, K]
            (a K-vector) or [H, K, D] (a K x D matrix, used elementwise: e * (1 i_t^T)).
        log_o: log oscillation, o = exp(log_o); None means o = 1. Data-dependent
            [B, T, H, K|1, D|1] or data-independent [H, K|1, D|1]; or a separable pair
            (log_row, log_col) meaning o = exp(log_row + log_col) = a (x) b (LCSM Table 3, o code 1),
            log_row [B, T, H, K, 1] or [H, K, 1], log_col [B, T, H, 1, D] or [H, 1, D], each
            data-dependent or not on its own; or ``LogProduct(a, b)`` meaning o = exp(a * b), a and b
            each of log_o's shapes (Mamba: Delta_t [B, T, H, 1, D] times A [H, K, D]). May be
            complex (log r + i theta) for rotations; then y and the memory are complex.
        mode: "auto", "recurrent", "parallel", "chunk", "fft", "triton" or "native" (see ``explain``).
        initial_state: m_0 [B, H, K, D] (zeros when None).
        output_final_state: also return m_T [B, H, K, D].
        chunk_size: C for mode "chunk" (any C >= 1; T need not be a multiple; C > T runs as C = T);
            mode "triton" takes the largest of 16, 32, 64 not above it (16 at least; its selective
            scan for a full decay runs blocks of 16 steps whatever chunk_size); mode "native"
            keeps its memory every C steps (``native_scan.chunk_length``).
        real_output: return Re(y), a real tensor, as the diagonal SSMs and CES read a complex
            system (the memory stays complex). With a real input, mode "fft" then convolves it with
            the kernel's real part by real FFTs, about half the work of the complex ones.
        cu_seqlens: packed sequences (FlashAttention's convention): an integer tensor [N + 1],
            0 = cu[0] < cu[1] < ... < cu[N] = T, with B = 1 holding N documents back to back.
            Each document's memory starts from its own initial state, ``initial_state`` then
            [N, H, K, D], and the final states are per document, [N, H, K, D]; nothing crosses
            a boundary. Modes recurrent (a loop over documents), parallel and chunk (one pass,
            the memory zeroed at each boundary), triton (each document from a chunk boundary; the
            selective scan restarts at each document's first token),
            native (restarted at each document's first token); not fft (see docs/eos.md, "Packed sequences").

    Returns:
        y [B, T, H, D] and m_T (or None).
    """
    chunk_size = check_chunk_size(chunk_size)
    real_output = check_bool("real_output", real_output)
    output_final_state = check_bool("output_final_state", output_final_state)
    prime_host_heap(i)
    if cu_seqlens is not None:
        return _eos_packed(i, e, s, log_o, mode, initial_state, output_final_state, chunk_size, real_output, cu_seqlens)
    p = canonicalize(i, e, s, log_o, initial_state)
    plan = _plan(p, mode, chunk_size)
    if p.T == 0:
        m = p.m0 if p.m0 is not None else p.i.new_zeros(p.B, p.H, p.K, p.D)
        return finish(p, p.i.new_zeros(p.B, p.H, 0, p.D), m, output_final_state, real_output)
    # An empty batch, head or state dimension: every form gives the same empty (or, for K = 0,
    # zero) output; the step loop computes it without the fast forms' block and FFT sizing.
    if plan.mode == "recurrent" or p.B * p.H * p.K * p.D == 0:
        y, m_T = eos_recurrent(p)
    elif plan.mode == "parallel":
        y, m_T = eos_parallel(p)
    elif plan.mode == "fft":
        y, m_T = eos_fft(p, real_output, output_final_state)
    elif plan.kernel == "triton-scan":
        from .triton_scan import eos_triton_scan

        y, m_T = eos_triton_scan(p)
    elif plan.mode == "triton":
        from .triton_chunk import eos_triton

        y, m_T = eos_triton(p, chunk_size)
    elif plan.mode == "native":
        y, m_T = eos_native(p, chunk_size)
    else:
        y, m_T = eos_chunk(p, chunk_size)
    return finish(p, y, m_T, output_final_state, real_output)


def _eos_packed(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    log_o: LogO,
    mode: str,
    initial_state: Tensor | None,
    output_final_state: bool,
    chunk_size: int,
    real_output: bool,
    cu_seqlens: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """``eos`` on packed sequences (``packed.py``): y [1, T, H, D], final states [N, H, K, D]."""
    bounds = check_cu_seqlens(cu_seqlens)
    p = canonicalize(i, e, s, log_o, initial_state, states=len(bounds) - 1)
    check_packed(bounds, p.B, p.T)
    plan = _plan(p, mode, chunk_size, len(bounds) - 1)
    docs = Documents.of(bounds, p.i.device)
    if plan.mode == "recurrent" or p.H * p.K * p.D == 0:
        y, m_T = packed_recurrent(p, docs)
        return finish(p, y, m_T, output_final_state, real_output)
    if plan.kernel == "triton-scan":
        from .triton_scan import eos_triton_scan

        y, m_T = eos_triton_scan(p, cu_seqlens)
        return finish(p, y, m_T, output_final_state, real_output)
    if plan.mode == "triton":
        from .triton_chunk import eos_triton_packed

        y, m_T = eos_triton_packed(p, bounds, chunk_size)
        return finish(p, y, m_T, output_final_state, real_output)
    if plan.mode == "native":
        y, m_T = eos_native(p, chunk_size, cu_seqlens)
        return finish(p, y, m_T, output_final_state, real_output)
    core = reset_at_starts(p, docs)
    y, _ = eos_parallel(core) if plan.mode == "parallel" else eos_chunk(core, chunk_size)
    y, m_T = add_states(p, docs, y, output_final_state)
    return finish(p, y, m_T, output_final_state, real_output)


def eos_step(i_t: Tensor, e_t: Tensor, s_t: Tensor, log_o_t: LogO, state: Tensor) -> tuple[Tensor, Tensor]:
    """One decoding step, O(K * D). Arguments have their ``eos`` shapes with T = 1
    (i_t [B, 1, H, D], data-dependent e_t [B, 1, H, K], data-independent ones unchanged; log_o_t
    a tensor, a separable pair or None); state [B, H, K, D].
    Returns (y_t [B, 1, H, D], new state [B, H, K, D])."""
    if isinstance(i_t, Tensor) and (i_t.dim() != 4 or i_t.shape[1] != 1):
        raise ValueError(f"i_t: eos_step takes one token, expected [B, 1, H, D], got {shape_str(i_t)}")
    if state is None:
        raise ValueError("state: eos_step needs the memory [B, H, K, D]; start from zeros or eos(...)'s final state")
    p = canonicalize(i_t, e_t, s_t, log_o_t, state, state_name="state")
    g = p.g_full
    o = g[:, :, 0].exp() if g is not None else None
    y, m = eos_step_state(p.i[:, :, 0], p.e[:, :, 0], p.s[:, :, 0], o, p.m0)
    return finish(p, y.unsqueeze(2), m, True)
