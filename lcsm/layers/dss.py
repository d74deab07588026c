"""``dss``: DSS-softmax (Gupta, Gu & Berant 2022), diagonal SSMs with a softmax-normalised kernel.

A linear time-invariant state-space mixer: the family's shared pieces and shape glossary are in
``_ssm.py``, the HiPPO matrices in ``_hippo.py``; docs/zoo/ssm.md.

Packed sequences (``cu_seqlens``): the FFT form once on the documents as padded rows
(``_ssm.PaddedDocuments``; the cost of N rows of the longest document, twice with final states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_float, check_int
from lcsm.ops import MODES

from ._hippo import hippo_skew_pos_imag
from ._ssm import DiagonalSISO, SSMState, as_complex, check_dt, complex_param, log_dt_init, param_dtype
from .base import EOSRow, no_weight_decay, register

Tensor = torch.Tensor


@register("dss")
class DSS(DiagonalSISO):
    """DSS-softmax (Gupta, Gu & Berant 2022, "Diagonal State Spaces are as Effective as Structured
    State Spaces", section 3, Proposition 1(b)): per channel h, with P_{n,j} = Delta Lambda_n j,

        K_j = Re( sum_n W_n / Lambda_n * softmax_j(P_n)_j ),   softmax over j = 0 .. L-1,

    i.e. K_j = Re sum_n W_n / (Lambda_n Z_n) exp(j Delta Lambda_n), Z_n = sum_{j<L} exp(j Delta Lambda_n)
    = (exp(L Delta Lambda_n) - 1) / (exp(Delta Lambda_n) - 1). Lambda [N] is shared by the channels;
    W [H, N] and Delta [H] are per channel; Delta has separate real and imaginary parts (the official
    ``sep_dt_re_im``: Delta Lambda = Delta_re Re Lambda + i Delta_im Im Lambda).

    EOS mapping (H = d_model heads, K = N complex modes, D = 1): i = u_t, e = 1 / (Lambda Z) [H, N],
    log_o = Delta Lambda [H, N, 1], s = W [H, N]; y = Re(EOS output) + D u (no factor 2: DSS keeps
    all N modes, as the official code). Positive Re Lambda is allowed (the softmax keeps the kernel
    bounded); for those modes the official code's shift exp(-(L-1) Delta Lambda) is folded into e.
    Departure: the official code computes that shift under ``no_grad``, so its gradient for such
    modes is not the kernel's; ours differentiates it (the same forward, the kernel's own gradient).

    Departure: the official kernel normalises the softmax over the current input length L, which
    makes the layer's output at time t depend on how long the whole input is: not causal across
    calls and with no recurrent form. We normalise over a fixed ``l_max`` (the paper's L, the
    training length), which makes DSS a true time-invariant SSM: causal, streamable, and identical
    to the official kernel whenever the input length equals l_max.

    Init (official): Lambda = the N eigenvalues with positive imaginary part of the skew-symmetric
    part of HiPPO-LegS of size 2N, minus 1/2 ("hippo_skew_pos_imag"); W ~ complex normal with
    N(0, 1) real and imaginary parts; D ~ N(0, 1); log Delta ~ U[log dt_min, log dt_max] (tiled over
    the re/im pair). ``epsilon`` is the official guard in 1 / (Lambda (exp(L Delta Lambda) - 1)),
    computed as conj(x) / (|x|^2 + epsilon). Output: GELU -> Linear(H, H) (the official default
    output_linear with no post-activation).

    Args:
        d_model: channels H.
        d_state: N complex modes per channel (default 64, the paper's).
        l_max: the softmax normalisation length L (default 1024).
        dt_min, dt_max: range of the log-uniform Delta init.
        epsilon: the reciprocal's guard (official 1e-7; 0 gives the exact formula).
        mode: the ``lcsm.ops.eos`` mode.
    """

    real_factor = 1.0
    float32_parameters = ("Lambda", "log_dt", "W")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        l_max: int = 1024,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        epsilon: float = 1e-7,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = self.modes = check_int("d_state", d_state, 1)
        self.l_max = check_int("l_max", l_max, 1)
        dt_min, dt_max = check_dt(dt_min, dt_max)
        self.epsilon = check_float("epsilon", epsilon, 0)
        self.mode = check_choice("mode", mode, MODES)
        H, N = d_model, d_state
        Lam = hippo_skew_pos_imag(N)
        self.Lambda = no_weight_decay(complex_param(Lam))
        log_dt = log_dt_init(H, dt_min, dt_max).unsqueeze(-1).repeat(1, 2)  # [H, (re, im)]
        self.log_dt = no_weight_decay(nn.Parameter(log_dt.to(param_dtype())))
        self.W = no_weight_decay(nn.Parameter(torch.randn(H, N, 2)))  # official: wd 0 on W
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, H)

    def dt_lambda(self) -> Tensor:
        """Delta Lambda [H, N] with separate steps for the real and imaginary parts."""
        return as_complex(self.log_dt.exp().unsqueeze(1) * self.Lambda.unsqueeze(0))

    def eos_parameters(self):
        Lam = as_complex(self.Lambda)
        x = self.dt_lambda()
        L = self.l_max
        positive = Lam.real > 0
        # Official "fast softmax": for Re Lambda > 0 evaluate 1/Z with -x (no overflow of exp(L x))
        # and shift the powers by exp(-(L-1) x), which we fold into e.
        xs = torch.where(positive, -x, x)
        num = torch.expm1(xs)
        den = torch.expm1(L * xs) * Lam
        inv = den.conj() / (den.real**2 + den.imag**2 + self.epsilon)
        # exp only of the positive modes' x: a stable mode's exp(-(L-1) x) overflows, and the
        # where's backward would then give 0 * inf = NaN for Lambda and log_dt
        shift = torch.where(positive, (-(L - 1) * torch.where(positive, x, 0)).exp(), torch.ones_like(x))
        e = num * inv * shift
        return e, as_complex(self.W), x.unsqueeze(-1)

    def forward(
        self,
        x: Tensor,
        state: SSMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        y, m = self._run(x, state, return_state, cu_seqlens)
        y = self.output_linear(F.gelu(y))
        return (y, SSMState(memory=m)) if return_state else y

    def describe(self) -> EOSRow:
        return EOSRow(
            name="DSS-softmax",
            input="u_t",
            expand=f"1 / (Lambda Z), Z = sum_(j<{self.l_max}) exp(j Delta Lambda) (softmax normaliser)",
            oscillation="exp(Delta Lambda) (Lambda shared by channels, Delta per channel): a 1_k^T",
            shrink="W, Re(.) kept",
            memory=f"K x D = {self.d_state} x 1 complex per channel, {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="DSS (Gupta et al., 2022), section 3 Prop. 1 (DSS-softmax); LCSM Table 1 row DSS",
        )
