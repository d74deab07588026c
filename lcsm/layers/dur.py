"""``dur`` (``gfw``): decaying fast weights with an outer-product gate (Mao 2022; Schlag &
Schmidhuber 2018).

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float, check_int

from ._qkv import QKVAttention, head_width
from .base import EOSRow, no_weight_decay, register

Tensor = torch.Tensor


@register("dur", "gfw")
class DUR(QKVAttention):
    """Decaying fast weights with an outer-product gate, Mao 2022 (decay update rule, DUR) and
    Schlag & Schmidhuber 2018 (gated fast weights, GFW); LCSM Table 1 row "DUR/GFW".

    Computation, in order::

        q = q_proj(x) * K^-1/2, k = k_proj(x), v = v_proj(x)     (no feature map, no biases)
        log g_t    = logsigmoid(gk_proj(x)) / tau     [B, T, H, K]
        log gbar_t = logsigmoid(gv_proj(x)) / tau     [B, T, H, D]
        m_t = (g_t gbar_t^T) o m_{t-1} + k_t v_t^T    (log_o = log g[k] + log gbar[d], passed as the
                                                       separable pair ([B, T, H, K, 1], [B, T, H, 1, D]))
        y_t = m_t^T q_t
        out = o_proj(concat_heads(y))

    The sigmoid^(1/tau) gates (tau = 16) are LCSM's data-dependent oscillation rule (sec. 2.4) and
    its oscillation code 1 (outer product of a d-gate and a k-gate). Mao's "no feature map, no
    attention normalisation" is kept; the query scale K^-1/2 is that of the softmax attention Mao
    fine-tunes from.

    Options:
        num_heads: H.
        expand_k, expand_v: key / value widths relative to d_model.
        gate_logit_normalizer: tau (16).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        gate_logit_normalizer: float = 16.0,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = head_width("expand_v", d_model, expand_v, num_heads)
        self.tau = check_float("gate_logit_normalizer", gate_logit_normalizer, 0, low_open=True)
        self._make_qkv(d_model, bias=False)
        self.gk_proj = nn.Linear(d_model, self.num_heads * self.head_k, bias=True)
        self.gv_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=True)
        no_weight_decay(self.gk_proj.bias)
        no_weight_decay(self.gv_proj.bias)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """log g [B, T, H, K] and log gbar [B, T, H, D]."""
        return (
            F.logsigmoid(self._split(self.gk_proj(x))) / self.tau,
            F.logsigmoid(self._split(self.gv_proj(x))) / self.tau,
        )

    def eos_inputs(self, x):
        q = self._split(self.q_proj(x)) * self.head_k**-0.5
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        log_g, log_gbar = self.gates(x)
        # The separable pair, not its [B, T, H, K, D] sum: eos's matmul kernel applies g along K and
        # gbar along D (LCSM o code 1's form), where the sum would need the step-by-step
        # elementwise kernel, several times slower and more so at longer T (docs/eos.md).
        return v, k, q, (log_g.unsqueeze(-1), log_gbar.unsqueeze(-2))

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="DUR/GFW",
            input="v_t",
            expand="k_t",
            oscillation="g_t gbar_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Mao 2022, Decaying Fast Weights; Schlag & Schmidhuber 2018; LCSM Table 1 (DUR/GFW)",
        )
