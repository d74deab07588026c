"""``gated_deltaproduct``: Gated DeltaProduct (Siems et al. 2025, arXiv:2502.10297), on :func:`lcsm.ops.eos_dplr`.

Each token applies a scalar gate, then n_h generalised Householder factors, each with its own key,
value and step (fla's naive reference fla/ops/gated_delta_product/naive.py, state [K, D])::

    m <- alpha_t m
    m <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) m + beta_{t,j} k_{t,j} v_{t,j}^T      j = 1..n_h
    y_t = m^T q_t / sqrt(K)

As eos_dplr micro-steps ([B, T, H, n_h, K]): log_alpha = g_t (a scalar per head, applied at the
first micro-step), a_j = beta_j k_j, b_j = k_j, e_j = beta_j k_j, i_j = v_j; the decay acts on the
memory before the first factor, so its low-rank term reads the decayed memory: a_1 = alpha_t beta_1 k_1
((alpha I - alpha beta k k^T) m = (I - beta k k^T) alpha m).

The layer is fla's ``GatedDeltaProduct`` (fla/layers/gated_deltaproduct.py): q, k (n_h per token)
and v (n_h per token, width expand_v K) projections, each through a causal depthwise convolution
and SiLU, q and k L2-normalised per head, beta = sigmoid(Linear(x)) (times 2 with negative
eigenvalues, so each factor's eigenvalue 1 - beta lies in [-1, 1]), the Mamba-2 gate
g = -exp(A_log) softplus(Linear(x) + dt_bias), an RMSNorm of the read-out gated by SiLU(Linear(x))
and the output projection. The three convolutions are one depthwise convolution over their
concatenated channels (the same function). Linear layers keep PyTorch's default init (fla's model
re-initialises them, xavier_uniform gain 2^-2.5; lcsm's global init is the model's).

Shape glossary: B batch, T time, H heads, n n_h micro-steps, K key width per head, D value width
per head (expand_v K), W conv width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_float, check_int

from ..ops import DPLR_MODES, eos_dplr, native_gated_rms_norm, native_serves
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import causal_conv

Tensor = torch.Tensor

# fla's l2norm eps (fla/modules/l2norm.py).
_L2_EPS = 1e-6


@dataclass
class GatedDeltaProductState(State):
    """conv [B, W - 1, C_qkv]: the last W - 1 conv inputs (q, k, v projections), oldest first.
    memory [B, H, K, D]: m_T."""

    conv: Tensor
    memory: Tensor


@register("gated_deltaproduct", "deltaproduct")
class GatedDeltaProduct(Mixer):
    """Gated DeltaProduct (module docstring).

    Args:
        d_model: model width.
        heads: H; the key width per head is K = d_model / H.
        expand_v: value width per head D = expand_v K (fla default 2).
        num_householder: n_h factors per token (fla default 2).
        negative_eigenvalues: beta in [0, 2] (fla's allow_neg_eigval, default True) instead of [0, 1].
        forget_gate: the scalar gate alpha_t (fla's use_forget_gate, default True).
        conv_size: W of the short convolutions (fla default 4).
        norm_eps: eps of the output RMSNorm (fla default 1e-5).
        mode: eos_dplr mode.
    """

    modes = DPLR_MODES

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_v: float = 2.0,
        num_householder: int = 2,
        negative_eigenvalues: bool = True,
        forget_gate: bool = True,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        H = check_int("heads", heads, 1)
        if d_model % H:
            raise ValueError(f"heads: expected a positive integer dividing d_model={d_model}, got {heads!r}")
        K = d_model // H
        expand_v = check_float("expand_v", expand_v, 0.0)
        if expand_v <= 0 or K * expand_v != int(K * expand_v):
            raise ValueError(
                f"expand_v: expected a positive number with K * expand_v an integer (K = {K}), got {expand_v!r}"
            )
        self.n = check_int("num_householder", num_householder, 1)
        self.negative_eigenvalues = check_bool("negative_eigenvalues", negative_eigenvalues)
        self.forget_gate = check_bool("forget_gate", forget_gate)
        self.conv_size = check_int("conv_size", conv_size, 1)
        self.norm_eps = check_float("norm_eps", norm_eps, 0.0)
        self.mode = check_choice("mode", mode, self.modes)
        self.heads, self.head_k, self.head_v = H, K, int(K * expand_v)
        n, D = self.n, self.head_v
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, n * H * K, bias=False)
        self.v_proj = nn.Linear(d_model, n * H * D, bias=False)
        self.b_proj = nn.Linear(d_model, n * H, bias=False)
        self.channels = H * K * (1 + n) + n * H * D
        # fla: ShortConvolution(bias=False, activation="silu") for each of q, k, v.
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.conv_size, groups=self.channels, bias=False)
        if self.forget_gate:
            self.a_proj = nn.Linear(d_model, H, bias=False)
            # fla's (Mamba-2's) init: A ~ U(0, 16), dt log-uniform in [1e-3, 0.1] (floor 1e-4)
            # stored through the inverse softplus.
            A = torch.empty(H).uniform_(0, 16)
            self.A_log = no_weight_decay(nn.Parameter(torch.log(A)))
            dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias = no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
        self.g_proj = nn.Linear(d_model, H * D, bias=False)
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(D)))
        self.o_proj = nn.Linear(H * D, d_model, bias=False)

    def _conv(self, x: Tensor, conv_state: Tensor | None, cu_seqlens: Tensor | None):
        """Causal depthwise conv + SiLU over [B, T, C_qkv]; returns the new window too."""
        if cu_seqlens is not None:
            u, window = causal_conv(x, self.conv1d.weight, None, cu_seqlens, conv_state)
            return F.silu(u), window
        B = x.shape[0]
        if conv_state is None:
            conv_state = x.new_zeros(B, self.conv_size - 1, self.channels)
        full = torch.cat([conv_state.to(x.dtype), x], 1)
        u = F.conv1d(full.transpose(1, 2), self.conv1d.weight.to(x.dtype), groups=self.channels)
        return F.silu(u.transpose(1, 2)), full[:, full.shape[1] - (self.conv_size - 1) :]

    def forward(
        self,
        x: Tensor,
        state: GatedDeltaProductState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, _ = x.shape
        H, K, D, n = self.heads, self.head_k, self.head_v, self.n
        conv0 = memory0 = None
        if state is not None:
            conv0, memory0 = state.conv, state.memory
        qkv, conv = self._conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), conv0, cu_seqlens)
        q, k, v = qkv.split([H * K, n * H * K, n * H * D], -1)
        q = F.normalize(q.reshape(B, T, H, K), dim=-1, eps=_L2_EPS)
        # fla lays out the n_h factors outermost: (n h d).
        k = F.normalize(k.reshape(B, T, n, H, K).transpose(2, 3), dim=-1, eps=_L2_EPS)
        v = v.reshape(B, T, n, H, D).transpose(2, 3)
        beta = torch.sigmoid(self.b_proj(x)).reshape(B, T, n, H).transpose(2, 3)[..., None]
        if self.negative_eigenvalues:
            beta = 2 * beta
        bk = beta * k
        log_alpha = a = None
        if self.forget_gate:
            # As fla (its .float()), the gate is computed in at least float32.
            gdt = torch.promote_types(x.dtype, torch.float32)
            log_alpha = -self.A_log.to(gdt).exp() * F.softplus(self.a_proj(x).to(gdt) + self.dt_bias.to(gdt))
            # The decay comes before the first factor: (I - beta k k^T) alpha m = (alpha I - alpha beta k k^T) m.
            first = bk[:, :, :, :1] * log_alpha.exp()[..., None, None].to(bk.dtype)
            a = torch.cat([first, bk[:, :, :, 1:]], 3)
        y, memory = eos_dplr(
            v,
            bk,
            q * K**-0.5,
            bk if a is None else a,
            k,
            log_alpha,
            mode=self.mode,
            initial_state=memory0,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        # fla's FusedRMSNormGated: RMSNorm(y) * weight * SiLU(gate), per head over D.
        gate = self.g_proj(x).reshape(B, T, H, D)
        if native_serves(x) and y.dtype == x.dtype:  # one native pass each way on the CPU
            y = native_gated_rms_norm(y, gate, self.o_norm, D, self.norm_eps, False)
        else:
            y = F.rms_norm(y.to(x.dtype), (D,), self.o_norm.to(x.dtype), eps=self.norm_eps) * F.silu(gate)
        out = self.o_proj(y.reshape(B, T, H * D))
        return (out, GatedDeltaProductState(conv=conv, memory=memory)) if return_state else out

    def init_state(self, batch_size: int) -> GatedDeltaProductState:
        p = self._param_like()
        return GatedDeltaProductState(
            conv=p.new_zeros(batch_size, self.conv_size - 1, self.channels),
            memory=p.new_zeros(batch_size, self.heads, self.head_k, self.head_v, dtype=self._memory_dtype()),
        )

    def describe(self) -> EOSRow:
        lo = "[0, 2]" if self.negative_eigenvalues else "[0, 1]"
        gate = "alpha_t " if self.forget_gate else ""
        return EOSRow(
            name="gated_deltaproduct",
            input="v_{t,j}, j = 1..n_h",
            expand="beta_{t,j} k_{t,j}",
            oscillation=f"{gate}prod_j (I_k - beta_{{t,j}} k_{{t,j}} k_{{t,j}}^T), n_h = {self.n}, beta in {lo}",
            shrink="q_t / sqrt(K)",
            memory=f"K x D = {self.head_k} x {self.head_v} per head, {self.heads} heads",
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Siems et al. 2025, DeltaProduct: Improving State-Tracking in Linear RNNs via Householder "
            "Products (arXiv:2502.10297)",
        )
