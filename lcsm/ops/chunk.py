"""Chunkwise-parallel forms of the EOS operator (linear in T), with the appendix-5.1 backward.

Two kernels, chosen by the structure of the problem (see ``kernel_for``):

``matmul`` -- e and s are K-vectors and the oscillation is none, a scalar, a row decay (varies
over K, GLA-like), a column decay (varies over D) or a separable decay o_t = a_t (x) b_t (kind
"outer", LCSM Table 3 o code 1), which is both at once: exp(Gamma_t - Gamma_s) factorises into
exp(Ga_t - Ga_s) along K, carried by q and k, and exp(Gb_t - Gb_s) along D, carried by v and y,
and chunk to chunk the memory decays by exp(Ga_C) (x) exp(Gb_C); the pair travels as one
[.., K + D] log tensor (see OUTER). The sequence is cut into chunks of C steps.
Within a chunk everything is matrix products (an attention map); across chunks only the K x D
memory at chunk starts is carried, by a loop over N = T / C chunks. Cumulative log decays Gamma
are taken from each chunk start, in double precision, and no mode ever divides by a cumulative
product. When a chunk's total decay is moderate (at most SAFE_SPAN, e.g. GLA's logsigmoid / 16
gates) exp(Gamma_t - Gamma_s) factorises through the chunk start with every factor within
exp(+-SAFE_SPAN); stronger decays (tests go to -30 per step) split the chunk into sub-chunks of
c <= 16 steps whose pairs factorise through the point between them (factors <= 1), with the
c x c diagonal blocks factorised or, if still too strong, split again the same way (down to single
steps). Long sequences run in segments of SEGMENT tokens so time per token stays flat.

``elementwise`` -- anything else (a full K x D decay as in Mamba, K x D expand or shrink states;
a separable decay there is applied factor by factor, and a decay given as a product of operands,
log_o = a * b, is formed one block of steps at a time): per chunk, the recurrence
m_t = o_t * m_{t-1} + e_t (x) i_t step by step over [B, H, K, D] (exact for any decay), on a CPU
in blocks of steps whose memories fit in BLOCK_BYTES (elsewhere a block is the chunk), each
block's shrink one batched product while they are in cache. ``ELEMENTWISE_FORM = "cumulative"``
selects the form meant for launch-bound devices instead (``_elementwise_form``): the chunk is cut
into blocks whose total decay stays within SAFE_SPAN, and in each the memories are
m_t = exp(L_t) * (m_start + sum_{j <= t} exp(-L_j) e_j (x) i_j) with L the block's cumulative
log decay, a few batched operations per block (steps beyond SAFE_SPAN, or too few for a block,
are taken by the recurrence). Only the memory at chunk ends is kept.

Backward (appendix 5.1, Type 1; corrected in docs/eos.md). For ``matmul`` the backward is itself
EOS problems over the same decays, so it stores no per-step memory:

    ds_t = conj(m_t) dy_t                the forward problem on the transposed memory m^T
    di_t = dm_t^T conj(e_t)              a reverse-time EOS on dm (input dy, expand conj(s))
    de_t = dm_t conj(i_t)                the same reverse-time EOS read through dm^T
    dg_t = sum_{tau >= t} (conj(s) ds - conj(e) de)_tau + sum_d dm_T * conj(m_T)   (row decay)
    dg_t = sum_{tau >= t} (dy conj(y) - conj(i) di)_tau + sum_k dm_T * conj(m_T)   (column decay)

where dm_t = conj(o_{t+1}) dm_{t+1} + conj(s_t) dy_t^T. The two are the marginals of dlog_o over
D and over K for any decay, so a separable decay takes both, one for each factor. Row and column
roles swap under transposition, which is why the kernel supports both (and "outer" becomes
"outer_t"). For ``elementwise`` the backward recomputes each chunk from its saved start memory, in
reverse order, and runs the same adjoint recurrence over that chunk alone, in the forward's
blocks (``scan_chunk_backward``; ``cumulative_backward`` for the cumulative form, whose blocks
sum dm_t = exp(-conj L_t) sum_{j >= t} exp(conj L_j) conj(s_j) dy_j in reverse). Either way
memory is O(T (K + D) + (T / C) K D), not O(T K D).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ._inputs import EOSProblem, LogProduct

Tensor = torch.Tensor

TRANSPOSED = {"none": "none", "scalar": "scalar", "row": "col", "col": "row", "outer": "outer_t", "outer_t": "outer"}
# A separable decay travels as one [.., K + D] log tensor, [log a | log b], so that the chunked
# factors (``_decay_factors``) are computed once for both parts. "outer" reads the first K entries
# (the width of q and k) as the row part; "outer_t" is the same tensor in a transposed problem
# (memory m^T, q and k of width D), where the last D entries vary over the rows.
OUTER = ("outer", "outer_t")
SUBCHUNK = 16
# Largest exponent magnitude a single-reference factorisation may produce: e^30 ~ 1e13 leaves
# float32 far from overflow (and its reciprocal far from underflow); float64 allows much more.
SAFE_SPAN = {torch.float32: 30.0, torch.float64: 200.0}
SEGMENT = 2048
# Cache budget of one block of the elementwise kernel's memories on a CPU (``_block_steps``):
# 1 MiB, about a core's share of a server CPU's cache.
BLOCK_BYTES = 1 << 20
# How the elementwise kernel runs a chunk's steps: "step" (the recurrence, step by step) or
# "cumulative" (a few batched operations per block of steps); see ``_elementwise_form``.
ELEMENTWISE_FORMS = ("step", "cumulative")
ELEMENTWISE_FORM = "step"
# Fewest steps a block of the cumulative form takes in batched operations (about ten of them
# against about three a step in the recurrence, forward and backward alike).
MIN_CUMULATIVE = 4


def kernel_for(p: EOSProblem) -> str:
    """``matmul`` when e and s are K-vectors and the decay is none, scalar, row, column or
    separable ("outer"); ``elementwise`` otherwise (a separable decay then factor by factor, a
    product of operands block by block)."""
    if p.e_is_vector and p.s_is_vector and p.decay_kind not in ("full", "product"):
        return "matmul"
    return "elementwise"


def _halves(x: Tensor, kind: str, width: int):
    """(row part, column part) of a separable decay's [.., K + D] tensor, for a problem whose q and
    k have ``width`` entries (see OUTER)."""
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


def _causal_mask(L: int, strict: bool, device) -> Tensor:
    """s <= t (or s < t when strict) as an [L, L] boolean mask."""
    return torch.ones(L, L, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _pairwise(G: Tensor, strict: bool, dtype: torch.dtype) -> Tensor:
    """[..., c, X] cumulative logs -> [..., c, c, X] masked exp(G_t - G_s) for s <= t (s < t)."""
    mask = _causal_mask(G.shape[-2], strict, G.device).unsqueeze(-1)
    return _masked_exp((G.unsqueeze(-2) - G.unsqueeze(-3)).to(dtype), mask)


def _exp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """exp of a difference of (double-precision) cumulative logs, in the compute dtype.

    Complex values go through polar form: the angle is reduced modulo 2 pi while still in double
    precision (a cumulative rotation can reach thousands of radians, which float32 would resolve
    only to ~1e-4), and polar(exp(re), im) is also several times faster than complex exp on CPU.
    """
    if x.is_complex():
        real = torch.empty((), dtype=dtype).real.dtype
        return torch.polar(x.real.to(real).exp(), torch.remainder(x.imag, 2 * math.pi).to(real))
    return x.to(dtype).exp()


def _is_moderate(G: Tensor, dtype: torch.dtype) -> bool:
    """True when no block's total decay |Gamma_first - Gamma_last| exceeds SAFE_SPAN for the
    compute dtype (G itself is kept in double precision)."""
    span = (G[..., :1, :] - G[..., -1:, :]).real
    real = torch.empty((), dtype=dtype).real.dtype
    return span.numel() == 0 or span.max().item() <= SAFE_SPAN[real]


def _single_reference(q, k, v, G, kind, strict):
    """Blocks [.., L, *] factorised through the block's first step: exact, and safe when
    ``_is_moderate(G)`` because every factor then lies within exp(+-SAFE_SPAN)."""
    mask = _causal_mask(q.shape[-2], strict, q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    ref = G[..., :1, :]
    if kind == "row":
        a = (q * _exp(G - ref, q.dtype)) @ (k * _exp(ref - G, q.dtype)).transpose(-1, -2)
        return torch.where(mask, a, zero) @ v
    if kind in OUTER:
        (Ga, Gb), (ra, rb) = _halves(G, kind, q.shape[-1]), _halves(ref, kind, q.shape[-1])
        a = (q * _exp(Ga - ra, q.dtype)) @ (k * _exp(ra - Ga, q.dtype)).transpose(-1, -2)
        return _exp(Gb - rb, q.dtype) * (torch.where(mask, a, zero) @ (v * _exp(rb - Gb, q.dtype)))
    a = torch.where(mask, q @ k.transpose(-1, -2), zero)
    return _exp(G - ref, q.dtype) * (a @ (v * _exp(ref - G, q.dtype)))


def _intra_subchunked(q, k, v, G, kind, strict, at_most: int = SUBCHUNK):
    """Within-chunk outputs for row, column or separable decays too strong for one reference per
    chunk (q, k [.., C, K], v [.., C, D], G [.., C, X]). The chunk is cut into sub-chunks of
    c <= at_most steps; pairs of sub-chunks factorise through the reference point between them
    (both factors <= 1); diagonal blocks are factorised when their own span is moderate and are
    otherwise cut again the same way, into sub-chunks of at most c / 4 steps, down to single steps
    (whose span is 0) if need be. All branches are exact; the choice only avoids overflow and
    underflow. Cutting again replaced explicit [c, c, K|D] pairwise decay tensors for the diagonal
    blocks, which made decays of about -1.4 per step 5-20x slower than GLA-like ones (eos forward
    and backward on LCSM code-1 shapes at T 256 and 2048; docs/eos.md has the bench); a level of
    cuts costs a few small matmuls.
    """
    C = q.shape[-2]
    c = _subchunk(C, at_most)
    ns = C // c
    lead = q.shape[:-2]

    def sub(x):
        return x.reshape(*lead, ns, c, x.shape[-1])

    qs, ks, vs, Gs = sub(q), sub(k), sub(v), sub(G)
    if c == 1 or _is_moderate(Gs, q.dtype):
        y = _single_reference(qs, ks, vs, Gs, kind, strict)  # [.., ns, c, D]
    else:
        y = _intra_subchunked(qs, ks, vs, Gs, kind, strict, max(1, c // 4))
    blocks = [y[..., 0, :, :]]
    for j in range(1, ns):
        ref = G[..., j * c - 1 : j * c, :]  # Gamma just before sub-chunk j
        q_I, G_I = qs[..., j, :, :], Gs[..., j, :, :]
        k_prev, v_prev, G_prev = k[..., : j * c, :], v[..., : j * c, :], G[..., : j * c, :]
        if kind == "row":
            a_off = (q_I * _exp(G_I - ref, q.dtype)) @ (k_prev * _exp(ref - G_prev, q.dtype)).transpose(-1, -2)
            off = a_off @ v_prev
        elif kind in OUTER:
            width = q.shape[-1]
            (Ga_I, Gb_I), (ra, rb) = _halves(G_I, kind, width), _halves(ref, kind, width)
            Ga_prev, Gb_prev = _halves(G_prev, kind, width)
            a_off = (q_I * _exp(Ga_I - ra, q.dtype)) @ (k_prev * _exp(ra - Ga_prev, q.dtype)).transpose(-1, -2)
            off = _exp(Gb_I - rb, q.dtype) * (a_off @ (v_prev * _exp(rb - Gb_prev, q.dtype)))
        else:
            a_off = q_I @ k_prev.transpose(-1, -2)
            off = _exp(G_I - ref, q.dtype) * (a_off @ (v_prev * _exp(ref - G_prev, q.dtype)))
        blocks.append(y[..., j, :, :] + off)
    return torch.cat(blocks, -2)


def chunk_matmul(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, kind: str, m0: Tensor | None, C: int, strict: bool = False
):
    """The ``matmul`` kernel (arguments as in ``_chunk_matmul_segment``), run over segments of
    about SEGMENT tokens with the memory carried between them. Segmenting changes nothing
    numerically; it keeps the working set and the temporaries of one call at a fixed size, so time
    per token stays flat as T grows (whole-sequence temporaries at T = 32K ran ~3x slower per token,
    from cache misses and fresh page faults on every large allocation)."""
    parts = _segments(q.shape[2], C)
    if len(parts) == 1:
        return _chunk_matmul_segment(q, k, v, g, kind, m0, C, strict)
    ys, M = [], m0
    for part in parts:
        y, M = _chunk_matmul_segment(
            q[:, :, part], k[:, :, part], v[:, :, part], None if g is None else g[:, :, part], kind, M, C, strict
        )
        ys.append(y)
    return torch.cat(ys, 2), M


@dataclass
class _Decay:
    """Chunked factors of one log-oscillation sequence. They depend only on the decays, so every
    EOS problem over the same decays (the forward one and its transposes in the backward) shares
    them whatever the roles of q, k and v."""

    G: Tensor | None = None  # [B, H, N, C, X] cumulative logs from each chunk start (double)
    e_G: Tensor | None = None  # exp(Gamma_t) <= 1
    e_last: Tensor | None = None  # exp(Gamma_C) per chunk, [B, H, N, 1, X]
    e_neg: Tensor | None = None  # exp(-Gamma_s), only when moderate
    to_end: Tensor | None = None  # exp(Gamma_C - Gamma_s)
    moderate: bool = True


def _chunked(x: Tensor, C: int) -> Tensor:
    """[B, H, T, X] -> [B, H, N, C, X], zero-padded at the end. Contiguous once here: the operands
    arrive as head-major views of [B, T, H, *], and every batched matmul would copy them again."""
    B, H, T, X = x.shape
    N = max(1, math.ceil(T / C))
    if N * C != T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(B, H, N, C, X).contiguous()


def _decay_factors(g: Tensor | None, C: int, dt: torch.dtype) -> _Decay:
    if g is None:
        return _Decay()
    # Cumulative logs in double precision: their differences over short spans must stay accurate
    # even when |Gamma| grows large under strong decays.
    wide = torch.complex128 if g.is_complex() else torch.float64
    G = _chunked(g, C).to(wide).cumsum(-2)
    G_last = G[..., -1:, :]
    # Moderate decays (the usual case, e.g. GLA's logsigmoid / 16): everything factorises through
    # the chunk start, exp(Gamma_t - Gamma_s) = exp(Gamma_t) * exp(-Gamma_s), with every factor
    # within exp(+-SAFE_SPAN). Stronger decays take the sub-chunk scheme.
    moderate = _is_moderate(torch.nn.functional.pad(G, (0, 0, 1, 0)), dt)
    e_last = _exp(G_last, dt)
    e_neg = _exp(-G, dt) if moderate else None
    to_end = e_last * e_neg if moderate else _exp(G_last - G, dt)
    return _Decay(G, _exp(G, dt), e_last, e_neg, to_end, moderate)


def _chunk_states(k: Tensor, v: Tensor, f: _Decay, kind: str, m0: Tensor | None):
    """Memories at every chunk start, S [B, H, N, K, D], and after the last chunk.
    k [B, H, N, C, K] and v [B, H, N, C, D] are chunked."""
    B, H, N, _, K = k.shape
    D = v.shape[-1]
    M = m0 if m0 is not None else k.new_zeros(B, H, K, D)
    if kind == "none":
        U = k.transpose(-1, -2) @ v
        # without decay the chunk-start memories are an exclusive prefix sum of the contributions,
        # one small matmul with a strictly lower-triangular matrix of ones
        before = torch.ones(N, N, dtype=U.dtype, device=U.device).tril(-1)
        S = (before @ U.reshape(B, H, N, K * D)).reshape(B, H, N, K, D) + M.unsqueeze(2)
        return S, S[:, :, -1] + U[:, :, -1]
    if kind == "col":
        U = k.transpose(-1, -2) @ (v * f.to_end)
        decay = f.e_last  # [B, H, N, 1, D]
    elif kind in OUTER:
        (a_end, b_end), (a_last, b_last) = _halves(f.to_end, kind, K), _halves(f.e_last, kind, K)
        U = (k * a_end).transpose(-1, -2) @ (v * b_end)
        decay = a_last.transpose(-1, -2) * b_last  # [B, H, N, K, D]
    else:
        U = (k * f.to_end).transpose(-1, -2) @ v
        decay = f.e_last.transpose(-1, -2)  # [B, H, N, K|1, 1]
    states = []
    for n in range(N):
        states.append(M)
        M = torch.addcmul(U[:, :, n], decay[:, :, n], M)
    return torch.stack(states, 2), M


def _chunk_outputs(q: Tensor, k: Tensor, v: Tensor, f: _Decay, S: Tensor, kind: str, strict: bool):
    """y [B, H, N, C, D] from chunked q, k, v and the chunk-start memories S."""
    if kind == "none":
        return (q @ S).add_((q @ k.transpose(-1, -2)).tril_(-1 if strict else 0) @ v)
    mask = _causal_mask(q.shape[-2], strict, q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    if kind == "scalar":
        w = f.e_G * f.e_neg.transpose(-1, -2) if f.moderate else _pairwise(f.G, False, q.dtype)[..., 0]
        return (q @ S) * f.e_G + torch.where(mask, (q @ k.transpose(-1, -2)) * w, zero) @ v
    if kind == "row":
        if f.moderate:
            intra = torch.where(mask, (q * f.e_G) @ (k * f.e_neg).transpose(-1, -2), zero) @ v
        else:
            intra = _intra_subchunked(q, k, v, f.G, "row", strict)
        return (q * f.e_G) @ S + intra
    if kind in OUTER:
        e_a, e_b = _halves(f.e_G, kind, q.shape[-1])
        q_a = q * e_a
        if f.moderate:
            neg_a, neg_b = _halves(f.e_neg, kind, q.shape[-1])
            intra = e_b * (torch.where(mask, q_a @ (k * neg_a).transpose(-1, -2), zero) @ (v * neg_b))
        else:
            intra = _intra_subchunked(q, k, v, f.G, kind, strict)
        return (q_a @ S) * e_b + intra
    if f.moderate:
        intra = f.e_G * (torch.where(mask, q @ k.transpose(-1, -2), zero) @ (v * f.e_neg))
    else:
        intra = _intra_subchunked(q, k, v, f.G, "col", strict)
    return (q @ S) * f.e_G + intra


def _chunk_matmul_segment(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, kind: str, m0: Tensor | None, C: int, strict: bool = False
):
    """The ``matmul`` kernel on one segment. q, k [B, H, T, K]; v [B, H, T, D]; g None (kind 'none') or
    [B, H, T, 1] ('scalar'), [B, H, T, K] ('row'), [B, H, T, D] ('col'), [B, H, T, K + D] ('outer':
    the row part, then the column part); m0 [B, H, K, D] or None.
    Returns y [B, H, T, D] and m_T [B, H, K, D]. Differentiable by autograd as written.
    ``strict`` leaves out each step's own contribution (s = t) from y (not from m_T); see
    ``ChunkMatmulFunction`` for why the backward wants that."""
    f = _decay_factors(g, C, q.dtype)
    qc, kc, vc = _chunked(q, C), _chunked(k, C), _chunked(v, C)
    S, M = _chunk_states(kc, vc, f, kind, m0)
    return _unchunk(_chunk_outputs(qc, kc, vc, f, S, kind, strict), q.shape[2]), M


def _unchunk(y: Tensor, T: int) -> Tensor:
    """[B, H, N, C, D] -> [B, H, T, D], dropping the padding."""
    B, H, N, C, D = y.shape
    return y.reshape(B, H, N * C, D)[:, :, :T]


def _own_step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Each step's own contribution (q_t . k_t) v_t, the part ``strict`` leaves out."""
    return (q * k).sum(-1, keepdim=True) * v


