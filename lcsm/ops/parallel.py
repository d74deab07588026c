"""Parallel (attention-map) form of the EOS operator, O(T^2): MetaLA eq. 16-18 / LCSM eq. 14.

Unrolling the recurrence gives, with Gamma_t = sum_{j<=t} g_j (log of the cumulative oscillation)::

    y_t = sum_{s<=t} sum_k s_t[k] * exp(Gamma_t - Gamma_s)[k, :] * e_s[k] * i_s
          + sum_k s_t[k] * exp(Gamma_t)[k, :] * m_0[k, :]

When e and s are K-vectors and the decay does not vary over D this is a masked attention map
A[t, s] = sum_k s_t[k] e_s[k] exp(Gamma_t - Gamma_s)[k] followed by y = A i; otherwise the map
carries a D axis (A[t, s, d]). The exponent is masked *before* exp so that s > t never overflows.
"""

from __future__ import annotations

import torch

from ._inputs import EOSProblem, finite_log, log_zero, real_dtype


def _cumulative_log(g: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gamma [B|1, H, T, K|1, D|1] of a log decay g [B|1, H, T|1, K|1, D|1] over the whole
    sequence, accumulated in double precision: differences of long
    float32 cumulative sums would lose the small exponents between nearby steps. And for a
    data-dependent g the run of each step [B|1, H, T, 1, 1]: the number of resets (steps whose
    every log is at ``LOG_ZERO``, a decay of exactly 0: a packed document's first token) up to it.
    A reset's log counts as 0 in Gamma and the pairs across it are masked out, which is exact;
    summed through it, Gamma's differences after it would carry the rounding of |LOG_ZERO|."""
    wide = torch.complex128 if g.is_complex() else torch.float64
    if g.shape[2] == 1:
        steps = torch.arange(1, T + 1, device=g.device, dtype=torch.float64)
        return g.to(wide) * steps.view(1, 1, T, 1, 1), None
    reset = (g.real <= log_zero(real_dtype(g.dtype))).flatten(3).all(-1)[..., None, None]
    return g.to(wide).masked_fill(reset, 0).cumsum(2), reset.cumsum(2)


def eos_parallel(p: EOSProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, H, T, D] and the final memory [B, H, K, D] from the masked O(T^2) map."""
    B, H, T, K, D = p.B, p.H, p.T, p.K, p.D
    dtype = p.i.dtype
    causal = torch.ones(T, T, dtype=torch.bool, device=p.i.device).tril()
    e, s = p.e, p.s
    g = p.g_full  # a separable pair as its K x D sum: this form is the plain twin
    if g is not None:
        g = finite_log(g)  # o = 0 (log_o = -inf) would make Gamma_t - Gamma_s = -inf - (-inf)
    if g is None:
        gamma = None
        w = causal.to(dtype).view(1, 1, T, T, 1, 1)
    else:
        gamma, run = _cumulative_log(g, T)  # [B|1, H, T, Kg, Dg]
        diff = gamma.unsqueeze(3) - gamma.unsqueeze(2)  # [.., t, s, Kg, Dg]
        # The own step's weight exp(Gamma_t - Gamma_t) is 1 whatever the decay: a constant. Through
        # the difference it would send +G and -G into Gamma_t's gradient, O(1) terms that cancel
        # to the O(decay) true one only after rounding (dlog_o wholly lost at log_o = -50).
        diagonal = torch.eye(T, dtype=torch.bool, device=p.i.device).view(1, 1, T, T, 1, 1)
        mask = causal.view(1, 1, T, T, 1, 1) & ~diagonal
        if run is not None:
            mask = mask & (run.unsqueeze(3) == run.unsqueeze(2))
        w = torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device)).exp()
        w = torch.where(mask, w, diagonal.to(w.dtype)).to(dtype)
    if p.e_is_vector and p.s_is_vector and w.shape[-1] == 1:
        # A[t, s] = sum_k s_t[k] e_s[k] w[t, s, k]
        a = (s[..., 0].unsqueeze(3) * e[..., 0].unsqueeze(2) * w[..., 0]).sum(-1)
        y = a @ p.i
    else:
        a = (s.unsqueeze(3) * e.unsqueeze(2) * w).sum(-2)  # [.., t, s, D]
        y = (a * p.i.unsqueeze(2)).sum(3)
    if g is None:
        decay_to_end = torch.ones((), dtype=dtype, device=p.i.device)
        from_start = decay_to_end
    else:
        # exp(Gamma_T - Gamma_s); at s = T a constant 1, as the diagonal above
        to_end = torch.cat([gamma[:, :, -1:] - gamma[:, :, :-1], torch.zeros_like(gamma[:, :, -1:])], 2)
        decay_to_end = to_end.exp().to(dtype)
        from_start = gamma.exp().to(dtype)  # exp(Gamma_t)
        if run is not None:
            decay_to_end = decay_to_end * (run == run[:, :, -1:])
            from_start = from_start * (run == 0)
    m_T = (decay_to_end * e * p.i.unsqueeze(-2)).sum(2).expand(B, H, K, D)
    if p.m0 is not None:
        y = y + (s * from_start * p.m0.unsqueeze(2)).sum(-2)
        last = from_start[:, :, -1] if g is not None else from_start
        m_T = m_T + last * p.m0
    return y, m_T
