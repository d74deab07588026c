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
They form one [T, K, D] tensor each (one term a token), so they cost O(T K D) time and memory,
only when initial states are given or final states asked for; the kernels do not return the
memory at arbitrary positions.
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


def add_states(p: EOSProblem, docs: Documents, y: Tensor, final: bool) -> tuple[Tensor, Tensor | None]:
    """y_core + the initial states' share of y, and (when ``final``) every document's final
    state [N, H, K, D] (see the module docstring)."""
    T, N, dtype = p.T, docs.N, p.i.dtype
    g = p.g_full
    if g is not None:
        # Within-document cumulative logs, summed in double precision as every Gamma of lcsm is
        # (parallel.py); exponents are differences t >= j, so nothing overflows.
        g = finite_log(g).expand(*g.shape[:2], T, *g.shape[3:])
        gamma = g.to(torch.complex128 if g.is_complex() else torch.float64).cumsum(2)
        gamma0 = torch.cat([torch.zeros_like(gamma[:, :, :1]), gamma], 2)  # gamma0[t] = Gamma before t
        before = gamma0.index_select(2, docs.starts)  # [1, H, N, Kg, Dg]
        last = gamma0.index_select(2, docs.ends)

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
