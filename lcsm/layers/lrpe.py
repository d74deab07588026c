"""``lrpe``: linearized relative positional encoding (Qin et al. 2023c), learned angles.

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

import torch
from torch import nn

from lcsm._checks import check_choice, check_int

from ._qkv import FEATURE_MAPS, QKVAttention, split_width
from .base import EOSRow, no_weight_decay, register


@register("lrpe")
class LRPE(QKVAttention):
    """Linearized relative positional encoding, Qin et al. 2023c (LRPE), unitary family with a
    learnable per-channel angle; LCSM eq. 10 and appendix 5.3 eq. 15.

    Computation, in order::

        q = phi(q_proj(x)), k = phi(k_proj(x)), v = v_proj(x)
        m_t = diag(exp(i Theta_h)) m_{t-1} + k_t v_t^T         (log_o = i Theta, [H, K, 1])
        y_t = Re(m_t)^T q_t = sum_s sum_j cos((t - s) Theta_hj) q_tj k_sj v_s
        out = o_proj(concat_heads(y))

    Theta [H, K] is learned. Init: one RoPE spectrum over all H * K channels,
    Theta[h, k] = 10000^(-2 (h K + k) / (H K)) in [1e-8, 1], so heads cover different frequency
    bands, as the LRPE authors' own "cosformer style" Lrpe module does (Doraemonzzz/xmixers
    ``xmixers/modules/pes/_legacy/lrpe.py``, lrpe_type 3; moved there on 2025-01-16, and the new
    ``pes/lrpe.py`` numbers its types differently).
    Equivalent to LRPE's real form, which doubles q and k into [q cos(t theta), q sin(t theta)]:
    the complex memory holds the same 2 x K x D reals.

    No denominator (LCSM's row): with cos re-weights of both signs the kernel sum can vanish, so a
    normaliser would be ill-defined.

    Departure: this is LCSM's row on a plain linear attention, not the authors' layer. Their
    xmixers ``LinearAttention`` (``token_mixers/linear_attention/linear_attention.py``) uses SiLU
    features, no biases, and a per-head RMSNorm fused with a sigmoid output gate from a low-rank
    Linear(d -> head_dim -> d). The norm and gate have no counterpart here; the features alone
    (1+elu against SiLU on the same weights) change the output's RMS 45-85x and leave a cosine of
    0.33-0.47 (docs/zoo/linear_attention.md).

    Options:
        num_heads: H.
        feature_map: phi, "1+elu" (default; LRPE is a positional encoding for any linear
            attention kernel, we pair it with Katharopoulos' map), "relu" or "identity".
        bias: biases on the projections (default True).
    """

    def __init__(self, d_model: int, num_heads: int = 4, feature_map: str = "1+elu", bias: bool = True):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = self.head_v = split_width(d_model, self.num_heads)
        self.feature_map = check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
        if not isinstance(bias, bool):
            raise ValueError(f"bias: expected a bool, got {bias!r}")
        self._make_qkv(d_model, bias)
        channels = self.num_heads * self.head_k
        c = torch.arange(channels, dtype=torch.float64)
        theta = (10000.0 ** (-2.0 * c / channels)).view(self.num_heads, self.head_k)
        self.theta = no_weight_decay(nn.Parameter(theta.to(torch.get_default_dtype())))
        self.complex_memory = True

    def rotating_inputs(self, x):
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self._split(self.q_proj(x)))
        k = phi(self._split(self.k_proj(x)))
        return self._split(self.v_proj(x)), k, q, None, self.theta

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="LRPE (linear attention)",
            input="v_t",
            expand="k_t",
            oscillation="exp(i Theta) 1^(d)T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Qin et al. 2023c, Linearized Relative Positional Encoding; LCSM eq. 10, appendix 5.3 eq. 15",
        )