def _cat(parts: list) -> Tensor:
    """Segments joined along time; a single segment is returned as it is (torch.cat would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _segments(T: int, C: int):
    seg = max(C, (SEGMENT // C) * C)
    return [slice(a, min(a + seg, T)) for a in range(0, T, seg)]


def _no_decay_backward(q: Tensor, k: Tensor, v: Tensor, dy: Tensor, S: Tensor, dM: Tensor, C: int):
    """The backward of one segment without decay (real inputs), in chunks:
    with A = tril(q k^T) and G = tril(dy v^T) per chunk, dq = G k + dy S^T, dk = G^T q + v dA^T,
    dv = A^T dy + k dA, where S is the memory at each chunk start (saved by the forward) and dA
    the adjoint memory after each chunk (a reverse exclusive prefix sum of q^T dy plus the
    adjoint carried in from later segments). No decay means no strict/own-step split is needed
    (that split only protects the decay gradient), so both intra-chunk maps take the diagonal.
    Returns dq, dk, dv and the adjoint memory at the segment's start."""
    L = q.shape[2]
    qc, kc, vc, dyc = (_chunked(x, C) for x in (q, k, v, dy))
    N = qc.shape[2]
    A = (qc @ kc.transpose(-1, -2)).tril_()
    G = (dyc @ vc.transpose(-1, -2)).tril_()
    P = qc.transpose(-1, -2) @ dyc  # [B, H, N, K, D]
    B, H, _, K, D = P.shape
    later = torch.ones(N, N, dtype=P.dtype, device=P.device).triu(1)
    dA = (later @ P.reshape(B, H, N, K * D)).reshape(B, H, N, K, D) + dM.unsqueeze(2)
    dq = (G @ kc).add_(dyc @ S.transpose(-1, -2))
    dk = (G.transpose(-1, -2) @ qc).add_(vc @ dA.transpose(-1, -2))
    dv = (A.transpose(-1, -2) @ dyc).add_(kc @ dA)
    return _unchunk(dq, L), _unchunk(dk, L), _unchunk(dv, L), dA[:, :, 0] + P[:, :, 0]


