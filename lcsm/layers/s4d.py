"""``s4d``: S4D (Gu, Gupta, Goel & Re 2022), diagonal SISO SSMs, ZOH.

A linear time-invariant state-space mixer: the family's shared pieces and shape glossary are in
``_ssm.py``, the HiPPO matrices in ``_hippo.py``; docs/zoo/ssm.md.

Packed sequences (``cu_seqlens``): the FFT form once on the documents as padded rows
(``_ssm.PaddedDocuments``; the cost of N rows of the longest document, twice with final states).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lcsm._checks import check_choice
from lcsm.ops import MODES

from ._ssm import (
    DiagonalSISO,
    SSMState,
    as_complex,
    check_dt,
    check_even,
    complex_param,
    gelu_glu,
    log_dt_init,
    param_dtype,
)
from .base import EOSRow, no_weight_decay, register

Tensor = torch.Tensor


S4D_INITS = ("lin", "inv", "real")


@register("s4d")
class S4D(DiagonalSISO):
    """S4D (Gu, Gupta, Goel & Re 2022, "On the Parameterization and Initialization of Diagonal
    State Space Models"): a bank of d_model SISO diagonal SSMs, ZOH discretisation (section 3.1):

        A_bar = exp(Delta A),   B_bar = (exp(Delta A) - 1) / A * B,   K_j = 2 Re sum_n C_n A_bar_n^j B_bar_n

    EOS mapping (one head per channel, H = d_model, K = N/2 complex modes, D = 1):
    i = u_t, e = B_bar [H, K], log_o = Delta A [H, K, 1] (complex), s = C [H, K];
    y = 2 Re(EOS output) + D u (one mode per conjugate pair, as the official ``s4d.py``).

    Init (section 4): A = -1/2 + i pi n ("lin", S4D-Lin, default, the official standalone's init),
    -1/2 + i (N/pi)(N/(2n+1) - 1) ("inv", S4D-Inv) or -(n+1) ("real", S4D-Real); B = 1;
    C ~ complex normal (variance 1); D ~ N(0, 1); log Delta ~ U[log dt_min, log dt_max].
    Re A is stored as log(-Re A) so it stays negative (official). Output: GELU -> Linear(H, 2H) -> GLU.

    Args:
        d_model: channels H.
        d_state: N (even); N/2 complex modes per channel. Default 64 (the paper's N).
        init: "lin", "inv" or "real".
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: the ``lcsm.ops.eos`` mode ("auto" picks fft for T > 1, recurrent for T = 1).
    """

    revision = 2  # 2: B without weight decay

    float32_parameters = ("log_dt", "log_A_real", "A_imag", "B", "C")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        init: str = "lin",
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = check_even("d_state", d_state)
        self.modes = d_state // 2
        if init not in S4D_INITS:
            raise ValueError(f"init: expected one of {', '.join(S4D_INITS)}, got {init!r}")
        self.init = init
        dt_min, dt_max = check_dt(dt_min, dt_max)
        self.mode = check_choice("mode", mode, MODES)
        H, N, N2 = d_model, d_state, d_state // 2
        n = torch.arange(N2, dtype=torch.float64).expand(H, N2)
        if init == "lin":
            re, im = torch.full_like(n, 0.5), math.pi * n
        elif init == "inv":
            re, im = torch.full_like(n, 0.5), (N / math.pi) * (N / (2 * n + 1) - 1)
        else:
            re, im = n + 1, torch.zeros_like(n)
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(H, dt_min, dt_max).to(param_dtype())))
        self.log_A_real = no_weight_decay(nn.Parameter(re.log().to(param_dtype()).contiguous()))
        self.A_imag = no_weight_decay(nn.Parameter(im.to(param_dtype()).contiguous()))
        # No weight decay on B, as on A and Delta: the official S4D kernel (state-spaces/s4
        # models/s4/s4.py, SSMKernelDiag.register_params) registers B with wd_dict["B"] = 0.0; C decays.
        self.B = no_weight_decay(complex_param(torch.ones(H, N2, dtype=torch.complex128)))
        self.C = complex_param(torch.randn(H, N2, dtype=torch.complex128))
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, 2 * H)

    def A(self) -> Tensor:
        """Continuous A [H, N/2] (complex, Re < 0)."""
        return torch.complex(-self.log_A_real.exp(), self.A_imag)

    def eos_parameters(self):
        A = self.A()
        dtA = self.log_dt.exp().unsqueeze(-1) * A
        B_bar = as_complex(self.B) * torch.expm1(dtA) / A  # ZOH
        return B_bar, as_complex(self.C), dtA.unsqueeze(-1)

    def forward(
        self,
        x: Tensor,
        state: SSMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        y, m = self._run(x, state, return_state, cu_seqlens)
        y = gelu_glu(y, self.output_linear)
        return (y, SSMState(memory=m)) if return_state else y

    def describe(self) -> EOSRow:
        return EOSRow(
            name=f"S4D-{self.init.capitalize()}",
            input="u_t",
            expand="B_bar = (exp(Delta A) - 1) / A * B (ZOH)",
            oscillation="A_bar = exp(Delta A), diagonal complex (one mode per conjugate pair)",
            shrink="C, 2 Re(.) kept",
            memory=f"K x D = {self.d_state // 2} x 1 complex per channel, {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="S4D (Gu et al., 2022), section 3-4; LCSM Table 1 row S4 with a diagonal A (eq. 9)",
        )
