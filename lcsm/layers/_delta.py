"""Delta-rule mixers: the matrix-oscillation rows of LCSM Table 7 (appendix 5.2).

This module holds their shared base (``DeltaBase``) and state; each mixer is in the file named
by its registry name (``fwp.py``, ``m1.py``, ``m2.py``, ``m3.py``).

    m_t = o_t m_{t-1} + e_t v_t^T,   y_t = m_t^T q_t

    fwp / deltanet  o_t = I - beta_t k_t k_t^T,   e_t = beta_t k_t   (Schlag et al. 2021, LCSM eq. 13)
    m1              o_t = I - k_t k_t^T,          e_t = k_t
    m2              o_t = I - k_t kbar_t^T,       e_t = k_t
    m3              o_t = I - Diag{k_t},          e_t = k_t           (diagonal: psi = elementwise)

fwp, m1 and m2 run on :func:`lcsm.ops.eos_dplr` with no decay (a dense K x K oscillation the
elementwise EOS op cannot express; its chunk form is ``eos_delta``'s kernel for this structure);
m3 is diagonal and runs on :func:`lcsm.ops.eos`. See docs/zoo/delta_rule.md.

Packed sequences: ``cu_seqlens`` goes straight to the operator (one pass over the row, the memory
restarting at each document from its row of the state); the projections are per token.

Shape glossary: B batch, T time, H heads, K key width per head (memory rows), D value width per
head (memory columns) = d_model / H, d_model model width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import DPLR_MODES, eos_dplr
from .base import Mixer, State, no_weight_decay

Tensor = torch.Tensor


# fla's l2norm epsilon: keeps the normalisation finite when a projection is exactly zero.
_L2_EPS = 1e-6


@dataclass
class DeltaState(State):
    """memory: the fast weight matrix m_t (W_t of Schlag et al.) [B, H, K, D]."""

    memory: Tensor


def l2norm(x: Tensor) -> Tensor:
    return F.normalize(x, dim=-1, eps=_L2_EPS)


class DeltaBase(Mixer):
    """Shared layout: q, k, v projections into H heads, a K x D memory per head, a per-head
    RMSNorm on the read-out and an output projection.

    The output RMSNorm (weight over D, shared by the heads) follows DeltaNet (Yang et al. 2024;
    fla's ``RMSNorm(head_v_dim)``): the delta rule keeps ||m|| bounded but not at a fixed scale, and
    the norm makes the layer's output scale independent of how full the memory is.
    """

    modes = DPLR_MODES

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__(d_model)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d_model % heads:
            raise ValueError(f"heads: expected a positive integer dividing d_model={d_model}, got {heads!r}")
        numeric = isinstance(expand_k, (int, float)) and not isinstance(expand_k, bool) and math.isfinite(expand_k)
        key_total = d_model * expand_k if numeric else 0
        if not numeric or expand_k <= 0 or key_total != int(key_total) or int(key_total) % heads:
            raise ValueError(
                f"expand_k: expected a positive number with d_model * expand_k divisible by heads={heads} "
                f"(d_model={d_model}), got {expand_k!r}"
            )
        if not isinstance(output_norm, bool):
            raise ValueError(f"output_norm: expected True or False, got {output_norm!r}")
        if mode not in self.modes:
            raise ValueError(f"mode: expected one of {', '.join(self.modes)}, got {mode!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
        self.heads, self.mode, self.chunk_size = heads, mode, chunk_size
        self.head_k = int(key_total) // heads
        self.head_v = d_model // heads
        # No biases, as in fla's DeltaNet projections.
        self.q_proj = nn.Linear(d_model, heads * self.head_k, bias=False)
        self.k_proj = nn.Linear(d_model, heads * self.head_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(self.head_v))) if output_norm else None

    # -- helpers ---------------------------------------------------------------------------------
    def _heads(self, x: Tensor, width: int) -> Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, width)

    def _readout(self, y: Tensor) -> Tensor:
        """y [B, T, H, D] -> [B, T, d_model]."""
        if self.o_norm is not None:
            y = F.rms_norm(y, (self.head_v,), self.o_norm, eps=1e-5)
        return self.o_proj(y.reshape(y.shape[0], y.shape[1], self.d_model))

    def init_state(self, batch_size: int) -> DeltaState:
        p = self._param_like()
        return DeltaState(
            memory=p.new_zeros(batch_size, self.heads, self.head_k, self.head_v, dtype=self._memory_dtype())
        )

    def _memory_str(self) -> str:
        return f"K x D = {self.head_k} x {self.head_v} per head, {self.heads} heads"

    # -- the recurrence ----------------------------------------------------------------------------
    def _qkv(self, x: Tensor):
        """q, k [B, T, H, K] (SiLU then L2-normalised per head, as in DeltaNet) and v [B, T, H, D]."""
        q = l2norm(F.silu(self._heads(self.q_proj(x), self.head_k)))
        k = l2norm(F.silu(self._heads(self.k_proj(x), self.head_k)))
        return q, k, self._heads(self.v_proj(x), self.head_v)

    def _delta_states(self, x: Tensor):
        """Returns (e, s, a, b) [B, T, H, K] and i [B, T, H, D] of eos_dplr (no decay)."""
        raise NotImplementedError

    def _mix(self, x: Tensor, m0: Tensor | None, return_state: bool, cu_seqlens: Tensor | None):
        """x [B, T, d_model] -> (y [B, T, H, D], m_T [B, H, K, D] or None; B = N documents with
        ``cu_seqlens``)."""
        e, s, a, b, i = self._delta_states(x)
        return eos_dplr(
            i,
            e,
            s,
            a,
            b,
            mode=self.mode,
            initial_state=m0,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )

    def forward(
        self,
        x: Tensor,
        state: DeltaState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        y, m = self._mix(x, None if state is None else state.memory, return_state, cu_seqlens)
        # A carried float32 state (a half-precision layer's) promotes the operator's output.
        y = self._readout(y.to(x.dtype))
        return (y, DeltaState(memory=m)) if return_state else y