def _final_memory_strict(kc: Tensor, vc: Tensor, f: _Decay, kind: str, S: Tensor, j: int) -> Tensor:
    """o_T * m_{T-1}: the final memory without the last step's own input e_T i_T^T, from the last
    chunk's start memory S[:, :, -1] and its steps before j (the last step's index in the chunk;
    padded steps after it have no input and decay 1). Computed directly, because m_T - e_T i_T^T
    would keep m_T's O(1) rounding error in an O(o) result."""
    k = kc[:, :, -1:].clone()
    k[:, :, :, j] = 0
    last_chunk = _Decay(e_last=f.e_last[:, :, -1:], to_end=f.to_end[:, :, -1:])
    return _chunk_states(k, vc[:, :, -1:], last_chunk, kind, S[:, :, -1])[1]


def _input_part(x: Tensor, last_segment: bool) -> Tensor:
    """conj(e) de (or conj(i) di) of a segment, for the decay gradient. In the sequence's last
    segment its last step is left out: there it is exactly the dM part that the boundary term
    leaves out too (``ChunkMatmulFunction``)."""
    if last_segment:
        x[:, :, -1] = 0
    return x


class ChunkMatmulFunction(torch.autograd.Function):
    """``chunk_matmul`` with the appendix-5.1 backward expressed as three more EOS problems.

    The three share work: ds is the forward problem transposed, so it reuses the forward's
    chunk-start memories (saved: O((T / C) K D)); di and de are one reverse-time problem read out
    two ways (its memory is dm for di and dm^T for de), so its chunk-start memories are computed
    once. Forward and backward walk the sequence in segments (see ``chunk_matmul``); the backward
    visits them last to first, carrying the adjoint memory and the decay gradient's reverse
    cumulative sum back across segment boundaries.

    Without decay (real inputs) a specialised backward (``_no_decay_backward``) takes the place of
    the three problems: with nothing to protect it needs no strict split and no time reversal,
    and the intra-chunk maps tril(q k^T) and tril(dy v^T) each serve two gradients.

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
    def forward(ctx, q, k, v, g, m0, kind, C):
        B, H, T, K = q.shape
        M = m0 if m0 is not None else q.new_zeros(B, H, K, v.shape[-1])
        ys, stricts, starts = [], [], []
        for part in _segments(T, C):
            f = _decay_factors(None if g is None else g[:, :, part], C, q.dtype)
            qc, kc, vc = (_chunked(x[:, :, part], C) for x in (q, k, v))
            S, M = _chunk_states(kc, vc, f, kind, M)
            if g is not None and part.stop == T:
                M_strict = _final_memory_strict(kc, vc, f, kind, S, (part.stop - part.start - 1) % C)
            y_strict = _unchunk(_chunk_outputs(qc, kc, vc, f, S, kind, True), part.stop - part.start)
            # whole-sequence temporaries are avoided: at long T every large allocation costs
            # fresh page faults, so the own-step term is added segment by segment
            ys.append(y_strict + _own_step(q[:, :, part], k[:, :, part], v[:, :, part]))
            stricts.append(y_strict)
            starts.append(S)
        # only the column-decay gradient (of a column or a separable decay) needs the strict output
        y_strict = _cat(stricts) if kind in ("col", "outer") else None
        # the backward reads the final memory only in the decay gradient's boundary term; it visits
        # the chunk-start memories segment by segment, so they are saved as they are, not joined
        # into one whole-sequence tensor (a copy and a fresh allocation of O((T / C) K D))
        ctx.save_for_backward(q, k, v, g, m0, y_strict, M if g is None else M_strict, *starts)
        ctx.kind, ctx.C = kind, C
        return _cat(ys), M

    @staticmethod
    def backward(ctx, dy, dm_T):
        q, k, v, g, m0, y_strict, m_T, *starts = ctx.saved_tensors  # m_T: o_T * m_{T-1} when g is set
        kind, C = ctx.kind, ctx.C
        tkind = TRANSPOSED[kind]
        T = q.shape[2]
        dy = torch.zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device) if dy is None else dy
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
        grads = {"q": [], "k": [], "v": [], "g": []}
        parts = _segments(T, C)
        if kind == "none" and not q.is_complex():
            for j in reversed(range(len(parts))):
                part = parts[j]
                dq, dk, dv, dM = _no_decay_backward(
                    q[:, :, part], k[:, :, part], v[:, :, part], dy[:, :, part], starts[j], dM, C
                )
                for name, grad in (("q", dq), ("k", dk), ("v", dv)):
                    grads[name].append(grad)

            def cat(name):
                return _cat(grads[name][::-1])

            return cat("q"), cat("k"), cat("v"), None, dM if m0 is not None else None, None, None
        for j in reversed(range(len(parts))):
            part, L = parts[j], parts[j].stop - parts[j].start
            qc, kc, vc = q[:, :, part].conj(), k[:, :, part].conj(), v[:, :, part].conj()
            dy_j = dy[:, :, part]
            gc = g_rev = None
            if g is not None:
                gc = g[:, :, part].conj()
                # the adjoint at step t decays by o_{t+1}; past the last step of the sequence o = 1
                after = g[:, :, part.stop : part.stop + 1].conj() if part.stop < T else torch.zeros_like(gc[:, :, :1])
                g_rev = torch.cat([gc[:, :, 1:], after], 2).flip(2)

            # ds: the forward problem transposed (memory conj(m)^T), from the saved memories
            S_fwd = starts[j].conj().transpose(-1, -2)
            f_fwd = _decay_factors(gc, C, q.dtype)
            dq = _unchunk(
                _chunk_outputs(_chunked(dy_j, C), _chunked(vc, C), _chunked(kc, C), f_fwd, S_fwd, tkind, True), L
            )
            del f_fwd, S_fwd  # released before the adjoint pass: the backward's peak is one segment's temporaries

            # di and de: the reverse-time adjoint problem (input dy, expand conj(s), shrink conj(e)
            # for di; its transpose for de), one set of chunk-start memories for both
            f_rev = _decay_factors(g_rev, C, q.dtype)
            q_r, k_r, v_r, dy_r = (_chunked(x.flip(2), C) for x in (qc, kc, vc, dy_j))
            S_rev, dM_start = _chunk_states(q_r, dy_r, f_rev, kind, dM)
            dv = _unchunk(_chunk_outputs(k_r, q_r, dy_r, f_rev, S_rev, kind, True), L).flip(2)
            del k_r
            dk = _unchunk(_chunk_outputs(v_r, dy_r, q_r, f_rev, S_rev.transpose(-1, -2), tkind, True), L).flip(2)
            del q_r, v_r, dy_r, f_rev, S_rev

            if g is not None:
                last = part.stop == T  # the boundary term already left out the last input
                if kind == "col":
                    term = dy_j * y_strict[:, :, part].conj() - _input_part(vc * dv, last)
                elif kind == "outer":
                    # a separable decay's gradient is both marginals of dlog_o at once: the row
                    # identity over its K entries, the column identity over its D entries
                    term = torch.cat(
                        [
                            qc * dq - _input_part(kc * dk, last),
                            dy_j * y_strict[:, :, part].conj() - _input_part(vc * dv, last),
                        ],
                        -1,
                    )
                else:
                    term = qc * dq - _input_part(kc * dk, last)
                    if kind == "scalar":
                        term = term.sum(-1, keepdim=True)
                dg = term.flip(2).cumsum(2).flip(2) + carry
                carry = dg[:, :, :1]
                grads["g"].append(dg)
            v_dy = (vc * dy_j).sum(-1, keepdim=True)  # own-step terms share i . dy
            grads["q"].append(dq.addcmul_(v_dy, kc))
            grads["k"].append(dk.addcmul_(v_dy, qc))
            grads["v"].append(dv.add_(_own_step(qc, kc, dy_j)))
            dM = dM_start
        dm0 = None
        if m0 is not None:
            dm0 = dM
            if g is not None:
                first = g[:, :, 0].conj().exp()
                if kind == "outer":
                    first_a, first_b = _halves(first, kind, q.shape[-1])
                    dm0 = dM * (first_a.unsqueeze(-1) * first_b.unsqueeze(-2))
                else:
                    dm0 = dM * (first.unsqueeze(-2) if kind == "col" else first.unsqueeze(-1))

        def cat(name):
            return torch.cat(grads[name][::-1], 2) if grads[name] else None

        return cat("q"), cat("k"), cat("v"), cat("g"), dm0, None, None


# ----------------------------------------------------------------------------- elementwise kernel


def _time_slice(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    if x is None or x.shape[2] == 1:
        return x
    return x[:, :, start:stop]


def _at(x: Tensor, t: int) -> Tensor:
    """Step t of a [B|1, H, c|1, ...] tensor (a time-shared tensor serves every step)."""
    return x[:, :, t if x.shape[2] > 1 else 0]


def _grad_for(x: Tensor, grad: Tensor) -> Tensor:
    """A gradient reduced to the (broadcast) shape of x, real where x is real."""
    if grad.is_complex() and not x.is_complex():
        grad = grad.real
    return grad.sum_to_size(x.shape)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt) @ b.to(dt)


def _contract_k(a: Tensor, h: Tensor) -> Tensor:
    """sum_k a[.., k, d] h[.., k, d] for a [.., K, D|1] and h [.., K, D] -> [.., D]; a batched
    vector-matrix product when a is a K-vector (no [.., K, D] temporary)."""
    if a.shape[-1] == 1:
        return _matmul(a.transpose(-1, -2), h).squeeze(-2)
    return (a * h).sum(-2)


def _promoted(*xs: Tensor | None) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        if x is not None:
            dt = torch.promote_types(dt, x.dtype)
    return dt


def _block_steps(B: int, H: int, K: int, D: int, dtype: torch.dtype, device: torch.device, c: int) -> int:
    """Steps per block of a chunk of c steps in the elementwise kernel (see ``scan_chunk``): on a
    CPU as many [B, H, K, D] memories as fit in BLOCK_BYTES, at least one; elsewhere the whole
    chunk, the form the project's GPU runs used, since there each operation is a kernel launch
    whose fixed cost dominates at these sizes and per-step blocks would multiply the launches."""
    if device.type != "cpu":
        return c
    step = B * H * K * D * torch.empty((), dtype=dtype).element_size()
    return min(c, max(1, BLOCK_BYTES // step))


def _recur(v, e, o, h, out):
    """``h_t = o_t * h_{t-1} + e_t (x) v_t`` for the n steps of v [B, H, n, D] (e and the decay
    factors o sliced alike) from the memory h, written into out[:, :, :n]; returns the last
    memory, a view of out. h may be out's last slot: each step reads only the slot before it."""
    vv = v.unsqueeze(-2)
    for t in range(v.shape[2]):
        h_t = out[:, :, t]
        if o:
            torch.mul(_at(o[0], t), h, out=h_t)
            for factor in o[1:]:
                h_t.mul_(_at(factor, t))
            h_t.addcmul_(_at(e, t), vv[:, :, t])
        else:
            torch.addcmul(h, _at(e, t), vv[:, :, t], out=h_t)
        h = h_t
    return h


def _blocks(c: int, b: int):
    return [(a, min(a + b, c)) for a in range(0, c, b)]


# The elementwise kernel's decay ``o`` is a list of factors [B|1, H, c|1, K|1, D|1] whose product
# is o (none, one, or a separable pair's two), or a LogProduct of operands in that layout whose
# product is log o, from which each block forms its own factor exp(a * b) in cache.


def _operands(o) -> list:
    """The tensors the decay's gradients are taken for: its factors, or a product's a and b."""
    return [o.a, o.b] if isinstance(o, LogProduct) else list(o)


def _decay_slice(o, start: int, stop: int):
    """The decay of steps start..stop."""
    if isinstance(o, LogProduct):
        return LogProduct(_time_slice(o.a, start, stop), _time_slice(o.b, start, stop))
    return [_time_slice(f, start, stop) for f in o]


@dataclass(frozen=True)
class _FormedProduct(LogProduct):
    """One chunk's product with its factor exp(a * b) [B|1, H, c|1, K, D] formed (``_formed_once``)."""

    factor: Tensor


def _formed_once(o, v: Tensor, e: Tensor, m: Tensor):
    """The decay the backward's two passes over a chunk read (``_memories``, then
    ``scan_chunk_backward``): a product's factor formed once for both when the chunk is a single
    block, where each pass would form all of it again (at batch 1 the exp is a large part of the
    work); per block, in cache, otherwise."""
    if not isinstance(o, LogProduct):
        return o
    B, H, c, D = v.shape
    if _block_steps(B, H, e.shape[3], D, _promoted(m, e, v, o.a, o.b), v.device, c) < c:
        return o
    return _FormedProduct(o.a, o.b, _block_factors(o, 0, c)[0])


