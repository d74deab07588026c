"""``cosformer``: cosFormer (Qin et al. 2022), a per-head rotation.

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch
import torch.nn.functional as F

from lcsm._checks import check_float, check_int

from ._qkv import QKVAttention, split_width
from .base import EOSRow, register


@register("cosformer")
class Cosformer(QKVAttention):
    """cosFormer, Qin et al. 2022 ("cosFormer: Rethinking Softmax in Attention"), section 3
    (relu features, cos-based re-weighting); official code OpenNLPLab/cosFormer; LCSM section 2.3
    and appendix 5.3 eq. 14.

    The re-weighting cos(pi/2 (t - s)/M) = Re exp(i (t - s) theta) with theta = pi / (2M) is a
    complex, data-independent oscillation, so the layer is one EOS call (LCSM eq. 14)::

        q = relu(q_proj(x)), k = relu(k_proj(x)), v = v_proj(x)       (with biases)
        m_t = exp(i theta_h) m_{t-1} + k_t v_t^T                      (log_o = i theta_h, [H, 1, 1])
        y_t = Re(m_t)^T q_t = sum_s cos((t - s) theta_h) (q_t . k_s) v_s
        normalize: y_t / max(sum_s cos((t - s) theta_h) q_t . k_s, eps)   (memory column D+1)
        out = o_proj(concat_heads(y))

    Departure: the original sets M to the current sequence length, which a streaming recurrence
    cannot know in advance (and makes a token's output depend on the future length). Here theta
    is fixed: by default pi / (2 * 512), i.e. M = 512; it may also be given per head. Re-weights
    stay non-negative only for t - s <= pi / (2 theta) = M: choose M >= the longest context.

    Options:
        num_heads: H.
        theta: a float shared by all heads (the original) or one float per head.
        normalize: the original's denominator (default True); False is LCSM Table 1's row.
        eps: clamp floor of the denominator (1e-6, as the official code).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        theta: float | Sequence[float] = math.pi / (2 * 512),
        normalize: bool = True,
        eps: float = 1e-6,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = self.head_v = split_width(d_model, self.num_heads)
        if isinstance(theta, Real) and not isinstance(theta, bool):
            thetas = [float(theta)] * num_heads
        elif (
            isinstance(theta, (list, tuple))
            and len(theta) == num_heads
            and all(isinstance(t, Real) and not isinstance(t, bool) for t in theta)
        ):
            thetas = [float(t) for t in theta]
        else:
            raise ValueError(f"theta: expected a float or a sequence of num_heads = {num_heads} floats, got {theta!r}")
        if not all(math.isfinite(t) for t in thetas):
            raise ValueError(f"theta: expected finite angles, got {theta!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: expected a bool, got {normalize!r}")
        self.normalize = normalize
        self.eps = check_float("eps", eps, 0, low_open=True)
        self._make_qkv(d_model, bias=True)
        # Python floats, not a buffer, for the reason given in RetNet.__init__.
        self.thetas = tuple(thetas)
        self.complex_memory = True

    def rotating_inputs(self, x):
        q = F.relu(self._split(self.q_proj(x)))
        k = F.relu(self._split(self.k_proj(x)))
        v = self._split(self.v_proj(x))
        return v, k, q, None, torch.tensor(self.thetas, dtype=q.dtype, device=q.device).view(-1, 1)

    def _denominator(self, z):
        return 1.0 / z.clamp_min(self.eps)

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="cosFormer" + ("" if self.normalize else " (no denominator, LCSM Table 1 form)"),
            input="v_t",
            expand="k_t",
            oscillation="exp(i theta) J^(kd)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Qin et al. 2022, cosFormer, sec. 3; LCSM Table 1 and appendix 5.3 eq. 14",
        )
