"""Packed sequences: N documents back to back in one row, FlashAttention's ``cu_seqlens``.

Document n holds tokens [cu[n], cu[n + 1]) of a batch of one; its memory starts from its own
initial state m0_n (zeros by default) and nothing crosses a boundary. The recurrent mode is the
definition, a loop over documents. The parallel and chunk modes run the whole row at once, by
linearity split into

    y = y_core + y_init,        m_n = m_n^core + exp(Gamma_end - Gamma_before) * m0_n

``y_core`` is the packed problem with every initial state zero and a decay of exactly 0
(``LOG_ZERO``) at each document's first token: the memory is multiplied by 0 there, so it restarts
from e_t i_t^T, which is the document's own first step from a zero state. Its gradients are exact:
the masked log decays get none, and the reference's gradient for them is dm_t * o_t * m_{t-1} = 0
with m_{t-1} = 0. The chunk form's matmul kernel takes such a step as a reset, by masks, so the
boundaries cost it almost nothing (chunk_matmul.py). ``y_init`` (the initial states' share of the
output, read through each document's own cumulative decay) and every final state
m_n^core = sum_j exp(Gamma_end - Gamma_j) e_j i_j^T are closed forms on the within-document
cumulative logs, which carry the gradients of the initial states and of the unmasked decay at
the first tokens. They are paid only when initial states are given or final states asked for
(the kernels do not return the memory at arbitrary positions). For K-vector e and s with a decay
of the matmul kernel each token's term is rank one and they are batched matmuls over the
documents cut into pieces (``_Pieces``, ``_DocumentStates``, whose backward writes each K x D
gradient once), O(T K D) multiply-adds and O(T (K + D) + N K D) memory; otherwise (the
elementwise kernel's problems, themselves O(T K D)) they form one [T, K, D] tensor each, and
autograd gives their gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._autograd import first_order
from ._inputs import LOG_ZERO, EOSProblem, finite_log, real_dtype
from .reference import eos_recurrent

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Documents:
    """Document boundaries of a packed row of T tokens: ``bounds`` (cu_seqlens as ints), ``doc``
    [T] the document of each token, ``starts`` [N] its first token, ``ends`` [N] one past its last
    (all int64 on the inputs' device)."""

    bounds: list[int]
    doc: Tensor
    starts: Tensor
    ends: Tensor

    @property
    def N(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def of(bounds: list[int], device: torch.device) -> Documents:
        cu = torch.tensor(bounds, dtype=torch.int64, device=device)
        lengths = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=device), lengths)
        return Documents(bounds, doc, cu[:-1], cu[1:])


def _slice(p: EOSProblem, a: int, b: int, n: int) -> EOSProblem:
    """The sub-problem of tokens [a, b) with the n-th initial state (a data-independent tensor,
    time dim 1, is shared)."""

    def cut(x: Tensor | None) -> Tensor | None:
        return x if x is None or x.shape[2] == 1 else x[:, :, a:b]

    def cut_pair(xs: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor] | None:
        return None if xs is None else (cut(xs[0]), cut(xs[1]))

    return dataclasses.replace(
        p,
        i=cut(p.i),
        e=cut(p.e),
        s=cut(p.s),
        g=cut(p.g),
        g_outer=cut_pair(p.g_outer),
        g_product=cut_pair(p.g_product),
        i_real=cut(p.i_real),
        m0=None if p.m0 is None else p.m0[n : n + 1],
        T=b - a,
    )


def packed_recurrent(p: EOSProblem, docs: Documents) -> tuple[Tensor, Tensor]:
    """The reference: each document alone through the recurrence. y [1, H, T, D], final states
    [N, H, K, D]."""
    ys, ms = [], []
    for n in range(docs.N):
        y, m = eos_recurrent(_slice(p, docs.bounds[n], docs.bounds[n + 1], n))
        ys.append(y)
        ms.append(m)
    return torch.cat(ys, 2), torch.cat(ms, 0)


def reset_at_starts(p: EOSProblem, docs: Documents) -> EOSProblem:
    """The packed problem with zero initial states and a decay of exactly 0 at each document's
    first token (``LOG_ZERO``, whose exp is 0 in the compute dtype: the kernels take it exactly).
    A decay that was data-independent or absent becomes a data-dependent one; a product a * b is
    formed (a masked operand would not make the product's exp 0 whatever the other's sign), so it
    runs as a full K x D decay."""
    first = torch.zeros(p.T, dtype=torch.bool, device=p.i.device)
    first[docs.starts] = True
    first = first.view(1, 1, p.T, 1, 1)
    real = real_dtype(p.i.dtype)
    zero = torch.tensor(LOG_ZERO[real], dtype=real, device=p.i.device)

    def mask(g: Tensor) -> Tensor:
        return torch.where(first, zero.to(g.dtype), g)

    g, outer = None, None
    if p.g_outer is not None:
        # Both factors: LOG_ZERO on one alone would leave exp(LOG_ZERO + g_col) > 0 for g_col > 0.
        outer = (mask(p.g_outer[0]), mask(p.g_outer[1]))
    elif p.g_product is not None or p.g is not None:
        g = mask(p.g_full)
    else:
        g = mask(torch.zeros(1, p.H, 1, 1, 1, dtype=p.i.dtype, device=p.i.device))
    return dataclasses.replace(p, g=g, g_outer=outer, g_product=None, m0=None, g_dd=True)


