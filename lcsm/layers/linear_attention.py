"""The linear-attention family of LCSM Table 1: q/k/v projections feeding one EOS recurrence.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import eos, eos_rotating
from .base import EOSRow, Mixer, State, no_weight_decay, register

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


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _head_width(name: str, d_model: int, expand, num_heads: int) -> int:
    """Per-head width of a projection of size expand * d_model split over num_heads heads."""
    expand = _positive_float(name, expand)
    total = d_model * expand
    if abs(total - round(total)) > 1e-9 or round(total) % num_heads != 0:
        raise ValueError(
            f"{name}: d_model * {name} = {d_model} * {expand} = {total:g} must be an integer divisible "
            f"by num_heads = {num_heads}"
        )
    return round(total) // num_heads


def _split_width(d_model: int, num_heads: int) -> int:
    """Per-head width when d_model is split over the heads (q, k and v all d_model wide)."""
    if d_model % num_heads:
        raise ValueError(f"num_heads: d_model = {d_model} must be divisible by num_heads, got {num_heads}")
    return d_model // num_heads


def _complex(real: Tensor, imag: Tensor) -> Tensor:
    """torch.complex, with half precisions lifted to float32 (there is no complex bfloat16; the
    EOS op computes half-precision inputs in float32 anyway)."""
    if real.dtype in (torch.float16, torch.bfloat16):
        real, imag = real.float(), imag.float()
    return torch.complex(real, imag)


def _head_norm(y: Tensor, kind: str, eps: float, weight: Tensor | None = None) -> Tensor:
    """Normalise each head's D channels of y [B, T, H, D]: LayerNorm (RetNet's GroupNorm with one
    group per head) or RMSNorm (fla's GLA), optionally with a per-channel weight shared by heads."""
    if kind == "layernorm":
        y = y - y.mean(-1, keepdim=True)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


# ----------------------------------------------------------------------------- shared machinery


class _QKVAttention(Mixer):
    """Shared body: q/k/v projections, one EOS call, an output stage.

    Subclasses set ``num_heads``, ``head_k``, ``head_v``, ``normalize`` and implement
    ``eos_inputs(x) -> (i, e, s, log_o)`` (the ``eos`` arguments) and
    ``_output(y, x) -> [B, T, d_model]``.
    """

    normalize: bool = False
    complex_memory: bool = False
    memory_rows: int = 0  # K of the EOS memory (K/2 for RetNet's complex xPos pairs)

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
        rotation = _complex(torch.zeros_like(theta), theta).unsqueeze(-1)
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

    def eos_readout(self, x: Tensor, state: LinearAttentionState | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, d_model] -> (read-out [B, T, H, D] (real), final memory [B, H, K, D'])."""
        self.check_input(x)
        m0 = None
        if state is not None:
            if not isinstance(state, LinearAttentionState):
                raise ValueError(f"state: expected a LinearAttentionState, got {type(state).__name__}")
            m0 = state.memory
        if self.complex_memory:
            i, e, s, log_o, theta = self.rotating_inputs(x)
        else:
            i, e, s, log_o = self.eos_inputs(x)
        if self.normalize:
            # The normaliser z_t = sum_s o-weighted k_s is the same EOS with input 1: one extra
            # memory column computes numerator and denominator in a single pass.
            i = torch.cat([i, i.new_ones(*i.shape[:-1], 1)], -1)
        if self.complex_memory:
            # LCSM eq. 14-15: y_t = Re{[kv]_t}^T q_t, computed in the rotating frame (real kernels;
            # the same system as eos(*eos_inputs(x)): tests/layers/test_linear_attention.py checks it)
            y, m = eos_rotating(i, e, s, theta, log_o, initial_state=m0, output_final_state=True)
        else:
            y, m = eos(i, e, s, log_o, initial_state=m0, output_final_state=True)
        if self.normalize:
            y = y[..., :-1] * self._denominator(y[..., -1:])
        # eos promotes to the state's dtype (float32 for half-precision inputs): back to x's.
        return y.to(x.dtype), m

    def forward(self, x: Tensor, state: LinearAttentionState | None = None, return_state: bool = False):
        y, m = self.eos_readout(x, state)
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


# ----------------------------------------------------------------------------- linear attention


@register("linear_attention")
class LinearAttention(_QKVAttention):
    """Linear attention, Katharopoulos et al. 2020 ("Transformers are RNNs"), section 3.2 and the
    causal recurrence of section 3.4; LCSM Table 1 row "Linear Attention".

    Computation, in order (attribute names are stable: other layers copy these weights)::

        q = phi(q_proj(x)), k = phi(k_proj(x)), v = v_proj(x)    split to [B, T, H, K|D]
        m_t = m_{t-1} + k_t v_t^T                                (EOS: i=v, e=k, s=q, o=1)
        y_t = m_t^T q_t                                          [B, T, H, D]
        normalize: y_t / (q_t^T z_t + eps),  z_t = sum_{s<=t} k_s  (z is memory column D+1)
        out = o_proj(concat_heads(y))

    phi is ``1 + elu`` (the paper's feature map). No query scaling: the original has none (the
    normaliser makes the attention scale-free).

    Options:
        num_heads: H; head widths are d_model * expand_k / H and d_model * expand_v / H.
        expand_k, expand_v: key / value widths relative to d_model (1.0 in the original).
        feature_map: "1+elu" (original), "relu" or "identity".
        normalize: divide by phi(q_t)^T sum_s phi(k_s) as in the original (default True). LCSM
            Table 1 writes the row without the denominator; ``normalize=False`` is that row.
        eps: added to the denominator (1e-6, as in the authors' fast-transformers library).
        bias: biases on the four projections (True: fast-transformers uses nn.Linear defaults).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        feature_map: str = "1+elu",
        normalize: bool = True,
        eps: float = 1e-6,
        bias: bool = True,
    ):
        super().__init__(d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = _head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = _head_width("expand_v", d_model, expand_v, num_heads)
        self.feature_map = _choice("feature_map", feature_map, tuple(FEATURE_MAPS))
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: expected a bool, got {normalize!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias: expected a bool, got {bias!r}")
        self.normalize = normalize
        self.eps = _positive_float("eps", eps)
        self._make_qkv(d_model, bias)

    def eos_inputs(self, x):
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self._split(self.q_proj(x)))
        k = phi(self._split(self.k_proj(x)))
        v = self._split(self.v_proj(x))
        return v, k, q, None

    def _denominator(self, z):
        return 1.0 / (z + self.eps)

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="Linear Attention" + ("" if self.normalize else " (no denominator, LCSM Table 1 form)"),
            input="v_t",
            expand="k_t",
            oscillation="J^(kd)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Katharopoulos et al. 2020, Transformers are RNNs, sec. 3.2, 3.4; LCSM Table 1",
        )


# ----------------------------------------------------------------------------- RetNet


@register("retnet", "tnl")
class RetNet(_QKVAttention):
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
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = _head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = _head_width("expand_v", d_model, expand_v, num_heads)
        if not isinstance(xpos, bool):
            raise ValueError(f"xpos: expected a bool, got {xpos!r}")
        if xpos and self.head_k % 2:
            raise ValueError(f"xpos: needs an even key width per head to pair channels, got {self.head_k}")
        self.xpos = xpos
        self.norm = _choice("norm", norm, ("layernorm", "rmsnorm"))
        self.norm_eps = _positive_float("norm_eps", norm_eps)
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
        qc = _complex(q[..., 0::2], q[..., 1::2])
        kc = _complex(k[..., 0::2], k[..., 1::2])
        return v, kc.conj(), qc, log_gamma, self.xpos_theta(q).expand(self.num_heads, -1)

    def _output(self, y, x):
        y = _head_norm(y, self.norm, self.norm_eps)
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


# ----------------------------------------------------------------------------- cosFormer


@register("cosformer")
class Cosformer(_QKVAttention):
    """cosFormer, Qin et al. 2022 ("cosFormer: Rethinking Softmax in Attention"), section 3
    (relu features, cos-based re-weighting); official code OpenNLPLab/cosFormer; LCSM section 2.3
    and appendix 5.3 eq. 14.

    The re-weighting cos(pi/2 (t - s)/M) = Re exp(i (t - s) theta) with theta = pi / (2M) is a
    complex, data-independent oscillation, so the layer is one EOS call (LCSM eq. 14)::

        q = relu(q_proj(x)), k = relu(k_proj(x)), v = v_proj(x)       (with biases)
        m_t = exp(i theta_h) m_{t-1} + k_t v_t^T                      (log_o = i theta_h, [H, 1, 1])
        y_t = Re(m_t)^T q_t = sum_s cos((t - s) theta_h) (q_t . k_s) v_s
        normalize: y_t / max(sum_s cos((t - s) theta_h) q_t . k_s, eps)   (memory column D+1)
        out = o_proj(concat_heads(y))

    Departure: the original sets M to the current sequence length, which a streaming recurrence
    cannot know in advance (and makes a token's output depend on the future length). Here theta
    is fixed: by default pi / (2 * 512), i.e. M = 512; it may also be given per head. Re-weights
    stay non-negative only for t - s <= pi / (2 theta) = M: choose M >= the longest context.

    Options:
        num_heads: H.
        theta: a float shared by all heads (the original) or one float per head.
        normalize: the original's denominator (default True); False is LCSM Table 1's row.
        eps: clamp floor of the denominator (1e-6, as the official code).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        theta: float | Sequence[float] = math.pi / (2 * 512),
        normalize: bool = True,
        eps: float = 1e-6,
    ):
        super().__init__(d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = self.head_v = _split_width(d_model, self.num_heads)
        if isinstance(theta, Real) and not isinstance(theta, bool):
            thetas = [float(theta)] * num_heads
        elif (
            isinstance(theta, (list, tuple))
            and len(theta) == num_heads
            and all(isinstance(t, Real) and not isinstance(t, bool) for t in theta)
        ):
            thetas = [float(t) for t in theta]
        else:
            raise ValueError(f"theta: expected a float or a sequence of num_heads = {num_heads} floats, got {theta!r}")
        if not all(math.isfinite(t) for t in thetas):
            raise ValueError(f"theta: expected finite angles, got {theta!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: expected a bool, got {normalize!r}")
        self.normalize = normalize
        self.eps = _positive_float("eps", eps)
        self._make_qkv(d_model, bias=True)
        # Python floats, not a buffer, for the reason given in RetNet.__init__.
        self.thetas = tuple(thetas)
        self.complex_memory = True

    def rotating_inputs(self, x):
        q = F.relu(self._split(self.q_proj(x)))
        k = F.relu(self._split(self.k_proj(x)))
        v = self._split(self.v_proj(x))
        return v, k, q, None, torch.tensor(self.thetas, dtype=q.dtype, device=q.device).view(-1, 1)

    def _denominator(self, z):
        return 1.0 / z.clamp_min(self.eps)

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="cosFormer" + ("" if self.normalize else " (no denominator, LCSM Table 1 form)"),
            input="v_t",
            expand="k_t",
            oscillation="exp(i theta) J^(kd)",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Qin et al. 2022, cosFormer, sec. 3; LCSM Table 1 and appendix 5.3 eq. 14",
        )


# ----------------------------------------------------------------------------- LRPE


@register("lrpe")
class LRPE(_QKVAttention):
    """Linearized relative positional encoding, Qin et al. 2023c (LRPE), unitary family with a
    learnable per-channel angle; LCSM eq. 10 and appendix 5.3 eq. 15.

    Computation, in order::

        q = phi(q_proj(x)), k = phi(k_proj(x)), v = v_proj(x)
        m_t = diag(exp(i Theta_h)) m_{t-1} + k_t v_t^T         (log_o = i Theta, [H, K, 1])
        y_t = Re(m_t)^T q_t = sum_s sum_j cos((t - s) Theta_hj) q_tj k_sj v_s
        out = o_proj(concat_heads(y))

    Theta [H, K] is learned. Init: one RoPE spectrum over all H * K channels,
    Theta[h, k] = 10000^(-2 (h K + k) / (H K)) in [1e-8, 1], so heads cover different frequency
    bands, as the LRPE authors' own "cosformer style" Lrpe module does (Doraemonzzz/xmixers
    ``xmixers/modules/pes/_legacy/lrpe.py``, lrpe_type 3; moved there on 2025-01-16, and the new
    ``pes/lrpe.py`` numbers its types differently).
    Equivalent to LRPE's real form, which doubles q and k into [q cos(t theta), q sin(t theta)]:
    the complex memory holds the same 2 x K x D reals.

    No denominator (LCSM's row): with cos re-weights of both signs the kernel sum can vanish, so a
    normaliser would be ill-defined.

    Departure: this is LCSM's row on a plain linear attention, not the authors' layer. Their
    xmixers ``LinearAttention`` (``token_mixers/linear_attention/linear_attention.py``) uses SiLU
    features, no biases, and a per-head RMSNorm fused with a sigmoid output gate from a low-rank
    Linear(d -> head_dim -> d). The norm and gate have no counterpart here; the features alone
    (1+elu against SiLU on the same weights) change the output's RMS 45-85x and leave a cosine of
    0.33-0.47 (docs/zoo/linear_attention.md).

    Options:
        num_heads: H.
        feature_map: phi, "1+elu" (default; LRPE is a positional encoding for any linear
            attention kernel, we pair it with Katharopoulos' map), "relu" or "identity".
        bias: biases on the projections (default True).
    """

    def __init__(self, d_model: int, num_heads: int = 4, feature_map: str = "1+elu", bias: bool = True):
        super().__init__(d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = self.head_v = _split_width(d_model, self.num_heads)
        self.feature_map = _choice("feature_map", feature_map, tuple(FEATURE_MAPS))
        if not isinstance(bias, bool):
            raise ValueError(f"bias: expected a bool, got {bias!r}")
        self._make_qkv(d_model, bias)
        channels = self.num_heads * self.head_k
        c = torch.arange(channels, dtype=torch.float64)
        theta = (10000.0 ** (-2.0 * c / channels)).view(self.num_heads, self.head_k)
        self.theta = no_weight_decay(nn.Parameter(theta.to(torch.get_default_dtype())))
        self.complex_memory = True

    def rotating_inputs(self, x):
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self._split(self.q_proj(x)))
        k = phi(self._split(self.k_proj(x)))
        return self._split(self.v_proj(x)), k, q, None, self.theta

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="LRPE (linear attention)",
            input="v_t",
            expand="k_t",
            oscillation="exp(i Theta) 1^(d)T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Qin et al. 2023c, Linearized Relative Positional Encoding; LCSM eq. 10, appendix 5.3 eq. 15",
        )


# ----------------------------------------------------------------------------- GLA


@register("gla", "gateloop")
class GLA(_QKVAttention):
    """Gated linear attention, Yang et al. 2023 (GLA), section 4 (the gated recurrence and the GLA
    Transformer layer); official code fla ``GatedLinearAttention``; LCSM Table 1 row "GLA/GateLoop".

    Computation, in order::

        q = q_proj(x) * K^-1/2, k = k_proj(x), v = v_proj(x)           (no biases)
        log alpha_t = logsigmoid(gk_proj(x)) / tau,  gk_proj = Linear(d, 16) -> Linear(16, H K, bias)
        m_t = diag(alpha_t) m_{t-1} + k_t v_t^T,  y_t = m_t^T q_t       (log_o [B, T, H, K, 1])
        y = norm_h(y) * norm_weight       (per head over D; "layernorm" paper, "rmsnorm" fla)
        out = o_proj(swish(g_proj(x)) * y)     (g_proj with bias: the paper's r_t = Swish(x W_r + b_r))

    alpha_t = sigmoid(x W_1 W_2 + b)^(1/tau) with tau = 16 (the paper's low-rank decay, rank 16),
    computed in log space. The query scale K^-1/2 is that of the authors' kernels (fla).
    The alias ``gateloop`` builds this layer; GateLoop's own complex data-dependent decay is not
    reproduced (see docs/zoo/linear_attention.md).

    Options:
        num_heads: H (4 in the paper).
        expand_k, expand_v: key / value widths relative to d_model (paper: 0.5 and 1).
        gate_low_rank_dim: rank of the decay projection (16).
        gate_logit_normalizer: tau (16).
        norm: "layernorm" (paper) or "rmsnorm" (fla).
        norm_eps: 1e-5 (fla).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
    ):
        super().__init__(d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = _head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = _head_width("expand_v", d_model, expand_v, num_heads)
        rank = _positive_int("gate_low_rank_dim", gate_low_rank_dim)
        self.tau = _positive_float("gate_logit_normalizer", gate_logit_normalizer)
        self.norm = _choice("norm", norm, ("layernorm", "rmsnorm"))
        self.norm_eps = _positive_float("norm_eps", norm_eps)
        self._make_qkv(d_model, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(d_model, rank, bias=False), nn.Linear(rank, self.num_heads * self.head_k, bias=True)
        )
        no_weight_decay(self.gk_proj[1].bias)
        self.g_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=True)
        no_weight_decay(self.g_proj.bias)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(self.head_v)))

    def eos_inputs(self, x):
        q = self._split(self.q_proj(x)) * self.head_k**-0.5
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        log_alpha = F.logsigmoid(self._split(self.gk_proj(x))) / self.tau
        return v, k, q, log_alpha.unsqueeze(-1)

    def _output(self, y, x):
        y = _head_norm(y, self.norm, self.norm_eps, self.norm_weight)
        g = self._split(self.g_proj(x))
        return self.o_proj((F.silu(g) * y).flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="GLA",
            input="v_t",
            expand="k_t",
            oscillation="g_t 1_d^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Yang et al. 2023, Gated Linear Attention, sec. 4; LCSM Table 1 (GLA/GateLoop)",
        )


# ----------------------------------------------------------------------------- DUR / GFW


@register("dur", "gfw")
class DUR(_QKVAttention):
    """Decaying fast weights with an outer-product gate, Mao 2022 (decay update rule, DUR) and
    Schlag & Schmidhuber 2018 (gated fast weights, GFW); LCSM Table 1 row "DUR/GFW".

    Computation, in order::

        q = q_proj(x) * K^-1/2, k = k_proj(x), v = v_proj(x)     (no feature map, no biases)
        log g_t    = logsigmoid(gk_proj(x)) / tau     [B, T, H, K]
        log gbar_t = logsigmoid(gv_proj(x)) / tau     [B, T, H, D]
        m_t = (g_t gbar_t^T) o m_{t-1} + k_t v_t^T    (log_o = log g[k] + log gbar[d], passed as the
                                                       separable pair ([B, T, H, K, 1], [B, T, H, 1, D]))
        y_t = m_t^T q_t
        out = o_proj(concat_heads(y))

    The sigmoid^(1/tau) gates (tau = 16) are LCSM's data-dependent oscillation rule (sec. 2.4) and
    its oscillation code 1 (outer product of a d-gate and a k-gate). Mao's "no feature map, no
    attention normalisation" is kept; the query scale K^-1/2 is that of the softmax attention Mao
    fine-tunes from.

    Options:
        num_heads: H.
        expand_k, expand_v: key / value widths relative to d_model.
        gate_logit_normalizer: tau (16).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        gate_logit_normalizer: float = 16.0,
    ):
        super().__init__(d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_k = _head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = _head_width("expand_v", d_model, expand_v, num_heads)
        self.tau = _positive_float("gate_logit_normalizer", gate_logit_normalizer)
        self._make_qkv(d_model, bias=False)
        self.gk_proj = nn.Linear(d_model, self.num_heads * self.head_k, bias=True)
        self.gv_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=True)
        no_weight_decay(self.gk_proj.bias)
        no_weight_decay(self.gv_proj.bias)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """log g [B, T, H, K] and log gbar [B, T, H, D]."""
        return (
            F.logsigmoid(self._split(self.gk_proj(x))) / self.tau,
            F.logsigmoid(self._split(self.gv_proj(x))) / self.tau,
        )

    def eos_inputs(self, x):
        q = self._split(self.q_proj(x)) * self.head_k**-0.5
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        log_g, log_gbar = self.gates(x)
        # The separable pair, not its [B, T, H, K, D] sum: eos's matmul kernel applies g along K and
        # gbar along D (LCSM o code 1's form), where the sum would need the step-by-step
        # elementwise kernel (4.98x slower at T 256, 11.66x at T 2048: docs/eos.md).
        return v, k, q, (log_g.unsqueeze(-1), log_gbar.unsqueeze(-2))

    def _output(self, y, x):
        return self.o_proj(y.flatten(-2))

    def describe(self) -> EOSRow:
        return EOSRow(
            name="DUR/GFW",
            input="v_t",
            expand="k_t",
            oscillation="g_t gbar_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Mao 2022, Decaying Fast Weights; Schlag & Schmidhuber 2018; LCSM Table 1 (DUR/GFW)",
        )
