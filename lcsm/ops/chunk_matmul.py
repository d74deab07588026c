"""The chunk mode's ``matmul`` kernel, with the appendix-5.1 backward (linear in T).

For e and s that are K-vectors and a decay that is none, a scalar, a row decay (varies over K,
GLA-like), a column decay (varies over D) or separable, o_t = a_t (x) b_t (kind "outer", LCSM
Table 3 o code 1). The sequence is cut into chunks of C steps: within a chunk everything is matrix
products (an attention map); across chunks only the K x D memory at chunk starts is carried, by
a loop over N = T / C chunks. Cumulative log decays Gamma are taken from each chunk start, in
double precision, and nothing is ever divided by a cumulative product. When a chunk's total decay
is moderate (at most SAFE_SPAN, e.g. GLA's logsigmoid / 16 gates) exp(Gamma_t - Gamma_j)
factorises through the chunk start with every factor within exp(+-SAFE_SPAN); stronger decays
split the chunk into sub-chunks of c <= SUBCHUNK steps whose pairs factorise through the point
between them (factors <= 1), the c x c diagonal blocks factorised or, if still too strong, split
again the same way (down to single steps). A step whose decay is exactly 0 in every entry (a
reset, e.g. a packed document's first token) is taken by masks instead: no pair spans it, the
chunk-start memory stops at it, and its log counts as 0 towards the spans. A separable decay
factorises into exp(Ga_t - Ga_j) along K, carried by s and e, and exp(Gb_t - Gb_j) along D,
carried by i and y; chunk to chunk the memory decays by exp(Ga_C) (x) exp(Gb_C). Sequences run
in segments of whole chunks whose [B, H, L, K|D] tensors hold about SEGMENT_BYTES (at most SEGMENT
tokens), so that a segment's temporaries stay in cache and time per token stays flat.

Under torch.compile (``torch.compiler.is_compiling()``) the same arithmetic is traced whole, with
T symbolic: the value-dependent choices (moderate or not, resets or not) become tensors that
select between the exact forms (``_either``: torch.cond; the reset masks, all-true when there is
no reset), decays too strong for one reference per chunk take the pairwise form
(``_intra_pairwise``) instead of sub-chunk cuts, the loop over chunks becomes a doubling scan
(``_doubling_states``), and the sequence is one segment. Every form is exact: the traced kernel
computes eager's numbers up to rounding (docs/compile.md).

Backward (LCSM appendix 5.1, Type 1; corrected in docs/eos.md): itself EOS problems over the
same decays, so it stores no per-step memory:

    ds_t = conj(m_t) dy_t                the forward problem on the transposed memory m^T
    di_t = dm_t^T conj(e_t)              a reverse-time EOS on dm (input dy, expand conj(s))
    de_t = dm_t conj(i_t)                the same reverse-time EOS read through dm^T
    dg_t = sum_{tau >= t} (conj(s) ds - conj(e) de)_tau + sum_d dm_T * conj(m_T)   (row decay)
    dg_t = sum_{tau >= t} (dy conj(y) - conj(i) di)_tau + sum_k dm_T * conj(m_T)   (column decay)

where dm_t = conj(o_{t+1}) dm_{t+1} + conj(s_t) dy_t^T. The two are the marginals of dlog_o over
D and over K for any decay, so a separable decay takes both, one for each factor. Row and column
roles swap under transposition, which is why the kernel supports both (and "outer" becomes
"outer_t"). Where the decay factorises through every chunk start (real inputs, moderate decays,
no resets: the usual case) the same gradients are formed directly from the factorised chunk
products (``_factorised_backward``), in forward time order. Memory: O(T (K + D) + (T / C) K D),
not O(T K D).

Names: a problem is (s, e, i, g) in the roles of y_t = sum_k s_t[k] m_t[k, :] and
m_t = exp(g_t) * m_{t-1} + e_t (x) i_t: shrink s and expand e [B, H, T, K], input i [B, H, T, D],
log decay g (log_o, in the layout of ``kind``). The backward passes other tensors in these roles
(for ds: shrink dy, expand conj(i), input conj(e), on the transposed memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._autograd import first_order
from ._inputs import LOG_ZERO, constant_result, finite_log, log_zero, real_dtype

Tensor = torch.Tensor

TRANSPOSED = {"none": "none", "scalar": "scalar", "row": "col", "col": "row", "outer": "outer_t", "outer_t": "outer"}
# A separable decay travels as one [.., K + D] log tensor, [log a | log b], so that the chunked
# factors (``_decay_factors``) are computed once for both parts. "outer" reads the first K entries
# (the width of s and e) as the row part; "outer_t" is the same tensor in a transposed problem
# (memory m^T, s and e of width D), where the last D entries vary over the rows.
OUTER = ("outer", "outer_t")
SUBCHUNK = 16
# Largest exponent magnitude a single-reference factorisation may produce: e^30 ~ 1e13 leaves
# float32 far from overflow (and its reciprocal far from underflow); float64 allows much more.
SAFE_SPAN = {torch.float32: 30.0, torch.float64: 200.0}
SEGMENT = 2048
# Bytes of one [B, H, L, K|D] tensor of a segment (at least one chunk): a segment's operands and
# temporaries then stay in a core's cache, where whole 2048-step segments at B 1, H 4, K = D = 64
# streamed every elementwise pass and matmul through memory (512 steps there).
SEGMENT_BYTES = 1 << 19
# Levels of the traced kernel's doubling scan over chunks (``_doubling_states``): 2^24 chunks at most.
SCAN_LEVELS = 24


def _halves(x: Tensor, kind: str, width: int) -> tuple[Tensor, Tensor]:
    """(row part, column part) of a separable decay's [.., K + D] tensor, for a problem whose s and
    e have ``width`` entries (see OUTER)."""
    split = width if kind == "outer" else x.shape[-1] - width
    first, last = x[..., :split], x[..., split:]
    return (first, last) if kind == "outer" else (last, first)


def _subchunk(C: int, at_most: int) -> int:
    """Largest divisor of C that is at most ``at_most``."""
    return max(c for c in range(1, min(C, at_most) + 1) if C % c == 0)


def _masked_exp(diff: Tensor, mask: Tensor) -> Tensor:
    """exp(diff) where mask, else 0, without ever evaluating exp of a masked (possibly huge) value."""
    zero = torch.zeros((), dtype=diff.dtype, device=diff.device)
    return torch.where(mask, torch.where(mask, diff, zero).exp(), zero)


def _causal_mask(L: int, strict: bool, device: torch.device) -> Tensor:
    """j <= t (or j < t when strict) as an [L, L] boolean mask."""
    return torch.ones(L, L, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b over equal leading dims [.., n, k] @ [.., k, m], as one bmm on 3-D views: on CPU,
    torch.matmul copies a transposed operand of more than 3 dims before its batched product
    (a copy of a whole operand per product), where bmm reads the transposed layout as it is."""
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*a.shape[:-1], b.shape[-1])


