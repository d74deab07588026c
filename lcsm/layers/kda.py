"""``kda``: Kimi Delta Attention (Kimi Linear, Moonshot AI 2025).

A gated delta-rule mixer on the DPLR operator with a per-channel decay: the shared body is in
``_gated_delta.py``; docs/zoo/gated_deltanet_kda.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._gated_delta import GatedDeltaBase, inverse_softplus_dt
from .base import EOSRow, no_weight_decay, register


@register("kda")
class KimiDeltaAttention(GatedDeltaBase):
    """Kimi Delta Attention, Kimi Team 2025 (Kimi Linear, arXiv:2510.26692), section 3; layer as
    fla's ``fla/layers/kda.py`` (the authors' code)::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x));  q, k L2-normalised per head
        beta_t  = sigmoid(W_b x)            (2 sigmoid(W_b x) with negative_eigenvalues)
        log alpha_t = -exp(A_log[h]) softplus(W_f2 W_f1 x + dt_bias)   [H, K]: one decay per key channel
        S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t K^-1/2
        y = o_proj(RMSNorm(o_t) * sigmoid(W_g2 W_g1 x + b_g))              (per head over D)

    eos_dplr with log_alpha = log alpha_t [B, T, H, K], a = e = beta k, b = alpha * k, i = v,
    s = q K^-1/2. The decay and output-gate projections are low rank, of rank D (fla's head_v_dim).

    Options (fla's defaults, widths relative to d_model: fla's 16 heads of 128 at d_model 2048 are
    key width 1 d_model):
        num_heads: H (4).
        expand_k: H K / d_model (1).
        expand_v: D / K (1).
        conv_size: W (4); conv_bias (False).
        negative_eigenvalues: beta in [0, 2] (fla's allow_neg_eigval).
        norm_eps: the output RMSNorm's eps (1e-5).

    Inits as fla: A ~ U(1, 16) per head stored as A_log = log A; dt_bias [H K] = softplus^-1 of
    dt ~ LogUniform[1e-3, 0.1] (floor 1e-4); projections and convolutions PyTorch's defaults.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        conv_size: int = 4,
        conv_bias: bool = False,
        negative_eigenvalues: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__(d_model, num_heads, expand_k, expand_v, conv_size, conv_bias, negative_eigenvalues, norm_eps)
        H, K, D = self.num_heads, self.head_k, self.head_v
        self.f_proj = nn.Sequential(nn.Linear(d_model, D, bias=False), nn.Linear(D, H * K, bias=False))
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(inverse_softplus_dt(H * K)))
        self.g_proj = nn.Sequential(nn.Linear(d_model, D, bias=False), nn.Linear(D, H * D, bias=True))
        no_weight_decay(self.g_proj[1].bias)

    def log_alpha(self, x):
        # In float32 at least (A_log, dt_bias are float32 parameters), as fla's gate computes it.
        f = self.f_proj(x)
        wide = torch.promote_types(f.dtype, torch.float32)
        return -torch.exp(self.A_log.to(wide)).unsqueeze(-1) * F.softplus(
            (f.to(wide) + self.dt_bias.to(wide)).unflatten(-1, (self.num_heads, self.head_k))
        )

    def _gate(self, x, o):
        return o * torch.sigmoid(self.g_proj(x).reshape(o.shape))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="KDA",
            input="v_t",
            expand="beta_t k_t",
            oscillation="(I_k - beta_t k_t k_t^T) Diag(alpha_t)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention Architecture "
            "(arXiv:2510.26692), section 3 (Kimi Delta Attention)",
        )
