"""``s5``: S5 (Smith, Warrington & Linderman 2023), one MIMO diagonal SSM.

A linear time-invariant state-space mixer: the family's shared pieces and shape glossary are in
``_ssm.py``, the HiPPO matrices in ``_hippo.py``; docs/zoo/ssm.md.

Packed sequences (``cu_seqlens``): the FFT form once on the documents as padded rows
(``_ssm.PaddedDocuments``; the cost of N rows of the longest document, twice with final states).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_int
from lcsm.ops import MODES

from ._hippo import hippo_normal_eig
from ._ssm import (
    SSMState,
    as_complex,
    check_dt,
    check_even,
    complex_param,
    log_dt_init,
    param_dtype,
    time_invariant_eos,
)
from .base import EOSRow, Mixer, no_weight_decay, register

Tensor = torch.Tensor


def _lecun_trunc_normal(shape, fan_in: int) -> Tensor:
    """JAX's lecun_normal: truncated normal on [-2, 2] std units, rescaled to variance 1/fan_in."""
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(torch.empty(shape, dtype=torch.float64), std=std, a=-2 * std, b=2 * std)


@register("s5")
class S5(Mixer):
    """S5 (Smith, Warrington & Linderman 2023, "Simplified State Space Layers for Sequence
    Modeling"): one MIMO SSM with a complex diagonal state matrix, ZOH discretisation (section 3):

        x_t = Lambda_bar x_{t-1} + B_bar u_t,   y_t = 2 Re(C~ x_t) + D u_t,
        Lambda_bar = exp(Lambda Delta),   B_bar = (Lambda_bar - 1) / Lambda * B~   (Delta per state).

    EOS mapping: MIMO B_bar u_t mixes channels, which the EOS expand (an outer product e_t i_t^T)
    cannot; so the input state is the linear projection i_t = B_bar u_t [P/2] (LCSM: "u_t from x_t
    through linear projection"), with H = 1, K = 1, D = P/2, e = s = 1 and log_o = Lambda Delta
    as a column oscillation [1, 1, P/2]. The EOS memory is then exactly the S5 state x_t and the
    output projection C~ follows the shrink. One mode per conjugate pair and 2 Re(.) (official
    ``conj_sym=True``).

    Init (section 4.1 and the official code): Lambda, V from HiPPO-N, the diagonalised normal part
    of HiPPO-LegS, for each of ``blocks`` blocks of size P/blocks (block-diagonal V);
    B~ = V^-1 B with B lecun-normal [P, H]; C~ = C V with C's real and imaginary parts lecun-normal
    [H, P] ("trunc_standard_normal"); D ~ N(0, 1); log Delta [P/2] ~ U[log dt_min, log dt_max].
    Output ("half_glu1", the official default activation): g = GELU(y), g * sigmoid(Linear(g)), with
    flax's ``nn.gelu`` as the official ``s5/layers.py`` (SequenceLayer) calls it: its default is the
    tanh approximation (``approximate=True``), which differs from the exact GELU by up to 4.7e-4.

    Args:
        d_model: channels H.
        d_state: P, the (real) state size; P/2 complex modes are kept. Default 64.
        blocks: J, number of HiPPO-N blocks of the init (P/J must be even).
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: the ``lcsm.ops.eos`` mode.
    """

    revision = 2  # 2: the tanh GELU of flax

    float32_parameters = ("Lambda_re", "Lambda_im", "log_dt", "B", "C")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        blocks: int = 1,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = check_even("d_state", d_state)
        self.blocks = check_int("blocks", blocks, 1)
        if d_state % blocks or (d_state // blocks) % 2:
            raise ValueError(
                f"blocks: d_state / blocks must be an even integer, got d_state={d_state}, blocks={blocks!r}"
            )
        dt_min, dt_max = check_dt(dt_min, dt_max)
        self.mode = check_choice("mode", mode, MODES)
        H, P = d_model, d_state
        size = P // blocks
        Lam, V = hippo_normal_eig(size)
        Lam, V = Lam[: size // 2], V[:, : size // 2]
        Lam = Lam.repeat(blocks)  # [P/2]
        V = torch.block_diag(*([V] * blocks))  # [P, P/2]
        B = _lecun_trunc_normal((P, H), fan_in=P).to(torch.complex128)
        C = torch.complex(_lecun_trunc_normal((H, P), fan_in=P), _lecun_trunc_normal((H, P), fan_in=P))
        self.Lambda_re = no_weight_decay(nn.Parameter(Lam.real.to(param_dtype()).contiguous()))
        self.Lambda_im = no_weight_decay(nn.Parameter(Lam.imag.to(param_dtype()).contiguous()))
        self.B = no_weight_decay(complex_param(V.conj().t() @ B))  # [P/2, H]
        self.C = complex_param(C @ V)  # [H, P/2]
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(P // 2, dt_min, dt_max).to(param_dtype())))
        self.out2 = nn.Linear(H, H)

    def discretize(self) -> tuple[Tensor, Tensor]:
        """ZOH: (Lambda Delta [P/2] complex, B_bar [P/2, H] complex)."""
        Lam = torch.complex(self.Lambda_re, self.Lambda_im)
        dtL = Lam * self.log_dt.exp()
        return dtL, (torch.expm1(dtL) / Lam).unsqueeze(-1) * as_complex(self.B)

    def ssm(
        self,
        u: Tensor,
        memory: Tensor | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """u [B, T, H] -> (2 Re(C~ x_t) + D u_t [B, T, H], state memory [B, 1, 1, P/2] or None;
        [N, 1, 1, P/2], one row per document, with ``cu_seqlens``)."""
        dtL, B_bar = self.discretize()
        i = torch.einsum("bth,ph->btp", u.to(B_bar.dtype), B_bar).unsqueeze(2)  # [B, T, 1, P/2]
        ones = torch.ones(1, 1, dtype=u.dtype, device=u.device)
        x, m = time_invariant_eos(
            i,
            ones,
            ones,
            dtL.view(1, 1, -1),
            mode=self.mode,
            initial_state=memory,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        y = 2 * torch.einsum("btp,hp->bth", x.squeeze(2), as_complex(self.C)).real
        return (y + self.D * u).to(u.dtype), m

    def forward(
        self,
        x: Tensor,
        state: SSMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        memory = state.memory if state is not None else None
        y, m = self.ssm(x, memory, return_state, cu_seqlens)
        g = F.gelu(y, approximate="tanh")  # flax nn.gelu's default (the official s5/layers.py)
        y = g * torch.sigmoid(self.out2(g))
        return (y, SSMState(memory=m)) if return_state else y

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, 1, 1, self.d_state // 2, dtype=self._memory_dtype(True), device=self.Lambda_re.device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="S5",
            input="B_bar u_t (MIMO projection, P/2 complex)",
            expand="1 (B_bar moved into the input projection)",
            oscillation="Lambda_bar = exp(Lambda Delta), diagonal complex (HiPPO-N init)",
            shrink="1, then y_t = 2 Re(C~ m_t) + D u_t",
            memory=f"K x D = 1 x {self.d_state // 2} complex (the MIMO state)",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="S5 (Smith et al., 2023), section 3-4; LCSM Table 1 row S5 with a diagonal A (eq. 9)",
        )
