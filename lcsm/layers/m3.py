"""``m3``: LCSM Table 7 row M3, o_t = I - Diag{k_t} (diagonal, on ``lcsm.ops.eos``).

A delta-rule mixer (a matrix oscillation, LCSM Table 7): the family table and the shared base
are in ``_delta.py``; docs/zoo/delta_rule.md.

Packed sequences: ``cu_seqlens`` passes to ``eos`` (a decay of exactly 0 at each document start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import eos
from ._delta import DeltaBase
from .base import EOSRow, register

Tensor = torch.Tensor


_EOS_MODES = ("auto", "recurrent", "parallel", "chunk")


@register("m3")
class DeltaM3(DeltaBase):
    """LCSM Table 7 row M3: o_t = I - Diag{k_t}, e_t = k_t, s_t = q_t.

    A diagonal oscillation is psi = elementwise, so this runs on :func:`lcsm.ops.eos` with the row
    decay log o_t = log(1 - k_t):  m_t[r] = (1 - k_t[r]) m_{t-1}[r] + k_t[r] v_t.

    k_t = sigmoid(Linear(x)) so k_t in (0, 1): the decay 1 - k_t is in (0, 1) (stable, its log is
    defined, computed as logsigmoid(-z) without cancellation) and each memory row becomes a convex
    combination of its past and v_t, an input-dependent exponential moving average whose forget
    and input gates are tied (as in a GRU update gate or HGRN). q is a plain projection.
    """

    modes = _EOS_MODES

    def _mix(self, x: Tensor, m0: Tensor | None, return_state: bool, cu_seqlens: Tensor | None):
        z = self._heads(self.k_proj(x), self.head_k)
        k = torch.sigmoid(z)
        log_o = F.logsigmoid(-z).unsqueeze(-1)  # log(1 - k) [B, T, H, K, 1]
        q = self._heads(self.q_proj(x), self.head_k)
        v = self._heads(self.v_proj(x), self.head_v)
        return eos(
            v,
            k,
            q,
            log_o,
            mode=self.mode,
            initial_state=m0,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M3",
            input="v_t",
            expand="k_t",
            oscillation="I_k - Diag{k_t}",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )
