"""The EOS operator with a diagonal-plus-low-rank (DPLR) oscillation: the matrix-transition family.

    m_t = (D(alpha_t) - a_t b_t^T) m_{t-1} + e_t i_t^T        [K, D]
    y_t = m_t^T s_t                                           [D]

D(alpha_t) = diag(exp(log_alpha_t)) is given in log space: None (identity), one scalar per head
and step, or one value per memory row (per-channel decay). It covers the delta rule's members as
configurations (docs/eos_dplr.md):

    DeltaNet            D = I,             a = beta k,              b = k
    Gated DeltaNet      D = alpha I,       a = alpha beta k,        b = k
    KDA                 D = diag(alpha),   a = beta k,              b = alpha * k
    RWKV-7              D = diag(w),       a = a_t * kappa_hat,     b = kappa_hat

Products of n Householder-like factors per token (Gated DeltaProduct) are micro-steps: a, b, e
(and i) carry an axis of n after the heads, [B, T, H, n, K]; micro-step j of token t applies
(D_j - a_j b_j^T) m + e_j i_j^T with D_1 = D(alpha_t) and D_j = I for j > 1, and s_t reads the
memory after the last one.

``gate_first=True`` takes a before the decay, the transition D(alpha_t) (I - a_t b_t^T) (a DeltaNet
gated as in LCSM's and ``eos_delta``'s gamma_t (I - a_t b_t^T)): the low-rank factor is then
exp(log_alpha_t) * a_t, formed by a product, never by dividing a given factor by the decay.

Forms: ``recurrent`` (the definition, step by step), ``chunk`` (the WY / UT chunkwise form, linear
in T, with a backward that recomputes span by span), ``auto`` (T <= 1 -> recurrent, the decoding
step; else chunk); packed rows run through the chunk form in one call. The chunk form of one step
per token with no decay or a scalar one (DeltaNet, Gated DeltaNet, Comba, FWP, M1, M2) runs on
``eos_delta``'s chunk kernel (lcsm.ops.delta), which serves exactly that structure faster and
keeps packed documents apart inside its chunks without padding them; autograd differentiates it
(no recomputation: faster, more memory; docs/eos_dplr.md). ``explain_dplr`` says which.

Shape glossary: B batch, T time, H heads, n micro-steps per token, K memory rows, D memory
columns, N documents of a packed row.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lcsm._checks import check_bool

from ._autograd import first_order
from ._host_heap import prime_host_heap
from ._inputs import (
    check_chunk_size,
    check_cu_seqlens,
    check_packed,
    check_real,
    check_same_device,
    compute_dtype,
    finite_log,
    shape_str,
    without_autocast,
)
from .chunk_matmul import traced_chunk_count
from .delta import (
    EmptySpans,
    _delta_chunk,
    _delta_chunk_packed,
    _doubling_carry,
    _gated_b,
    _UnitLowerInverse,
    carry_for,
    decay_weight,
)
from .eos import Plan

Tensor = torch.Tensor

DPLR_MODES = ("auto", "recurrent", "chunk", "triton")


def _canonicalize(i, e, s, a, b, log_alpha, initial_state):
    """Checks shapes; returns float tensors with a micro-step axis: i [B, T, H, n, D], e, a, b
    [B, T, H, n, K], s [B, T, H, K], the log decay g [B, T, H, 1] (scalar) or [B, T, H, K] (per
    row) or None, m0 [B, H, K, D] (or None), the compute dtype and the output dtype."""
    named = {"i": i, "e": e, "s": s, "a": a, "b": b}
    for name, t in {**named, "log_alpha": log_alpha, "initial_state": initial_state}.items():
        if t is not None:
            check_real("eos_dplr", name, t)
    check_same_device({**named, "log_alpha": log_alpha, "initial_state": initial_state})
    if s.dim() != 4:
        raise ValueError(f"s: expected [B, T, H, K], got {shape_str(s)}")
    B, T, H, K = s.shape
    product = a.dim() == 5
    n = a.shape[3] if product else 1
    want_k = (B, T, H, n, K) if product else (B, T, H, K)
    for name in ("e", "a", "b"):
        if tuple(named[name].shape) != want_k:
            layout = "[B, T, H, n, K]" if product else "[B, T, H, K]"
            raise ValueError(f"{name}: expected {layout} = {list(want_k)} (from s and a), got {shape_str(named[name])}")
    if i.dim() != (5 if product else 4) or tuple(i.shape[:-1]) != want_k[:-1]:
        layout = "[B, T, H, n, D]" if product else "[B, T, H, D]"
        raise ValueError(
            f"i: expected {layout} with [B, T, H{', n' if product else ''}] = {list(want_k[:-1])}, got {shape_str(i)}"
        )
    D = i.shape[-1]
    dtype = compute_dtype([i, e, s, a, b, log_alpha, initial_state])
    # y in the values' dtype, as fla returns o in v's: mixers compute their log gates in float32
    # (as fla does), which must not turn a bfloat16 layer's output into float32
    out_dtype = i.dtype

    def cast(t):
        return t.to(dtype)

    if not product:
        i, e, a, b = i.unsqueeze(3), e.unsqueeze(3), a.unsqueeze(3), b.unsqueeze(3)
    g = None
    if log_alpha is not None:
        # A tuple of the accepted shapes, not a dict keyed by them: hashing a traced (symbolic)
        # size fixes it to its value, one compiled graph per B and T.
        accepted = ((H,), (B, T, H), (H, K), (B, T, H, K))
        if tuple(log_alpha.shape) not in accepted:
            raise ValueError(
                f"log_alpha: expected None, a scalar per head [H] = [{H}] or per step [B, T, H] = [{B}, {T}, {H}], "
                f"or one per memory row [H, K] = [{H}, {K}] or [B, T, H, K] = [{B}, {T}, {H}, {K}]; "
                f"got {shape_str(log_alpha)}"
            )
        # A scalar decay keeps a row axis of 1: the chunk form then factors its pairwise decays
        # out of the C x C products instead of carrying them per row.
        g = finite_log(cast(log_alpha))
        if g.dim() == 1:
            g = g[:, None]
        elif g.dim() == 3:
            g = g[..., None]
        g = g.expand(B, T, H, g.shape[-1])
    m0 = None
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, H, K, D):
            raise ValueError(
                f"initial_state: expected [B, H, K, D] = [{B}, {H}, {K}, {D}], got {shape_str(initial_state)}"
            )
        m0 = cast(initial_state)
    return cast(i), cast(e), cast(s), cast(a), cast(b), g, m0, dtype, out_dtype


def dplr_recurrent(i, e, s, a, b, g, m0):
    """The definition, step by step (autograd gives the gradients): canonical tensors as
    ``_canonicalize`` returns them -> y [B, T, H, D], m_T [B, H, K, D]."""
    B, T, H, n, D = i.shape
    K = s.shape[-1]
    m = m0 if m0 is not None else i.new_zeros(B, H, K, D)
    ys = []
    for t in range(T):
        for j in range(n):
            # (D - a b^T) m = D m - a (b^T m)
            decayed = m * g[:, t, :, :, None].exp() if (g is not None and j == 0) else m
            u = torch.einsum("bhk,bhkd->bhd", b[:, t, :, j], m)
            m = decayed - a[:, t, :, j, :, None] * u[:, :, None, :] + e[:, t, :, j, :, None] * i[:, t, :, j, None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", s[:, t], m))
    y = torch.stack(ys, 1) if ys else i.new_zeros(B, 0, H, D)
    return y, m


def _pairwise(
    x: Tensor, ys: tuple[Tensor, ...], cx: Tensor | None, cy: Tensor | None, mask: Tensor, over_no_step: Tensor
) -> list[Tensor]:
    """P[t, j] = sum_k x_t[k] y_j[k] exp(cx_t[k] - cy_j[k]) where ``mask`` [C, C] holds, else 0,
    for each y of ``ys`` (the decay weights are formed once for all of them); where
    ``over_no_step`` [.., C, C] holds, cx_t - cy_j sums the decays of no step: the weight is 1
    (``decay_weight``).

    x, y [..., C, K]; cx, cy [..., C, 1] (scalar decay) or [..., C, K] (per row). Where the mask
    holds, cx_t - cy_j is a sum of log decays (<= 0 for decays <= 1); the differences are masked
    before exp so the discarded entries, whose exp could overflow, never reach a product. A scalar
    decay factors out of the K sum (one C x C matmul for all ys); a per-row one needs the
    [C, C, K] weights.
    """
    if cx is None:  # no decay: the mask alone
        w = mask[..., None].to(x.dtype)
    else:
        w = decay_weight(cx.unsqueeze(-2) - cy.unsqueeze(-3), mask[..., None], over_no_step[..., None], x.dtype)
    if w.shape[-1] == 1:
        C = x.shape[-2]
        w = w.squeeze(-1)
        return list((x @ torch.cat(ys, -2).transpose(-1, -2) * w.repeat(*(1,) * (w.dim() - 1), len(ys))).split(C, -1))
    xw = x.unsqueeze(-2) * w
    return [(xw * y.unsqueeze(-3)).sum(-1) for y in ys]


def dplr_chunk(i, e, s, a, b, g, m0, chunk_size, bounds=None, a_is_e=False, recompute=False, carry="torch"):
    """The chunkwise (WY / UT) form: canonical tensors as ``_canonicalize`` returns them ->
    y [B, T, H, D], m_T [B, H, K, D]. With ``bounds`` (the documents of a packed row, B = 1) m0
    and m_T are [N, H, K, D], one per document. ``recompute``: the backward of
    ``_DplrSpans`` (recomputing span by span) instead of autograd through every intermediate.
    ``carry``: the memory carried across chunks by a loop of products ("torch") or by
    ``triton_delta``'s kernel ("triton"; ``delta.carry_for``).

    Micro-steps are flattened into the time axis (step j of token t at t n + j, the decay on j = 0
    only, s read at j = n - 1), so a chunk is C micro-steps. Per chunk, from its initial memory M,
    with the local cumulative log decay c_t = sum_{l<=t} g_l (per row) and u_t = b_t^T m_{t-1}:

        m_t = e^{c_t} M + sum_{j<=t} e^{c_t - c_j} (e_j i_j^T - a_j u_j^T)

    so U = [u_t] solves (I + L) U = (b e^{c_prev}) M + Le I_v with, for j < t,
        L[t, j] = sum_k b_t a_j e^{c_{t-1} - c_j},   Le[t, j] = sum_k b_t e_j e^{c_{t-1} - c_j}.
    U = W M + U0 with W, U0 independent of M, so each chunk's outputs and end memory are affine in
    M: y = Q M + R, M' = Phi M + Psi, and only the K x K products Phi M are sequential. Every
    exponent is a sum of log decays over steps inside one chunk (<= 0): no e^{+c} factor, so a
    log decay of -30 per step (or -inf) underflows to 0 instead of overflowing.

    Packed documents each start a chunk: every document is padded to a multiple of C (padded
    steps are the identity), so no chunk mixes two documents and the carry is reset to the
    document's initial state at its first chunk. The padding costs at most C - 1 steps per
    document, so C is capped at the longest document.

    ``a_is_e`` (DeltaNet's a = e = beta k, the same tensor) forms the C x C products once.

    Traced (torch.compile) and unpacked, T is symbolic: the same maps, their carry by
    ``_doubling_carry`` instead of the loop over chunks, differentiated by autograd (``recompute``
    must be False: its backward calls autograd inside a backward, which the tracer refuses).
    """
    B, T, H, n, D = i.shape
    K = s.shape[-1]
    L = T * n
    chunk_size = _chunk_size(chunk_size, g)
    traced = bounds is None and torch.compiler.is_compiling()
    if traced:
        # T symbolic: C stays chunk_size when L is shorter, the chunks are one more than needed
        # (identity padding) and the loop over them is a doubling scan (``_doubling_carry``):
        # nothing fixes the chunk count, so one graph serves every T
        if recompute:
            raise ValueError(
                "recompute: the recomputing backward calls autograd inside a backward, which "
                "torch.compile does not trace; expected False when compiling, got True"
            )
        C = chunk_size
        N = traced_chunk_count(L, C)
        dest = None
    elif bounds is None:
        C = min(chunk_size, L)
        N = -(-L // C)
        dest = None
        # one "document" per batch row: the whole initial state at chunk 0, the final at the end
        resets, finals = {0: None}, {N - 1: None}
    else:
        starts_ = torch.tensor(bounds[:-1]) * n
        lengths = torch.tensor(bounds[1:]) * n - starts_
        C = min(chunk_size, int(lengths.max()))
        padded = -(-lengths // C) * C
        first = padded.cumsum(0) - padded  # each document's first step in the chunk-aligned layout
        N = int(padded.sum()) // C
        # where each of the L steps goes in the chunk-aligned layout
        dest = (torch.arange(L) + torch.repeat_interleave(first - starts_, lengths)).to(i.device)
        resets = dict(zip((first // C).tolist(), range(len(lengths)), strict=True))
        finals = dict(zip(((first + padded) // C - 1).tolist(), range(len(lengths)), strict=True))

    def chunked(x: Tensor) -> Tensor:  # [B, T, H, n, .] -> head-major chunks [B, H, N, C, .]
        x = x.transpose(1, 2).reshape(B, H, L, x.shape[-1])
        if dest is None:
            return torch.nn.functional.pad(x, (0, 0, 0, N * C - L)).reshape(B, H, N, C, x.shape[-1])
        aligned = x.new_zeros(B, H, N * C, x.shape[-1]).index_copy(2, dest, x)
        return aligned.reshape(B, H, N, C, x.shape[-1])

    if n > 1:
        # s only after the last micro-step, the decay only at the first.
        s = torch.cat([s.new_zeros(B, T, H, n - 1, K), s.unsqueeze(3)], 3)
        if g is not None:
            g = torch.cat([g.unsqueeze(3), g.new_zeros(B, T, H, n - 1, g.shape[-1])], 3)
    else:
        s = s.unsqueeze(3)
        g = g.unsqueeze(3) if g is not None else None
    # Zero i, e, a, b, s and a zero log decay make a padded step the identity on m.
    v, e, s, a, b = (chunked(x) for x in (i, e, s, a, b))
    g = chunked(g) if g is not None else None
    steps = None  # the positions that carry a decay [N, C]: micro-step 0 of a token, not padding
    if g is not None:
        micro_zero = torch.arange(L, device=i.device) % n == 0
        if dest is None:
            steps = torch.nn.functional.pad(micro_zero, (0, N * C - L))
        else:
            steps = micro_zero.new_zeros(N * C).index_copy(0, dest, micro_zero)
        steps = steps.reshape(N, C)
    initial = m0 if m0 is not None else v.new_zeros(B if bounds is None else len(bounds) - 1, H, K, D)
    if traced:
        Q, R, Phi, Psi, W, A, gamma = _maps(v, e, s, a, b, g, a_is_e, phi=carry != "triton", steps=steps)
        if carry == "triton":
            from .triton_delta import triton_delta_carry

            starts, m = triton_delta_carry(W, A, Psi, gamma, initial)
        else:
            starts, m = _doubling_carry(Phi, Psi, initial)
        y = Q @ starts + R
    elif recompute:
        y, m = _DplrSpans.apply((resets, finals, a_is_e, carry, steps), SPAN_CHUNKS, v, e, s, a, b, g, initial)
    else:
        y, m = _spans((resets, finals, a_is_e, carry, steps), 0, v, e, s, a, b, g, initial, None)[:2]
    y = y.reshape(B, H, N * C, D)
    y = y[:, :, :L] if dest is None else y.index_select(2, dest)
    return y.reshape(B, H, T, n, D)[:, :, :, -1].transpose(1, 2), m


# Spans of 16 chunks for the recomputing backward: one span's intermediates stay small, the loop
# over spans short.
SPAN_CHUNKS = 16


def _spans(plan, n0, v, e, s, a, b, g, initial, M):
    """Chunks n0 .. n0 + N - 1 of the chunk-aligned layout (v, e, s, a, b, g [B, H, N, C, .]) from
    the memory M before chunk n0 (None or unused where chunk n0 starts a document): y [B, H, N, C,
    D], the final states of the documents ending here (concatenated; the memory after the last
    chunk when unpacked) and the memory after the last chunk. The plan's carry "triton" carries by
    ``triton_delta``'s kernel instead of the loop (``_spans_triton``)."""
    resets, finals, a_is_e, carry, steps = plan
    if steps is not None:
        steps = steps[n0 : n0 + v.shape[2]]
    Q, R, Phi, Psi, W, A, gamma = _maps(v, e, s, a, b, g, a_is_e, phi=carry != "triton", steps=steps)
    if carry == "triton":
        return _spans_triton(plan, n0, Q, R, Psi, W, A, gamma, initial, M)
    starts, done = [], []
    # Chunk-major copies make every per-chunk slice contiguous (no hidden copies in the loop).
    for k, (Phi_n, Psi_n) in enumerate(zip(*(x.movedim(2, 0).contiguous().unbind(0) for x in (Phi, Psi)), strict=True)):
        if n0 + k in resets:
            doc = resets[n0 + k]
            M = initial if doc is None else initial[doc].unsqueeze(0)
        starts.append(M)
        M = Phi_n @ M + Psi_n
        if n0 + k in finals:
            done.append(M)
    y = Q @ torch.stack(starts, 2) + R
    return y, (torch.cat(done, 0) if done else None), M


def _spans_triton(plan, n0, Q, R, Psi, W, A, gamma, initial, M):
    """``_spans`` with its carry by ``triton_delta``'s kernel, from the chunks' maps. A document
    starting at chunk r inside the span (packed rows) cuts the carry there: chunk r - 1's transition
    is zeroed (W and gamma) and its Psi replaced by the document's initial state, so that the kernel
    hands chunk r that state; the documents ending here read their final states from their last
    chunk's start memory and intact maps, M' = Phi M + Psi, batched."""
    from .delta import transition
    from .triton_delta import triton_delta_carry

    resets, finals = plan[:2]
    N = W.shape[2]

    def state(doc):  # a document's initial state [1, H, K, D] (the whole batch's when None)
        return initial if doc is None else initial[doc].unsqueeze(0)

    M_in = state(resets[n0]) if n0 in resets else M
    cut = [n - n0 for n in sorted(resets) if n0 < n < n0 + N]
    W_c, gamma_c, Psi_c = W, gamma, Psi
    if cut:
        before = torch.tensor(cut, device=W.device) - 1
        kept = torch.ones(N, dtype=W.dtype, device=W.device).index_fill(0, before, 0.0)
        W_c = W * kept[:, None, None]
        gamma_c = kept.expand(*W.shape[:3]) if gamma is None else gamma * kept[:, None]
        docs = torch.tensor([resets[n0 + r] for r in cut], device=W.device)
        Psi_c = Psi.index_copy(2, before, initial.index_select(0, docs).transpose(0, 1).unsqueeze(0))
    starts, M_out = triton_delta_carry(W_c, A, Psi_c, gamma_c, M_in)
    ends = [n - n0 for n in sorted(finals) if n0 <= n < n0 + N]
    done = None
    if ends:
        at = torch.tensor(ends, device=W.device)

        def picked(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(2, at)

        after = transition(picked(W), picked(A), picked(gamma), picked(starts)) + picked(Psi)
        done = after.transpose(1, 2).flatten(0, 1)  # [B * ends, H, K, D], as the loop's cat
    return Q @ starts + R, done, M_out


def _maps(v, e, s, a, b, g, a_is_e, phi=True, steps=None):
    """Every chunk's affine maps from its initial memory M (chunk-aligned v, e, s, a, b, g
    [B, H, N, C, .]): its outputs y = Q M + R, [B, H, N, C, K] and [B, H, N, C, D], and the memory
    after it M' = Phi M + Psi, [B, H, N, K, K] and [B, H, N, K, D] (``dplr_chunk``'s algebra),
    with Phi = diag(gamma) - A^T W; returns (Q, R, Phi, Psi, W, A, gamma): W and A [B, H, N, C, K],
    gamma [B, H, N, K] (None without a decay), Phi None unless ``phi`` (the Triton carry applies it
    as gamma M - A^T (W M), ``triton_delta``). ``steps`` [N, C] bool (given with a decay): the
    positions that carry one (micro-step 0 of a token, not padding), so that a weight over
    positions without one is exactly 1 (``EmptySpans``, ``decay_weight``)."""
    B, H, N, C, K = e.shape
    D = v.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=v.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    if g is None:  # no decay: every factor below is 1
        c = c_prev = gamma = before = at = None
        b_prev, s_now, e_end, a_rows = b, s, e, a
        diag_end = torch.eye(K, dtype=v.dtype, device=v.device)
    else:
        # Summed in float64 (a long float32 sum drifts from the exponents it sums); a per-row
        # decay's then rounded once to the compute dtype: its [C, C, K] differences in float64
        # cost KDA's layer ~9 % on the CPU, for ~3e-6 relative error in float32's decay gradient
        # (a scalar decay keeps float64, [C, C] differences).
        c = g.double().cumsum(-2)
        if c.shape[-1] > 1:
            c = c.to(v.dtype)
        c_prev = torch.nn.functional.pad(c, (0, 0, 1, 0))[..., :-1, :]
        empty = EmptySpans.of(steps)
        to_end = decay_weight(c[..., -1:, :] - c, None, empty.last[..., None], v.dtype)  # e^{c_C - c_j}
        b_prev = b * decay_weight(c_prev, None, empty.first[..., None], v.dtype)
        s_now, e_end, a_rows = s * c.to(v.dtype).exp(), e * to_end, a * to_end
        gamma = c[..., -1, :].to(v.dtype).exp().expand(B, H, N, K)
        diag_end = torch.diag_embed(gamma)
        before, at = empty.before, empty.at  # L's and the read-out's spans of no decay
    a_end = a_rows.transpose(-1, -2)
    if a_is_e:
        # Le = L and Pse = Psa, so R = Psa (v - U0) and Psi = a_end (v - U0).
        (Lm,) = _pairwise(b, (a,), c_prev, c, strict, before)
        (Psa,) = _pairwise(s, (a,), c, c, incl, at)
        inv = _UnitLowerInverse.apply(Lm)
        W, U0 = (inv @ torch.cat([b_prev, Lm @ v], -1)).split([K, D], -1)
        SW, R = (Psa @ torch.cat([W, v - U0], -1)).split([K, D], -1)
        AW, Psi = (a_end @ torch.cat([W, v - U0], -1)).split([K, D], -1) if phi else (None, a_end @ (v - U0))
    else:
        Lm, Le = _pairwise(b, (a, e), c_prev, c, strict, before)
        Psa, Pse = _pairwise(s, (a, e), c, c, incl, at)
        inv = _UnitLowerInverse.apply(Lm)
        W, U0 = (inv @ torch.cat([b_prev, Le @ v], -1)).split([K, D], -1)
        SW, SU = (Psa @ torch.cat([W, U0], -1)).split([K, D], -1)
        AW, AU = (a_end @ torch.cat([W, U0], -1)).split([K, D], -1) if phi else (None, a_end @ U0)
        R = Pse @ v - SU
        Psi = e_end.transpose(-1, -2) @ v - AU
    return s_now - SW, R, None if AW is None else diag_end - AW, Psi, W, a_rows, gamma


def _slice(chunks, n0: int, span: int) -> list[Tensor | None]:
    return [x[:, :, n0 : n0 + span] if x is not None else None for x in chunks]


class _DplrSpans(torch.autograd.Function):
    """The chunk form with a backward that recomputes: forward keeps only the memory before each
    span of ``span`` chunks; backward walks the spans in reverse, recomputes each one from its
    saved start memory with autograd on and pulls the gradients of its inputs, of the initial
    states and of its start memory (the previous span's end-memory cotangent) through it. Peak
    memory holds one span's intermediates instead of the whole sequence's, for one more forward
    pass. Inputs are the chunk-aligned tensors of ``dplr_chunk``; packed rows reset the memory at
    document starts inside a span as the forward does."""

    @staticmethod
    def forward(ctx: Any, plan, span: int, *tensors: Tensor) -> tuple[Tensor, Tensor]:
        *chunks, initial = tensors
        N = chunks[0].shape[2]
        M, ys, done, starts = None, [], [], []
        for n0 in range(0, N, span):
            starts.append(M)
            y, d, M = _spans(plan, n0, *_slice(chunks, n0, span), initial, M)
            ys.append(y)
            if d is not None:
                done.append(d)
        ctx.save_for_backward(*tensors, *(x if x is not None else initial.new_zeros(0) for x in starts))
        ctx.setup = (plan, span, len(chunks))
        return torch.cat(ys, 2), torch.cat(done, 0)

    @staticmethod
    @first_order
    def backward(ctx: Any, dy: Tensor, dfinal: Tensor) -> tuple[Tensor | None, ...]:
        plan, span, n_chunks = ctx.setup
        saved = ctx.saved_tensors
        chunks, initial, starts = saved[:n_chunks], saved[n_chunks], saved[n_chunks + 1 :]
        finals = plan[1]
        ordered = sorted(finals)  # the chunks that end a document, in the final states' order
        grads: list[list[Tensor]] = [[] for _ in chunks]
        d_initial = torch.zeros_like(initial)
        dM = None
        for index in reversed(range(len(starts))):
            n0 = index * span
            with torch.enable_grad():
                leaves = [x.detach().requires_grad_() if x is not None else None for x in _slice(chunks, n0, span)]
                init = initial.detach().requires_grad_()
                M0 = starts[index].detach().requires_grad_() if index > 0 else None
                y, d, M = _spans(plan, n0, *leaves, init, M0)
                outs, cots = [y], [dy[:, :, n0 : n0 + span]]
                if d is not None:
                    lo, hi = bisect.bisect_left(ordered, n0), bisect.bisect_left(ordered, n0 + span)
                    outs.append(d)
                    cots.append(dfinal if finals[ordered[0]] is None else dfinal[lo:hi])
                if dM is not None:
                    outs.append(M)
                    cots.append(dM)
                wrt = [x for x in leaves if x is not None] + [init] + ([M0] if M0 is not None else [])
                got = iter(torch.autograd.grad(outs, wrt, cots, allow_unused=True))
                got = [next(got) if x is not None else None for x in leaves] + list(got)
            for k, x in enumerate(leaves):
                if x is not None:
                    grads[k].append(got[k] if got[k] is not None else torch.zeros_like(x))
            if got[len(leaves)] is not None:
                d_initial += got[len(leaves)]
            dM = got[-1] if M0 is not None else None
        full = [torch.cat(parts[::-1], 2) if parts else None for parts in grads]
        return (None, None, *full, d_initial)


def _chunk_size(chunk_size: int | None, g: Tensor | None) -> int:
    """The chunk size; by default (None) the fastest on CPU at K = D = 64: 32 steps, or 8 with a
    per-row decay, whose C x C x K pairwise weights grow with C^2."""
    if chunk_size is not None:
        return chunk_size
    return 8 if g is not None and g.shape[-1] > 1 else 32


def _grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will differentiate the chunk form (then its backward recomputes). Not when
    traced (torch.compile): the recomputing backward calls autograd inside a backward, which the
    tracer refuses, so a compiled graph is differentiated by autograd through the chunk form."""
    if torch.compiler.is_compiling():
        return False
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _form(mode: str, T: int) -> str:
    """The form a (validated) mode takes for T tokens: auto decodes one token by the recurrence,
    whose one step needs none of the chunk machinery."""
    return "recurrent" if mode == "recurrent" or (mode == "auto" and T <= 1) or T == 0 else "chunk"


def _routed(n: int, g: Tensor | None) -> bool:
    """Whether the chunk form runs on ``eos_delta``'s kernel: one step per token and a decay that is
    none or a scalar (the kernel's gamma_t I - a_t b_t^T; a per-row decay or micro-steps are not)."""
    return n == 1 and (g is None or g.shape[-1] == 1)


def _own_form_a(a: Tensor, g: Tensor | None, gate_first: bool, shared: bool) -> tuple[Tensor, bool]:
    """a and a_is_e of this module's forms from canonical a: with ``gate_first`` the low-rank factor
    exp(g) * a at each token's first micro-step (where the decay is; a product, finite for any log
    decay); a is e (``shared``) still holds unless the decay was folded into a."""
    if not gate_first or g is None:
        return a, shared
    return torch.cat([a[:, :, :, :1] * g.exp().unsqueeze(3), a[:, :, :, 1:]], 3), False


# The routed kernel's default chunk size (eos_delta's: its products are cheapest per token at 64 on
# CPU) and the chunks per span of its recomputed backward (below).
DELTA_CHUNK = 64
DELTA_SPAN_CHUNKS = 8


def _delta_spans(v, e, s, a, b, g, m0, C, a_is_e, carry="torch"):
    """``_delta_chunk`` with a backward that recomputes: a sequence longer than DELTA_SPAN_CHUNKS chunks
    runs span by span (the memory carried between them), each span under activation checkpointing,
    so autograd keeps each span's inputs and the carried memories, not every chunk's intermediates
    (at T 8192, B 1, H 4, K = D = 64 otherwise about 3.5x the memory of eos_dplr's own recomputing
    form), for one more forward pass in the backward; 8 chunks, so that time per token is the same
    from 1K steps on (a sequence of one span keeps its intermediates and skips that pass). Spans
    are whole chunks, so the result is the one-pass result up to rounding."""
    span = DELTA_SPAN_CHUNKS * C
    # _grad first: traced (False), testing the symbolic length against span would guard on it
    if not _grad(v, e, s, a, b, g, m0) or v.shape[2] <= span:
        return _delta_chunk(v, e, s, a, b, g, m0, C, a_is_e, carry)
    # split, not slicing: the gradients of split's pieces are joined by one cat, where each slice's
    # backward would write its piece into a zero tensor of the whole length (quadratic in T).
    n = -(-v.shape[2] // span)
    pieces = [[None] * n if x is None else x.split(span, 2) for x in (v, e, s, a, b, g)]
    ys, m = [], m0
    for j in range(n):
        y, m = checkpoint(_delta_chunk, *(p[j] for p in pieces), m, C, a_is_e, carry, use_reentrant=False)
        ys.append(y)
    return torch.cat(ys, 2), m


def _delta_kernel(i, e, s, a, b, g, m0, chunk_size, a_is_e, gate_first, cu_seqlens=None, final=True, mode="chunk"):
    """The chunk form on ``eos_delta``'s kernel: canonical tensors (n = 1, g None or [B, T, H, 1])
    -> y [B, T, H, D], m_T (or None when packed and not ``final``); gradients by autograd through
    the kernel, recomputed span by span (``_delta_spans``) when unpacked, its carry across chunks
    chosen by ``mode`` (``delta.carry_for``). ``gate_first`` puts the scalar decay on b,
    D(alpha) (I - a b^T) = D(alpha) - a (alpha b)^T: a product like gating a, and a DeltaNet's
    a = e stays one tensor for the kernel's shared products."""

    def heads(x: Tensor) -> Tensor:  # [B, T, H, 1, .] -> [B, H, T, .]
        return x[:, :, :, 0].transpose(1, 2)

    v, e, a, b, s = heads(i), heads(e), heads(a), heads(b), s.transpose(1, 2)
    g = g[..., 0].transpose(1, 2) if g is not None else None
    if gate_first:
        b = _gated_b(b, g)
    C = chunk_size if chunk_size is not None else DELTA_CHUNK
    carry = carry_for(mode, v, e.shape[-1], packed=cu_seqlens is not None)[0]
    if cu_seqlens is None:
        y, m = _delta_spans(v, e, s, a, b, g, m0, C, a_is_e, carry)
    else:
        y, m = _delta_chunk_packed(v, e, s, a, b, g, m0, C, a_is_e, cu_seqlens, final, carry)
    return y.transpose(1, 2), m


def _carry_words(carry: str, why: str) -> str:
    if carry == "triton":
        return f"in one Triton kernel ({why}), its backward in another"
    return why


def explain_dplr(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    log_alpha: Tensor | None = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    chunk_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    gate_first: bool = False,
) -> Plan:
    """The plan ``eos_dplr`` follows for these arguments (validated as ``eos_dplr`` does): the
    form, its kernel and why. Rules: mode "recurrent", or "auto" with T <= 1 -> the recurrence
    (one step per micro-step); otherwise a chunk form: ``eos_delta``'s kernel ("delta") for one
    step per token and no or a scalar decay, its carry across chunks in Triton ("delta-triton")
    under mode "triton" or under "auto" on CUDA tensors where the kernel serves them
    (``delta.carry_for``), else the WY / UT chunk form of this module ("wy"; "wy-triton" with its
    carry in Triton, by the same rule), whose backward recomputes span by span when gradients are
    needed."""
    gate_first = check_bool("gate_first", gate_first)
    chunk_size = None if chunk_size is None else check_chunk_size(chunk_size)
    if mode not in DPLR_MODES:
        raise ValueError(f"mode: expected one of {', '.join(DPLR_MODES)}, got {mode!r}")
    packed = cu_seqlens is not None
    i_, _, s_, _, _, g, _, dtype, _ = _canonicalize(i, e, s, a, b, log_alpha, None if packed else initial_state)
    B, T, H, n, _ = i_.shape
    K = s_.shape[-1]
    decay = "no decay" if g is None else ("a scalar decay" if g.shape[-1] == 1 else "a per-row decay")
    micro = f", {n} micro-steps per token (flattened into time, {T * n} steps)" if n > 1 else ""
    if packed:
        bounds = check_cu_seqlens(cu_seqlens)
        check_packed(bounds, B, T)
        _check_document_states(initial_state, len(bounds) - 1, H, K, i_.shape[-1])
    if _form(mode, T) == "recurrent":
        why = (
            "requested: the step-by-step definition" if mode == "recurrent" else "T <= 1: one recurrent step (decoding)"
        )
        if packed:
            why += f"; cu_seqlens, {len(bounds) - 1} documents: each alone, a loop over documents"
        return Plan("recurrent", "loop", f"{why} ({decay}{micro})")
    gated = ", a given before the decay (gate_first)" if gate_first and g is not None else ""
    if _routed(n, g):
        C = min(chunk_size if chunk_size is not None else DELTA_CHUNK, T)
        how = (
            f"eos_delta's WY / UT chunk kernel, C = {C} steps ({decay}{gated}): one step per token and a "
            "decay that is none or a scalar, the structure it serves faster than the general chunk form"
        )
        if a is e:
            how += "; a is e: the C x C products formed once"
        if packed:
            how += (
                f"; cu_seqlens, {len(bounds) - 1} documents: one pass over the row's chunks, documents kept apart "
                "inside them by block-diagonal masks (no padding)"
            )
        carry, why = carry_for(mode, i_.new_empty(0, dtype=dtype), K, packed)
        how += f"; the carry across chunks {_carry_words(carry, why)}"
        form, kernel = ("triton", "delta-triton") if carry == "triton" else ("chunk", "delta")
        if packed:
            return Plan(form, kernel, how + "; gradients by autograd through the kernel")
        spans = (
            f"recomputed in spans of {DELTA_SPAN_CHUNKS} chunks ({DELTA_SPAN_CHUNKS * C} steps, activation "
            "checkpointing)"
            if T > DELTA_SPAN_CHUNKS * C
            else f"kept (T <= {DELTA_SPAN_CHUNKS} chunks: one span)"
        )
        return Plan(form, kernel, how + f"; gradients by autograd through the kernel, its intermediates {spans}")
    C = min(_chunk_size(chunk_size, g), T * n)
    carry, why = carry_for(mode, i_.new_empty(0, dtype=dtype), K, packed)
    cost = (
        f"C^2 K = {C * C * K} per chunk for the pairwise decays"
        if g is not None and g.shape[-1] > 1
        else "C x C matmuls"
    )
    shared = "; a is e: the C x C products formed once" if a is e and not gated else ""
    how = f"WY / UT chunk form, C = {C} steps ({decay}{gated}{micro}; {cost}{shared})"
    if packed:
        how += (
            f"; cu_seqlens, {len(bounds) - 1} documents: each padded to whole chunks in one pass, the "
            "memory reset at each document's first chunk"
        )
    how += f"; the carry across chunks {_carry_words(carry, why)}"
    how += f"; backward recomputes spans of {SPAN_CHUNKS} chunks from their start memories"
    form, kernel = ("triton", "wy-triton") if carry == "triton" else ("chunk", "wy")
    return Plan(form, kernel, how)


@without_autocast
def eos_dplr(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    log_alpha: Tensor | None = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    gate_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """EOS with the DPLR oscillation o_t = D(alpha_t) - a_t b_t^T (module docstring).

    Args:
        i: input state [B, T, H, D] (the values), or [B, T, H, n, D] with micro-steps.
        e, a, b: expand state and the low-rank pair, [B, T, H, K] (or [B, T, H, n, K]).
        s: shrink state [B, T, H, K] (read after the token's last micro-step).
        log_alpha: log of the diagonal decay: None (identity), [H] or [B, T, H] (a scalar), [H, K]
            or [B, T, H, K] (per memory row); applied at each token's first micro-step.
        mode: "recurrent" (the definition, step by step), "chunk" (the WY / UT chunkwise form,
            linear in T), "triton" (the chunk form with its carry across chunks in one Triton
            kernel, ``triton_delta``: float32 compute, K <= 128) or "auto" (T <= 1 ->
            recurrent, the cheap decoding step; else chunk, carried in Triton on CUDA tensors
            where that kernel serves them). ``explain_dplr`` names the plan.
        initial_state: m_0 [B, H, K, D]; [N, H, K, D] with ``cu_seqlens``.
        output_final_state: also return m_T.
        chunk_size: micro-steps per chunk of mode "chunk" (any C >= 1; T n need not be a
            multiple). None: 32, or 8 with a per-row decay, whose pairwise weights cost C^2 K
            per chunk where a scalar decay's cost C^2 (the fastest on CPU at K = D = 64); 64 where
            the chunk form runs on ``eos_delta``'s kernel (``explain_dplr`` says which).
        cu_seqlens: packed sequences [N + 1] (B = 1), as ``eos`` takes them.
        gate_first: a is given before the decay: the oscillation is D(alpha_t) (I - a_t b_t^T), i.e.
            the low-rank factor is exp(log_alpha_t) * a_t (at the token's first micro-step).
            ``eos_delta(i, e, s, a, b, log_o)`` is ``eos_dplr(i, e, s, a, b, log_o, gate_first=True)``
            in value (``eos_delta`` returns y in the inputs' promoted dtype, this one in i's).

    Returns:
        y [B, T, H, D] in i's dtype and m_T (or None) in the compute dtype (the inputs' promoted
        one; half precisions are computed in float32).
    """
    output_final_state = check_bool("output_final_state", output_final_state)
    prime_host_heap(i)
    gate_first = check_bool("gate_first", gate_first)
    chunk_size = None if chunk_size is None else check_chunk_size(chunk_size)
    if mode not in DPLR_MODES:
        raise ValueError(f"mode: expected one of {', '.join(DPLR_MODES)}, got {mode!r}")
    if cu_seqlens is not None:
        return _packed(
            i, e, s, a, b, log_alpha, initial_state, output_final_state, cu_seqlens, mode, chunk_size, gate_first
        )
    i_, e_, s_, a_, b_, g, m0, dtype, out_dtype = _canonicalize(i, e, s, a, b, log_alpha, initial_state)
    T, n = s_.shape[1], i_.shape[3]
    chunk = _form(mode, T) == "chunk"
    if chunk and _routed(n, g):
        y, m = _delta_kernel(i_, e_, s_, a_, b_, g, m0, chunk_size, a is e, gate_first, mode=mode)
        return y.to(out_dtype), (m if output_final_state else None)
    a_, a_is_e = _own_form_a(a_, g, gate_first, a is e)
    if chunk:
        grad = _grad(i_, e_, s_, a_, b_, g, m0)
        carry = carry_for(mode, i_, s_.shape[-1])[0]
        y, m = dplr_chunk(i_, e_, s_, a_, b_, g, m0, chunk_size, a_is_e=a_is_e, recompute=grad, carry=carry)
    else:
        y, m = dplr_recurrent(i_, e_, s_, a_, b_, g, m0)
    return y.to(out_dtype), (m if output_final_state else None)


def _check_document_states(initial_state: Tensor | None, N: int, H: int, K: int, D: int) -> None:
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, D):
        raise ValueError(
            f"initial_state: with cu_seqlens expected one state per document, [N, H, K, D] = "
            f"[{N}, {H}, {K}, {D}], got {shape_str(initial_state)}"
        )


def _packed(i, e, s, a, b, log_alpha, initial_state, output_final_state, cu_seqlens, mode, chunk_size, gate_first):
    """Packed sequences: mode "recurrent" runs each document alone (the reference); "chunk" and
    "auto" (for T > 1) run a chunk form on the whole row: ``eos_delta``'s kernel where it serves
    the structure (documents kept apart inside its chunks), else this module's, documents aligned
    to chunks."""
    bounds = check_cu_seqlens(cu_seqlens)
    _canonicalize(i, e, s, a, b, log_alpha, None)
    B, T, H, K = s.shape
    D = i.shape[-1]
    check_packed(bounds, B, T)
    N = len(bounds) - 1
    _check_document_states(initial_state, N, H, K, D)
    if _form(mode, T) == "chunk":
        i_, e_, s_, a_, b_, g, _, dtype, out_dtype = _canonicalize(i, e, s, a, b, log_alpha, None)
        m0 = initial_state.to(dtype) if initial_state is not None else None
        if _routed(i_.shape[3], g):
            cu = torch.tensor(bounds, dtype=torch.int64, device=i_.device)
            y, m = _delta_kernel(
                i_, e_, s_, a_, b_, g, m0, chunk_size, a is e, gate_first, cu, output_final_state, mode
            )
            return y.to(out_dtype), m
        a_, a_is_e = _own_form_a(a_, g, gate_first, a is e)
        grad = _grad(i_, e_, s_, a_, b_, g, m0)
        carry = carry_for(mode, i_, K, packed=True)[0]
        y, m = dplr_chunk(i_, e_, s_, a_, b_, g, m0, chunk_size, bounds, a_is_e=a_is_e, recompute=grad, carry=carry)
        return y.to(out_dtype), (m if output_final_state else None)
    ys, ms = [], []
    for n in range(N):
        lo, hi = bounds[n], bounds[n + 1]
        timed = log_alpha is not None and log_alpha.dim() >= 3
        y, m = eos_dplr(
            i[:, lo:hi],
            e[:, lo:hi],
            s[:, lo:hi],
            a[:, lo:hi],
            b[:, lo:hi],
            log_alpha[:, lo:hi] if timed else log_alpha,
            mode=mode,
            initial_state=None if initial_state is None else initial_state[n : n + 1],
            output_final_state=True,
            chunk_size=chunk_size,
            gate_first=gate_first,
        )
        ys.append(y)
        ms.append(m)
    return torch.cat(ys, 1), (torch.cat(ms, 0) if output_final_state else None)
