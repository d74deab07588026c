"""``linear_attention``: linear attention (Katharopoulos et al. 2020), no decay.

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

from lcsm._checks import check_choice, check_float, check_int

from ._qkv import FEATURE_MAPS, QKVAttention, head_width
from .base import EOSRow, register


@register("linear_attention")
class LinearAttention(QKVAttention):
    """Linear attention, Katharopoulos et al. 2020 ("Transformers are RNNs"), section 3.2 and the
    causal recurrence of section 3.4; LCSM Table 1 row "Linear Attention".

    Computation, in order (attribute names are stable: other layers copy these weights)::

        q = phi(q_proj(x)), k = phi(k_proj(x)), v = v_proj(x)    split to [B, T, H, K|D]
        m_t = m_{t-1} + k_t v_t^T                                (EOS: i=v, e=k, s=q, o=1)
        y_t = m_t^T q_t                                          [B, T, H, D]
        normalize: y_t / (q_t^T z_t + eps),  z_t = sum_{s<=t} k_s  (z is memory column D+1)
        out = o_proj(concat_heads(y))

    phi is ``1 + elu`` (the paper's feature map). No query scaling: the original has none (the
    normaliser makes the attention scale-free).

    Options:
        num_heads: H; head widths are d_model * expand_k / H and d_model * expand_v / H.
        expand_k, expand_v: key / value widths relative to d_model (1.0 in the original).
        feature_map: "1+elu" (original), "relu" or "identity".
        normalize: divide by phi(q_t)^T sum_s phi(k_s) as in the original (default True). LCSM
            Table 1 writes the row without the denominator; ``normalize=False`` is that row.
        eps: added to the denominator (1e-6, as in the authors' fast-transformers library).
        bias: biases on the four projections (True: fast-transformers uses nn.Linear defaults).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        feature_map: str = "1+elu",
        normalize: bool = True,
        eps: float = 1e-6,
        bias: bool = True,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = head_width("expand_v", d_model, expand_v, num_heads)
        self.feature_map = check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: expected a bool, got {normalize!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias: expected a bool, got {bias!r}")
        self.normalize = normalize
        self.eps = check_float("eps", eps, 0, low_open=True)
        self._make_qkv(d_model, bias)

    def eos_inputs(self, x):
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self._split(self.q_proj(x)))
        k = phi(self._split(self.k_proj(x)))
        v = self._split(self.v_proj(x))
        return v, k, q, None

    def _denominator(self, z):
        return 1.0 / (z + self.eps)

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="Linear Attention" + ("" if self.normalize else " (no denominator, LCSM Table 1 form)"),
            input="v_t",
            expand="k_t",
            oscillation="J^(kd)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Katharopoulos et al. 2020, Transformers are RNNs, sec. 3.2, 3.4; LCSM Table 1",
        )
