"""``m1``: LCSM Table 7 row M1, o_t = I - k_t k_t^T.

A delta-rule mixer (a matrix oscillation, LCSM Table 7): the family table and the shared base
are in ``_delta.py``; docs/zoo/delta_rule.md.

Packed sequences: ``cu_seqlens`` passes to ``eos_dplr``, one pass over the row.
"""

from __future__ import annotations

from ._delta import DeltaBase
from .base import EOSRow, register


@register("m1")
class DeltaM1(DeltaBase):
    """LCSM Table 7 row M1: o_t = I - k_t k_t^T, e_t = k_t, s_t = q_t.

    k is L2-normalised (after SiLU, as in fwp): then I - k k^T is the orthogonal projector that
    erases the memory along k before k v^T is written there, so every factor is non-expansive
    (eigenvalues 0 and 1). Without the normalisation ||k|| > sqrt(2) makes it expansive and the
    product over T diverges. M1 is DeltaNet with beta fixed to 1 (pure overwrite).
    """

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        return k, q, k, k, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M1",
            input="v_t",
            expand="k_t",
            oscillation="I_k - k_t k_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )
