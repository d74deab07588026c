"""Based's linear attention (Arora et al. 2024, "Simple linear attention language models balance
the recall-throughput tradeoff", arXiv:2402.18668, section 3) as a configuration of the EOS
operator: normalised linear attention with the 2nd-order Taylor feature map of exp.

Per head (H heads; q, k projected to a small feature dim F; v of width D = d_model / H)::

    phi(x) = [1, x / F^(1/4), (x (x) x) / (sqrt(2) sqrt(F))]     (1 + F + F^2 features)
    phi(q)^T phi(k) = 1 + q.k / sqrt(F) + (q.k)^2 / (2 F)         (exp(q.k / sqrt(F)) to 2nd order)
    y_t = sum_{s<=t} phi(q_t)^T phi(k_s) v_s / (sum_{s<=t} phi(q_t)^T phi(k_s) + eps)
    out = W_o y

EOS mapping (i = v_t, e = phi(k_t), s = phi(q_t), no decay; memory (1 + F + F^2) x (D + 1) per
head, the normaliser riding along as memory column D + 1, as ``linear_attention``). The outer
product is kept in full (F^2 entries, as the official feature map), not its F (F + 1) / 2 distinct
ones.

Sources read: HazyResearch/based ``based/models/mixers/linear_attention.py`` (``LinearAttention``:
bias-free proj_q / proj_k to F * H, proj_v to D * H, out_proj; causal form with cumulative sums and
eps 1e-12 in the denominator) and its ``TaylorExp`` feature map; fla ``BasedLinearAttention`` (the
same layer) and fla-core 0.6.0 ``fla/ops/based/naive.py`` (``naive_parallel_based``, the kernel
1 + s + s^2 / 2 on s = q.k / sqrt(F), denominator eps 1e-6).

Based is a hybrid: its blocks also use short convolutions and sliding-window softmax attention
(small windows, e.g. 64-128). Those are separate layers of the stack: this mixer is Based's linear
attention layer only; the window attention is an option of the ``attention`` mixer (added
separately), and a Based model is a hybrid stack of the two.

Departures: the default 4 heads (official 16, fla 12) let the layer build at small widths;
PyTorch's Linear init. Feature dim F = 16 as the official default.

Shape glossary: B batch, T time, H heads, F feature dim, D = d_model / H.
"""

from __future__ import annotations

import math

import torch

from lcsm._checks import check_float, check_int

from ._qkv import QKVAttention
from .base import EOSRow, register

Tensor = torch.Tensor


def taylor_features(x: Tensor) -> Tensor:
    """phi(x) [..., 1 + F + F^2] of x [..., F]: phi(a)^T phi(b) = 1 + a.b / sqrt(F) + (a.b)^2 / (2 F)."""
    F = x.shape[-1]
    square = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2 * F)
    return torch.cat([torch.ones_like(x[..., :1]), x / F**0.25, square], dim=-1)


@register("based")
class Based(QKVAttention):
    """Based's Taylor linear attention (the linear-attention layer of a Based stack).

    Options:
        num_heads: H; d_model must be divisible by it (official 16; fla 12).
        feature_dim: F, the width q and k are projected to before the feature map (official 16).
        eps: added to the denominator (1e-12, official).
    """

    normalize = True

    def __init__(self, d_model: int, num_heads: int = 4, feature_dim: int = 16, eps: float = 1e-12):
        super().__init__(d_model)
        H = check_int("num_heads", num_heads, 1)
        if d_model % H:
            raise ValueError(f"num_heads: expected a divisor of d_model = {d_model}, got {H}")
        self.num_heads, self.head_k, self.head_v = H, check_int("feature_dim", feature_dim, 1), d_model // H
        self.eps = check_float("eps", eps, 0, low_open=True)
        self._make_qkv(d_model, bias=False)
        self.memory_rows = 1 + self.head_k + self.head_k**2

    def eos_inputs(self, x: Tensor):
        q = taylor_features(self._split(self.q_proj(x)))
        k = taylor_features(self._split(self.k_proj(x)))
        return self._split(self.v_proj(x)), k, q, None

    def _denominator(self, z: Tensor) -> Tensor:
        return 1.0 / (z + self.eps)

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="based",
            input="v_t",
            expand="phi(k_t), phi = 2nd-order Taylor map [1, x, x (x) x / sqrt 2] (scaled)",
            oscillation="J (no decay)",
            shrink="phi(q_t), normalised by phi(q_t)^T sum phi(k_s)",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Arora et al. 2024, Based (arXiv:2402.18668), sec. 3",
        )
