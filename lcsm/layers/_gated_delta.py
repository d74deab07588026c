"""Gated delta-rule mixers on the DPLR operator: Gated DeltaNet (``gated_deltanet.py``) and KDA
(``kda.py``). This module holds their shared body and state; docs/zoo/gated_deltanet_kda.md.

Both run, per head, the gated delta rule in fla's convention (the memory S is [K, D], keys on rows)::

    S_t = (I - beta_t k_t k_t^T) D(alpha_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

which is :func:`lcsm.ops.eos_dplr` with log_alpha = log alpha_t, a = beta_t k_t,
b = alpha_t * k_t, e = beta_t k_t, i = v_t, s = q_t, since (I - beta k k^T) D(alpha) =
D(alpha) - (beta k)(alpha * k)^T. Gated DeltaNet has one alpha per head (a scalar decay), KDA one
per key channel.

Around the recurrence (fla's ``GatedDeltaNet`` / ``KimiDeltaAttention`` layers): bias-free q, k, v
projections, a depthwise causal convolution of width W with SiLU on each, q and k L2-normalised per
head, q scaled by K^-1/2 (the kernels' default scale), beta = sigmoid(b_proj x) (times 2 with
``negative_eigenvalues``), the Mamba-2 gate log alpha = -exp(A_log) softplus(a + dt_bias), a gated
RMSNorm per head over D and o_proj.

Shape glossary: B batch, T time, H heads, K key width per head (memory rows), D value width per
head (memory columns), W convolution width, N documents of a packed row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_float, check_int

from ..ops import eos_dplr
from ._qkv import head_width
from .base import Mixer, State, no_weight_decay, short_convs
from .packing import silu_short_conv

Tensor = torch.Tensor

# fla's l2norm: x / sqrt(sum x^2 + eps) (fla/modules/l2norm.py), eps 1e-6.
_L2_EPS = 1e-6


def l2norm_fla(x: Tensor) -> Tensor:
    """L2 normalisation over the last axis with fla's eps inside the square root (it differs from
    F.normalize's max(norm, eps) only for norms near 1e-3 or below)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + _L2_EPS)


def value_width(head_k: int, expand_v: float) -> int:
    """The value head width K * expand_v (fla's layers give expand_v relative to the key head)."""
    expand_v = check_float("expand_v", expand_v, 0, low_open=True)
    if abs(head_k * expand_v - round(head_k * expand_v)) > 1e-9:
        raise ValueError(f"expand_v: the value head width K * expand_v = {head_k} * {expand_v} must be an integer")
    return round(head_k * expand_v)


