"""LRU, the Linear Recurrent Unit (Orvieto et al. 2023, "Resurrecting Recurrent Neural Networks for
Long Sequences", ICML 2023, section 3 and appendix A) as a configuration of the EOS operator.

Per state index n (N complex states), input x_t in R^H (H = d_model)::

    lambda_n = exp(-exp(nu_n) + i exp(theta_n))                   stable exponential parameterisation
    h_t      = lambda ⊙ h_{t-1} + exp(gamma_log) ⊙ (B x_t)          B = B_re + i B_im  [N, H]
    y_t      = Re(C h_t) + D ⊙ x_t                                 C = C_re + i C_im  [H, N]

EOS mapping (field review b.1: "EOS, DI complex, K = 1"): the N diagonal modes are the D = N
columns of one head with K = 1 row, as in ``hgrn``: input gamma ⊙ B x_t (complex), e = s = 1, and
a learned, data-independent complex column decay log o = -exp(nu) + i exp(theta) [1, 1, N]. C and
the D skip act after the scan.

Source: the paper's appendix A listing (``init_lru_parameters``, ``forward_LRU``: JAX); no official
PyTorch code. Parameters and inits as there: u1, u2 ~ U[0, 1]; nu_log = log(-log(u1 (r_max^2 -
r_min^2) + r_min^2) / 2) (|lambda| uniform on the ring r_min <= |lambda| <= r_max in area),
theta_log = log(max_phase u2); B_re, B_im ~ N(0, 1 / (2 H)); C_re, C_im ~ N(0, 1 / N); D ~ N(0, 1);
gamma_log = log sqrt(1 - |lambda|^2) (the normalisation, a trained parameter as in the listing).

Departures: the ring defaults are r_min 0.9, r_max 0.999, max_phase 2 pi (the listing's function
defaults are r_min 0, r_max 1; the paper's experiments choose the ring per task); the layer is the
LRU alone (the paper's deep model wraps it in a norm, GLU MLP and residual, which are model-level
parts); 1 - |lambda|^2 at init is computed as -expm1(-2 exp(nu)) (no cancellation near |lambda| = 1).

Shape glossary: B batch, T time, H = d_model, N = d_state (complex modes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lcsm._checks import check_float, check_int

from ..ops import eos
from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor


@dataclass
class LRUState(State):
    """memory [B, 1, 1, N], complex: h_t in EOS layout [B, H, K, D] (one head, one row)."""

    memory: Tensor


@register("lru")
class LRU(Mixer):
    """Linear Recurrent Unit.

    Args:
        d_model: H, model width (input and output).
        d_state: N, number of complex modes (default 64).
        r_min, r_max: ring of the init, r_min <= |lambda| <= r_max (default 0.9, 0.999).
        max_phase: phases arg(lambda) initialised in [0, max_phase] (default 2 pi).
    """

    # The eigenvalue parameters sit in exponents (|lambda| = exp(-exp(nu_log)) near 1): rounded to
    # bfloat16, nu_log's 2^-8 relative step moves 1 - |lambda| by about 3% at nu_log = -7.
    float32_parameters = ("nu_log", "theta_log", "gamma_log")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        r_min: float = 0.9,
        r_max: float = 0.999,
        max_phase: float = 2 * math.pi,
    ):
        super().__init__(d_model)
        N = self.d_state = check_int("d_state", d_state, 1)
        self.r_min = check_float("r_min", r_min, 0, 1, high_open=True)
        self.r_max = check_float("r_max", r_max, 0, 1, low_open=True, high_open=True)
        if not self.r_min <= self.r_max:
            raise ValueError(f"r_min, r_max: expected r_min <= r_max, got {r_min!r} > {r_max!r}")
        self.max_phase = check_float("max_phase", max_phase, 0, low_open=True)
        H = d_model
        u1, u2 = torch.rand(N, dtype=torch.float64), torch.rand(N, dtype=torch.float64)
        nu_log = torch.log(-0.5 * torch.log(u1 * (self.r_max**2 - self.r_min**2) + self.r_min**2))
        theta_log = torch.log(self.max_phase * u2)
        gamma_log = 0.5 * torch.log(-torch.expm1(-2 * torch.exp(nu_log)))
        dtype = torch.get_default_dtype()
        # Eigenvalue parameters: the decay's rate and phase, not weights, so kept out of weight decay.
        self.nu_log = no_weight_decay(nn.Parameter(nu_log.to(dtype)))
        self.theta_log = no_weight_decay(nn.Parameter(theta_log.to(dtype)))
        self.gamma_log = no_weight_decay(nn.Parameter(gamma_log.to(dtype)))
        self.B_re = nn.Parameter(torch.randn(N, H) / math.sqrt(2 * H))
        self.B_im = nn.Parameter(torch.randn(N, H) / math.sqrt(2 * H))
        self.C_re = nn.Parameter(torch.randn(H, N) / math.sqrt(N))
        self.C_im = nn.Parameter(torch.randn(H, N) / math.sqrt(N))
        # The per-channel skip gain, undecayed like a norm's scale (as D in the SSMs, docs/zoo/ssm.md).
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))

    def forward(
        self,
        x: Tensor,
        state: LRUState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        # Projections in the layer's precision; half precisions run the recurrence in complex64
        # (there is no usable complex32).
        rdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        gamma = torch.exp(self.gamma_log.to(rdt))
        u = torch.complex((x @ self.B_re.t()).to(rdt), (x @ self.B_im.t()).to(rdt)) * gamma  # [B, T, N]
        log_o = torch.complex(-torch.exp(self.nu_log.to(rdt)), torch.exp(self.theta_log.to(rdt)))
        ones = gamma.new_ones(1, 1)
        h, memory = eos(
            u.unsqueeze(2),
            ones,
            ones,
            log_o[None, None, :],
            initial_state=state.memory if state is not None else None,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        h = h.squeeze(2)
        # Re(C h) = C_re Re(h) - C_im Im(h)
        out = h.real.to(x.dtype) @ self.C_re.t() - h.imag.to(x.dtype) @ self.C_im.t() + self.D * x
        if return_state:
            return out, LRUState(memory=memory)
        return out

    def init_state(self, batch_size: int) -> LRUState:
        return LRUState(
            memory=torch.zeros(
                batch_size, 1, 1, self.d_state, dtype=self._memory_dtype(True), device=self._param_like().device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="lru",
            input="gamma * (B x_t), B complex N x H, gamma = exp(gamma_log)",
            expand="1",
            oscillation="lambda = exp(-exp(nu) + i exp(theta)), diagonal complex",
            shrink="1, then y_t = Re(C h_t) + D x_t",
            memory=f"1 x 1 complex per mode, {self.d_state} modes",
            psi="elementwise",
            input_dd=False,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="Orvieto et al. 2023, Resurrecting Recurrent Neural Networks for Long Sequences "
            "(ICML 2023, arXiv:2303.06349), section 3, appendix A",
        )