def _pairwise(G: Tensor, strict: bool, dtype: torch.dtype) -> Tensor:
    """[..., c, X] cumulative logs -> [..., c, c, X] masked exp(G_t - G_j) for j <= t (j < t)."""
    mask = _causal_mask(G.shape[-2], strict, G.device).unsqueeze(-1)
    return _masked_exp((G.unsqueeze(-2) - G.unsqueeze(-3)).to(dtype), mask)


@constant_result
def _two_pi() -> float:
    """2 pi as a constant of a traced graph, not a symbolic input (``_inputs.log_zero`` says why)."""
    return 2 * math.pi


def _exp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """exp of a difference of (double-precision) cumulative logs, in the compute dtype.

    Complex values go through polar form: the angle is reduced modulo 2 pi while still in double
    precision (a cumulative rotation can reach thousands of radians, which float32 would resolve
    only to ~1e-4), and polar(exp(re), im) is also several times faster than complex exp on CPU.
    """
    if x.is_complex():
        real = real_dtype(dtype)
        return torch.polar(x.real.to(real).exp(), torch.remainder(x.imag, _two_pi()).to(real))
    return x.to(dtype).exp()


def _is_moderate(G: Tensor, dtype: torch.dtype) -> bool | Tensor:
    """True when no block's total decay |Gamma_first - Gamma_last| exceeds SAFE_SPAN for the
    compute dtype (G itself is kept in double precision). Under torch.compile the answer is a
    0-dim boolean tensor: the tracer cannot read a value, so ``_either`` selects on it."""
    span = (G[..., :1, :] - G[..., -1:, :]).real
    if torch.compiler.is_compiling():
        return (span <= _safe_span(real_dtype(dtype))).all()
    return span.numel() == 0 or span.max().item() <= SAFE_SPAN[real_dtype(dtype)]


@constant_result
def _safe_span(real: torch.dtype) -> float:
    """SAFE_SPAN[real] as a constant of the traced graph: read directly, the tracer would make the
    module-level float a symbolic input, which torch.cond's branches cannot capture."""
    return SAFE_SPAN[real]


def _either(
    moderate: bool | Tensor, fast: Callable[[], Tensor], safe: Callable[[], Tensor], shape: Sequence[int]
) -> Tensor:
    """``fast()`` for moderate decays, else ``safe()``, each of the given shape: one branch
    evaluated either way, by Python on a bool and by torch.cond on the 0-dim tensor
    ``_is_moderate`` gives under torch.compile."""
    if isinstance(moderate, bool):
        return fast() if moderate else safe()
    # torch.cond wants its branches' outputs dense, with strides it can prove to be products of the
    # sizes; it fails to when two symbolic sizes are equal (a batch of 2 with 2 heads: one symbol)
    # and a stride keeps an unsimplified division. A flat output has the stride 1.
    flat = torch.cond(moderate, lambda: fast().reshape(-1), lambda: safe().reshape(-1))
    return flat.view(shape)


def _single_reference(s: Tensor, e: Tensor, i: Tensor, G: Tensor, kind: str, strict: bool) -> Tensor:
    """Blocks [.., L, *] factorised through the block's first step: exact, and safe when
    ``_is_moderate(G)`` because every factor then lies within exp(+-SAFE_SPAN)."""
    mask = _causal_mask(s.shape[-2], strict, s.device)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    ref = G[..., :1, :]
    if kind == "row":
        a = (s * _exp(G - ref, s.dtype)) @ (e * _exp(ref - G, s.dtype)).transpose(-1, -2)
        return torch.where(mask, a, zero) @ i
    if kind in OUTER:
        (Ga, Gb), (ra, rb) = _halves(G, kind, s.shape[-1]), _halves(ref, kind, s.shape[-1])
        a = (s * _exp(Ga - ra, s.dtype)) @ (e * _exp(ra - Ga, s.dtype)).transpose(-1, -2)
        return _exp(Gb - rb, s.dtype) * (torch.where(mask, a, zero) @ (i * _exp(rb - Gb, s.dtype)))
    a = torch.where(mask, s @ e.transpose(-1, -2), zero)
    return _exp(G - ref, s.dtype) * (a @ (i * _exp(ref - G, s.dtype)))