def inverse_softplus_dt(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> Tensor:
    """Mamba's dt_bias init (fla's layers hard-code these values): softplus^-1 of
    dt ~ LogUniform[dt_min, dt_max] clamped at ``floor``, so softplus(dt_bias) starts in that range."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


@dataclass
class GatedDeltaState(State):
    """memory [B, H, K, D]: S_t; conv_q, conv_k [B, W - 1, H K], conv_v [B, W - 1, H D]: the last
    W - 1 inputs of each short convolution (the projections before it), oldest first."""

    memory: Tensor
    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor


class GatedDeltaBase(Mixer):
    """The shared body; subclasses make the gates (``_log_alpha``) and the output gate (``_gate``)."""

    # A_log and dt_bias define the decay over the whole sequence; fla keeps A_log float32 and its
    # gate reads dt_bias in float32.
    float32_parameters = ("A_log", "dt_bias")

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        expand_k: float,
        expand_v: float,
        conv_size: int,
        conv_bias: bool,
        negative_eigenvalues: bool,
        norm_eps: float,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = value_width(self.head_k, expand_v)
        self.conv_size = check_int("conv_size", conv_size, 1)
        conv_bias = check_bool("conv_bias", conv_bias)
        self.negative_eigenvalues = check_bool("negative_eigenvalues", negative_eigenvalues)
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        H, K, D = self.num_heads, self.head_k, self.head_v
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, H * K, bias=False)
        self.v_proj = nn.Linear(d_model, H * D, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = short_convs((H * K, H * K, H * D), conv_size, conv_bias)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(D)))
        self.o_proj = nn.Linear(H * D, d_model, bias=False)

    # -- pieces (the tests compare them with fla's references) -------------------------------------
    def recurrence_inputs(self, x: Tensor, state: GatedDeltaState | None = None, cu_seqlens: Tensor | None = None):
        """The recurrence's inputs in fla's naming: q, k [B, T, H, K] (after conv, SiLU and L2 norm,
        q not yet scaled), v [B, T, H, D], g = log alpha ([B, T, H] or [B, T, H, K]), beta [B, T, H],
        and the three convolution histories."""
        B, T, _ = x.shape
        H, K, D = self.num_heads, self.head_k, self.head_v
        q, cq = silu_short_conv(self.q_conv1d, self.q_proj(x), state.conv_q if state else None, cu_seqlens)
        k, ck = silu_short_conv(self.k_conv1d, self.k_proj(x), state.conv_k if state else None, cu_seqlens)
        v, cv = silu_short_conv(self.v_conv1d, self.v_proj(x), state.conv_v if state else None, cu_seqlens)
        q = l2norm_fla(q.reshape(B, T, H, K))
        k = l2norm_fla(k.reshape(B, T, H, K))
        beta = torch.sigmoid(self.b_proj(x))
        if self.negative_eigenvalues:
            # Grazzi et al. 2025: beta in [0, 2] lets I - beta k k^T reach eigenvalue -1.
            beta = 2 * beta
        return q, k, v.reshape(B, T, H, D), self.log_alpha(x), beta, (cq, ck, cv)

    def log_alpha(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _gate(self, x: Tensor, o: Tensor) -> Tensor:
        """The output gate applied to the normalised read-out o [B, T, H, D]."""
        raise NotImplementedError

    def recurrence(self, q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
        """S_t = (I - beta_t k_t k_t^T) D(alpha_t) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t K^-1/2
        (fla's naive_recurrent_gated_delta_rule / naive_recurrent_kda on the same arguments)."""
        # g is [B, T, H] (scalar decay) or [B, T, H, K]; b = alpha * k either way.
        alpha = torch.exp(g if g.dim() == 4 else g.unsqueeze(-1))
        bk = beta.unsqueeze(-1) * k
        return eos_dplr(
            v,
            bk,
            q * self.head_k**-0.5,
            bk,
            alpha * k,
            g,
            mode="auto",
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )

    def readout(self, x: Tensor, o: Tensor) -> Tensor:
        """The gated RMSNorm per head and o_proj: o [B, T, H, D] -> [B, T, d_model]."""
        # Normalised and gated in float32 at least, as fla's fused gated norm does for half inputs.
        wide = torch.promote_types(x.dtype, torch.float32)
        o = F.rms_norm(o.to(wide), (self.head_v,), self.o_norm.to(wide), eps=self.norm_eps)
        return self.o_proj(self._gate(x, o).to(x.dtype).flatten(-2))

    # -- mixer interface ---------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        state: GatedDeltaState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        q, k, v, g, beta, convs = self.recurrence_inputs(x, state, cu_seqlens)
        o, m = self.recurrence(q, k, v, g, beta, state.memory if state is not None else None, return_state, cu_seqlens)
        y = self.readout(x, o)
        if return_state:
            return y, GatedDeltaState(memory=m, conv_q=convs[0], conv_k=convs[1], conv_v=convs[2])
        return y

    def init_state(self, batch_size: int) -> GatedDeltaState:
        p = self.q_proj.weight
        H, K, D, W = self.num_heads, self.head_k, self.head_v, self.conv_size - 1
        return GatedDeltaState(
            memory=p.new_zeros(batch_size, H, K, D, dtype=self._memory_dtype()),
            conv_q=p.new_zeros(batch_size, W, H * K),
            conv_k=p.new_zeros(batch_size, W, H * K),
            conv_v=p.new_zeros(batch_size, W, H * D),
        )

    def _memory_str(self) -> str:
        return f"K x D = {self.head_k} x {self.head_v} per head, {self.num_heads} heads"
