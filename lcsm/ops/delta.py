"""The EOS operator with a matrix oscillation (psi = x): the generalised delta rule.

LCSM section 2.2 with psi = "x" (appendix 5.2, Table 7)::

    m_t = exp(log_o_t) (I - a_t b_t^T) m_{t-1} + e_t i_t^T        [K, D]
    y_t = m_t^T s_t                                                 [D]

FWP / DeltaNet (Schlag et al. 2021, eq. 13 of LCSM): a = beta k, b = k, e = beta k, s = q.
M1: a = b = e = k.  M2: a = e = k, b = k_bar.  (M3 is diagonal and lives in :func:`lcsm.ops.eos`.)

Modes (see docs/eos_delta.md for the algebra):

* ``recurrent``: the step-by-step definition, with a hand-written reverse-time backward (LCSM
  appendix 5.1 "Type 2", eq. 12, corrected) that stores memory checkpoints every ``chunk_size``
  steps and recomputes the steps in between, so training memory is O(T/C * K * D) not O(T K D).
* ``chunk``: the WY / UT form of the delta rule (Yang et al. 2024, "Parallelizing linear
  transformers with the delta rule over sequence length"), generalised to
  a != b and an optional scalar gate: within a chunk the corrections u_t = b_t^T m_{t-1} solve one
  unit lower-triangular system, and across chunks m is propagated by one K x K matrix per chunk.
  The gate is carried on b, gamma (I - a b^T) = gamma I - a (gamma b)^T, so DeltaNet's a = e stays
  one tensor. Gradients come from autograd through this forward. ``eos_dplr`` runs this kernel
  for the structures it serves (one step per token, no or a scalar decay).
* ``triton``: the chunk form with its one sequential part, the carry of the memory across chunks,
  in a Triton kernel (``triton_delta``), forward and backward; the rest stays batched PyTorch.
* ``auto``: T <= 1 -> recurrent (one step, decoding), otherwise chunk; on CUDA tensors its carry
  runs in Triton where that kernel serves them (``carry_for``).

Packed sequences (``cu_seqlens``): the chunk form runs the row's regular chunks in one pass with
the documents kept apart inside them (block-diagonal masks, the carry reset where a document
starts, final states read at each document's last token); the recurrent form, the reference,
runs the documents one by one.

Shape glossary: B batch, T time, H heads, K memory rows (key width), D memory columns (value
width), C chunk size, Nc = ceil(T / C) chunks, N documents of a packed row. Internally tensors
are head-major [B, H, T, .].
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

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
    promoted_dtype,
    shape_str,
    triton_unavailable,
    without_autocast,
)
from .chunk_matmul import SCAN_LEVELS, traced_chunk_count
from .packed import Pieces

Tensor = torch.Tensor

DELTA_MODES = ("auto", "recurrent", "chunk", "triton")

# The Triton carry (``triton_delta``) holds all K memory rows in one register block; here so that
# planning never imports triton.
TRITON_MAX_K = 128


# ----------------------------------------------------------------------------- validation


def _canonicalize(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    log_o: Tensor | None,
    initial_state: Tensor | None,
    documents: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, torch.dtype]:
    """Validate ``eos_delta``'s arguments; return head-major tensors in the compute dtype: i, e, s,
    a, b [B, H, T, D|K], the gate log g [B, H, T] (or None), m0 [B, H, K, D] (or None; [N, H, K, D]
    for ``documents`` = N packed documents) and the output dtype."""
    named = {"i": i, "e": e, "s": s, "a": a, "b": b, "log_o": log_o, "initial_state": initial_state}
    for name, x in named.items():
        if x is None and name in ("log_o", "initial_state"):
            continue
        check_real("eos_delta", name, x)
    check_same_device(named)
    if i.dim() != 4:
        raise ValueError(f"i: expected [B, T, H, D], got {i.dim()}-d tensor {shape_str(i)}")
    B, T, H, D = i.shape
    if e.dim() != 4:
        raise ValueError(f"e: expected [B, T, H, K], got {e.dim()}-d tensor {shape_str(e)}")
    K = e.shape[-1]
    for name in ("e", "s", "a", "b"):
        x = named[name]
        if x.dim() != 4 or tuple(x.shape) != (B, T, H, K):
            raise ValueError(
                f"{name}: expected [B, T, H, K] = [{B}, {T}, {H}, {K}] (B, T, H from i {shape_str(i)}, "
                f"K from e {shape_str(e)}), got {shape_str(x)}"
            )
    if log_o is not None:
        if log_o.dim() == 3:
            if tuple(log_o.shape) != (B, T, H):
                raise ValueError(f"log_o: expected [B, T, H] = [{B}, {T}, {H}] or [H] = [{H}], got {shape_str(log_o)}")
        elif log_o.dim() == 1:
            if log_o.shape[0] != H:
                raise ValueError(f"log_o: expected [B, T, H] = [{B}, {T}, {H}] or [H] = [{H}], got {shape_str(log_o)}")
        else:
            raise ValueError(
                f"log_o: expected a scalar gate per step [B, T, H] = [{B}, {T}, {H}] or per head [H] = [{H}], "
                f"got {log_o.dim()}-d tensor {shape_str(log_o)}"
            )
    if documents is not None and initial_state is not None and tuple(initial_state.shape) != (documents, H, K, D):
        raise ValueError(
            f"initial_state: with cu_seqlens expected one state per document, [N, H, K, D] = "
            f"[{documents}, {H}, {K}, {D}], got {shape_str(initial_state)}"
        )
    if documents is None and initial_state is not None and tuple(initial_state.shape) != (B, H, K, D):
        raise ValueError(f"initial_state: expected [B, H, K, D] = [{B}, {H}, {K}, {D}], got {shape_str(initial_state)}")
    tensors = [i, e, s, a, b, log_o, initial_state]
    # y in the inputs' dtype, not the initial state's (a carried float32 state of half-precision inputs)
    out_dtype = promoted_dtype(tensors[:-1])
    dtype = compute_dtype(tensors)

    def hm(x: Tensor) -> Tensor:
        return x.permute(0, 2, 1, 3).to(dtype)

    g = None
    if log_o is not None:
        g = log_o.to(dtype)
        g = g.permute(0, 2, 1) if g.dim() == 3 else g[None, :, None].expand(B, H, T)
    m0 = initial_state.to(dtype) if initial_state is not None else None
    return hm(i), hm(e), hm(s), hm(a), hm(b), g, m0, out_dtype


# ----------------------------------------------------------------------------- recurrent form


def _step(
    m: Tensor, v: Tensor, e: Tensor, s: Tensor, a: Tensor, b: Tensor, gamma: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One step on [B, H, .] tensors: m [B, H, K, D] -> (y [B, H, D], m_new)."""
    u = torch.einsum("bhk,bhkd->bhd", b, m)
    m = m - a.unsqueeze(-1) * u.unsqueeze(-2)
    if gamma is not None:
        m = gamma[..., None, None] * m
    m = m + e.unsqueeze(-1) * v.unsqueeze(-2)
    return torch.einsum("bhk,bhkd->bhd", s, m), m


