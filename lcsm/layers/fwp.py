"""``fwp`` (``deltanet``): the fast weight programmer with the delta rule (Schlag et al. 2021;
DeltaNet, Yang et al. 2024).

A delta-rule mixer (a matrix oscillation, LCSM Table 7): the family table and the shared base
are in ``_delta.py``; docs/zoo/delta_rule.md.

Packed sequences: ``cu_seqlens`` passes to ``eos_dplr``, one pass over the row.
"""

from __future__ import annotations

import torch
from torch import nn

from lcsm._checks import check_bool

from ._delta import DeltaBase
from .base import EOSRow, register


@register("fwp", "deltanet")
class FastWeightProgrammer(DeltaBase):
    """Fast weight programmer with the delta rule (Schlag et al. 2021 sec. 4.2, eq. 13 of LCSM; DeltaNet,
    Yang et al. 2024)::

        W_t = W_{t-1} + beta_t k_t (v_t - W_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) W_{t-1} + beta_t k_t v_t^T
        y_t = W_t^T q_t

    i.e. eos_dplr with a = e = beta k, b = k, s = q, no decay. beta_t = sigmoid(Linear(x)) per head (one
    learning rate per head and token). q and k are SiLU then L2-normalised per head (Yang et al.
    2024; fla's qk_activation='silu', qk_norm='l2'). With ||k|| = 1 and beta in (0, 1),
    I - beta k k^T has eigenvalues 1 and 1 - beta: the update is non-expansive and the memory
    stays bounded. (Schlag et al. sum-normalise positive DPFP features, which also gives
    ||k||_2 <= 1; Yang et al. found SiLU + L2 to train better.) The query is then scaled by K^-1/2
    as fla's kernels do (fla/ops/delta_rule ``chunk_delta_rule``, scale None -> K^-0.5): the output
    RMSNorm removes the factor only up to its eps, and without it the layer's output moves by
    1.2-3.2 % relative RMS at init (docs/zoo/delta_rule.md).

    ``negative_eigenvalues=True`` takes beta_t = 2 sigmoid(.) in (0, 2) (Grazzi et al., ICLR 2025,
    "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues"; fla's
    ``allow_neg_eigval``, which doubles the sigmoid: fla/layers/delta_net.py at bc3b101): the
    eigenvalue 1 - beta then reaches (-1, 1), so a token can reflect the memory along k (a
    Householder reflection at beta = 2), which parity and permutation composition need and beta in
    (0, 1) cannot express. Off by default, leaving the model as it was (same revision).
    """

    revision = 2  # 2: query scaled by K^-1/2, as fla

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
        negative_eigenvalues: bool = False,
    ):
        super().__init__(d_model, heads, expand_k, output_norm, mode, chunk_size)
        check_bool("negative_eigenvalues", negative_eigenvalues)
        self.beta_scale = 2.0 if negative_eigenvalues else 1.0
        self.beta_proj = nn.Linear(d_model, heads, bias=False)

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        beta = (self.beta_scale * torch.sigmoid(self.beta_proj(x))).unsqueeze(-1)
        bk = beta * k
        return bk, q * self.head_k**-0.5, bk, k, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="FWP / DeltaNet",
            input="v_t",
            expand="beta_t k_t",
            oscillation="I_k - beta_t k_t k_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Schlag et al. 2021 (Linear Transformers Are Secretly Fast Weight Programmers); "
            "Yang et al. 2024 (DeltaNet, parallel delta rule); LCSM Table 7, eq. 13",
        )
