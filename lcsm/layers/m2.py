"""``m2``: LCSM Table 7 row M2, o_t = I - k_t kbar_t^T.

A delta-rule mixer (a matrix oscillation, LCSM Table 7): the family table and the shared base
are in ``_delta.py``; docs/zoo/delta_rule.md.

Packed sequences: ``cu_seqlens`` passes to ``eos_dplr``, one pass over the row.
"""

from __future__ import annotations

from torch import nn

from ._delta import DeltaBase, l2norm
from .base import EOSRow, register


@register("m2")
class DeltaM2(DeltaBase):
    """LCSM Table 7 row M2: o_t = I - k_t kbar_t^T with a second key kbar_t, e_t = k_t, s_t = q_t.

    The paper leaves kbar open. Independent unit k and kbar make the product of the oscillations
    grow geometrically (measured: ||prod|| ~ 1e25 after 2048 random steps at K = 16), because
    I - k kbar^T is far from normal when k and kbar are far apart. So kbar is a bounded tilt of k:

        k_hat = L2norm(k),  delta = Linear(x),  kbar = L2norm(k_hat + delta / (1 + ||delta||)).

    ||delta / (1 + ||delta||)|| < 1 keeps kbar within 90 degrees of k (k_hat . kbar > 0), so the
    rank-one eigenvalue 1 - k_hat . kbar of each factor lies in [0, 1): the memory is erased (not
    amplified) along k as in M1, and kbar only tilts which component of the memory is read out.
    """

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__(d_model, heads, expand_k, output_norm, mode, chunk_size)
        self.kbar_proj = nn.Linear(d_model, heads * self.head_k, bias=False)

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        delta = self._heads(self.kbar_proj(x), self.head_k)
        kbar = l2norm(k + delta / (1 + delta.norm(dim=-1, keepdim=True)))
        return k, q, k, kbar, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M2",
            input="v_t",
            expand="k_t",
            oscillation="I_k - k_t kbar_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )
