"""The linear-attention family of LCSM Table 1: q/k/v projections feeding one EOS recurrence.

This module holds what the family shares (the state, the option helpers, ``QKVAttention``); each
mixer is in the file named by its registry name (``linear_attention.py``, ``retnet.py``, ...).

Every mixer here is ``i = v_t``, ``e = k_t``, ``s = q_t`` and differs only in the oscillation
(LCSM section 2.3, Table 1, appendix 5.3):

=================  =============================  =============================================
name (aliases)     oscillation o_t                EOS ``log_o`` given to :func:`lcsm.ops.eos`
=================  =============================  =============================================
linear_attention   J (no decay)                   None
retnet (tnl)       lambda_h J, xPos rotation      log lambda_h + i theta_j, [H, K/2, 1] complex
cosformer          exp(i theta_h) J               i theta_h, [H, 1, 1] complex
lrpe               exp(i Theta) 1^T (learned)     i Theta_{h,k}, [H, K, 1] complex
gla (gateloop)     g_t 1^T (data-dependent rows)  logsigmoid(.)/tau, [B, T, H, K, 1]
dur (gfw)          g_t gbar_t^T (outer product)   (log g_t [B, T, H, K, 1], log gbar_t [B, T, H, 1, D])
=================  =============================  =============================================

Complex oscillations give a complex memory; e, s and i stay real (except RetNet's xPos, where q
and k are read as K/2 complex numbers) and the readout is the real part, LCSM eq. 14-15. Their
oscillation is a real decay times a time-invariant rotation, exp(log_decay + i theta), which the
layers compute in the rotating frame (:func:`lcsm.ops.rotating.eos_rotating`, real kernels).

Shape glossary: B batch, T time, H heads, K key (expand) width per head, D value width per head,
d_model model width. Projections produce [B, T, H * K] and are split to [B, T, H, K].

Every mixer exposes ``eos_inputs(x) -> (i, e, s, log_o)``, the arguments of ``eos`` for its
system (before the normaliser column; the rotating mixers hand ``eos_rotating`` the same system
split into log_decay and theta, ``rotating_inputs``), and ``eos_readout(x, state)``: the per-head
read-out [B, T, H, D] before the output stage (norm / gate / output projection) and the final
memory. Tests use them to compare the EOS part alone.

Init: RetNet follows torchscale's layer init (Xavier-uniform, gain 2^-2.5 on q/k/v/g); the others
use PyTorch's default ``nn.Linear`` init (model-level init schemes belong to the training engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float

from ..ops import eos, eos_rotating
from .base import Mixer, State, no_weight_decay

Tensor = torch.Tensor


FEATURE_MAPS = {
    "1+elu": lambda x: 1.0 + F.elu(x),
    "relu": F.relu,
    "identity": lambda x: x,
}


@dataclass
class LinearAttentionState(State):
    """memory: [B, H, K, D'] with D' = D, or D + 1 when Katharopoulos' normaliser z_t
    rides along as an extra column; complex for rotating oscillations (RetNet xPos: K/2 rows)."""

    memory: Tensor


# ----------------------------------------------------------------------------- option checks


def head_width(name: str, d_model: int, expand, num_heads: int) -> int:
    """Per-head width of a projection of size expand * d_model split over num_heads heads."""
    expand = check_float(name, expand, 0, low_open=True)
    total = d_model * expand
    if abs(total - round(total)) > 1e-9 or round(total) % num_heads != 0:
        raise ValueError(
            f"{name}: d_model * {name} = {d_model} * {expand} = {total:g} must be an integer divisible "
            f"by num_heads = {num_heads}"
        )
    return round(total) // num_heads


def split_width(d_model: int, num_heads: int) -> int:
    """Per-head width when d_model is split over the heads (q, k and v all d_model wide)."""
    if d_model % num_heads:
        raise ValueError(f"num_heads: d_model = {d_model} must be divisible by num_heads, got {num_heads}")
    return d_model // num_heads


def half_safe_complex(real: Tensor, imag: Tensor) -> Tensor:
    """torch.complex, with half precisions lifted to float32 (there is no complex bfloat16; the
    EOS op computes half-precision inputs in float32 anyway)."""
    if real.dtype in (torch.float16, torch.bfloat16):
        real, imag = real.float(), imag.float()
    return torch.complex(real, imag)


def head_norm(y: Tensor, kind: str, eps: float, weight: Tensor | None = None) -> Tensor:
    """Normalise each head's D channels of y [B, T, H, D]: LayerNorm (RetNet's GroupNorm with one
    group per head) or RMSNorm (fla's GLA), optionally with a per-channel weight shared by heads."""
    if kind == "layernorm":
        y = y - y.mean(-1, keepdim=True)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


# ----------------------------------------------------------------------------- shared machinery


class QKVAttention(Mixer):
    """Shared body: q/k/v projections, one EOS call, an output stage.

    Subclasses set ``num_heads``, ``head_k``, ``head_v``, ``normalize`` and implement
    ``eos_inputs(x) -> (i, e, s, log_o)`` (the ``eos`` arguments) and
    ``_output(y, x) -> [B, T, d_model]``.
    """

    normalize: bool = False
    complex_memory: bool = False
    memory_rows: int = 0  # K of the EOS memory (K/2 for RetNet's complex xPos pairs)
    chunk_size: int = 64  # C of the operator's chunk form (its default; HGRN2 takes its own)

    def _make_qkv(self, d_model: int, bias: bool) -> None:
        H = self.num_heads
        self.q_proj = nn.Linear(d_model, H * self.head_k, bias=bias)
        self.k_proj = nn.Linear(d_model, H * self.head_k, bias=bias)
        self.v_proj = nn.Linear(d_model, H * self.head_v, bias=bias)
        self.o_proj = nn.Linear(H * self.head_v, d_model, bias=bias)
        if bias:
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                no_weight_decay(lin.bias)
        self.memory_rows = self.head_k

    def _split(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.num_heads, -1))

    def eos_inputs(self, x: Tensor):
        """(i, e, s, log_o), the ``eos`` arguments; a rotating mixer's log_o is
        log_decay + i theta (complex [H, K|1, 1]), built from ``rotating_inputs``."""
        if not self.complex_memory:
            raise NotImplementedError
        i, e, s, log_decay, theta = self.rotating_inputs(x)
        rotation = half_safe_complex(torch.zeros_like(theta), theta).unsqueeze(-1)
        return i, e, s, rotation if log_decay is None else log_decay + rotation

    def rotating_inputs(self, x: Tensor):
        """Mixers with a complex memory: (i, e, s, log_decay, theta) with a real decay (or None)
        and the angles theta [H, K|1] of the oscillation exp(log_decay + i theta)."""
        raise NotImplementedError

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _denominator(self, z: Tensor) -> Tensor:
        """1 / denominator from the normaliser column z [..., 1]; only mixers with ``normalize``."""
        raise NotImplementedError

    def eos_readout(
        self,
        x: Tensor,
        state: LinearAttentionState | None = None,
        cu_seqlens: Tensor | None = None,
        final: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """x [B, T, d_model] -> (read-out [B, T, H, D] (real), final memory [B, H, K, D'], one row
        per document with ``cu_seqlens``; None without ``final``, not computed: with ``cu_seqlens``
        the documents' final memories are a pass of their own, ``ops.packed``)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        m0 = state.memory if state is not None else None
        if self.complex_memory:
            i, e, s, log_o, theta = self.rotating_inputs(x)
        else:
            i, e, s, log_o = self.eos_inputs(x)
        if self.normalize:
            # The normaliser z_t = sum_s o-weighted k_s is the same EOS with input 1: one extra
            # memory column computes numerator and denominator in a single pass.
            i = torch.cat([i, i.new_ones(*i.shape[:-1], 1)], -1)
        run = dict(initial_state=m0, output_final_state=final, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
        if self.complex_memory:
            # LCSM eq. 14-15: y_t = Re{[kv]_t}^T q_t, computed in the rotating frame (real kernels;
            # the same system as eos(*eos_inputs(x)): tests/layers/test_linear_attention.py checks it)
            y, m = eos_rotating(i, e, s, theta, log_o, **run)
        else:
            y, m = eos(i, e, s, log_o, **run)
        if self.normalize:
            y = y[..., :-1] * self._denominator(y[..., -1:])
        # eos promotes to the state's dtype (float32 for half-precision inputs): back to x's.
        return y.to(x.dtype), m

    def forward(
        self,
        x: Tensor,
        state: LinearAttentionState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        y, m = self.eos_readout(x, state, cu_seqlens, final=return_state)
        out = self._output(y, x)
        return (out, LinearAttentionState(memory=m)) if return_state else out

    def init_state(self, batch_size: int) -> LinearAttentionState:
        p = self._param_like()
        dtype = self._memory_dtype(self.complex_memory)
        cols = self.head_v + (1 if self.normalize else 0)
        return LinearAttentionState(
            memory=torch.zeros(batch_size, self.num_heads, self.memory_rows, cols, device=p.device, dtype=dtype)
        )

    def _memory_str(self) -> str:
        cols = f"{self.head_v}+1 (normaliser column)" if self.normalize else f"{self.head_v}"
        kind = " complex" if self.complex_memory else ""
        return f"k x d = {self.memory_rows} x {cols}{kind} per head, {self.num_heads} heads"