def _block_factors(o, start: int, stop: int) -> list:
    """The factors of steps start..stop, a product's exp(a * b) formed for those steps alone."""
    if isinstance(o, _FormedProduct):
        return [_time_slice(o.factor, start, stop)]
    if isinstance(o, LogProduct):
        return [torch.mul(_time_slice(o.a, start, stop), _time_slice(o.b, start, stop)).exp_()]
    return _decay_slice(o, start, stop)


def _decay_grads(o, start: int, stop: int, dG: Tensor):
    """(index in ``_operands(o)``, gradient before reduction) for steps start..stop given
    dG = dlog_o there: every factor's log takes dG (their logs add); a product's a takes
    dG conj(b) and b takes dG conj(a) (PyTorch's convention for complex inputs)."""
    if isinstance(o, LogProduct):
        a, b = _time_slice(o.a, start, stop), _time_slice(o.b, start, stop)
        return [(0, dG * b.conj()), (1, dG * a.conj())]
    return [(j, dG) for j in range(len(o))]


def scan_chunk(v, e, s, o, m):
    """One chunk of the elementwise kernel: v [B, H, c, D], e/s [B|1, H, c|1, K, D|1], o a list of
    decay factors [B|1, H, c|1, K|1, D|1] whose product is the decay (exp(log_o); two for a
    separable pair, none for no decay) or a LogProduct of the log decay's operands, m [B, H, K, D]
    -> (y [B, H, c, D], the memory after the chunk [B, H, K, D]).

    ``h_t = o_t * h_{t-1} + e_t (x) v_t`` step by step is the recurrence itself: exact for any
    decay, with no cumulative product to overflow or cancel. The steps run in blocks (on a CPU,
    those whose memories fit in BLOCK_BYTES; ``_block_steps``), each block followed by its shrink
    as one batched product, so the shrink reads memories still in cache: with a large batch a
    block is one step (the kernel is bound by memory traffic, and a chunk's [c, K, D] memories
    would make a round trip to main memory), with small memories a block is the whole chunk (few,
    large operations: the cost per operation then dominates). A separable decay stays two factors
    (two in-place products a step) rather than a materialised [B, H, T, K, D] tensor; a product's
    factor exp(a * b) is formed for each block as it runs. No autograd: ``scan_chunk_backward`` is
    its adjoint.
    """
    B, H, c, D = v.shape
    dtype = _promoted(m, e, v, *_operands(o))
    b = _block_steps(B, H, e.shape[3], D, dtype, v.device, c)
    buffer = v.new_empty(B, H, b, e.shape[3], D, dtype=dtype)
    h, ys = m, []
    for a, z in _blocks(c, b):
        h = _recur(v[:, :, a:z], _time_slice(e, a, z), _block_factors(o, a, z), h, buffer)
        ys.append(_contract_k(_time_slice(s, a, z), buffer[:, :, : z - a]))
    return torch.cat(ys, 2), h.clone()


def _memories(v, e, o, m):
    """The memories h [B, H, c, K, D] after each step of a chunk, for its backward, in the
    forward's blocks (a product's factors formed block by block)."""
    B, H, c, D = v.shape
    hs = v.new_empty(B, H, c, e.shape[3], D, dtype=_promoted(m, e, v, *_operands(o)))
    h = m
    for a, z in _blocks(c, _block_steps(B, H, e.shape[3], D, hs.dtype, v.device, c)):
        h = _recur(v[:, :, a:z], _time_slice(e, a, z), _block_factors(o, a, z), h, hs[:, :, a:z])
    return hs


def _grad_outer(x: Tensor, A: Tensor, w: Tensor) -> Tensor:
    """The gradient of x [.., K, D|1] in a term x[.., k, d] w[.., d] whose adjoint is A [.., K, D]:
    sum_d A[.., k, d] w[.., d] when x is a K-vector, A * w otherwise, before reduction to x's shape."""
    if x.shape[-1] == 1:
        # As a row vector times A^T: CPU batched products with the vector on the right, A @ w,
        # ran about 6x slower at B 64, K 64, D 128 (1.0 ms against 0.17 ms, torch 2.13).
        return _matmul(w.unsqueeze(-2), A.mT).mT
    return A * w.unsqueeze(-2)


class _BlockGrads:
    """The gradient of an input x [B|1, H, c|1, ...] of one chunk, given block by block: ``out``
    is the chunk's slice of a per-step x's gradient buffer, written in place; None for a
    time-shared x, whose blocks are summed."""

    def __init__(self, x: Tensor, out: Tensor | None):
        self.x, self.out, self.total = x, out, None

    def slot(self, a: int, z: int, like: Tensor) -> Tensor | None:
        """The buffer's slice for steps a..z when a gradient shaped and typed like ``like`` can be
        written there as it is (no reduction, no real part); else None."""
        if self.out is None or self.out.dtype != like.dtype or self.out[:, :, a:z].shape != like.shape:
            return None
        return self.out[:, :, a:z]

    def add(self, a: int, z: int, grad: Tensor) -> None:
        if self.out is not None:
            part = self.out[:, :, a:z]
            part.copy_(_grad_for(part, grad))
        else:
            grad = _grad_for(self.x, grad)
            self.total = grad if self.total is None else self.total + grad

    def result(self) -> Tensor:
        return self.total if self.out is None else self.out


def scan_chunk_backward(v, e, s, o, m, hs, dy, dm, out):
    """The adjoint of ``scan_chunk`` (appendix 5.1, Type 1, restricted to one chunk), by the
    reverse-time recurrence ``dh_t = conj(o_{t+1}) dh_{t+1} + conj(s_t) dy_t``; with it
    ``dlog_o_t = conj(o_t) dh_t conj(h_{t-1})`` (reduced to each factor's shape: the factors
    multiply, so their logs add), ``de_t = dh_t conj(v_t)``, ``dv_t = sum_k dh_t conj(e_t)`` and
    ``ds_t = dy_t conj(h_t)`` (PyTorch's conjugate convention for complex inputs); a product's
    operands then take dlog_o conj(b) and dlog_o conj(a) (``_decay_grads``). The recurrence
    runs step by step in the forward's blocks, from the last, and each block's gradients follow
    as batched products while its dh are in cache. hs are the chunk's memories (``_memories``);
    ``out`` maps "v", "e", "s" and each decay operand's index (``_operands``) to the chunk's slice
    of its gradient buffer, None for a time-shared input. Returns (dv, de, ds, the operands'
    gradients, dm for the chunk's start memory), a per-step input's gradient being its ``out``
    slice."""
    B, H, c, D = v.shape
    K = e.shape[3]
    dY = dy.unsqueeze(-2)  # [B, H, c, 1, D]
    ec, sc, vc = e.conj(), s.conj(), v.conj()
    operands = _operands(o)
    grads = {
        "v": _BlockGrads(v, out["v"]),
        "e": _BlockGrads(e, out["e"]),
        "s": _BlockGrads(s, out["s"]),
        **{j: _BlockGrads(x, out[j]) for j, x in enumerate(operands)},
    }
    # A real memory read by complex s or dy takes the real part of its adjoint (two ops a step).
    real_part = not hs.is_complex() and (sc.is_complex() or dy.is_complex())
    b = _block_steps(B, H, K, D, hs.dtype, hs.device, c)
    dH = hs.new_empty(B, H, b, K, D)
    dC = hs.new_empty(B, H, b, K, D) if operands else dH  # conj(o_t) dh_t, the carry into step t - 1
    carry = dm
    for a, z in reversed(_blocks(c, b)):
        oc = [factor.conj() for factor in _block_factors(o, a, z)]
        for j in reversed(range(z - a)):
            t = a + j
            if real_part:
                torch.add(carry, (dY[:, :, t] * _at(sc, t)).real, out=dH[:, :, j])
            else:
                torch.addcmul(carry, dY[:, :, t], _at(sc, t), out=dH[:, :, j])
            carry = dC[:, :, j]
            for i, factor in enumerate(oc):
                torch.mul(dH[:, :, j] if i == 0 else carry, _at(factor, j), out=carry)
        n = z - a
        grads["v"].add(a, z, _contract_k(_time_slice(ec, a, z), dH[:, :, :n]))
        grads["e"].add(a, z, _grad_outer(e, dH[:, :, :n], vc[:, :, a:z]))
        grads["s"].add(a, z, _grad_outer(s, hs[:, :, a:z].conj(), dy[:, :, a:z]))
        if operands:
            # A single factor's dlog_o goes straight into its buffer when it needs no reduction.
            direct = grads[0].slot(a, z, dC[:, :, :n]) if not isinstance(o, LogProduct) and len(o) == 1 else None
            dG = direct if direct is not None else torch.empty_like(dC[:, :, :n])
            torch.mul(dC[:, :, 1:n], hs[:, :, a : z - 1].conj(), out=dG[:, :, 1:])
            torch.mul(dC[:, :, 0], (hs[:, :, a - 1] if a > 0 else m).conj(), out=dG[:, :, 0])
            if direct is None:
                for j, grad in _decay_grads(o, a, z, dG):
                    grads[j].add(a, z, grad)
    d_operands = [grads[j].result() for j in range(len(operands))]
    return grads["v"].result(), grads["e"].result(), grads["s"].result(), d_operands, carry.clone()


def chunk_elementwise(v, e, s, o, m0, C):
    """The ``elementwise`` kernel over the whole sequence (o: the decay factors, or a LogProduct
    of the log decay's operands); returns y, m_T and the chunks' start memories."""
    B, H, T, D = v.shape
    K = e.shape[3]
    M = m0 if m0 is not None else v.new_zeros(B, H, K, D)
    ys, states = [], []
    for start in range(0, T, C):
        stop = min(start + C, T)
        states.append(M)
        y_c, M = scan_chunk(
            v[:, :, start:stop],
            _time_slice(e, start, stop),
            _time_slice(s, start, stop),
            _decay_slice(o, start, stop),
            M,
        )
        ys.append(y_c)
    return torch.cat(ys, 2), M, states


def _elementwise_form() -> str:
    """The form of the elementwise kernel, ``ELEMENTWISE_FORM``. "step" is the default on every
    device. "cumulative" is meant for devices where each operation is a kernel launch and the
    stepwise form's few small operations a step make a run launch-bound (a GPU): it issues 3.5x
    fewer operations in a training step of Mamba and 6x fewer for LCSM codes 6-9 (aten calls
    counted on a CPU, 256 tokens), but it has not been timed on a GPU yet, so it is not the
    default there. On a CPU it is slower (2.9x for a Mamba layer's forward and backward, 7x for
    code 1-6-1-0's, at B 16, T 256, d_model 128, one thread: its [n, K, D] temporaries leave the
    cache)."""
    if ELEMENTWISE_FORM not in ELEMENTWISE_FORMS:
        raise ValueError(f"ELEMENTWISE_FORM: expected 'step' or 'cumulative', got {ELEMENTWISE_FORM!r}")
    return ELEMENTWISE_FORM


