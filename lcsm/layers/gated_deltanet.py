"""``gated_deltanet`` (``gdn``): Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025).

A gated delta-rule mixer on the DPLR operator: the shared body is in ``_gated_delta.py``;
docs/zoo/gated_deltanet_kda.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._gated_delta import GatedDeltaBase, inverse_softplus_dt
from .base import EOSRow, no_weight_decay, register


@register("gated_deltanet", "gdn")
class GatedDeltaNet(GatedDeltaBase):
    """Gated DeltaNet, Yang, Kautz & Hatamizadeh 2025 (arXiv:2412.06464), eq. 10 and section 3.3;
    layer as fla's ``fla/layers/gated_deltanet.py`` (its official code, NVlabs/GatedDeltaNet,
    builds on the same layer)::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x));  q, k L2-normalised per head
        beta_t  = sigmoid(W_b x)            (2 sigmoid(W_b x) with negative_eigenvalues)
        alpha_t = exp(-exp(A_log) softplus(W_a x + dt_bias))              (one per head, Mamba-2's)
        S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t K^-1/2
        y = o_proj(RMSNorm(o_t) * SiLU(W_g x))                             (per head over D)

    eos_dplr with log_alpha = log alpha_t [B, T, H], a = e = beta k, b = alpha k, i = v, s = q K^-1/2.

    Options (fla's defaults, widths relative to d_model: fla's 6 heads of 256 at d_model 2048 are
    key width 0.75 d_model):
        num_heads: H (4).
        expand_k: H K / d_model (0.75).
        expand_v: D / K (2, fla's expand_v).
        conv_size: W (4); conv_bias (False).
        negative_eigenvalues: beta in [0, 2] (Grazzi et al. 2025; fla's allow_neg_eigval).
        norm_eps: the output RMSNorm's eps (1e-5).

    Inits as fla: A ~ U(0, 16) stored as A_log = log A; dt_bias = softplus^-1 of
    dt ~ LogUniform[1e-3, 0.1] (floor 1e-4); projections and convolutions PyTorch's defaults.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 0.75,
        expand_v: float = 2.0,
        conv_size: int = 4,
        conv_bias: bool = False,
        negative_eigenvalues: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__(d_model, num_heads, expand_k, expand_v, conv_size, conv_bias, negative_eigenvalues, norm_eps)
        H = self.num_heads
        self.a_proj = nn.Linear(d_model, H, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(H).uniform_(0, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(inverse_softplus_dt(H)))
        self.g_proj = nn.Linear(d_model, H * self.head_v, bias=False)

    def log_alpha(self, x):
        # In float32 at least (A_log, dt_bias are float32 parameters), as fla's gate computes it.
        a = self.a_proj(x)
        wide = torch.promote_types(a.dtype, torch.float32)
        return -torch.exp(self.A_log.to(wide)) * F.softplus(a.to(wide) + self.dt_bias.to(wide))

    def _gate(self, x, o):
        return o * F.silu(self.g_proj(x).reshape(o.shape))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="Gated DeltaNet",
            input="v_t",
            expand="beta_t k_t",
            oscillation="alpha_t (I_k - beta_t k_t k_t^T)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Yang, Kautz & Hatamizadeh 2025, Gated Delta Networks: Improving Mamba2 with Delta Rule "
            "(ICLR 2025, arXiv:2412.06464), eq. 10",
        )
