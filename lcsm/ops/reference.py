"""The recurrent reference of the EOS operator: the definition, one step at a time.

LCSM eq. 2-3 with psi = elementwise (eq. 6)::

    m_t = exp(g_t) * m_{t-1} + e_t (x) i_t          [K, D]
    y_t = sum_k s_t[k, :] * m_t[k, :]                [D]

This is the slow, obviously correct twin every other mode is tested against; a separable
oscillation (a pair of log factors) is applied as its materialised K x D sum. The time loop uses
``unbind``/``stack`` rather than slicing ``x[:, t]``: slicing inside the loop makes autograd write
a full-size gradient per step, i.e. an O(T^2) backward (as flash-linear-attention's
``naive_recurrent_gla``, fla/ops/gla/naive.py in https://github.com/fla-org/flash-linear-attention,
slices per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._inputs import EOSProblem


def _steps(x: torch.Tensor, T: int) -> Sequence[torch.Tensor]:
    """Per-step views of a canonical [B|1, H, T|1, ...] tensor; data-independent ones repeat."""
    if x.shape[2] == 1:
        return [x[:, :, 0]] * T
    return x.unbind(2)


def eos_recurrent(p: EOSProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y [B, H, T, D] and the final memory [B, H, K, D]."""
    m = p.m0 if p.m0 is not None else p.i.new_zeros(p.B, p.H, p.K, p.D)
    es, ss = _steps(p.e, p.T), _steps(p.s, p.T)
    g = p.g_full
    os = _steps(g.exp(), p.T) if g is not None else [None] * p.T
    ys = []
    for i_t, e_t, s_t, o_t in zip(p.i.unbind(2), es, ss, os, strict=False):
        y_t, m = eos_step_state(i_t, e_t, s_t, o_t, m)
        ys.append(y_t)
    y = torch.stack(ys, 2) if ys else p.i.new_zeros(p.B, p.H, 0, p.D)
    return y, m


def eos_step_state(
    i_t: torch.Tensor, e_t: torch.Tensor, s_t: torch.Tensor, o_t: torch.Tensor | None, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step on canonical per-step tensors (no time dim): i_t [B, H, D], e_t and s_t
    [B|1, H, K, D|1], o_t [B|1, H, K|1, D|1] or None, m [B, H, K, D] -> (y_t [B, H, D], the new
    memory [B, H, K, D]); O(K * D) work."""
    m = (m if o_t is None else o_t * m) + e_t * i_t.unsqueeze(-2)
    return (s_t * m).sum(-2), m
