"""``retnet`` (``tnl``): multi-scale retention (Sun et al. 2023, RetNet) with xPos.

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py``; docs/zoo/linear_attention.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_float, check_int

from ._qkv import QKVAttention, half_safe_complex, head_norm, head_width
from .base import EOSRow, register

Tensor = torch.Tensor


@register("retnet", "tnl")
class RetNet(QKVAttention):
    """Multi-scale retention, Sun et al. 2023 (RetNet) sections 2.1-2.2; official code torchscale
    ``MultiScaleRetention``; LCSM Table 1 row "TNL/RetNet".

    Computation, in order::

        q = q_proj(x), k = k_proj(x) * K^-1/2, v = v_proj(x), g = g_proj(x)   (no biases)
        xPos (sec. 2.1, default): q_n <- q_n e^{i n theta}, k_m <- k_m e^{i m theta} on pairs of
            channels, theta_j = 10000^-linspace(0, 1, K/2) (torchscale). Folded into the decay:
            Re(q~_n conj(k~_m) e^{i(n-m) theta}) is the rotated dot product, so the EOS runs with
            e = conj(k~), s = q~ (K/2 complex rows) and log_o = log gamma_h + i theta_j [H, K/2, 1].
        without xPos: e = k, s = q, log_o = log gamma_h [H, 1, 1].
        m_t = gamma_h o m_{t-1} + e_t v_t^T,   y_t = Re(m_t^T s_t)        [B, T, H, D]
        y = GroupNorm_h(y)  (per head over D, no affine: option ``norm``, eps = norm_eps)
        out = o_proj(swish(g) * y)

    Init as torchscale's ``MultiScaleRetention.reset_parameters``
    (``torchscale/component/multiscale_retention.py``): Xavier-uniform with gain 2^-2.5 for
    q/k/v/g and 2^-1 for the output projection (torchscale commit ff7c1f2, 2023-11-24; gain 1
    before it).

    gamma_h = 1 - 2^(-5-h), h = 0..H-1: RetNet's fixed per-head decays (sec. 2.2, "gamma =
    1 - 2^{-5-arange(0, h)}"), constants, not learned. The alias ``tnl`` builds this same layer:
    TNL (TransNormerLLM, Qin et al. 2023b) instead uses ALiBi-like, layer-dependent slopes, LRPE
    rather than xPos and SRMSNorm; those are not reproduced here (see docs/zoo/linear_attention.md).

    Departure: torchscale divides the decay mask by the square root of its row sum and the
    retention scores by their row |sum| (clamped to [1, 5e4]) (``RetNetRelPos``,
    ``parallel_forward``). Each multiplies a (t, head) read-out by a positive scalar that the
    per-head norm would remove but for its eps; lcsm omits both (the |sum| has no recurrent
    form). At torchscale's init the read-out is small against eps = 1e-6, so the omission is not
    negligible: the layer output differs from torchscale's formula on the same weights by 3.3-3.6 %
    relative RMS (d 64-1024, T 128-512, either norm); with q/k/v/g at gain 1 it is under 1e-4
    (docs/zoo/linear_attention.md has the script).

    Options:
        num_heads: H (the decays depend on the head index).
        expand_k, expand_v: key / value widths relative to d_model (RetNet: 1 and 2).
        xpos: apply RetNet's rotation (default True); False gives LCSM Table 1's "lambda J" row.
        norm: per-head norm, "layernorm" (the paper's GroupNorm, default) or "rmsnorm" (what
            torchscale's code uses today).
        norm_eps: norm eps (torchscale's layernorm_eps, 1e-6).
    """

    revision = 2  # 2: output projection at torchscale's gain 2^-1

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 2.0,
        xpos: bool = True,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = head_width("expand_v", d_model, expand_v, num_heads)
        if not isinstance(xpos, bool):
            raise ValueError(f"xpos: expected a bool, got {xpos!r}")
        if xpos and self.head_k % 2:
            raise ValueError(f"xpos: needs an even key width per head to pair channels, got {self.head_k}")
        self.xpos = xpos
        self.norm = check_choice("norm", norm, ("layernorm", "rmsnorm"))
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self._make_qkv(d_model, bias=False)
        self.g_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.g_proj):
            nn.init.xavier_uniform_(lin.weight, gain=2**-2.5)
        nn.init.xavier_uniform_(self.o_proj.weight, gain=2**-1)
        # Fixed constants are rebuilt in the input's dtype at every call rather than stored as
        # buffers: a buffer created in float32 and later cast to float64 would keep float32 values.
        self.gammas = tuple(1.0 - 2.0 ** (-5 - h) for h in range(self.num_heads))
        if xpos:
            self.complex_memory = True
            self.memory_rows = self.head_k // 2

    def log_gamma(self, like: Tensor) -> Tensor:
        """log gamma_h [H] in the dtype / device of ``like``."""
        return torch.tensor(self.gammas, dtype=torch.float64, device=like.device).log().to(like.dtype)

    def xpos_theta(self, like: Tensor) -> Tensor:
        """theta_j = 10000^-linspace(0, 1, K/2) [K/2] (torchscale's angles)."""
        half = self.head_k // 2
        return (10000.0 ** -torch.linspace(0, 1, half, dtype=torch.float64, device=like.device)).to(like.dtype)

    def _qkv(self, x):
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x)) * self.head_k**-0.5
        return q, k, self._split(self.v_proj(x)), self.log_gamma(q).view(self.num_heads, 1, 1)

    def eos_inputs(self, x):
        if self.xpos:
            return super().eos_inputs(x)
        q, k, v, log_gamma = self._qkv(x)
        return v, k, q, log_gamma

    def rotating_inputs(self, x):
        q, k, v, log_gamma = self._qkv(x)
        qc = half_safe_complex(q[..., 0::2], q[..., 1::2])
        kc = half_safe_complex(k[..., 0::2], k[..., 1::2])
        return v, kc.conj(), qc, log_gamma, self.xpos_theta(q).expand(self.num_heads, -1)

    def _output(self, y, x):
        y = head_norm(y, self.norm, self.norm_eps)
        g = self._split(self.g_proj(x))
        return self.o_proj((F.silu(g) * y).flatten(-2))

    def describe(self) -> EOSRow:
        osc = "lambda exp(i theta) 1_d^T (xPos folded in; Table 1: lambda J)" if self.xpos else "lambda J^(kd)"
        return EOSRow(
            name="RetNet (multi-scale retention)",
            input="v_t",
            expand="k_t",
            oscillation=osc,
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Sun et al. 2023, Retentive Network, sec. 2.1-2.2; LCSM Table 1 (TNL/RetNet)",
        )
