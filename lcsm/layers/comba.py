"""``comba``: Comba, a bilinear RNN with closed-loop control (Hu et al. 2025, arXiv 2506.02475).

A matrix-transition mixer on :func:`lcsm.ops.eos_dplr`; docs/zoo/longhorn_comba_gdn2.md.

Shape glossary: B batch, T time, H heads, K key width per head (memory rows), D value width per
head (memory columns), C channels of a short convolution, W its width, N documents of a packed row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_float, check_int

from ..ops import DPLR_MODES, eos_dplr
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import short_conv

Tensor = torch.Tensor

# fla's l2norm epsilon (fla.modules.l2norm): keeps the normalisation finite for a zero vector.
_L2_EPS = 1e-6


@dataclass
class CombaState(State):
    """memory [B, H, K, D]; conv_q, conv_k [B, W - 1, H K] and conv_v [B, W - 1, H D]: the last
    W - 1 projected inputs of each short convolution (oldest first)."""

    memory: Tensor
    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor


@register("comba")
class Comba(Mixer):
    """Comba (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop Control"), as fla's
    layer ``fla/layers/comba.py`` and its kernels ``fla/ops/comba`` (fla-core 0.6.0)::

        q, k, v = silu(conv_W(proj(x)))                     (depthwise causal convs, width W = 4)
        p = sigmoid(d_h) k,   q <- q - D_h p                (inner decay; output correction <q - D k>)
        q, k, p <- l2norm(q), l2norm(k), l2norm(p)          (fla's use_qk_l2norm_in_kernel)
        beta_t = sigmoid(b_proj(x)),  log alpha_t = -exp(A_log) softplus(a_proj(x) + dt_bias)
        S_t = alpha_t (I - beta_t k_t p_t^T) S_{t-1} + beta_t k_t v_t^T
        y_t = S_t^T q_t K^-1/2,   out = o_proj(rmsnorm(y) * w * sigmoid(g_proj(x)))

    i.e. eos_dplr with log_alpha [B, T, H], a = alpha beta k, b = p, e = beta k, i = v,
    s = q K^-1/2. The feedback p differs from the key k only in scale, and the L2 norm removes
    the scale, so p = l2norm(k) exactly: the inner decay d_h does not reach the transition; it acts
    only through the output correction, y_t ~ S_t^T l2norm(q - D sigmoid(d) k).

    Inits as fla: A ~ U(0, 16) (A_log = log A), dt_bias = softplus^-1(dt), dt log-uniform in
    [0.001, 0.1] floored at 1e-4; D = correction_factor (1; the authors note 0.02 may be better for
    small models); d = 1. expand_v is relative to the key width per head (fla: head_v = 2 head_k).

    Options:
        heads: H.  head_k: K (fla: head_dim, 256 there; d_model / H by default here).
        expand_v: D / K (2).  conv_size: W (4).  output_gate: sigmoid-gated norm (True) or plain.
        output_correction: q - D p (True).  correction_factor: D's init (1).  norm_eps: 1e-5.
        mode: eos_dplr's mode.
    """

    modes = DPLR_MODES
    float32_parameters = ("A_log", "dt_bias")

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        head_k: int | None = None,
        expand_v: float = 2.0,
        conv_size: int = 4,
        output_gate: bool = True,
        output_correction: bool = True,
        correction_factor: float = 1.0,
        norm_eps: float = 1e-5,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.heads = check_int("heads", heads, 1)
        if head_k is None:
            if d_model % heads:
                raise ValueError(f"heads: expected a divisor of d_model={d_model} when head_k is None, got {heads}")
            head_k = d_model // heads
        self.head_k = check_int("head_k", head_k, 1)
        expand_v = check_float("expand_v", expand_v, 0, low_open=True)
        if self.head_k * expand_v != int(self.head_k * expand_v):
            raise ValueError(f"expand_v: expected head_k * expand_v integral (head_k {self.head_k}), got {expand_v}")
        self.head_v = int(self.head_k * expand_v)
        self.conv_size = check_int("conv_size", conv_size, 1)
        self.output_gate = check_bool("output_gate", output_gate)
        self.output_correction = check_bool("output_correction", output_correction)
        correction_factor = check_float("correction_factor", correction_factor)
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self.mode = check_choice("mode", mode, DPLR_MODES)
        H, kd, vd = self.heads, self.heads * self.head_k, self.heads * self.head_v
        self.q_proj = nn.Linear(d_model, kd, bias=False)
        self.k_proj = nn.Linear(d_model, kd, bias=False)
        self.v_proj = nn.Linear(d_model, vd, bias=False)
        self.a_proj = nn.Linear(d_model, H, bias=False)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.decay = nn.Parameter(torch.ones(H))
        self.D = no_weight_decay(nn.Parameter(torch.full((H,), correction_factor))) if output_correction else None
        self.A_log = no_weight_decay(nn.Parameter(torch.empty(H).uniform_(0, 16).log()))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
        # Depthwise convolutions, weights [C, 1, W] as nn.Conv1d(C, C, W, groups=C), no bias (fla).
        bound = self.conv_size**-0.5
        self.q_conv = nn.Parameter(torch.empty(kd, 1, self.conv_size).uniform_(-bound, bound))
        self.k_conv = nn.Parameter(torch.empty(kd, 1, self.conv_size).uniform_(-bound, bound))
        self.v_conv = nn.Parameter(torch.empty(vd, 1, self.conv_size).uniform_(-bound, bound))
        self.g_proj = nn.Linear(d_model, vd, bias=False) if output_gate else None
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(self.head_v)))
        self.o_proj = nn.Linear(vd, d_model, bias=False)

    def init_state(self, batch_size: int) -> CombaState:
        p = self._param_like()
        kd, vd, w = self.heads * self.head_k, self.heads * self.head_v, self.conv_size - 1
        return CombaState(
            memory=p.new_zeros(batch_size, self.heads, self.head_k, self.head_v, dtype=self._memory_dtype()),
            conv_q=p.new_zeros(batch_size, w, kd),
            conv_k=p.new_zeros(batch_size, w, kd),
            conv_v=p.new_zeros(batch_size, w, vd),
        )

    def _heads(self, t: Tensor, width: int) -> Tensor:
        return t.reshape(*t.shape[:-1], -1, width)

    def forward(self, x: Tensor, state: CombaState | None = None, return_state: bool = False, cu_seqlens=None):
        # each row of the batch its own sequence, or the documents of one packed row
        docs = self.check_call(x, cu_seqlens)
        hist = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
        q, cq = short_conv(self.q_proj(x), self.q_conv, None, docs, hist[0], silu=True)
        k, ck = short_conv(self.k_proj(x), self.k_conv, None, docs, hist[1], silu=True)
        v, cv = short_conv(self.v_proj(x), self.v_conv, None, docs, hist[2], silu=True)
        q, k = self._heads(q, self.head_k), self._heads(k, self.head_k)
        v = self._heads(v, self.head_v)
        p = k * torch.sigmoid(self.decay)[:, None]
        if self.D is not None:
            q = q - self.D[:, None] * p
        q, k, p = (F.normalize(t, dim=-1, eps=_L2_EPS) for t in (q, k, p))
        beta = torch.sigmoid(self.b_proj(x)).unsqueeze(-1)
        # The decay in at least float32 (fla computes it in float32): a half-precision softplus
        # would round alpha_t = exp(log alpha_t) near 1, where long memories live.
        wide = torch.promote_types(x.dtype, torch.float32)
        log_alpha = -self.A_log.to(wide).exp() * F.softplus(self.a_proj(x).to(wide) + self.dt_bias.to(wide))
        bk = beta * k
        y, m = eos_dplr(
            v,
            bk,
            q * self.head_k**-0.5,
            torch.exp(log_alpha).unsqueeze(-1).to(bk.dtype) * bk,
            p,
            log_alpha,
            mode=self.mode,
            initial_state=None if state is None else state.memory,
            output_final_state=return_state,
            cu_seqlens=docs,
        )
        y = F.rms_norm(y.to(x.dtype), (self.head_v,), self.o_norm.to(x.dtype), eps=self.norm_eps)
        if self.g_proj is not None:
            y = y * torch.sigmoid(self._heads(self.g_proj(x), self.head_v))
        out = self.o_proj(y.flatten(-2))
        return (out, CombaState(memory=m, conv_q=cq, conv_k=ck, conv_v=cv)) if return_state else out

    def _memory_str(self) -> str:
        return f"K x D = {self.head_k} x {self.head_v} per head, {self.heads} heads"

    def describe(self) -> EOSRow:
        return EOSRow(
            name="Comba",
            input="v_t",
            expand="beta_t k_t",
            oscillation="alpha_t (I_k - beta_t k_t p_t^T)",
            shrink="(q_t - D p_t) / ||q_t - D p_t||",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Hu et al. 2025, Comba: Improving Bilinear RNNs with Closed-loop Control (arXiv 2506.02475); "
            "fla/layers/comba.py",
        )
