"""``gla`` (``gateloop``): gated linear attention (Yang et al. 2023, GLA).

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_float, check_int

from ._qkv import QKVAttention, head_norm, head_width
from .base import EOSRow, no_weight_decay, register


@register("gla", "gateloop")
class GLA(QKVAttention):
    """Gated linear attention, Yang et al. 2023 (GLA), section 4 (the gated recurrence and the GLA
    Transformer layer); official code fla ``GatedLinearAttention``; LCSM Table 1 row "GLA/GateLoop".

    Computation, in order::

        q = q_proj(x) * K^-1/2, k = k_proj(x), v = v_proj(x)           (no biases)
        log alpha_t = logsigmoid(gk_proj(x)) / tau,  gk_proj = Linear(d, 16) -> Linear(16, H K, bias)
        m_t = diag(alpha_t) m_{t-1} + k_t v_t^T,  y_t = m_t^T q_t       (log_o [B, T, H, K, 1])
        y = norm_h(y) * norm_weight       (per head over D; "layernorm" paper, "rmsnorm" fla)
        out = o_proj(swish(g_proj(x)) * y)     (g_proj with bias: the paper's r_t = Swish(x W_r + b_r))

    alpha_t = sigmoid(x W_1 W_2 + b)^(1/tau) with tau = 16 (the paper's low-rank decay, rank 16),
    computed in log space. The query scale K^-1/2 is that of the authors' kernels (fla).
    The alias ``gateloop`` builds this layer; GateLoop's own complex data-dependent decay is not
    reproduced (see docs/zoo/linear_attention.md).

    Options:
        num_heads: H (4 in the paper).
        expand_k, expand_v: key / value widths relative to d_model (paper: 0.5 and 1).
        gate_low_rank_dim: rank of the decay projection (16).
        gate_logit_normalizer: tau (16).
        norm: "layernorm" (paper) or "rmsnorm" (fla).
        norm_eps: 1e-5 (fla).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = head_width("expand_v", d_model, expand_v, num_heads)
        rank = check_int("gate_low_rank_dim", gate_low_rank_dim, 1)
        self.tau = check_float("gate_logit_normalizer", gate_logit_normalizer, 0, low_open=True)
        self.norm = check_choice("norm", norm, ("layernorm", "rmsnorm"))
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self._make_qkv(d_model, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(d_model, rank, bias=False), nn.Linear(rank, self.num_heads * self.head_k, bias=True)
        )
        no_weight_decay(self.gk_proj[1].bias)
        self.g_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=True)
        no_weight_decay(self.g_proj.bias)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(self.head_v)))

    def eos_inputs(self, x):
        q = self._split(self.q_proj(x)) * self.head_k**-0.5
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        log_alpha = F.logsigmoid(self._split(self.gk_proj(x))) / self.tau
        return v, k, q, log_alpha.unsqueeze(-1)

    def _output(self, y, x):
        y = head_norm(y, self.norm, self.norm_eps, self.norm_weight)
        g = self._split(self.g_proj(x))
        return self.o_proj((F.silu(g) * y).flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="GLA",
            input="v_t",
            expand="k_t",
            oscillation="g_t 1_d^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Yang et al. 2023, Gated Linear Attention, sec. 4; LCSM Table 1 (GLA/GateLoop)",
        )
