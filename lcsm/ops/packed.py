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
with m_{t-1} = 0. ``y_init`` (the initial states' share of the output, read through each
document's own cumulative decay) and every final state m_n^core = sum_j exp(Gamma_end - Gamma_j)
e_j i_j^T are closed forms on the within-document cumulative logs: autograd gives their
gradients, those of the initial states and the unmasked decay at the first tokens among them.
They are paid only when initial states are given or final states asked for (the kernels do not
return the memory at arbitrary positions). For K-vector e and s with a decay of the matmul kernel
each token's term is rank one and they are batched matmuls over the documents cut into pieces,
O(T K D) multiply-adds and O(T (K + D) + N K D) memory; otherwise (the elementwise kernel's
problems, themselves O(T K D)) they form one [T, K, D] tensor each.
"""

from __future__ import annotations

import dataclasses

import torch

from ._inputs import LOG_ZERO, EOSProblem, finite_log
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
    real = p.i.dtype.to_real()
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
    gamma0 = torch.cat([torch.zeros_like(gamma[:, :, :1]), gamma], 2)  # gamma0[t] = Gamma before t
    return gamma, gamma0.index_select(2, docs.starts), gamma0.index_select(2, docs.ends)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Token ranges (the documents, or parts of them) cut into pieces of at most P = ceil(total / n)
    tokens for n ranges: at most 2n pieces (n + total/P), so a [pieces, P] grid holds at most twice
    the ranges' tokens however uneven they are. ``index`` [pieces * P] the token of each slot
    (``size``, one past the row, for padding), ``doc`` [pieces] each piece's range, ``valid``
    [pieces * P] the slots that hold a token (in token order)."""

    index: Tensor
    doc: Tensor
    valid: Tensor
    P: int

    @staticmethod
    def of(docs: Documents, T: int) -> Pieces:
        return Pieces.of_ranges(docs.starts, docs.ends, T)

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

    def grid(self, x: Tensor) -> Tensor:
        """x [H, T, F] -> [H, pieces, P, F], zeros in the padding."""
        x = torch.cat([x, x.new_zeros(x.shape[0], 1, x.shape[2])], 1)
        return x.index_select(1, self.index).unflatten(1, (self.doc.numel(), self.P))


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


def _add_states_matmul(p: EOSProblem, docs: Documents, y: Tensor, final: bool) -> tuple[Tensor, Tensor | None]:
    """``add_states`` for K-vector e and s with a decay of the matmul kernel: the per-token terms
    are rank one, so the final states are sum_j a_j b_j^T per document and the initial states'
    share of y is q_t^T m0_n, batched matmuls over the documents cut into pieces (``Pieces``):
    O(T K D) multiply-adds in matmuls, O(T (K + D) + N K D) memory."""
    T, N, H, dtype = p.T, docs.N, p.H, p.i.dtype
    pieces = Pieces.of(docs, T)
    logs = [(x, *_gammas(x, docs, T)) if x is not None else None for x in _factor_logs(p)]

    def exp(n: int, diff) -> Tensor | float:  # exp of a within-document difference of factor n's Gamma
        return 1.0 if logs[n] is None else diff(*logs[n][1:]).to(dtype).exp()[0]

    def from_start(n: int) -> Tensor | float:  # exp(Gamma_t - Gamma before t's document), [H, T, F]
        return exp(n, lambda gamma, before, last: gamma - before.index_select(2, docs.doc))

    def to_end(n: int) -> Tensor | float:  # exp(Gamma at the end of t's document - Gamma_t), [H, T, F]
        return exp(n, lambda gamma, before, last: last.index_select(2, docs.doc) - gamma)

    e = p.e[0, ..., 0].expand(H, T, p.K)
    s = p.s[0, ..., 0].expand(H, T, p.K)
    i = p.i[0]
    m_T = None
    if p.m0 is not None:
        m0 = p.m0.index_select(0, pieces.doc).transpose(0, 1)  # [H, pieces, K, D]
        share = pieces.grid(s * from_start(0)) @ m0  # [H, pieces, P, D]
        y = y + share.flatten(1, 2)[:, pieces.valid].unsqueeze(0) * from_start(1)
        if final:
            # The decay over each whole document, [N, H, K|1, 1] and [N, H, 1, D|1].
            rows, cols = (exp(n, lambda gamma, before, last: last - before) for n in (0, 1))
            m_T = p.m0 * (rows if logs[0] is None else rows.transpose(0, 1).unsqueeze(-1))
            m_T = m_T * (cols if logs[1] is None else cols.transpose(0, 1).unsqueeze(-2))
    if final:
        a, b = pieces.grid(e * to_end(0)), pieces.grid(i * to_end(1))
        sums = a.transpose(-1, -2) @ b  # [H, pieces, K, D]
        core = sums.new_zeros(H, N, p.K, p.D).index_add(1, pieces.doc, sums).transpose(0, 1)
        m_T = core if m_T is None else core + m_T
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