@contextlib.contextmanager
def use_elementwise_form(form: str):
    """``ELEMENTWISE_FORM`` = ``form`` inside the block (the trainer's ``run.elementwise_form``)."""
    global ELEMENTWISE_FORM
    if form not in ELEMENTWISE_FORMS:
        raise ValueError(f"form: expected 'step' or 'cumulative', got {form!r}")
    previous, ELEMENTWISE_FORM = ELEMENTWISE_FORM, form
    try:
        yield
    finally:
        ELEMENTWISE_FORM = previous


def _span_blocks(g, T: int, C: int, dtype: torch.dtype):
    """For each chunk of C steps, its blocks (a, z, cumulative) in the cumulative form: runs of
    consecutive steps whose summed largest |Re log o| (over batch, heads, K and D; the factors'
    maxima added) is at most SAFE_SPAN for the memory dtype, which bounds every exp(+-L) in the
    block. A run shorter than MIN_CUMULATIVE steps (a step beyond SAFE_SPAN is a run of one) is
    cheaper as recurrence steps: consecutive such runs make one stepwise block (cumulative False).
    One host synchronisation for the whole sequence."""
    limit = SAFE_SPAN[torch.empty((), dtype=dtype).real.dtype]
    per_step = torch.zeros(T, dtype=torch.float64, device=g[0].device if g else None)
    for x in g:
        per_step = per_step + x.real.abs().amax(dim=(0, 1, 3, 4)).to(torch.float64)
    per_step = per_step.tolist()
    chunks = []
    for start in range(0, T, C):
        stop, runs, a, total = min(start + C, T), [], 0, 0.0
        for t in range(stop - start):
            if t > a and total + per_step[start + t] > limit:
                runs.append((a, t))
                a, total = t, 0.0
            total += per_step[start + t]
        blocks = []
        for first, z in [*runs, (a, stop - start)]:
            cumulative = z - first >= MIN_CUMULATIVE
            if not cumulative and blocks and not blocks[-1][2]:
                first = blocks.pop()[0]
            blocks.append((first, z, cumulative))
        chunks.append(blocks)
    return chunks


def _cumulative_log(g, a: int, z: int) -> Tensor | None:
    """L_t = sum_{a <= i <= t} log o_i over steps a..z of a chunk, [B|1, H, z - a, K|1, D|1], in
    double precision (None without a decay)."""
    total = None
    for x in g:
        part = _time_slice(x, a, z)
        part = part.to(torch.complex128 if part.is_complex() else torch.float64)
        total = part if total is None else total + part
    if total is None:
        return None
    if total.shape[2] == 1:
        steps = torch.arange(1, z - a + 1, dtype=torch.float64, device=total.device)
        return total * steps.view(1, 1, -1, 1, 1)
    return total.cumsum(2)


def cumulative_memories(v, e, g, m, blocks):
    """The memories h [B, H, c, K, D] after each step of a chunk in the cumulative form: in a block
    of steps a..z, h_t = exp(L_t) * (h_{a-1} + sum_{a <= j <= t} exp(-L_j) e_j (x) v_j) with L the
    block's cumulative log decay (``_cumulative_log``); every factor lies within exp(+-SAFE_SPAN)
    by the blocks' construction (``_span_blocks``); a stepwise block is the recurrence.
    v [B, H, c, D], e [B|1, H, c|1, K, D|1], g the decay's log factors, m [B, H, K, D]."""
    B, H, c, D = v.shape
    dtype = _promoted(m, e, v, *g)
    hs = v.new_empty(B, H, c, e.shape[3], D, dtype=dtype)
    h = m
    for a, z, cumulative in blocks:
        if not cumulative:
            h = _recur(v[:, :, a:z], _time_slice(e, a, z), [_time_slice(x, a, z).exp() for x in g], h, hs[:, :, a:z])
            continue
        L = _cumulative_log(g, a, z)
        X = _time_slice(e, a, z) * v[:, :, a:z].unsqueeze(-2)
        if L is None:
            torch.add(X.cumsum(2), h.unsqueeze(2), out=hs[:, :, a:z])
        else:
            torch.mul(_exp(L, dtype), (_exp(-L, dtype) * X).cumsum(2) + h.unsqueeze(2), out=hs[:, :, a:z])
        h = hs[:, :, z - 1]
    return hs


def chunk_cumulative(v, e, s, g, m0, C):
    """The elementwise kernel in the cumulative form (g: the decay's log factors); returns y, m_T,
    the chunks' start memories and their blocks."""
    B, H, T, D = v.shape
    M = m0 if m0 is not None else v.new_zeros(B, H, e.shape[3], D)
    chunks = _span_blocks(g, T, C, _promoted(M, e, v, *g))
    ys, states = [], []
    for n, start in enumerate(range(0, T, C)):
        stop = min(start + C, T)
        states.append(M)
        hs = cumulative_memories(
            v[:, :, start:stop], _time_slice(e, start, stop), [_time_slice(x, start, stop) for x in g], M, chunks[n]
        )
        ys.append(_contract_k(_time_slice(s, start, stop), hs))
        M = hs[:, :, -1].clone()
    return torch.cat(ys, 2), M, states, chunks


def cumulative_backward(v, e, s, g, m, hs, dy, dm, out, blocks):
    """The adjoint of one chunk of the cumulative form, in its blocks from the last: with
    Q_t = conj(s_t) dy_t, dh_t = exp(-conj L_t) (sum_{j >= t} exp(conj L_j) Q_j + exp(conj L_last)
    dh_carry) within a cumulative block, the reverse recurrence dh_t = Q_t + conj(o_{t+1}) dh_{t+1}
    in a stepwise one; then every gradient as in ``scan_chunk_backward``, over the whole chunk at
    once. Same arguments and returns as ``scan_chunk_backward``, g being log factors."""
    ec, sc, vc = e.conj(), s.conj(), v.conj()
    Q = sc * dy.unsqueeze(-2)
    if not hs.is_complex() and Q.is_complex():
        Q = Q.real
    # conj(o_t), each step's factor of the carry into step t - 1
    oc = None if not g else (g[0] if len(g) == 1 else g[0] + g[1]).conj().exp()
    dH = torch.empty_like(hs)
    carry = dm
    for a, z, cumulative in reversed(blocks):
        if not cumulative:
            for t in reversed(range(a, z)):
                torch.add(carry, Q[:, :, t], out=dH[:, :, t])
                carry = dH[:, :, t] if oc is None else _at(oc, t) * dH[:, :, t]
            continue
        L = _cumulative_log(g, a, z)
        if L is None:
            torch.add(Q[:, :, a:z].flip(2).cumsum(2).flip(2), carry.unsqueeze(2), out=dH[:, :, a:z])
        else:
            A = _exp(L.conj(), hs.dtype)
            R = (A * Q[:, :, a:z]).flip(2).cumsum(2).flip(2) + A[:, :, -1:] * carry.unsqueeze(2)
            torch.mul(_exp(-L.conj(), hs.dtype), R, out=dH[:, :, a:z])
        carry = dH[:, :, a] if oc is None else _at(oc, a) * dH[:, :, a]
    c = v.shape[2]
    grads = {
        "v": _BlockGrads(v, out["v"]),
        "e": _BlockGrads(e, out["e"]),
        "s": _BlockGrads(s, out["s"]),
        **{j: _BlockGrads(x, out[j]) for j, x in enumerate(g)},
    }
    grads["v"].add(0, c, _contract_k(ec, dH))
    grads["e"].add(0, c, _grad_outer(e, dH, vc))
    grads["s"].add(0, c, _grad_outer(s, hs.conj(), dy))
    if g:
        dC = oc * dH
        dG = torch.cat([dC[:, :, :1] * m.conj().unsqueeze(2), dC[:, :, 1:] * hs[:, :, :-1].conj()], 2)
        for j in range(len(g)):
            grads[j].add(0, c, dG)
    return (
        grads["v"].result(),
        grads["e"].result(),
        grads["s"].result(),
        [grads[j].result() for j in range(len(g))],
        carry.clone(),
    )