def _gammas(g: Tensor, docs: Documents, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """Cumulative logs of g [1, H, T|1, ...] over the row, summed in double precision as every
    Gamma of lcsm is (parallel.py), with those just before each document's first token and at its
    last: (gamma [1, H, T, ...], before [1, H, N, ...], last [1, H, N, ...]). Every exponent taken
    from them is a within-document difference t >= j, so nothing overflows."""
    g = finite_log(g).expand(*g.shape[:2], T, *g.shape[3:])
    gamma = g.to(torch.complex128 if g.is_complex() else torch.float64).cumsum(2)
    last = gamma.index_select(2, docs.ends - 1)
    # the documents tile the row: the Gamma before a document is the last of the one before it
    before = torch.cat([torch.zeros_like(last[:, :, :1]), last[:, :, :-1]], 2)
    return gamma, before, last


# What a tail (``_Pieces``) costs in slots of padding. An estimate, not a fit: a slot costs the
# pieces' six matmuls K x D multiply-adds each, a tail about six fresh K x D tensors (gathered
# states, sums, scattered gradients), whose page-faulted writes cost several multiply-adds per
# element; on the bench's shape (bench/results/packed.md) the shared 2-core machine could not tell
# 4 from 16 apart, and 0 (pieces of one token) ran ~5x slower.
TAIL_COST = 16


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Token ranges (parts of documents: eos_delta's segments) cut into pieces of at most
    P = ceil(total / n) tokens for n ranges: at most 2n pieces (n + total/P), so a [pieces, P] grid
    holds at most twice the ranges' tokens however uneven they are. ``index`` [pieces * P] the
    token of each slot (``size``, one past the row, for padding), ``doc`` [pieces] each piece's
    range, ``valid`` [pieces * P] the slots that hold a token (in token order). (The states of
    ``eos`` use ``_Pieces``, a layout of whole documents with heads written in place.)"""

    index: Tensor
    doc: Tensor
    valid: Tensor
    P: int

    @staticmethod
    def of_ranges(starts: Tensor, ends: Tensor, size: int) -> Pieces:
        """Ranges [starts[n], ends[n]) (non-empty, int64) of a row of ``size`` tokens."""
        lengths = ends - starts
        P = -(-int(lengths.sum()) // lengths.numel())
        counts = (lengths + P - 1) // P
        doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), counts)
        first_piece = torch.cumsum(counts, 0) - counts
        offset = torch.arange(doc.numel(), device=doc.device) - first_piece.index_select(0, doc)
        start = starts.index_select(0, doc) + offset * P
        slot = start[:, None] + torch.arange(P, device=doc.device)
        valid = slot < ends.index_select(0, doc)[:, None]
        return Pieces(torch.where(valid, slot, size).flatten(), doc, valid.flatten(), P)

    def rows(self, x: Tensor) -> Tensor:
        """x [H, size, F] -> [H, pieces, P, F] without the copy that zero padding costs: a padding
        slot holds some row of x, which the caller masks or drops."""
        return x.index_select(1, self.index.clamp(max=x.shape[1] - 1)).unflatten(1, (self.doc.numel(), self.P))


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """The documents cut into pieces of at most P tokens: each document's first piece (its head;
    the N heads come first, in document order) and the rest (its tails). A head's K x D sums are
    its document's own, read and written in place; a tail's are gathered and scattered. P is the
    power of two (or the longest document) that minimises slots + TAIL_COST * tails: padding
    against tails. P = ceil(2 T / N) would give at most 3T slots and N / 2 tails, so the grids stay
    O(T + N). ``rows`` [pieces, H, P] the row of each slot in a [H * (T + 1), F] tensor (row T of
    each head is padding), ``tokens_at`` [H * T] the slot of each (head, token) in a
    [pieces * H * P, F] tensor, ``tail_doc`` [tails] each tail's document."""

    rows: Tensor
    tokens_at: Tensor
    tail_doc: Tensor

    @staticmethod
    def of(docs: Documents, T: int, H: int) -> _Pieces:
        lengths = docs.ends - docs.starts
        longest = int(lengths.max())
        sizes = {longest} | {2**k for k in range(longest.bit_length()) if 2**k < longest}

        def cost(P: int) -> int:
            pieces = int(((lengths + P - 1) // P).sum())
            return pieces * P + TAIL_COST * (pieces - docs.N)

        P = min(sorted(sizes), key=cost)
        device = lengths.device
        extra = (lengths + P - 1) // P - 1
        tail_doc = torch.repeat_interleave(torch.arange(docs.N, device=device), extra)
        first_tail = torch.cumsum(extra, 0) - extra
        later = torch.arange(tail_doc.numel(), device=device) - first_tail.index_select(0, tail_doc) + 1
        start = torch.cat([docs.starts, docs.starts.index_select(0, tail_doc) + later * P])
        end = torch.cat([docs.ends, docs.ends.index_select(0, tail_doc)])
        slots = start[:, None] + torch.arange(P, device=device)  # [pieces, P]
        valid = slots < end[:, None]
        token = torch.where(valid, slots, T)
        heads = torch.arange(H, device=device)
        rows = heads[None, :, None] * (T + 1) + token[:, None, :]
        slot = torch.empty(T, dtype=torch.int64, device=device)
        slot[token[valid]] = torch.nonzero(valid.flatten()).flatten()
        tokens_at = ((slot // P) * H + heads[:, None]) * P + slot % P
        return _Pieces(rows, tokens_at.flatten(), tail_doc)

    def grid(self, x: Tensor) -> Tensor:
        """x [H, T, F] -> [pieces, H, P, F], zeros in the padding (contiguous: the matmuls read
        heads and tails as views)."""
        H, _, F = x.shape
        x = torch.cat([x, x.new_zeros(H, 1, F)], 1).flatten(0, 1)
        return x.index_select(0, self.rows.flatten()).view(*self.rows.shape, F)

    def tokens(self, x: Tensor) -> Tensor:
        """x [pieces, H, P, F] -> [H, T, F], the slots that hold tokens, in token order."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.tokens_at).view(x.shape[1], -1, x.shape[-1])


def _factor_logs(p: EOSProblem) -> tuple[Tensor | None, Tensor | None]:
    """The decay of a matmul-kernel problem as a log factor on the K rows [1, H, T|1, K|1] and one on
    the D columns [1, H, T|1, D] (None: no factor); o = exp(row) (x) exp(col)."""
    kind = p.decay_kind
    if kind in ("scalar", "row"):
        return p.g.flatten(-2), None
    if kind == "col":
        return None, p.g[..., 0, :]
    if kind == "outer":
        return p.g_outer[0][..., 0], p.g_outer[1][..., 0, :]
    return None, None


def _heads_and_tails(x: Tensor, N: int) -> tuple[Tensor, Tensor]:
    """[pieces, ...] -> the N heads and the tails, as [N * H, ...] and [tails * H, ...] batches
    of matrices (x [pieces, H, r, c])."""
    return x[:N].flatten(0, 1), x[N:].flatten(0, 1)


def _per_piece(x: Tensor, tail_doc: Tensor) -> tuple[Tensor, Tensor]:
    """Document states [N, H, r, c] -> (heads' [N * H, r, c], tails' [tails * H, r, c])."""
    return x.flatten(0, 1), x.index_select(0, tail_doc).flatten(0, 1)


class _DocumentStates(torch.autograd.Function):
    """The matmul closed forms of ``_add_states_matmul`` over the pieces (``_Pieces``, heads first):
    the initial states' share q_t^T m0_n of every slot, share = q @ m0 [pieces, H, P, D], and the
    final states m0 * w + sum over a document's slots of a_j b_j^T, [N, H, K, D]. Written as tensor
    expressions, autograd would allocate five or six fresh N x H x K x D tensors in the backward
    (products, slices' zero-filled gradients, sums), each a page fault per 4 KiB: at N 512 they
    made the states cost several times the packed row's kernel. The forward writes m_T once and
    the backward dm0 once, adding the other parts into them in place; dw is reduced by batched
    dot products.

    m0 [N, H, K, D] or None; w [N, H, K|1, D|1] or None (no decay); q [pieces, H, P, K] (None
    without m0); a [pieces, H, P, K] and b [pieces, H, P, D] (None: no final states); tail_doc
    [tails]; N documents. Complex tensors follow autograd's convention (gradients of conjugates)."""

    @staticmethod
    def forward(
        ctx: Any,
        m0: Tensor | None,
        w: Tensor | None,
        q: Tensor | None,
        a: Tensor | None,
        b: Tensor | None,
        tail_doc: Tensor,
        N: int,
    ) -> tuple[Tensor | None, Tensor | None]:
        H = (q if q is not None else a).shape[1]
        share = m_T = None
        if q is not None:
            heads, tails = _heads_and_tails(q, N)
            m0_heads, m0_tails = _per_piece(m0, tail_doc)
            share = _pieces_matmul(heads, m0_heads, tails, m0_tails, H)
        if a is not None:
            (a_h, a_t), (b_h, b_t) = _heads_and_tails(a, N), _heads_and_tails(b, N)
            if m0 is None:
                m_T = a_h.transpose(-1, -2) @ b_h
            else:
                m_T = _fresh(m0, w).flatten(0, 1).baddbmm_(a_h.transpose(-1, -2), b_h)
            m_T = m_T.unflatten(0, (N, H))
            if tail_doc.numel():
                m_T.index_add_(0, tail_doc, (a_t.transpose(-1, -2) @ b_t).unflatten(0, (-1, H)))
        ctx.save_for_backward(m0, w, q, a, b, tail_doc)
        ctx.N, ctx.H = N, H
        return share, m_T

    @staticmethod
    @first_order
    def backward(ctx: Any, d_share: Tensor | None, d_m: Tensor | None) -> tuple[Tensor | None, ...]:
        m0, w, q, a, b, tail_doc = ctx.saved_tensors
        N, H = ctx.N, ctx.H
        want_m0 = m0 is not None and ctx.needs_input_grad[0]
        dm0 = dw = dq = da = db = None
        if a is not None and d_m is not None:
            dm_h, dm_t = _per_piece(d_m, tail_doc)
            (a_h, a_t), (b_h, b_t) = _heads_and_tails(a, N), _heads_and_tails(b, N)
            da = _pieces_matmul(b_h.conj(), dm_h.transpose(-1, -2), b_t.conj(), dm_t.transpose(-1, -2), H)
            db = _pieces_matmul(a_h.conj(), dm_h, a_t.conj(), dm_t, H)
            if want_m0:
                dm0 = _fresh(d_m, None if w is None else w.conj())
            if w is not None and ctx.needs_input_grad[1]:
                dw = _reduce_to(d_m, m0.conj(), w.shape)
        if q is not None and d_share is not None:
            (q_h, q_t), (s_h, s_t) = _heads_and_tails(q, N), _heads_and_tails(d_share, N)
            m0_h, m0_t = _per_piece(m0, tail_doc)
            dq = _pieces_matmul(s_h, m0_h.conj().transpose(-1, -2), s_t, m0_t.conj().transpose(-1, -2), H)
            if want_m0:
                q_h, q_t = q_h.conj().transpose(-1, -2), q_t.conj().transpose(-1, -2)
                if dm0 is None:
                    dm0 = (q_h @ s_h).unflatten(0, (N, H))
                else:
                    dm0 = dm0.flatten(0, 1).baddbmm_(q_h, s_h).unflatten(0, (N, H))
                if tail_doc.numel():
                    dm0.index_add_(0, tail_doc, (q_t @ s_t).unflatten(0, (-1, H)))
        return dm0, dw, dq, da, db, None, None


def _pieces_matmul(x_h: Tensor, y_h: Tensor, x_t: Tensor, y_t: Tensor, H: int) -> Tensor:
    """[x_h @ y_h; x_t @ y_t] as [pieces, H, r, c], heads then tails, each written into its part
    of one tensor (torch.cat would allocate and copy a second one)."""
    out = x_h.new_empty(x_h.shape[0] + x_t.shape[0], x_h.shape[1], y_h.shape[2])
    torch.bmm(x_h, y_h, out=out[: x_h.shape[0]])
    torch.bmm(x_t, y_t, out=out[x_h.shape[0] :])
    return out.unflatten(0, (-1, H))


def _fresh(x: Tensor, w: Tensor | None) -> Tensor:
    """x * w (x when w is None) as a new tensor for the callers to update in place, contiguous so
    that flattening it for the batched matmuls is a view, not a copy."""
    return x.clone(memory_format=torch.contiguous_format) if w is None else (x * w).contiguous()


def _reduce_to(x: Tensor, y: Tensor, shape: torch.Size) -> Tensor:
    """(x * y) summed to ``shape`` ([N, H, K|1, D|1]) as batched dot products where it sums over a
    whole axis: the product itself would be one more N x H x K x D tensor."""
    if shape[-1] == 1 and shape[-2] != 1:
        return torch.einsum("nhkd,nhkd->nhk", x, y).unsqueeze(-1)
    if shape[-2] == 1 and shape[-1] != 1:
        return torch.einsum("nhkd,nhkd->nhd", x, y).unsqueeze(-2)
    return (x * y).sum_to_size(shape)


def _add_states_matmul(p: EOSProblem, docs: Documents, y: Tensor, final: bool) -> tuple[Tensor, Tensor | None]:
    """``add_states`` for K-vector e and s with a decay of the matmul kernel: the per-token terms
    are rank one, so the final states are sum_j a_j b_j^T per document and the initial states'
    share of y is q_t^T m0_n, batched matmuls over the documents cut into pieces (``_Pieces``,
    ``_DocumentStates``): O(T K D) multiply-adds in matmuls, O(T (K + D) + N K D) memory."""
    T, H, dtype = p.T, p.H, p.i.dtype
    if p.m0 is None and not final:
        return y, None
    pieces = _Pieces.of(docs, T, H)
    logs = [(x, *_gammas(x, docs, T)) if x is not None else None for x in _factor_logs(p)]

    def exp(n: int, diff) -> Tensor | None:  # exp of a within-document difference of factor n's Gamma
        return None if logs[n] is None else diff(*logs[n][1:]).to(dtype).exp()[0]

    def scaled(x: Tensor, n: int, diff) -> Tensor:
        factor = exp(n, diff)
        return x if factor is None else x * factor

    def from_start(gamma: Tensor, before: Tensor, last: Tensor) -> Tensor:  # [1, H, T, F]
        return gamma - before.index_select(2, docs.doc)

    def to_end(gamma: Tensor, before: Tensor, last: Tensor) -> Tensor:
        return last.index_select(2, docs.doc) - gamma

    e = p.e[0, ..., 0].expand(H, T, p.K)
    s = p.s[0, ..., 0].expand(H, T, p.K)
    q = a = b = w = None
    if p.m0 is not None:
        q = pieces.grid(scaled(s, 0, from_start))
        if final:
            # The decay over each whole document, [N, H, K, 1] and [N, H, 1, D].
            rows, cols = (exp(n, lambda gamma, before, last: (last - before).transpose(1, 2)) for n in (0, 1))
            rows, cols = (None if x is None else x.unsqueeze(u) for x, u in ((rows, -1), (cols, -2)))
            w = cols if rows is None else rows if cols is None else rows * cols
    if final:
        a, b = pieces.grid(scaled(e, 0, to_end)), pieces.grid(scaled(p.i[0], 1, to_end))
    share, m_T = _DocumentStates.apply(p.m0, w, q, a, b, pieces.tail_doc, docs.N)
    if share is not None:
        y = y + scaled(pieces.tokens(share), 1, from_start).unsqueeze(0)
    return y, m_T


def add_states(p: EOSProblem, docs: Documents, y: Tensor, final: bool) -> tuple[Tensor, Tensor | None]:
    """y_core + the initial states' share of y, and (when ``final``) every document's final
    state [N, H, K, D] (see the module docstring)."""
    if p.e_is_vector and p.s_is_vector and p.decay_kind not in ("full", "product"):
        return _add_states_matmul(p, docs, y, final)
    T, N, dtype = p.T, docs.N, p.i.dtype
    g = p.g_full
    if g is not None:
        gamma, before, last = _gammas(g, docs, T)

    m_T = None
    if p.m0 is not None:
        m0 = p.m0.index_select(0, docs.doc).transpose(0, 1).unsqueeze(0)  # [1, H, T, K, D]
        if g is not None:
            m0 = (gamma - before.index_select(2, docs.doc)).to(dtype).exp() * m0
        y = y + (p.s * m0).sum(-2)
        if final:
            m_T = p.m0 if g is None else (last - before).to(dtype).exp()[0].transpose(0, 1) * p.m0
    if final:
        terms = p.e * p.i.unsqueeze(-2)  # [1, H, T, K, D]: e_j i_j^T
        if g is not None:
            terms = (last.index_select(2, docs.doc) - gamma).to(dtype).exp() * terms
        terms = terms.expand(1, p.H, T, p.K, p.D)
        core = terms.new_zeros(1, p.H, N, p.K, p.D).index_add(2, docs.doc, terms)[0].transpose(0, 1)
        m_T = core if m_T is None else core + m_T
    return y, m_T