class _DeltaRecurrent(torch.autograd.Function):
    """The recurrence with the reverse-time backward of docs/eos_delta.md (corrected LCSM eq. 12).

    Forward keeps m at t = 0, C, 2C, ... only; backward walks the segments last to first,
    recomputes the C memories of a segment from its checkpoint and runs the adjoint recursion
        G_t = s_t dy_t^T + F_{t+1}^T G_{t+1},   F_t = gamma_t (I - a_t b_t^T),   G_T += dm_T.
    """

    @staticmethod
    def forward(
        ctx: Any,
        v: Tensor,
        e: Tensor,
        s: Tensor,
        a: Tensor,
        b: Tensor,
        g: Tensor | None,
        m0: Tensor | None,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        Bn, H, T, D = v.shape
        K = e.shape[-1]
        m = m0 if m0 is not None else v.new_zeros(Bn, H, K, D)
        gammas = g.exp().unbind(2) if g is not None else [None] * T
        checkpoints = []
        ys = []
        for t, (v_t, e_t, s_t, a_t, b_t, gm_t) in enumerate(
            zip(v.unbind(2), e.unbind(2), s.unbind(2), a.unbind(2), b.unbind(2), gammas, strict=False)
        ):
            if t % chunk_size == 0:
                checkpoints.append(m)
            y_t, m = _step(m, v_t, e_t, s_t, a_t, b_t, gm_t)
            ys.append(y_t)
        ctx.save_for_backward(v, e, s, a, b, g, *checkpoints)
        ctx.chunk_size = chunk_size
        ctx.has_m0 = m0 is not None
        return torch.stack(ys, 2), m

    @staticmethod
    @first_order
    def backward(ctx: Any, dy: Tensor | None, dm_T: Tensor | None) -> tuple[Tensor | None, ...]:
        v, e, s, a, b, g, *checkpoints = ctx.saved_tensors
        C = ctx.chunk_size
        T = v.shape[2]
        vs, es, ss, as_, bs = v.unbind(2), e.unbind(2), s.unbind(2), a.unbind(2), b.unbind(2)
        gammas = g.exp().unbind(2) if g is not None else [None] * T
        dys = dy.unbind(2) if dy is not None else [None] * T
        G = dm_T.clone() if dm_T is not None else torch.zeros_like(checkpoints[0])
        dv: list[Tensor] = [None] * T
        de: list[Tensor] = [None] * T
        ds: list[Tensor] = [None] * T
        da: list[Tensor] = [None] * T
        db: list[Tensor] = [None] * T
        dg: list[Tensor] = [None] * T
        for n in range(len(checkpoints) - 1, -1, -1):
            t0, t1 = n * C, min((n + 1) * C, T)
            prev = [checkpoints[n]]  # prev[j] = m_{t0 + j}, the memory before step t0 + j
            for t in range(t0, t1):
                prev.append(_step(prev[-1], vs[t], es[t], ss[t], as_[t], bs[t], gammas[t])[1])
            for t in range(t1 - 1, t0 - 1, -1):
                m_prev, m_t = prev[t - t0], prev[t - t0 + 1]
                if dys[t] is not None:
                    ds[t] = torch.einsum("bhkd,bhd->bhk", m_t, dys[t])
                    G = G + ss[t].unsqueeze(-1) * dys[t].unsqueeze(-2)
                else:
                    ds[t] = torch.zeros_like(ss[t])
                # G is now dL/dm_t (all paths). Gradients of m_t = F_t m_{t-1} + e_t v_t^T:
                de[t] = torch.einsum("bhkd,bhd->bhk", G, vs[t])
                dv[t] = torch.einsum("bhkd,bhk->bhd", G, es[t])
                u = torch.einsum("bhk,bhkd->bhd", bs[t], m_prev)  # b^T m_{t-1}
                w = torch.einsum("bhk,bhkd->bhd", as_[t], G)  # a^T G
                # dF_t = G m_{t-1}^T; F = gamma (I - a b^T) gives da = -gamma dF b, db = -gamma dF^T a,
                # dlog_o = gamma <dF, I - a b^T> = <G, m_t - e v^T>.
                gm = gammas[t]
                da[t] = -torch.einsum("bhkd,bhd->bhk", G, u)
                db[t] = -torch.einsum("bhkd,bhd->bhk", m_prev, w)
                if gm is not None:
                    da[t] = gm[..., None] * da[t]
                    db[t] = gm[..., None] * db[t]
                    dg[t] = (G * m_prev).sum((-2, -1)) - (w * u).sum(-1)
                    dg[t] = gm * dg[t]
                # dL/dm_{t-1} = F_t^T G = gamma (G - b (a^T G)): F_t^T, not F_t (LCSM eq. 12 has F_t).
                G = G - bs[t].unsqueeze(-1) * w.unsqueeze(-2)
                if gm is not None:
                    G = gm[..., None, None] * G
        dg_out = torch.stack(dg, 2) if g is not None else None
        dm0 = G if ctx.has_m0 else None
        return (
            torch.stack(dv, 2),
            torch.stack(de, 2),
            torch.stack(ds, 2),
            torch.stack(da, 2),
            torch.stack(db, 2),
            dg_out,
            dm0,
            None,
        )


# ----------------------------------------------------------------------------- chunk form


class _UnitLowerInverse(torch.autograd.Function):
    """(I + L)^{-1} for strictly lower-triangular L [..., C, C].

    Backward uses d(A^{-1}) = -A^{-1} dA A^{-1} with the inverse already in hand: two matmuls
    instead of the second triangular solve that autograd through ``solve_triangular`` costs.
    """

    @staticmethod
    def forward(ctx: Any, L: Tensor) -> Tensor:
        C = L.shape[-1]
        eye = torch.eye(C, dtype=L.dtype, device=L.device)
        inv = torch.linalg.solve_triangular(L + eye, eye.expand_as(L), upper=False, unitriangular=True)
        ctx.save_for_backward(inv)
        return inv

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (inv,) = ctx.saved_tensors
        inv_t = inv.transpose(-1, -2)
        return -(inv_t @ grad @ inv_t).tril(-1)


@dataclasses.dataclass(frozen=True)
class _Segments:
    """Where the documents of a packed row cut its chunks: a segment is the part of one document
    inside one chunk. All [Nc, C] or [Nc, C, C] over the padded row (padding belongs to the last
    document, as identity steps).

    ``same`` [Nc, C, C]: tokens t and j are of one document (the block-diagonal mask);
    ``start`` [Nc, C]: the position in the chunk of the first token of t's segment;
    ``carried`` [Nc, C]: t's document began before the chunk (its segment reads the memory carried
    in from the previous chunk; otherwise it reads the document's own initial state);
    ``last`` [Nc, C]: t is in the chunk's last segment (the one whose memory is carried out);
    ``doc`` [Nc, C]: t's document."""

    same: Tensor
    start: Tensor
    carried: Tensor
    last: Tensor
    doc: Tensor

    @staticmethod
    def of(cu: Tensor, T: int, C: int) -> _Segments:
        Nc = -(-T // C)
        lengths = cu[1:] - cu[:-1]
        N = lengths.numel()
        doc = torch.repeat_interleave(torch.arange(N, device=cu.device), lengths, output_size=T)
        doc = torch.cat([doc, doc.new_full((Nc * C - T,), N - 1)]).reshape(Nc, C)
        pos = torch.arange(Nc * C, device=cu.device).reshape(Nc, C)
        chunk_start = pos[:, :1]
        doc_start = cu.index_select(0, doc.flatten()).reshape(Nc, C)
        return _Segments(
            same=doc.unsqueeze(-1) == doc.unsqueeze(-2),
            start=torch.maximum(doc_start, chunk_start) - chunk_start,
            carried=doc_start < chunk_start,
            last=doc == doc[:, -1:],
            doc=doc,
        )


@dataclasses.dataclass(frozen=True)
class _ChunkMaps:
    """Per chunk (all [B, H, Nc, C, .] or [B, H, Nc, K, .]), for a chunk whose segments start from
    memories Z (the chunk's initial memory M when there are no segments):
    U = W Z + U0 (the corrections u_t = b_t^T m_{t-1}), y = Q Z + R, and the memory carried out of
    the chunk's last segment Phi Z_last + Psi, where Phi = gamma I - A^T W (gamma [B, H, Nc] the
    chunk's decay, None for 1; A the low-rank factors weighted to the chunk's end); Phi is None
    when not asked for (the Triton carry applies it as gamma M - A^T (W M)). ``a`` is the low-rank
    factor of the transition gamma_t I - a_t b_t^T, ``c`` the chunk-local cumulative log gate and
    ``c_seg`` the same from each segment's first token (None without a gate); packed rows need
    them for the states read at document ends."""

    Q: Tensor
    R: Tensor
    Phi: Tensor | None
    Psi: Tensor
    W: Tensor
    U0: Tensor
    a: Tensor
    c: Tensor | None
    c_seg: Tensor | None
    A: Tensor
    gamma: Tensor | None


def _chunk_maps(
    v: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor | None,
    a_is_e: bool,
    seg: _Segments | None,
    steps: Tensor,
    phi: bool = True,
) -> _ChunkMaps:
    """The WY / UT algebra of every chunk at once; inputs chunked [B, H, Nc, C, .], g [B, H, Nc, C];
    ``phi``: form the transitions Phi (the PyTorch carries multiply by them; the Triton one does not);
    ``steps`` [Nc, C] bool: the positions of tokens, not padding (``EmptySpans``).

    The transition is gamma_t I - a_t b_t^T (``eos_delta``'s gamma_t (I - a_t b_t^T) arrives with b
    gamma_t: a scalar gate moves onto either factor, and on b it leaves a = e one tensor).
    ``a_is_e``: a and e are one tensor (DeltaNet's beta k), so L = Le and Psa = Pse.

    Per chunk, with local cumulative log gate c_t = sum_{l<=t} g_l:
        m_t = e^{c_t} M + sum_{j<=t} e^{c_t - c_j} (e_j v_j^T - a_j u_j^T),   u_t = b_t^T m_{t-1},
    so U = [u_t] solves (I + L) U = diag(e^{c_{t-1}}) B M + Le V with
        L[t, j]  = e^{c_{t-1} - c_j} b_t . a_j,   Le[t, j] = e^{c_{t-1} - c_j} b_t . e_j   (j < t).
    Writing U = W M + U0 (W, U0 independent of M) makes every chunk's y and next state an affine
    function of its initial memory M: y = Q M + R and M' = Phi M + Psi.

    With ``seg`` (packed documents) every chunk-internal interaction is masked to one document
    (L, Le and the read-out maps are block-diagonal, so is (I + L)^{-1}: each segment's W, U0 see
    only its own tokens), and M becomes each segment's own initial memory Z, so e^{c_t} becomes
    e^{c_t - c_{start - 1}} with start the segment's first token; Phi and Psi sum over the chunk's
    last segment only.
    """
    C, K, D = v.shape[-2], e.shape[-1], v.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=v.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    if seg is not None:
        strict, incl = strict & seg.same, incl & seg.same
    eye = torch.eye(K, dtype=v.dtype, device=v.device)
    c = c_seg = None
    if g is not None:
        # a gate of exactly 0 (log_o = -inf) would make c_t - g_t = -inf - (-inf)
        g = finite_log(g)
        # Cumulative logs and their C x C differences in float64: differences of long float32 sums
        # lose the small exponents between nearby steps (as eos's parallel form); the float64
        # costs GDN's layer ~5-10 % on the CPU for 30-300x the float32 accuracy (bench/results/dplr.md).
        c = g.double().cumsum(-1)  # c_t
        c_prev = torch.nn.functional.pad(c, (1, 0))[..., :-1]  # c_{t-1}
        empty = EmptySpans.of(steps)
        first = empty.first  # t's segment starts at t
        c_seg, c_seg_prev = c, c_prev
        if seg is not None:
            # c_t - c_{start - 1}: the cumulative log from the segment's first token
            from_start = c_prev.gather(-1, seg.start.expand_as(c))
            c_seg, c_seg_prev = c - from_start, c_prev - from_start
            first = seg.start == torch.arange(C, device=v.device)
        # Differences are masked before exp so the (discarded) upper triangle can never overflow;
        # a weight over no step (j = t - 1 in L, j = t in Ps, the segment's first b, the last a
        # and e before the chunk's end or its padding) is exactly 1 and out of the gradient
        # (``decay_weight``).
        dec_b = decay_weight(c_prev.unsqueeze(-1) - c.unsqueeze(-2), strict, empty.before, v.dtype)
        dec_s = decay_weight(c.unsqueeze(-1) - c.unsqueeze(-2), incl, empty.at, v.dtype)
        b_scaled = b * decay_weight(c_seg_prev, None, first, v.dtype).unsqueeze(-1)
        s_scaled = s * c_seg.to(v.dtype).exp().unsqueeze(-1)
        to_end = decay_weight(c[..., -1:] - c, None, empty.last, v.dtype).unsqueeze(-1)  # e^{c_C - c_j}
        gamma = c_seg[..., -1].to(v.dtype).exp()
        m_decay = gamma[..., None, None] * eye
    else:
        dec_b, dec_s = strict.to(v.dtype), incl.to(v.dtype)
        b_scaled, s_scaled, to_end = b, s, None
        gamma, m_decay = None, eye
    if seg is not None:
        last = seg.last.unsqueeze(-1).to(v.dtype)
        to_end = last if to_end is None else to_end * last
    a_end = a if to_end is None else a * to_end
    e_end = e if to_end is None else e * to_end
    if a_is_e:
        # DeltaNet (a = e = beta k): the C x C products are formed once.
        et = e.transpose(-1, -2)
        L, Pse = (b @ et) * dec_b, (s @ et) * dec_s
    else:
        ae = torch.cat([a, e], -2).transpose(-1, -2)  # [K, 2C]: a and e side by side
        L, Le = ((b @ ae) * torch.cat([dec_b, dec_b], -1)).split(C, -1)  # b_t . a_j, b_t . e_j
        Psa, Pse = ((s @ ae) * torch.cat([dec_s, dec_s], -1)).split(C, -1)
    inv = _UnitLowerInverse.apply(L)
    if a_is_e:
        # Here L = Le, Psa = Pse and a_end = e_end; with (I + L)^{-1} L = I - (I + L)^{-1},
        # U0 = v - inv v, so every product with v and U0 collapses onto v - U0 = inv v.
        W, inv_v = (inv @ torch.cat([b_scaled, v], -1)).split([K, D], -1)
        SW, R = (Pse @ torch.cat([W, inv_v], -1)).split([K, D], -1)
        if phi:
            EW, Psi = (e_end.transpose(-1, -2) @ torch.cat([W, inv_v], -1)).split([K, D], -1)
        else:
            EW, Psi = None, e_end.transpose(-1, -2) @ inv_v
        Phi = None if EW is None else m_decay - EW
        return _ChunkMaps(s_scaled - SW, R, Phi, Psi, W, v - inv_v, a, c, c_seg, e_end, gamma)
    W, U0 = (inv @ torch.cat([b_scaled, Le @ v], -1)).split([K, D], -1)  # U = W M + U0
    SW, SU = (Psa @ torch.cat([W, U0], -1)).split([K, D], -1)
    if phi:
        AW, AU = (a_end.transpose(-1, -2) @ torch.cat([W, U0], -1)).split([K, D], -1)
    else:
        AW, AU = None, a_end.transpose(-1, -2) @ U0
    Phi = None if AW is None else m_decay - AW
    Psi = e_end.transpose(-1, -2) @ v - AU
    return _ChunkMaps(s_scaled - SW, Pse @ v - SU, Phi, Psi, W, U0, a, c, c_seg, a_end, gamma)


def _tokens(Nc: int, C: int, T: int, device: torch.device) -> Tensor:
    """[Nc, C] bool: the chunked positions that hold one of the T tokens (not end padding)."""
    return (torch.arange(Nc * C, device=device) < T).reshape(Nc, C)


class EmptySpans(NamedTuple):
    """Where a chunk's decay exponents sum the log decays of no step, each [.., C] or [.., C, C]:
    ``before`` c_{t-1} - c_j (j < t), ``at`` c_t - c_j (j <= t), ``first`` c_{t-1} (nothing before t
    in the chunk), ``last`` c_C - c_j (nothing after j). ``decay_weight`` makes those weights 1."""

    before: Tensor
    at: Tensor
    first: Tensor
    last: Tensor

    @staticmethod
    def of(steps: Tensor) -> EmptySpans:
        """From ``steps`` [.., C] bool, the positions that carry a decay (not padding, nor a
        token's micro-steps after its first): spans between positions of equal counts are empty."""
        k = steps.long().cumsum(-1)  # the decays up to t
        k_prev = k - steps.long()
        return EmptySpans(
            k_prev.unsqueeze(-1) == k.unsqueeze(-2), k.unsqueeze(-1) == k.unsqueeze(-2), k_prev == 0, k == k[..., -1:]
        )


def decay_weight(exponent: Tensor, mask: Tensor | None, over_no_step: Tensor, dtype: torch.dtype) -> Tensor:
    """exp(exponent) in ``dtype`` where ``mask`` holds (0 elsewhere; None: everywhere), with the
    entries ``over_no_step`` (a sum of log decays over no step, 0 whatever the decays) exactly 1
    and out of the gradient. Through a difference c_x - c_x such an entry sends +G and -G into the
    decay's gradient, O(1) terms that cancel to the true O(decay) one only after rounding: under
    strong decays (log -20 a step in float32) the decay's gradient was wholly lost."""
    zero = torch.zeros((), dtype=exponent.dtype, device=exponent.device)
    if mask is None:
        return torch.where(over_no_step, zero, exponent).to(dtype).exp()
    # one pass over the (large) exponent: its fill, 0 or -inf, is formed at the masks' size
    fill = torch.where(mask & over_no_step, zero, float("-inf"))
    return torch.where(mask & ~over_no_step, exponent, fill).to(dtype).exp()


def _chunked(
    v: Tensor, e: Tensor, s: Tensor, a: Tensor, b: Tensor, g: Tensor | None, C: int, Nc: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Pads T to Nc chunks (default ceil(T / C); chunks past T are all padding) and splits it:
    [B, H, T, .] -> [B, H, Nc, C, .], g -> [B, H, Nc, C]."""
    Bn, H, T, _ = v.shape
    if Nc is None:
        Nc = -(-T // C)
    pad = Nc * C - T
    # traced, T is symbolic and testing pad would guard on its value: always pad there
    if torch.compiler.is_compiling() or pad:
        # Zero a, b, e, v, s and a zero log gate make a padded step the identity on m.
        v, e, s, a, b = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (v, e, s, a, b))
        if g is not None:
            g = torch.nn.functional.pad(g, (0, pad))
    v, e, s, a, b = (x.reshape(Bn, H, Nc, C, x.shape[-1]) for x in (v, e, s, a, b))
    return v, e, s, a, b, (None if g is None else g.reshape(Bn, H, Nc, C))


def _gated_b(b: Tensor, g: Tensor | None) -> Tensor:
    """b_t gamma_t (head-major b [B, H, T, K], g [B, H, T]): the chunk kernels' transition
    gamma_t I - a_t (gamma_t b_t)^T is gamma_t (I - a_t b_t^T); a product, finite for any gate."""
    return b if g is None else b * g.exp().unsqueeze(-1)


def _carry(Phi: Tensor, Psi: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """The only sequential part: M_{n+1} = Phi_n M_n + Psi_n. Returns (the memories entering the
    chunks [B, H, Nc, K, D], the memory after the last)."""
    starts = []
    # Chunk-major copies make every per-chunk slice contiguous (no hidden copies in the loop).
    Phis, Psis = (x.movedim(2, 0).contiguous().unbind(0) for x in (Phi, Psi))
    for Phi_n, Psi_n in zip(Phis, Psis, strict=False):
        starts.append(M)
        M = Phi_n @ M + Psi_n
    return torch.stack(starts, 2), M


def _doubling_carry(Phi: Tensor, Psi: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """``_carry`` for torch.compile, where its Python loop over Nc chunks would fix Nc, and with it
    T, in the traced graph: the affine maps M -> Phi_n M + Psi_n compose associatively,
    (Phi_n, Psi_n) o (Phi_m, Psi_m) = (Phi_n Phi_m, Phi_n Psi_m + Psi_n), so SCAN_LEVELS doubling
    steps give every prefix (``chunk_matmul._doubling_states``, there with elementwise decays; here
    K x K products). At level l each chunk takes in the composite of the 2^l chunks before it;
    shifts past the first chunk take in the identity map (Phi = I, Psi = 0), so the levels past
    log2 Nc change nothing and the level count, fixed, leaves Nc symbolic. Each level costs Nc
    K x K times K x (K + D) products where the loop costs one K x K times K x D product per chunk:
    compile-clean, not cheap. The products of transitions are formed explicitly, so they must stay
    finite where the memories do (non-expansive transitions, e.g. DeltaNet's normalised keys with
    beta in [0, 2])."""
    Nc, K = Phi.shape[2], Phi.shape[-1]
    torch._check(
        Nc <= 1 << SCAN_LEVELS, lambda: f"traced eos_delta / eos_dplr chunk form: at most 2^{SCAN_LEVELS} chunks"
    )
    chunk = torch.arange(Nc, device=Phi.device).view(Nc, 1, 1)
    eye = torch.eye(K, dtype=Phi.dtype, device=Phi.device)
    # The first chunk takes in the memory before it; by a mask, not a cat with chunks 1.., whose
    # count Nc - 1 the tracer would guard on (``chunk_matmul._doubling_states``).
    # Phi_p, Psi_p [n]: the composite of the chunks up to n (back to 2^level chunks, then all)
    Phi_p, Psi_p = Phi, Psi + torch.where(chunk == 0, Phi @ M.unsqueeze(2), 0.0)

    def shifted(x: Tensor, by: int, fill: Tensor | float) -> Tensor:  # x[n - by] along chunks, ``fill`` before
        return torch.where(chunk >= by, x.roll(by, 2), fill)

    for level in range(SCAN_LEVELS):
        by = 1 << level
        Psi_p = Psi_p + Phi_p @ shifted(Psi_p, by, 0.0)
        Phi_p = Phi_p @ shifted(Phi_p, by, eye)
    # Psi_p[n]: the memory after chunk n; each chunk starts from the one after the chunk before.
    return torch.where(chunk == 0, M.unsqueeze(2), Psi_p.roll(1, 2)), Psi_p[:, :, -1]


def triton_carry_unsupported(v: Tensor, K: int, packed: bool = False) -> str | None:
    """Why the Triton carry (``triton_delta``) cannot serve the chunk form's compute tensors (v
    [B, H, T, D], K memory rows), or None when it can: traced by torch.compile too (a custom op),
    but not for packed documents."""
    why = triton_unavailable(v, traceable=not packed)
    if why is not None:
        return why
    if v.dtype != torch.float32:
        return f"compute dtype {v.dtype} (the kernel computes in float32: inputs float32, bfloat16 or float16)"
    if K > TRITON_MAX_K:
        return f"K = {K}: more than {TRITON_MAX_K} (all K memory rows are one register block)"
    return None


def carry_for(mode: str, v: Tensor, K: int, packed: bool = False) -> tuple[str, str]:
    """(carry, why) for a chunk form run under ``mode``: "triton" (``triton_delta``) when asked for,
    or under "auto" on CUDA tensors where it serves them; else "torch", the loop of ``_carry`` (the
    doubling scan when traced). Mode "triton" where the kernel cannot serve raises, naming why."""
    if mode == "triton":
        why = triton_carry_unsupported(v, K, packed)
        if why is not None:
            raise ValueError(f"mode='triton' cannot serve these inputs: {why}; use mode='chunk' or 'auto'")
        return "triton", "requested"
    if mode == "auto" and v.device.type == "cuda":
        why = triton_carry_unsupported(v, K, packed)
        if why is None:
            return "triton", "CUDA tensors and triton installed"
        return "torch", f"not the Triton carry: {why}"
    return "torch", "a loop over chunks, one batched product each"


def transition(W: Tensor, A: Tensor, gamma: Tensor | None, X: Tensor) -> Tensor:
    """Phi X = diag(gamma) X - A^T (W X) for chunk maps W, A [..., C, K] and memories X [..., K, D],
    gamma [...] (a scalar a chunk), [..., K] (one per row) or None (1): a chunk's transition
    applied without forming the K x K Phi."""
    corrected = A.transpose(-1, -2) @ (W @ X)
    if gamma is None:
        return X - corrected
    scale = gamma[..., None, None] if gamma.dim() == W.dim() - 2 else gamma.unsqueeze(-1)
    return scale * X - corrected


def _delta_chunk(
    v: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor | None,
    m0: Tensor | None,
    chunk_size: int,
    a_is_e: bool = False,
    carry: str = "torch",
) -> tuple[Tensor, Tensor]:
    """Chunkwise (WY / UT) form (``_chunk_maps``) of gamma_t I - a_t b_t^T. All inputs head-major
    [B, H, T, .]; returns (y, m_T). ``carry``: the memory carried across chunks by the loop of
    ``_carry`` ("torch") or by one Triton kernel ("triton", ``triton_delta``; ``carry_for``).

    Traced (torch.compile), T is symbolic: the chunk length stays ``chunk_size`` when T is shorter,
    the chunks are ``traced_chunk_count`` (padding past T, identity steps) and the carry is the
    doubling scan ``_doubling_carry`` (or the Triton kernel's custom op); nothing reads a value, so
    one graph serves every T."""
    Bn, H, T, D = v.shape
    K = e.shape[-1]
    M = m0 if m0 is not None else v.new_zeros(Bn, H, K, D)
    traced = torch.compiler.is_compiling()
    if traced:
        C = chunk_size
        chunks = _chunked(v, e, s, a, b, g, C, traced_chunk_count(T, C))
    else:
        C = min(chunk_size, T)
        chunks = _chunked(v, e, s, a, b, g, C)
    steps = _tokens(chunks[0].shape[2], C, T, v.device)
    maps = _chunk_maps(*chunks, a_is_e, None, steps, phi=carry != "triton")
    if carry == "triton":
        from .triton_delta import triton_delta_carry

        starts, M = triton_delta_carry(maps.W, maps.A, maps.Psi, maps.gamma, M)
    else:
        starts, M = (_doubling_carry if traced else _carry)(maps.Phi, maps.Psi, M)
    y = maps.Q @ starts + maps.R  # [B, H, Nc, C, D]
    return y.flatten(2, 3)[:, :, :T], M


def _delta_chunk_packed(
    v: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor | None,
    m0: Tensor | None,
    chunk_size: int,
    a_is_e: bool,
    cu: Tensor,
    final: bool,
    carry: str = "torch",
) -> tuple[Tensor, Tensor | None]:
    """The chunk form over a packed row (B = 1) of N documents, cu [N + 1] int64: one pass over the
    row's regular chunks, the documents kept apart inside them by ``_Segments`` masks. y [1, H, T, D]
    and (when ``final``) the documents' final states [N, H, K, D]; m0 [N, H, K, D] or None.
    ``carry``: the loop of ``_carry`` ("torch") or ``triton_delta``'s kernel ("triton"), which
    takes the transition zeroed as gamma and W times the carried-out flag.

    A segment reads from Z: the carried memory when its document began in an earlier chunk, else
    the document's own initial state m0_n (zero when None). The carry M_{n+1} = Phi_n Z_last + Psi_n
    keeps Phi_n where the chunk's last segment is carried and folds m0 into Psi_n where it is not,
    so the sequential loop is the one-sequence loop. The initial states' share of the outputs of
    documents' first segments, and every final state (read at the document's last token, inside a
    chunk or at its end, from its last segment's Z and corrections u_j = W_j Z + U0_j), are sums
    over segments batched over documents by ``packed.Pieces``: beyond the one-sequence form
    O(T K D) multiply-adds and O(N K D) memory, no loop over documents.
    """
    _, H, T, D = v.shape
    K = e.shape[-1]
    C = min(chunk_size, T)
    seg = _Segments.of(cu, T, C)
    v, e, s, a, b, g = _chunked(v, e, s, a, b, g, C)
    Nc = seg.last.shape[0]
    maps = _chunk_maps(v, e, s, a, b, g, a_is_e, seg, _tokens(Nc, C, T, v.device), phi=carry != "triton")
    carried_out = seg.carried[:, -1]  # [Nc]: the chunk's last segment continues from the carry
    Psi = maps.Psi
    if m0 is not None:
        # Where the last segment began inside the chunk its memory comes from m0, not the carry.
        fresh = (~carried_out).nonzero()[:, 0]
        m0_fresh = m0.index_select(0, seg.doc[:, -1].index_select(0, fresh)).transpose(0, 1).unsqueeze(0)
        picked = (x.index_select(2, fresh) for x in (maps.W, maps.A))
        gamma = None if maps.gamma is None else maps.gamma.index_select(2, fresh)
        Psi = Psi.index_add(2, fresh, transition(*picked, gamma, m0_fresh))
    kept = carried_out.to(v.dtype)
    if carry == "triton":
        from .triton_delta import triton_delta_carry

        gamma = kept.expand(1, H, Nc) if maps.gamma is None else maps.gamma * kept
        starts, _ = triton_delta_carry(maps.W * kept[:, None, None], maps.A, Psi, gamma, v.new_zeros(1, H, K, D))
    else:
        starts, _ = _carry(maps.Phi * kept[:, None, None], Psi, v.new_zeros(1, H, K, D))

    def flat(x: Tensor) -> Tensor:  # [1, H, Nc, C, ...] -> [H, Nc C, ...]
        return x.reshape(H, Nc * C, *x.shape[4:])

    # y = Q Z + R; here Z is the carried memory, and the tokens of a document that began in the
    # chunk get their m0's share next.
    y = flat((maps.Q * seg.carried.unsqueeze(-1).to(v.dtype)) @ starts + maps.R)

    def chunk_of(t: Tensor) -> Tensor:  # the first token of t's chunk
        return torch.div(t, C, rounding_mode="floor") * C

    doc_starts, doc_ends = cu[:-1], cu[1:]
    if m0 is not None:
        first = Pieces.of_ranges(doc_starts, torch.minimum(doc_ends, chunk_of(doc_starts) + C), Nc * C)
        at = first.index[first.valid]
        m0_first = m0.index_select(0, first.doc)  # [pieces, H, K, D]: document-major, never transposed

        def share(x: Tensor) -> Tensor:  # x_t m0_n at the first segments' tokens, [H, tokens, D]
            return (first.rows(flat(x)).transpose(0, 1) @ m0_first).transpose(0, 1).flatten(1, 2)[:, first.valid]

        y = y.index_add(1, at, share(maps.Q))
    y = y[:, :T].unsqueeze(0)
    if not final:
        return y, None
    # m at a document's last token t_e, from its last segment [p, t_e] with initial memory Z:
    #   m = e^{c_{t_e} - c_{p-1}} Z + sum_j e^{c_{t_e} - c_j} (e_j v_j^T - a_j u_j^T),  u_j = W_j Z + U0_j
    last_token = doc_ends - 1
    seg_start = torch.maximum(doc_starts, chunk_of(last_token))
    pieces = Pieces.of_ranges(seg_start, doc_ends, Nc * C)
    valid = pieces.valid.reshape(-1, pieces.P)  # [pieces, P]

    def rows(x: Tensor) -> Tensor:  # [1, H, Nc, C, F] -> [pieces, H, P, F], document-major
        return pieces.rows(flat(x)).transpose(0, 1)

    if maps.c is not None:
        c, c_seg = flat(maps.c), flat(maps.c_seg)  # [H, Nc C]
        at_end = c.index_select(1, last_token.index_select(0, pieces.doc))  # c_{t_e} of each piece
        diff = (at_end.unsqueeze(-1) - pieces.rows(c.unsqueeze(-1))[..., 0]).transpose(0, 1)  # [pieces, H, P]
        # Masked before exp: a padding slot's difference is not one within a segment. The piece's
        # last token (j = t_e) weighs exactly 1.
        at_last = pieces.index.reshape(-1, pieces.P) == last_token.index_select(0, pieces.doc)[:, None]
        weight = decay_weight(diff, valid[:, None], at_last[:, None], v.dtype)
    else:
        weight = valid[:, None].to(v.dtype)
    # Z: the memory carried into the last segment's chunk, or the document's m0 (zero when None).
    keep = (seg_start > doc_starts)[:, None, None, None]
    Z = starts[0].transpose(0, 1).index_select(0, torch.div(last_token, C, rounding_mode="floor"))  # [N, H, K, D]
    Z = torch.where(keep, Z, 0.0 if m0 is None else m0)
    # One matmul per piece: [e_j; -a_j] weighted against [v_j; u_j]. The left factors are 0 in
    # the padding (weight), so the right ones' padding rows drop out.
    u = rows(maps.W) @ Z.index_select(0, pieces.doc) + rows(maps.U0)
    left = torch.cat([rows(e), -rows(maps.a)], -2) * weight.repeat(1, 1, 2).unsqueeze(-1)
    sums = left.transpose(-1, -2) @ torch.cat([rows(v), u], -2)  # [pieces, H, K, D]
    if maps.c is not None:
        Z = c_seg.index_select(1, last_token).t().to(v.dtype).exp()[..., None, None] * Z
    return y, Z.index_add(0, pieces.doc, sums)


# ----------------------------------------------------------------------------- public API


@without_autocast
def eos_delta(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    log_o: Tensor | None = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """EOS with the matrix oscillation o_t = exp(log_o_t) (I - a_t b_t^T) (LCSM 5.2, Table 7).

        m_t = exp(log_o_t) (I - a_t b_t^T) m_{t-1} + e_t i_t^T,    y_t = m_t^T s_t

    Args:
        i: input state [B, T, H, D] (the values v).
        e, s: expand and shrink states [B, T, H, K] (DeltaNet: e = beta k, s = q).
        a, b: the rank-one correction of the oscillation, [B, T, H, K] (DeltaNet: a = beta k, b = k).
        log_o: optional scalar gate per step [B, T, H] or per head [H]; None means 1.
        mode: "recurrent", "chunk", "triton" (the chunk form with its carry across chunks in one
            Triton kernel, ``triton_delta``: CUDA tensors, or the CPU under Triton's interpreter;
            float32 compute, K <= 128) or "auto" (T <= 1 -> recurrent, else chunk,
            its carry in Triton on CUDA tensors where that kernel serves them).
            ``explain_dplr(..., gate_first=True)`` names the form, the carry and why.
        initial_state: m_0 [B, H, K, D] (zeros when None).
        output_final_state: also return m_T [B, H, K, D].
        chunk_size: chunk length C of mode "chunk" and checkpoint spacing of the recurrent
            backward (any C >= 1; T need not be a multiple).
        cu_seqlens: packed sequences, as ``eos`` takes them ([N + 1], B = 1); initial and final
            states are then [N, H, K, D]. Mode chunk runs the whole row in one pass, the
            documents kept apart inside its chunks by block-diagonal masks (docs/eos_delta.md);
            mode recurrent, the reference, runs each document alone (a loop over documents).

    Returns:
        y [B, T, H, D] and m_T (or None). Half-precision inputs are computed in float32 and y is
        cast back; the final state stays float32 (as in fla).

    Passing the same tensor object as ``a`` and ``e`` (DeltaNet's beta k) lets mode "chunk" compute
    the C x C products once (about 25% faster); the result is the same as with two equal tensors.

    The product of (I - a b^T) factors is stable when each factor is non-expansive, e.g. a = beta b
    with ||b|| = 1 and beta in [0, 2] (DeltaNet's L2-normalised keys); the operator does not
    normalise its inputs, that is the caller's parameterisation.
    """
    chunk_size = check_chunk_size(chunk_size)
    output_final_state = check_bool("output_final_state", output_final_state)
    prime_host_heap(i)
    if mode not in DELTA_MODES:
        raise ValueError(f"mode: expected one of {', '.join(DELTA_MODES)}, got {mode!r}")
    if cu_seqlens is not None:
        return _delta_packed(i, e, s, a, b, log_o, mode, initial_state, output_final_state, chunk_size, cu_seqlens)
    v, e_, s_, a_, b_, g, m0, out_dtype = _canonicalize(i, e, s, a, b, log_o, initial_state)
    Bn, H, T, D = v.shape
    K = e_.shape[-1]
    if T == 0:
        y, m = v.new_zeros(Bn, H, 0, D), (m0 if m0 is not None else v.new_zeros(Bn, H, K, D))
    elif mode == "recurrent" or (mode == "auto" and T <= 1):
        y, m = _DeltaRecurrent.apply(v, e_, s_, a_, b_, g, m0, chunk_size)
    else:
        carry, _ = carry_for(mode, v, K)
        y, m = _delta_chunk(v, e_, s_, a_, _gated_b(b_, g), g, m0, chunk_size, a_is_e=a is e, carry=carry)
    y = y.permute(0, 2, 1, 3).to(out_dtype)
    if not output_final_state:
        return y, None
    return y, m.to(v.dtype)  # the compute dtype (float32 for half-precision inputs)


def _delta_packed(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    log_o: Tensor | None,
    mode: str,
    initial_state: Tensor | None,
    output_final_state: bool,
    chunk_size: int,
    cu_seqlens: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """``eos_delta`` on packed sequences. Chunk (and auto): one pass over the row, documents kept
    apart inside the chunks (``_delta_chunk_packed``). Recurrent, the reference: each document
    alone, its outputs concatenated and its final states stacked (a loop over documents)."""
    bounds = check_cu_seqlens(cu_seqlens)
    N = len(bounds) - 1
    v, e_, s_, a_, b_, g, m0, out_dtype = _canonicalize(i, e, s, a, b, log_o, initial_state, documents=N)
    check_packed(bounds, v.shape[0], v.shape[2])
    if mode == "recurrent" or (mode == "auto" and v.shape[2] <= 1):
        ys, ms = [], []
        for n in range(N):
            lo, hi = bounds[n], bounds[n + 1]
            y, m = _DeltaRecurrent.apply(
                v[:, :, lo:hi],
                e_[:, :, lo:hi],
                s_[:, :, lo:hi],
                a_[:, :, lo:hi],
                b_[:, :, lo:hi],
                None if g is None else g[:, :, lo:hi],
                None if m0 is None else m0[n : n + 1],
                chunk_size,
            )
            ys.append(y)
            ms.append(m)
        y, m = torch.cat(ys, 2), torch.cat(ms, 0)
    else:
        cu = torch.tensor(bounds, dtype=torch.int64, device=v.device)
        carry, _ = carry_for(mode, v, e_.shape[-1], packed=True)
        y, m = _delta_chunk_packed(
            v, e_, s_, a_, _gated_b(b_, g), g, m0, chunk_size, a is e, cu, output_final_state, carry
        )
    y = y.permute(0, 2, 1, 3).to(out_dtype)
    if not output_final_state:
        return y, None
    return y, m.to(v.dtype)  # the compute dtype (float32 for half-precision inputs)