class ChunkElementwiseFunction(torch.autograd.Function):
    """``chunk_elementwise`` (or ``chunk_cumulative``, see ``_elementwise_form``) whose backward
    recomputes one chunk at a time from its saved start memory and runs ``scan_chunk_backward``
    (``cumulative_backward``) over it, in reverse chunk order. The decay comes as up to two log
    tensors, g_a and g_b: a separable pair's row and column parts, whose exps multiply (g_b None
    for a single log), or with ``product`` the operands of log_o = g_a * g_b, which only the step
    form takes (``eos_chunk``) and which it saves as they are, forming exp(g_a * g_b) block by
    block in the forward and again in the backward (once for a chunk of one block, ``_formed_once``)."""

    @staticmethod
    def forward(ctx, v, e, s, g_a, g_b, m0, C, product):
        logs = [x for x in (g_a, g_b) if x is not None]
        ctx.form = "step" if product else _elementwise_form()
        if product:
            decay = logs  # saved as they are, formed again in the backward
            y, m_T, states = chunk_elementwise(v, e, s, LogProduct(g_a, g_b), m0, C)
        elif ctx.form == "step":
            # the factors exp(g), formed once and saved; the cumulative form saves the logs
            decay = [x.exp() for x in logs]
            y, m_T, states = chunk_elementwise(v, e, s, decay, m0, C)
        else:
            decay = logs
            y, m_T, states, ctx.blocks = chunk_cumulative(v, e, s, logs, m0, C)
        ctx.save_for_backward(v, e, s, m0, *decay, *states)
        ctx.C, ctx.operands, ctx.product = C, len(decay), product
        return y, m_T

    @staticmethod
    def backward(ctx, dy, dm_T):
        v, e, s, m0, *saved = ctx.saved_tensors
        # the decay factors exp(g) (step form), their logs g (cumulative form) or a product's operands
        operands, states = saved[: ctx.operands], saved[ctx.operands :]
        C = ctx.C
        T = v.shape[2]
        dM = torch.zeros_like(states[-1]) if dm_T is None else dm_T
        dy = torch.zeros_like(v) if dy is None else dy
        # Each operand's gradient has its shape: dlog_o of o = exp(log_o), factor by factor, or a
        # product's da and db.
        full = {"v": v, "e": e, "s": s, **dict(enumerate(operands))}
        # A per-step input's gradient is written chunk by chunk into one buffer; a time-shared
        # input's (time dimension 1) is summed over the chunks.
        buffers = {name: None if name != "v" and x.shape[2] == 1 else torch.empty_like(x) for name, x in full.items()}
        sums = dict.fromkeys(full)
        for n in reversed(range(len(states))):
            start, stop = n * C, min(n * C + C, T)
            part = {name: _time_slice(x, start, stop) for name, x in full.items()}
            out = {name: _time_slice(buf, start, stop) for name, buf in buffers.items()}
            decay = [part[j] for j in range(len(operands))]
            if ctx.product:
                decay = _formed_once(LogProduct(*decay), part["v"], part["e"], states[n])
            if ctx.form == "step":
                hs = _memories(part["v"], part["e"], decay, states[n])
                dv, de, ds, d_operands, dM = scan_chunk_backward(
                    part["v"], part["e"], part["s"], decay, states[n], hs, dy[:, :, start:stop], dM, out
                )
            else:
                hs = cumulative_memories(part["v"], part["e"], decay, states[n], ctx.blocks[n])
                dv, de, ds, d_operands, dM = cumulative_backward(
                    part["v"], part["e"], part["s"], decay, states[n], hs, dy[:, :, start:stop], dM, out, ctx.blocks[n]
                )
            for name, grad in zip(full, (dv, de, ds, *d_operands), strict=False):
                if buffers[name] is None:
                    sums[name] = grad if sums[name] is None else sums[name] + grad
        grads = [sums[name] if buffers[name] is None else buffers[name] for name in full]
        dg = grads[3:] + [None] * (2 - len(operands))
        dm0 = None if m0 is None else _grad_for(m0, dM)
        return (*grads[:3], *dg, dm0, None, None)


# ----------------------------------------------------------------------------- entry point


def _matmul_operands(p: EOSProblem):
    """Canonical problem -> (q, k, v, g, kind) for the matmul kernel. The unit dims go by squeeze,
    not indexing: squeeze's backward is a view, where the backward of x[..., 0] writes the
    gradient into a zero-filled tensor of the full shape (a fresh, page-faulted 64 MiB each at T 65536, H 4, K 64)."""
    B, H, T = p.B, p.H, p.T
    q = p.s.squeeze(-1).expand(B, H, T, p.K)
    k = p.e.squeeze(-1).expand(B, H, T, p.K)
    kind = p.decay_kind
    g = None
    if kind == "scalar":
        g = p.g.reshape(*p.g.shape[:3], 1).expand(B, H, T, 1)
    elif kind == "row":
        g = p.g.squeeze(-1).expand(B, H, T, p.K)
    elif kind == "col":
        g = p.g.squeeze(-2).expand(B, H, T, p.D)
    elif kind == "outer":
        row, col = p.g_outer
        g = torch.cat([row.squeeze(-1).expand(B, H, T, p.K), col.squeeze(-2).expand(B, H, T, p.D)], -1)
    return q, k, p.v, g, kind


def eos_chunk(p: EOSProblem, chunk_size: int, backward: str = "custom"):
    """Chunk mode. ``backward``: "custom" (the memory-light Functions above) or "autograd"
    (autograd through the matmul kernel's forward; kept for the benchmark's memory comparison)."""
    if backward not in ("custom", "autograd"):
        raise ValueError(f"backward: expected 'custom' or 'autograd', got {backward!r}")
    # A chunk longer than the sequence would only pad it: the C x C intra-chunk map makes the
    # cost grow with C, not T.
    C = max(1, min(chunk_size, p.T))
    if kernel_for(p) == "matmul":
        q, k, v, g, kind = _matmul_operands(p)
        if backward == "custom":
            return ChunkMatmulFunction.apply(q, k, v, g, p.m0, kind, C)
        return chunk_matmul(q, k, v, g, kind, p.m0, C)
    if backward != "custom":
        raise ValueError(
            f"backward: the elementwise kernel (decay {p.decay_kind!r}, e {tuple(p.e.shape)}, "
            f"s {tuple(p.s.shape)}) has only the 'custom' backward, got {backward!r}; "
            "'autograd' is the matmul kernel's baseline"
        )
    if p.g_product is not None:
        if _elementwise_form() == "cumulative":
            # The cumulative form batches a block's [n, K, D] logs and exps in any case: it takes
            # the product formed, its gradient reduced to a and b by autograd.
            return ChunkElementwiseFunction.apply(p.v, p.e, p.s, p.g_full, None, p.m0, C, False)
        return ChunkElementwiseFunction.apply(p.v, p.e, p.s, *p.g_product, p.m0, C, True)
    g_a, g_b = p.g_outer if p.g_outer is not None else (p.g, None)
    return ChunkElementwiseFunction.apply(p.v, p.e, p.s, g_a, g_b, p.m0, C, False)