def _intra_subchunked(
    s: Tensor, e: Tensor, i: Tensor, G: Tensor, kind: str, strict: bool, at_most: int = SUBCHUNK
) -> Tensor:
    """Within-chunk outputs for row, column or separable decays too strong for one reference per
    chunk (s, e [.., C, K], i [.., C, D], G [.., C, X]). The chunk is cut into sub-chunks of
    c <= at_most steps; pairs of sub-chunks factorise through the reference point between them
    (both factors <= 1); diagonal blocks are factorised when their own span is moderate and are
    otherwise cut again the same way, into sub-chunks of at most c / 4 steps, down to single steps
    (whose span is 0) if need be. All branches are exact; the choice only avoids overflow and
    underflow. Cutting again, rather than forming [c, c, K|D] pairwise decay tensors for the
    diagonal blocks, keeps decays of about -1.4 per step within a small factor of GLA-like ones'
    cost (bench/results/eos_kernels.md): a level of cuts costs a few small matmuls.
    """
    C = s.shape[-2]
    c = _subchunk(C, at_most)
    ns = C // c
    lead = s.shape[:-2]

    def sub(x: Tensor) -> Tensor:
        return x.reshape(*lead, ns, c, x.shape[-1])

    s_parts, e_parts, i_parts, G_parts = sub(s), sub(e), sub(i), sub(G)
    if c == 1 or _is_moderate(G_parts, s.dtype):
        y = _single_reference(s_parts, e_parts, i_parts, G_parts, kind, strict)  # [.., ns, c, D]
    else:
        y = _intra_subchunked(s_parts, e_parts, i_parts, G_parts, kind, strict, max(1, c // 4))
    blocks = [y[..., 0, :, :]]
    for j in range(1, ns):
        ref = G[..., j * c - 1 : j * c, :]  # Gamma just before sub-chunk j
        s_I, G_I = s_parts[..., j, :, :], G_parts[..., j, :, :]
        e_prev, i_prev, G_prev = e[..., : j * c, :], i[..., : j * c, :], G[..., : j * c, :]
        if kind == "row":
            a_off = (s_I * _exp(G_I - ref, s.dtype)) @ (e_prev * _exp(ref - G_prev, s.dtype)).transpose(-1, -2)
            off = a_off @ i_prev
        elif kind in OUTER:
            width = s.shape[-1]
            (Ga_I, Gb_I), (ra, rb) = _halves(G_I, kind, width), _halves(ref, kind, width)
            Ga_prev, Gb_prev = _halves(G_prev, kind, width)
            a_off = (s_I * _exp(Ga_I - ra, s.dtype)) @ (e_prev * _exp(ra - Ga_prev, s.dtype)).transpose(-1, -2)
            off = _exp(Gb_I - rb, s.dtype) * (a_off @ (i_prev * _exp(rb - Gb_prev, s.dtype)))
        else:
            a_off = s_I @ e_prev.transpose(-1, -2)
            off = _exp(G_I - ref, s.dtype) * (a_off @ (i_prev * _exp(ref - G_prev, s.dtype)))
        blocks.append(y[..., j, :, :] + off)
    return torch.cat(blocks, -2)


def _intra_pairwise(s: Tensor, e: Tensor, i: Tensor, G: Tensor, kind: str, strict: bool) -> Tensor:
    """Within-chunk outputs for row, column or separable decays by the pairwise decays
    exp(Gamma_t - Gamma_j) themselves, [.., C, C, K|D]: exact and safe for any decay (no kept
    pair's exponent is positive), at O(C^2 (K|D)) memory per chunk. The traced kernel's form for
    decays too strong for one reference per chunk, where eager cuts sub-chunks
    (``_intra_subchunked``): the depth of those cuts depends on the decays' values, and each
    level would be one more torch.cond to trace (minutes of compile time)."""
    dt = s.dtype
    if kind == "row":
        return torch.einsum("...tk,...jk,...tjk->...tj", s, e, _pairwise(G, strict, dt)) @ i
    if kind in OUTER:
        Ga, Gb = _halves(G, kind, s.shape[-1])
        a = torch.einsum("...tk,...jk,...tjk->...tj", s, e, _pairwise(Ga, strict, dt))
        return torch.einsum("...tj,...tjd,...jd->...td", a, _pairwise(Gb, strict, dt), i)
    return torch.einsum("...tj,...tjd,...jd->...td", s @ e.transpose(-1, -2), _pairwise(G, strict, dt), i)


def chunk_matmul(
    s: Tensor, e: Tensor, i: Tensor, g: Tensor | None, kind: str, m0: Tensor | None, C: int, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """The ``matmul`` kernel (arguments as in ``_chunk_matmul_segment``), run over segments of
    about SEGMENT tokens with the memory carried between them. Segmenting changes nothing
    numerically; it keeps the working set and the temporaries of one call at a fixed size, so time
    per token stays flat as T grows (whole-sequence temporaries at T = 32K ran ~3x slower per token,
    from cache misses and fresh page faults on every large allocation)."""
    parts = _segments(s.shape[2], C, _step_bytes(s, i))
    if len(parts) == 1:
        return _chunk_matmul_segment(s, e, i, g, kind, m0, C, strict)
    ys, M = [], m0
    for part in parts:
        y, M = _chunk_matmul_segment(
            s[:, :, part], e[:, :, part], i[:, :, part], None if g is None else g[:, :, part], kind, M, C, strict
        )
        ys.append(y)
    return torch.cat(ys, 2), M


@dataclass
class _Decay:
    """Chunked factors of one log-oscillation sequence. They depend only on the decays, so every
    EOS problem over the same decays (the forward one and its transposes in the backward) shares
    them whatever the roles of s, e and i."""

    G: Tensor | None = None  # [B, H, N, C, X] cumulative logs from each chunk start (double)
    exp_G: Tensor | None = None  # exp(Gamma_t) <= 1
    exp_last: Tensor | None = None  # exp(Gamma_C) per chunk, [B, H, N, 1, X]
    exp_neg: Tensor | None = None  # exp(-Gamma_j), only when moderate
    to_end: Tensor | None = None  # exp(Gamma_C - Gamma_j)
    moderate: bool | Tensor = True  # a 0-dim boolean tensor under torch.compile (``_is_moderate``)
    # Resets (steps whose decay is exactly 0, see ``_decay_factors``), when the chunk takes them by
    # masks: ``same`` [B, H, N, C, C] pairs (t, j) with no reset in (j, t]; ``reach`` [B, H, N, C, 1]
    # 1 at the steps the chunk-start memory reaches (no reset up to t), else 0. None: no resets.
    same: Tensor | None = None
    reach: Tensor | None = None


def traced_chunk_count(T: int, C: int) -> int:
    """The chunk count of the traced chunk forms (here, ``chunk_scan.traced_elementwise``, the
    matrix-transition forms of ``delta`` and ``dplr``): one more than ceil(T / C), the last all
    padding (no input, decay 1: the identity on the memory), so that a count of at least 2 is
    provable (see ``_chunked``)."""
    return (T + C - 1) // C + 1


def _chunked(x: Tensor, C: int, dtype: torch.dtype | None = None) -> Tensor:
    """[B, H, T, X] -> [B, H, N, C, X], zero-padded at the end, in ``dtype`` (default x's).
    Contiguous once here: the operands arrive as head-major views of [B, T, H, *], and every
    batched matmul would copy them again; a change of dtype is the same copy."""
    B, H, T, X = x.shape
    N = max(1, -(-T // C))
    # Traced, T is symbolic: padding by zero steps when C divides T keeps one graph for every T,
    # and one more chunk than needed, all padding, makes N >= 2 provable. With N = ceil(T / C)
    # the tracer meets N = 1 for every T <= C (a size-1 dimension, which torch's contiguity checks
    # test for) and guards on it: the graph held only for T <= C, and tensors formed before and
    # after the guard disagreed on N's expression, which torch.cond refused (column decays,
    # symbolic batch). A padding step has no input and decay 1, so it changes no output and no
    # memory; ``_final_memory_strict`` finds the last step's chunk by index, not as the last chunk.
    if torch.compiler.is_compiling():
        N = traced_chunk_count(T, C)
    if torch.compiler.is_compiling() or N * C != T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * C - T))
    x = x.reshape(B, H, N, C, X)
    # (to() with an unchanged dtype returns x as it is, whatever memory_format asks)
    return x.contiguous() if dtype in (None, x.dtype) else x.to(dtype, memory_format=torch.contiguous_format)


def _decay_factors(g: Tensor | None, C: int, dt: torch.dtype) -> _Decay:
    """The chunked factors of a log decay g [B, H, T, X] (None: no decay) for chunks of C steps and
    the compute dtype dt (see ``_Decay``)."""
    if g is None:
        return _Decay()
    # Cumulative logs in double precision: their differences over short spans must stay accurate
    # even when |Gamma| grows large under strong decays.
    # o = 0 (log_o = -inf) is raised to a log whose exp is still 0 in the compute dtype, so that
    # differences of cumulative logs never meet -inf - (-inf).
    wide = torch.complex128 if g.is_complex() else torch.float64
    logs = finite_log(_chunked(g, C, wide), dt)
    if torch.compiler.is_compiling():
        return _traced_factors(logs, dt)
    # A reset: a step whose decay is 0 in every entry (each log at LOG_ZERO, whose exp is 0 in dt),
    # e.g. a packed document's first token (packed.py). Its Gamma span alone exceeds SAFE_SPAN and
    # would send the whole tensor down the sub-chunk scheme; instead pairs across a reset are
    # masked out, which is exact (their decay is exactly 0), and the reset's log taken as 0, so
    # that the spans left are those of the other steps.
    # One reduction over g tells whether any log is that low at all, before the per-step test
    # (most decays have no reset, and the per-step test cost ~15% of this function).
    floor = LOG_ZERO[real_dtype(dt)]
    if g.numel() and bool(g.real.min() <= floor):
        reset = logs.real.amax(-1) <= floor
        f = _reset_factors(logs, reset, dt) if bool(reset.any()) else None
        if f is not None:
            return f
    G = logs.cumsum_(-2)
    G_last = G[..., -1:, :]
    # Moderate decays (the usual case, e.g. GLA's logsigmoid / 16): everything factorises through
    # the chunk start, exp(Gamma_t - Gamma_j) = exp(Gamma_t) * exp(-Gamma_j), with every factor
    # within exp(+-SAFE_SPAN). Stronger decays take the sub-chunk scheme. A chunk's widest span
    # runs from its start (Gamma 0) to its end.
    moderate = _is_moderate(torch.nn.functional.pad(G_last, (0, 0, 1, 0)), dt)
    exp_last = _exp(G_last, dt)
    if G.is_complex():
        exp_G, exp_neg = _exp(G, dt), _exp(-G, dt) if moderate else None
    else:  # the same numbers as _exp's, with one conversion and the passes in place
        G_dt = G.to(dt, copy=True)  # a copy also when dt is G's own float64: it is negated in place
        exp_G = G_dt.exp()
        exp_neg = G_dt.neg_().exp_() if moderate else None
    to_end = exp_last * exp_neg if moderate else _exp(G_last - G, dt)
    return _Decay(G, exp_G, exp_last, exp_neg, to_end, moderate)


def _reset_factors(logs: Tensor, reset: Tensor, dt: torch.dtype) -> _Decay | None:
    """The factors of chunked logs [B, H, N, C, X] with resets [B, H, N, C] taken by masks (see
    ``_Decay``): moderate factors of the cumulative logs with every reset's log taken as 0, a pair
    of steps kept when no reset lies after the earlier one up to the later one, the chunk-start
    memory kept up to the chunk's first reset. None when the other steps' spans are themselves
    beyond SAFE_SPAN: the sub-chunk scheme then takes the true logs, resets included."""
    G = logs.masked_fill(reset.unsqueeze(-1), 0).cumsum(-2)
    if not _is_moderate(torch.nn.functional.pad(G[..., -1:, :], (0, 0, 1, 0)), dt):
        return None
    part = reset.cumsum(-1)  # the steps between two resets share a number
    real = real_dtype(dt)
    reach = (part == 0).unsqueeze(-1).to(real)
    in_last = (part == part[..., -1:]).unsqueeze(-1).to(real)
    exp_last = _exp(G[..., -1:, :], dt)
    exp_neg = _exp(-G, dt)
    return _Decay(
        G,
        _exp(G, dt),
        exp_last * reach[..., -1:, :],
        exp_neg,
        exp_last * exp_neg * in_last,
        True,
        part.unsqueeze(-1) == part.unsqueeze(-2),
        reach,
    )


def _traced_factors(logs: Tensor, dt: torch.dtype) -> _Decay:
    """``_decay_factors`` of chunked logs under torch.compile, without reading a value: the reset
    masks are always formed (all-true, and the reach all ones, when the reset form is not taken:
    multiplying by 1 and masking by true change nothing), each cumulative log and factor is formed
    for both the reset and the plain form where they differ, and tensors select what eager's
    branches would (``_is_moderate``). exp(-Gamma) is formed even for strong decays, where it may
    overflow; it is then read only by the branches that the selection leaves out."""
    floor = log_zero(real_dtype(dt))
    reset = logs.real.amax(-1) <= floor
    G_plain = logs.cumsum(-2)
    G_reset = logs.masked_fill(reset.unsqueeze(-1), 0).cumsum(-2)
    with_resets = reset.any() & _is_moderate(torch.nn.functional.pad(G_reset, (0, 0, 1, 0)), dt)
    G = torch.where(with_resets, G_reset, G_plain)
    moderate = with_resets | _is_moderate(torch.nn.functional.pad(G_plain, (0, 0, 1, 0)), dt)
    part = reset.cumsum(-1) * with_resets  # all 0 (one part) when the plain form is taken
    real = real_dtype(dt)
    reach = (part == 0).unsqueeze(-1).to(real)
    in_last = (part == part[..., -1:]).unsqueeze(-1).to(real)
    exp_last = _exp(G[..., -1:, :], dt)
    exp_neg = _exp(-G, dt)
    to_end = torch.where(moderate, exp_last * exp_neg * in_last, _exp(G[..., -1:, :] - G, dt))
    return _Decay(
        G,
        _exp(G, dt),
        exp_last * reach[..., -1:, :],
        exp_neg,
        to_end,
        moderate,
        part.unsqueeze(-1) == part.unsqueeze(-2),
        reach,
    )


def _chunk_states(e: Tensor, i: Tensor, f: _Decay, kind: str, m0: Tensor | None) -> tuple[Tensor, Tensor]:
    """Memories at every chunk start, S [B, H, N, K, D], and after the last chunk.
    e [B, H, N, C, K] and i [B, H, N, C, D] are chunked."""
    B, H, N, _, K = e.shape
    D = i.shape[-1]
    M = m0 if m0 is not None else e.new_zeros(B, H, K, D)
    if kind == "none":
        U = _mm(e.transpose(-1, -2), i)
        # without decay the chunk-start memories are an exclusive prefix sum of the contributions,
        # one small matmul with a strictly lower-triangular matrix of ones
        before = torch.ones(N, N, dtype=U.dtype, device=U.device).tril(-1)
        S = (before @ U.reshape(B, H, N, K * D)).reshape(B, H, N, K, D) + M.unsqueeze(2)
        return S, S[:, :, -1] + U[:, :, -1]
    if kind == "col":
        U = _mm(e.transpose(-1, -2), i * f.to_end)
        decay = f.exp_last  # [B, H, N, 1, D]
    elif kind in OUTER:
        (a_end, b_end), (a_last, b_last) = _halves(f.to_end, kind, K), _halves(f.exp_last, kind, K)
        U = _mm((e * a_end).transpose(-1, -2), i * b_end)
        decay = a_last.transpose(-1, -2) * b_last  # [B, H, N, K, D]
    else:
        U = _mm((e * f.to_end).transpose(-1, -2), i)
        decay = f.exp_last.transpose(-1, -2)  # [B, H, N, K|1, 1]
    if torch.compiler.is_compiling():
        return _doubling_states(U, decay, M)
    states = []
    for U_n, decay_n in zip(U.unbind(2), decay.unbind(2), strict=True):  # one call for all chunks' views
        states.append(M)
        M = torch.addcmul(U_n, decay_n, M)
    return torch.stack(states, 2), M


def _doubling_states(U: Tensor, decay: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """``_chunk_states``' loop over chunks for torch.compile, where a Python loop over
    N = ceil(T / C) chunks would fix N, and with it T, in the traced graph (and torch.scan, which
    would not, fails in inductor 2.13 on a scan length derived from T). The recurrence
    M_n = decay_n * M_{n-1} + U_n composes associatively, so SCAN_LEVELS doubling steps give every
    prefix: at level l each chunk takes in the one 2^l before it (shifts past the first chunk take
    in the identity: decay 1, input 0). The level count is fixed, not ceil(log2 N), so that N
    stays symbolic; the levels past log2 N change nothing and cost O(N K D) each, little beside
    the chunks' C x C maps. Products of decays are at most 1 in modulus: nothing overflows."""
    N = U.shape[2]
    torch._check(N <= 1 << SCAN_LEVELS, lambda: f"traced eos chunk kernel: at most 2^{SCAN_LEVELS} chunks")
    chunk = torch.arange(N, device=U.device).view(N, 1, 1)
    # the first chunk takes in the memory before it; by a mask, not a cat with U[:, :, 1:]: a size of
    # N - 1, 1 for every T <= C, would be guarded on (``_chunked``)
    a, b = decay, U + torch.where(chunk == 0, decay * M.unsqueeze(2), 0.0)

    def shifted(x: Tensor, by: int, fill: float) -> Tensor:  # x[n - by] along chunks, ``fill`` before the first
        # a roll, not a pad by ``by``: padding would allocate up to 2^SCAN_LEVELS chunks
        return torch.where(chunk >= by, x.roll(by, 2), fill)

    for level in range(SCAN_LEVELS):
        by = 1 << level
        b = b + a * shifted(b, by, 0.0)
        a = a * shifted(a, by, 1.0)
    # b[n]: the memory after chunk n; the memory at each chunk's start is the one after the chunk
    # before (a roll, not a cat of b[:, :, :-1]: a size of N - 1, 1 for every T <= C, would be
    # guarded on, see ``_chunked``)
    return torch.where(chunk == 0, M.unsqueeze(2), b.roll(1, 2)), b[:, :, -1]


def _chunk_outputs(s: Tensor, e: Tensor, i: Tensor, f: _Decay, S: Tensor, kind: str, strict: bool) -> Tensor:
    """y [B, H, N, C, D] from chunked s, e, i and the chunk-start memories S."""
    if kind == "none":
        return _mm(s, S).add_(_mm(_mm(s, e.transpose(-1, -2)).tril_(-1 if strict else 0), i))
    mask = _causal_mask(s.shape[-2], strict, s.device)
    if f.same is not None:
        mask = mask & f.same
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    strong = _intra_pairwise if torch.compiler.is_compiling() else _intra_subchunked

    def carried(x: Tensor) -> Tensor:  # the chunk-start memory's share, up to the first reset
        return x if f.reach is None else x * f.reach

    if kind == "scalar":
        w = _either(
            f.moderate,
            lambda: f.exp_G * f.exp_neg.transpose(-1, -2),
            lambda: _pairwise(f.G, False, s.dtype)[..., 0],
            (*s.shape[:-1], s.shape[-2]),
        )
        return carried(_mm(s, S) * f.exp_G) + torch.where(mask, _mm(s, e.transpose(-1, -2)) * w, zero) @ i
    if kind == "row":
        intra = _either(
            f.moderate,
            lambda: torch.where(mask, (s * f.exp_G) @ (e * f.exp_neg).transpose(-1, -2), zero) @ i,
            lambda: strong(s, e, i, f.G, "row", strict),
            i.shape,
        )
        return carried(_mm(s * f.exp_G, S)) + intra
    if kind in OUTER:
        exp_a, exp_b = _halves(f.exp_G, kind, s.shape[-1])
        s_a = s * exp_a

        def factorised() -> Tensor:
            neg_a, neg_b = _halves(f.exp_neg, kind, s.shape[-1])
            return exp_b * (torch.where(mask, s_a @ (e * neg_a).transpose(-1, -2), zero) @ (i * neg_b))

        intra = _either(f.moderate, factorised, lambda: strong(s, e, i, f.G, kind, strict), i.shape)
        return carried(_mm(s_a, S) * exp_b) + intra
    intra = _either(
        f.moderate,
        lambda: f.exp_G * (torch.where(mask, s @ e.transpose(-1, -2), zero) @ (i * f.exp_neg)),
        lambda: strong(s, e, i, f.G, "col", strict),
        i.shape,
    )
    return carried(_mm(s, S) * f.exp_G) + intra


def _chunk_matmul_segment(
    s: Tensor, e: Tensor, i: Tensor, g: Tensor | None, kind: str, m0: Tensor | None, C: int, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """The ``matmul`` kernel on one segment. s, e [B, H, T, K]; i [B, H, T, D]; g None (kind 'none') or
    [B, H, T, 1] ('scalar'), [B, H, T, K] ('row'), [B, H, T, D] ('col'), [B, H, T, K + D] ('outer':
    the row part, then the column part); m0 [B, H, K, D] or None.
    Returns y [B, H, T, D] and m_T [B, H, K, D]. Differentiable by autograd as written.
    ``strict`` leaves out each step's own contribution (j = t) from y (not from m_T); see
    ``ChunkMatmulFunction`` for why the backward wants that."""
    f = _decay_factors(g, C, s.dtype)
    sc, ec, ic = _chunked(s, C), _chunked(e, C), _chunked(i, C)
    S, M = _chunk_states(ec, ic, f, kind, m0)
    return _unchunk(_chunk_outputs(sc, ec, ic, f, S, kind, strict), s.shape[2]), M


def factorised_segments(s: Tensor, i: Tensor, g: Tensor, C: int) -> tuple[int, int]:
    """(segments whose decays factorise through each chunk's start, segments): the forward's
    data-dependent choice between the factorised form and the slower pairwise / sub-chunk form of
    the strong decays, made per segment as ``ChunkMatmulFunction`` makes it (``explain``)."""
    parts = _segments(s.shape[2], C, _step_bytes(s, i))
    return sum(bool(_decay_factors(g[:, :, part], C, s.dtype).moderate) for part in parts), len(parts)


def _unchunk(y: Tensor, T: int) -> Tensor:
    """[B, H, N, C, D] -> [B, H, T, D], dropping the padding."""
    B, H, N, C, D = y.shape
    return y.reshape(B, H, N * C, D)[:, :, :T]


def _own_step(s: Tensor, e: Tensor, i: Tensor) -> Tensor:
    """Each step's own contribution (s_t . e_t) i_t [B, H, T, D] (s, e [B, H, T, K]), the part
    ``strict`` leaves out."""
    return (s * e).sum(-1, keepdim=True) * i


def _cat(parts: list) -> Tensor:
    """Segments joined along time; a single segment is returned as it is (torch.cat would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _segments(T: int, C: int, step_bytes: int) -> list[slice]:
    """Segments of at most SEGMENT steps whose [B, H, L, *] tensors of ``step_bytes`` per step
    hold SEGMENT_BYTES to within half a chunk, each a whole number of chunks (at least one)."""
    # traced, one segment: their number would fix T in the graph
    if torch.compiler.is_compiling():
        return [slice(0, T)]
    # The nearest whole number of chunks, not the largest under the budget: a width just past a
    # power of two (mLSTM's d + 1 normaliser column) would otherwise lose a chunk per segment
    # (7 of 64 where K = D = 64 has 8), and the extra segments cost it 8% (bench/results/eos_kernels.md).
    steps = min(SEGMENT, SEGMENT_BYTES / max(1, step_bytes))
    seg = max(C, min(SEGMENT // C, round(steps / C)) * C)
    return [slice(a, min(a + seg, T)) for a in range(0, T, seg)]


def _step_bytes(s: Tensor, i: Tensor) -> int:
    """Bytes of one step of the widest [B, H, T, K|D] operand (``_segments``)."""
    B, H = s.shape[:2]
    return B * H * max(s.shape[-1], i.shape[-1]) * s.element_size()


def _no_decay_backward(
    s: Tensor, e: Tensor, i: Tensor, dy: Tensor, S: Tensor, dM: Tensor, C: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward of one segment without decay (real inputs), in chunks:
    with A = tril(s e^T) and G = tril(dy i^T) per chunk, ds = G e + dy S^T, de = G^T s + i dA^T,
    di = A^T dy + e dA, where S is the memory at each chunk start (saved by the forward) and dA
    the adjoint memory after each chunk (a reverse exclusive prefix sum of s^T dy plus the
    adjoint carried in from later segments). No decay means no strict/own-step split is needed
    (that split only protects the decay gradient), so both intra-chunk maps take the diagonal.
    s, e [B, H, L, K], i and dy [B, H, L, D], S [B, H, N, K, D], dM [B, H, K, D]; returns ds, de
    [B, H, L, K], di [B, H, L, D] and the adjoint memory at the segment's start [B, H, K, D]."""
    L = s.shape[2]
    sc, ec, ic, dyc = (_chunked(x, C) for x in (s, e, i, dy))
    N = sc.shape[2]
    A = _mm(sc, ec.transpose(-1, -2)).tril_()
    G = _mm(dyc, ic.transpose(-1, -2)).tril_()
    P = _mm(sc.transpose(-1, -2), dyc)  # [B, H, N, K, D]
    B, H, _, K, D = P.shape
    later = torch.ones(N, N, dtype=P.dtype, device=P.device).triu(1)
    dA = (later @ P.reshape(B, H, N, K * D)).reshape(B, H, N, K, D) + dM.unsqueeze(2)
    ds = _mm(G, ec).add_(_mm(dyc, S.transpose(-1, -2)))
    de = _mm(G.transpose(-1, -2), sc).add_(_mm(ic, dA.transpose(-1, -2)))
    di = _mm(A.transpose(-1, -2), dyc).add_(_mm(ec, dA))
    return _unchunk(ds, L), _unchunk(de, L), _unchunk(di, L), dA[:, :, 0] + P[:, :, 0]


def _final_memory_strict(ec: Tensor, ic: Tensor, f: _Decay, kind: str, S: Tensor, last: int) -> Tensor:
    """o_T * m_{T-1}: the final memory without the last step's own input e_T i_T^T, from the start
    memory of the chunk holding the last step (``last``, its index in the segment) and that
    chunk's steps before it (padded steps after it have no input and decay 1). Computed directly,
    because m_T - e_T i_T^T would keep m_T's O(1) rounding error in an O(o) result."""
    C = ec.shape[-2]
    # eager, chunk n is the last one; traced, one all-padding chunk follows it (``_chunked``)
    n, j = last // C, last % C
    # by a mask, not by writing e[..., j, :] = 0: traced with symbolic T, j is symbolic too
    e = ec.narrow(2, n, 1)
    e = torch.where(torch.arange(e.shape[-2], device=e.device).unsqueeze(-1) == j, 0, e)
    last_chunk = _Decay(exp_last=f.exp_last.narrow(2, n, 1), to_end=f.to_end.narrow(2, n, 1))
    return _chunk_states(e, ic.narrow(2, n, 1), last_chunk, kind, S.select(2, n))[1]


def _input_part(x: Tensor, last_segment: bool) -> Tensor:
    """conj(e) de (or conj(i) di) of a segment, for the decay gradient. In the sequence's last
    segment its last step is left out: there it is exactly the dM part that the boundary term
    leaves out too (``ChunkMatmulFunction``)."""
    if last_segment:
        x[:, :, -1] = 0
    return x


def _decayed_by(m: Tensor, g_t: Tensor, kind: str) -> Tensor:
    """o_t * m for a memory m [B, H, K, D] and one step's log decay g_t [B, H, X] in the layout of
    ``kind``."""
    o = g_t.exp()
    if kind == "outer":
        o_a, o_b = _halves(o, kind, m.shape[-2])
        return m * (o_a.unsqueeze(-1) * o_b.unsqueeze(-2))
    return m * (o.unsqueeze(-2) if kind == "col" else o.unsqueeze(-1))


def _factorises(f: _Decay, s: Tensor) -> bool:
    """Whether the factorised forms (``_factorised_outputs``, ``_factorised_backward``) serve a
    segment: real inputs and a decay that factorises through every chunk start without resets."""
    return not s.is_complex() and f.moderate is True and f.same is None


def _factors(f: _Decay, kind: str, K: int) -> tuple[Tensor | None, ...]:
    """(a, 1 / a, a to the chunk end, b, 1 / b, b to the chunk end, chunk decay) of a factorising
    decay (``_factorises``): a = exp(Gamma) along K (row, scalar, the row part of a separable
    decay), b along D (column, the column part); None where a decay has no such part. The chunk
    decay is the memory's [.., K|1, D|1] factor from one chunk start to the next."""
    if kind == "col":
        return None, None, None, f.exp_G, f.exp_neg, f.to_end, f.exp_last
    if kind == "outer":
        (a, b), (a_neg, b_neg), (a_end, b_end) = (_halves(x, kind, K) for x in (f.exp_G, f.exp_neg, f.to_end))
        a_last, b_last = _halves(f.exp_last, kind, K)
        return a, a_neg, a_end, b, b_neg, b_end, a_last.transpose(-1, -2) * b_last
    return f.exp_G, f.exp_neg, f.to_end, None, None, None, f.exp_last.transpose(-1, -2)


def _scaled(x: Tensor, factor: Tensor | None) -> Tensor:
    return x if factor is None else x * factor


def _factorised_outputs(
    s: Tensor, e: Tensor, i: Tensor, f: _Decay, S: Tensor, kind: str, L: int
) -> tuple[Tensor, Tensor | None]:
    """y [B, H, L, D] of one segment (chunked s, e, i) for a factorising decay (``_factorises``):
    with q = s a, k = e / a and v = i / b, y = b (q S + tril(q k^T) v), the same products as
    ``_chunk_outputs`` without its masks' copies. Also the strict output (each step's own term
    left out) when a column decay's gradient reads it (column and separable decays), else None;
    then y is it plus the own term, otherwise the diagonal is kept in the map."""
    a, a_neg, _, b, b_neg, _, _ = _factors(f, kind, s.shape[-1])
    q = _scaled(s, a)
    strict = kind in ("col", "outer")
    y = _scaled(
        _mm(q, S).add_(_mm(_mm(q, _scaled(e, a_neg).transpose(-1, -2)).tril_(-1 if strict else 0), _scaled(i, b_neg))),
        b,
    )
    y = _unchunk(y, L)
    if not strict:
        return y, None
    return y + _unchunk(_own_step(s, e, i), L), y


def _factorised_backward(
    s: Tensor,
    e: Tensor,
    i: Tensor,
    dy: Tensor,
    f: _Decay,
    S: Tensor,
    dM: Tensor,
    kind: str,
    y_strict: Tensor | None,
    last: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """ds, de, di, the decay gradient's summand (``_decay_term``) and the adjoint memory at the
    segment's start, for a factorising decay (``_factorises``). In chunk coordinates, with q = s a,
    k = e / a, v = i / b and dv = dy b (``_factors``), the forward is y = b (q S + tril(q k^T) v):
    its backward is matrix products over the same chunks in forward time order, with no time
    reversal (no flipped copies) and the chunk factors computed once for all three gradients, where
    the three EOS problems of the general path compute two sets. R_n, the adjoint of the memory
    after chunk n, runs back over the chunks from dM: R_{n-1} = decay_n R_n + q_n^T dv_n. The maps
    whose gradients enter the decay gradient are strict (tril(q k^T) for di when a column decay's
    gradient reads it, tril(dv v^T) for ds and de when a row decay's does) and their own-step terms
    are added after the summand is formed; the others keep their diagonal.
    s, e [B, H, L, K], i, dy and y_strict [B, H, L, D], S [B, H, N, K, D] the chunk-start memories,
    dM [B, H, K, D] the adjoint after the segment; ``last``: the sequence's last segment."""
    L, C = s.shape[2], f.exp_G.shape[-2]
    sc, ec, ic, dyc = (_chunked(x, C) for x in (s, e, i, dy))
    a, a_neg, a_end, b, b_neg, b_end, decay = _factors(f, kind, s.shape[-1])
    q, k, v, dv = _scaled(sc, a), _scaled(ec, a_neg), _scaled(ic, b_neg), _scaled(dyc, b)
    P = _mm(q.transpose(-1, -2), dv)  # [B, H, N, K, D]
    R = torch.empty_like(S)
    R_n, P_n, decay_n = R.unbind(2), P.unbind(2), decay.unbind(2)  # one call for all chunks' views
    R_n[-1].copy_(dM)
    for n in range(S.shape[2] - 1, 0, -1):
        torch.addcmul(P_n[n], decay_n[n], R_n[n], out=R_n[n - 1])
    dM_start = torch.addcmul(P_n[0], decay_n[0], R_n[0])
    row_strict, col_strict = kind != "col", kind in ("col", "outer")
    A = _mm(q, k.transpose(-1, -2)).tril_(-1 if col_strict else 0)
    W = _mm(dv, v.transpose(-1, -2)).tril_(-1 if row_strict else 0)
    ds = _scaled(_mm(W, k).add_(_mm(dv, S.transpose(-1, -2))), a)
    de = _scaled(_mm(W.transpose(-1, -2), q), a_neg).add_(_scaled(_mm(_scaled(ic, b_end), R.transpose(-1, -2)), a_end))
    di = _scaled(_mm(A.transpose(-1, -2), dv), b_neg).add_(_scaled(_mm(_scaled(ec, a_end), R), b_end))
    term = _decay_term(*(_unchunk(x, L) for x in (sc, ec, ic, dyc, ds, de, di)), y_strict, kind, last)
    if row_strict:
        i_dy = (ic * dyc).sum(-1, keepdim=True)  # own-step terms share i . dy
        ds.addcmul_(i_dy, ec)
        de.addcmul_(i_dy, sc)
    if col_strict:
        di.add_(_own_step(sc, ec, dyc))
    return _unchunk(ds, L), _unchunk(de, L), _unchunk(di, L), term, dM_start


def _decay_term(
    s: Tensor,
    e: Tensor,
    i: Tensor,
    dy: Tensor,
    ds: Tensor,
    de: Tensor,
    di: Tensor,
    y_strict: Tensor | None,
    kind: str,
    last: bool,
) -> Tensor:
    """The decay gradient's summand, whose reverse cumulative sum is dlog_o (module docstring):
    conj(s) ds - conj(e) de for a row decay (summed over K for a scalar one), dy conj(y) -
    conj(i) di for a column decay, both side by side for a separable one; from the conjugated
    inputs and the strict gradients and output of one segment, [B, H, L, *]."""

    def row() -> Tensor:
        return s * ds - _input_part(e * de, last)

    def col() -> Tensor:
        return dy * y_strict.conj() - _input_part(i * di, last)

    if kind == "col":
        return col()
    if kind == "outer":
        # a separable decay's gradient is both marginals of dlog_o at once: the row
        # identity over its K entries, the column identity over its D entries
        return torch.cat([row(), col()], -1)
    term = row()
    return term.sum(-1, keepdim=True) if kind == "scalar" else term


class ChunkMatmulFunction(torch.autograd.Function):
    """``chunk_matmul`` with the appendix-5.1 backward: three more EOS problems in general, their
    factorised chunk products (``_factorised_backward``) where the decay factorises.

    The three share work: ds is the forward problem transposed, so it reuses the forward's
    chunk-start memories (saved: O((T / C) K D)); di and de are one reverse-time problem read out
    two ways (its memory is dm for di and dm^T for de), so its chunk-start memories are computed
    once. Forward and backward walk the sequence in segments (see ``chunk_matmul``); the backward
    visits them last to first, carrying the adjoint memory and the decay gradient's reverse
    cumulative sum back across segment boundaries.

    Without decay (real inputs) a specialised backward (``_no_decay_backward``) takes the place of
    the three problems: with nothing to protect it needs no strict split and no time reversal,
    and the intra-chunk maps tril(s e^T) and tril(dy i^T) each serve two gradients.

    Every output is computed ``strict`` and each step's own term added afterwards: the decay
    gradient is a reverse cumulative sum of conj(s) ds - conj(e) de, in which the own-step parts of
    ds and de are equal and cancel exactly. Left in, they are O(1) while the true dg is O(o) -- with
    strong decays float32 would lose dg to cancellation. The boundary term has the same trap:
    sum dM * conj(m_T) is O(1) and, at the last step, cancels against the part of e_T . de_T
    (i_T . di_T) that the final cotangent dM feeds in, exactly dM conj(i_T) (dM^T conj(e_T)). So the
    forward saves o_T * m_{T-1} (the final memory without the last input, computed directly, not as
    a difference) for the boundary term, and the backward leaves out that last-step part.
    """

    @staticmethod
    def forward(
        ctx: Any, s: Tensor, e: Tensor, i: Tensor, g: Tensor | None, m0: Tensor | None, kind: str, C: int
    ) -> tuple[Tensor, Tensor]:
        B, H, T, K = s.shape
        M = m0 if m0 is not None else s.new_zeros(B, H, K, i.shape[-1])
        # written segment by segment in i's layout (the head-major view of eos's [B, T, H, D]), so
        # that the caller's y is one dense tensor without a join of the segments or a copy after
        y_out = torch.empty_like(i)
        stricts, starts = [], []
        for part in _segments(T, C, _step_bytes(s, i)):
            L = part.stop - part.start
            f = _decay_factors(None if g is None else g[:, :, part], C, s.dtype)
            sc, ec, ic = (_chunked(x[:, :, part], C) for x in (s, e, i))
            S, M = _chunk_states(ec, ic, f, kind, M)
            if g is not None and part.stop == T:
                M_strict = _final_memory_strict(ec, ic, f, kind, S, L - 1)
            if kind == "none":  # nothing reads a strict output
                y, y_strict = _unchunk(_chunk_outputs(sc, ec, ic, f, S, kind, False), L), None
            elif _factorises(f, s):
                y, y_strict = _factorised_outputs(sc, ec, ic, f, S, kind, L)
            else:
                y_strict = _unchunk(_chunk_outputs(sc, ec, ic, f, S, kind, True), L)
                # whole-sequence temporaries are avoided: at long T every large allocation costs
                # fresh page faults, so the own-step term is added segment by segment
                y = y_strict + _own_step(s[:, :, part], e[:, :, part], i[:, :, part])
            y_out[:, :, part] = y
            stricts.append(y_strict)
            starts.append(S)
        # only the column-decay gradient (of a column or a separable decay) needs the strict output
        y_strict = _cat(stricts) if kind in ("col", "outer") else None
        # the backward reads the final memory only in the decay gradient's boundary term; it visits
        # the chunk-start memories segment by segment, so they are saved as they are, not joined
        # into one whole-sequence tensor (a copy and a fresh allocation of O((T / C) K D))
        ctx.save_for_backward(s, e, i, g, m0, y_strict, M if g is None else M_strict, *starts)
        ctx.kind, ctx.C = kind, C
        return y_out, M

    @staticmethod
    @first_order
    def backward(ctx: Any, dy: Tensor | None, dm_T: Tensor | None) -> tuple[Tensor | None, ...]:
        s, e, i, g, m0, y_strict, m_T, *starts = ctx.saved_tensors  # m_T: o_T * m_{T-1} when g is set
        kind, C = ctx.kind, ctx.C
        tkind = TRANSPOSED[kind]
        T = s.shape[2]
        dy = torch.zeros(*s.shape[:3], i.shape[-1], dtype=i.dtype, device=i.device) if dy is None else dy
        dM = torch.zeros_like(m_T) if dm_T is None else dm_T
        carry = None
        if g is not None:
            mm = dM * m_T.conj()
            if kind == "outer":
                carry = torch.cat([mm.sum(-1), mm.sum(-2)], -1)
            else:
                carry = mm.sum(-2) if kind == "col" else mm.sum(-1)
            if kind == "scalar":
                carry = carry.sum(-1, keepdim=True)
            carry = carry.unsqueeze(2)
        # Gradients are written segment by segment into tensors laid out as their inputs (dense
        # views of the caller's [B, T, H, *] leaves): no join of the segments, and autograd then
        # takes each as the leaf's .grad without copying it into the leaf's layout.
        ds_out, de_out, di_out = torch.empty_like(s), torch.empty_like(e), torch.empty_like(i)
        dg_out = None if g is None else torch.empty_like(g)
        parts = _segments(T, C, _step_bytes(s, i))
        if kind == "none" and not s.is_complex():
            for j in reversed(range(len(parts))):
                part = parts[j]
                ds, de, di, dM = _no_decay_backward(
                    s[:, :, part], e[:, :, part], i[:, :, part], dy[:, :, part], starts[j], dM, C
                )
                ds_out[:, :, part], de_out[:, :, part], di_out[:, :, part] = ds, de, di
            return ds_out, de_out, di_out, None, dM if m0 is not None else None, None, None
        for j in reversed(range(len(parts))):
            part, L = parts[j], parts[j].stop - parts[j].start
            sc, ec, ic = s[:, :, part].conj(), e[:, :, part].conj(), i[:, :, part].conj()
            dy_j = dy[:, :, part]
            gc = None if g is None else g[:, :, part].conj()

            y_strict_j = None if y_strict is None else y_strict[:, :, part]
            last = part.stop == T  # the boundary term already left out the last input
            f_fwd = _decay_factors(gc, C, s.dtype)
            if g is not None and _factorises(f_fwd, s):
                ds, de, di, term, dM_start = _factorised_backward(
                    sc, ec, ic, dy_j, f_fwd, starts[j], dM, kind, y_strict_j, last
                )
                del f_fwd
            else:
                # ds: the forward problem transposed (memory conj(m)^T), from the saved memories
                S_fwd = starts[j].conj().transpose(-1, -2)
                ds = _unchunk(
                    _chunk_outputs(_chunked(dy_j, C), _chunked(ic, C), _chunked(ec, C), f_fwd, S_fwd, tkind, True), L
                )
                del f_fwd, S_fwd  # released before the adjoint pass: the backward's peak is one segment's temporaries

                # di and de: the reverse-time adjoint problem (input dy, expand conj(s), shrink conj(e)
                # for di; its transpose for de), one set of chunk-start memories for both. The
                # adjoint at step t decays by o_{t+1}; dM already holds the next segment's first
                # decay, so past the segment's last step o = 1.
                g_rev = None
                if gc is not None:
                    # gc one step ahead, 0 past the last step: the slice takes T of T + 1 steps
                    # after the cat, where slicing gc first (T - 1 steps) would be guarded on
                    # T - 1 != 1 under torch.compile, a second graph for T = 2
                    g_rev = torch.cat([gc, torch.zeros_like(gc[:, :, :1])], 2)[:, :, 1:].flip(2)
                f_rev = _decay_factors(g_rev, C, s.dtype)
                s_r, e_r, i_r, dy_r = (_chunked(x.flip(2), C) for x in (sc, ec, ic, dy_j))
                S_rev, dM_start = _chunk_states(s_r, dy_r, f_rev, kind, dM)
                di = _unchunk(_chunk_outputs(e_r, s_r, dy_r, f_rev, S_rev, kind, True), L).flip(2)
                del e_r
                de = _unchunk(_chunk_outputs(i_r, dy_r, s_r, f_rev, S_rev.transpose(-1, -2), tkind, True), L).flip(2)
                del s_r, i_r, dy_r, f_rev, S_rev
                if gc is not None:  # the adjoint before the segment's first step, whose decay it takes
                    dM_start = _decayed_by(dM_start, gc[:, :, 0], kind)

                term = None
                if g is not None:
                    term = _decay_term(sc, ec, ic, dy_j, ds, de, di, y_strict_j, kind, last)
                i_dy = (ic * dy_j).sum(-1, keepdim=True)  # own-step terms share i . dy
                ds.addcmul_(i_dy, ec)
                de.addcmul_(i_dy, sc)
                di.add_(_own_step(sc, ec, dy_j))
            if term is not None:
                dg_out[:, :, part] = term.flip(2).cumsum(2).flip(2) + carry
                carry = dg_out[:, :, part.start : part.start + 1]
            ds_out[:, :, part], de_out[:, :, part], di_out[:, :, part] = ds, de, di
            dM = dM_start
        return ds_out, de_out, di_out, dg_out, dM if m0 is not None else None, None, None
