"""Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality", ICML 2024: section 6, the chunked SSD
algorithm of Listing 1; section 7, the Mamba-2 block) as a configuration of the EOS operator.

The SSD layer, per head h (scalar decay), head channel p and state index n::

    Delta_t[h] = softplus(dt_t[h] + dt_bias[h])
    m_t[n, p]  = exp(Delta_t[h] A[h]) m_{t-1}[n, p] + B_t[n] Delta_t[h] x_t[p]
    y_t[p]     = sum_n C_t[n] m_t[n, p] + D[h] x_t[p]

which is EOS (LCSM Table 1 row "Mamba", with Mamba-2's scalar-times-identity A) with H = nheads
heads, K = N = d_state rows and D = headdim columns:

    i_t = Delta_t x_t [B, T, H, P]    e_t = B_t [B, T, H, N]    s_t = C_t [B, T, H, N]
    log o_t = Delta_t A [B, T, H, 1, 1]   (one data-dependent scalar per head)

B_t and C_t are shared by the H / ngroups heads of a group (the paper's "multi-value" /
grouped heads, section 7.2). Around the scan (the block of figure 6): one in_proj to [z, x, B, C, dt]
(the official order), a causal depthwise conv of width d_conv over the concatenation xBC with SiLU,
the D skip, the gated RMSNorm norm(y * SiLU(z)) (normalised per group of d_inner / ngroups
channels; official ``norm_before_gate=False``) and out_proj.

Sources: the paper; state-spaces/mamba at e9594ce1c732d97440f0332fdc43170a2294dbfa,
``mamba_ssm/modules/mamba2.py`` (Mamba2: layout, inits, defaults, the non-fused ``step``),
``mamba_ssm/modules/ssd_minimal.py`` (the chunked SSD reference the test mirrors) and
``mamba_ssm/ops/triton/layernorm_gated.py`` (``rms_norm_ref``: the gate before the norm, group_size,
float32 upcast).

Parameterisation and inits (official): A = -exp(A_log), A ~ U[A_init_range] = U[1, 16] per head;
dt_bias = softplus^-1(dt), dt ~ LogUniform[dt_min, dt_max] = [1e-3, 1e-1] clamped at 1e-4; D = 1
per head; RMSNorm weight 1, eps 1e-5; in/out projections without bias, conv with bias, PyTorch's
default inits for them (official ``conv_init=None``).

Departures: defaults scaled to small widths (official d_state 128, headdim 64 at d_model >= 768;
here d_state 16, headdim 16 so that d_model 16 runs fast and has 2 heads); no ``d_ssm`` (gated-MLP
channels beside the SSM), no ``D_has_hdim``, no ``dt_limit`` clamp (official default: none), no
``rmsnorm=False`` variant. The official GPT-style model rescales out_proj at init by 1 / sqrt(n_layer)
(``_init_weights``, a model-level choice), not done here.

Packed sequences (``cu_seqlens``): the convolution restarts per document (``packing.causal_conv``)
and one EOS call runs the row; the rest is per token.

Shape glossary: B batch, T time, d_model model width, d_inner = expand * d_model, H = nheads =
d_inner / headdim, P = headdim, N = d_state, G = ngroups, W = d_conv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float, check_int

from ..ops import eos, native_gated_rms_norm, native_serves
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import short_conv

Tensor = torch.Tensor

# Official init floor for the sampled dt (Mamba2 dt_init_floor).
DT_INIT_FLOOR = 1e-4
# Official gated RMSNorm epsilon (Mamba2: RMSNormGated(..., eps=1e-5)).
NORM_EPS = 1e-5


@dataclass
class Mamba2State(State):
    """conv [B, W - 1, d_inner + 2 G N]: the last W - 1 conv inputs (xBC after in_proj), oldest first.
    ssm [B, H, N, P]: the SSM memory in EOS layout [B, H, K, D] (the official ssm_state transposed)."""

    conv: Tensor
    ssm: Tensor


@register("mamba2")
class Mamba2(Mixer):
    """Mamba-2 (SSD) mixer.

    Args:
        d_model: model width.
        d_state: N, state size per head (official 128; default 16 here).
        d_conv: W, width of the causal depthwise convolution over xBC (default 4).
        expand: d_inner = expand * d_model (default 2).
        headdim: P, channels per head; d_inner must be a multiple (official 64; default 16 here).
        ngroups: G, groups of heads sharing B_t and C_t; must divide the number of heads (default 1).
        A_init_min, A_init_max: range of the uniform init of -A per head (official (1, 16)).
        dt_min, dt_max: range of the log-uniform init of Delta (official 1e-3 and 1e-1).
        chunk_size: C, steps per chunk of the chunked scan (official 256, for its GPU kernels;
            default 16 here: with 16-wide heads a chunk's C x C maps are most of its work, and
            decays as strong as exp(-16 Delta) send long chunks to the kernel's sub-chunk form; on
            a CPU the efficiency benchmark's Mamba-2 trained 1.5-1.6x faster with 16 than with
            the operator's default 64, bench/results/mamba2_chunk.md). Changes no number beyond
            rounding.
    """

    # The official module reads A_log as float32 ("if the model is loaded in fp16 ... A might be
    # -inf") and its kernels take dt_bias and D in float32; stored float32 here likewise.
    float32_parameters = ("A_log", "D", "dt_bias")

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        headdim: int = 16,
        ngroups: int = 1,
        A_init_min: float = 1.0,
        A_init_max: float = 16.0,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        chunk_size: int = 16,
    ):
        super().__init__(d_model)
        self.d_state = check_int("d_state", d_state, 1)
        self.d_conv = check_int("d_conv", d_conv, 1)
        self.expand = check_int("expand", expand, 1)
        self.headdim = check_int("headdim", headdim, 1)
        self.ngroups = check_int("ngroups", ngroups, 1)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        d_inner = self.d_inner = self.expand * d_model
        if d_inner % self.headdim:
            raise ValueError(f"headdim: expected a divisor of d_inner = expand * d_model = {d_inner}, got {headdim!r}")
        H = self.nheads = d_inner // self.headdim
        if H % self.ngroups:
            raise ValueError(f"ngroups: expected a divisor of the number of heads {H}, got {ngroups!r}")
        check_float("A_init_min", A_init_min, 0, low_open=True)
        check_float("A_init_max", A_init_max, 0, low_open=True)
        if not A_init_min <= A_init_max:
            raise ValueError(
                f"A_init_min, A_init_max: expected A_init_min <= A_init_max, got {A_init_min!r} > {A_init_max!r}"
            )
        check_float("dt_min", dt_min, 0, low_open=True)
        check_float("dt_max", dt_max, 0, low_open=True)
        if not dt_min <= dt_max:
            raise ValueError(f"dt_min, dt_max: expected dt_min <= dt_max, got {dt_min!r} > {dt_max!r}")
        self.A_init_min, self.A_init_max = float(A_init_min), float(A_init_max)
        self.dt_min, self.dt_max = float(dt_min), float(dt_max)
        N, G = self.d_state, self.ngroups
        self.conv_dim = d_inner + 2 * G * N

        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * G * N + H, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.d_conv, groups=self.conv_dim, bias=True)
        no_weight_decay(self.conv1d.bias)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(d_inner)))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

        # dt_bias = softplus^-1(dt) with dt ~ LogUniform[dt_min, dt_max]: Delta for a zero input
        # starts in that range (official init; the inverse written with expm1 for small dt).
        dt = torch.exp(torch.rand(H) * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min)).clamp(
            min=DT_INIT_FLOOR
        )
        self.dt_bias = no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
        A = torch.empty(H).uniform_(self.A_init_min, self.A_init_max)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(A)))
        self.D = no_weight_decay(nn.Parameter(torch.ones(H)))

    # ------------------------------------------------------------------ pieces (used by tests)

    def conv(self, xBC: Tensor, conv_state: Tensor | None, cu_seqlens: Tensor | None = None):
        """Causal depthwise conv + SiLU over xBC [B, T, conv_dim]; conv_state [B, W - 1, conv_dim]
        (previous inputs, zeros at a sequence start). Returns (activated [B, T, conv_dim], new state)."""
        return short_conv(xBC, self.conv1d.weight, self.conv1d.bias, cu_seqlens, conv_state, silu=True)

    def gated_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """RMSNorm(y * SiLU(z)) per group of d_inner / G channels, in float32 at least (official
        ``rms_norm_ref`` with upcast): y, z [B, T, d_inner]."""
        if native_serves(y) and z.dtype == y.dtype:  # one native pass each way on the CPU
            return native_gated_rms_norm(y, z, self.norm_weight, self.d_inner // self.ngroups, NORM_EPS, True)
        wide = torch.promote_types(y.dtype, torch.float32)
        g = (y.to(wide) * F.silu(z.to(wide))).unflatten(-1, (self.ngroups, -1))
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + NORM_EPS)
        return g.flatten(-2) * self.norm_weight.to(wide)

    # ------------------------------------------------------------------ mixer interface

    def forward(
        self,
        x: Tensor,
        state: Mamba2State | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        d_inner, N, G, H, P = self.d_inner, self.d_state, self.ngroups, self.nheads, self.headdim
        z, xBC, dt = self.in_proj(x).split([d_inner, self.conv_dim, H], dim=-1)
        xBC, conv_state = self.conv(xBC, state.conv if state is not None else None, cu_seqlens)
        xs, Bt, Ct = xBC.split([d_inner, G * N, G * N], dim=-1)
        # Delta in float32 at least, as the official kernels take dt_bias and softplus in float32.
        wide = torch.promote_types(dt.dtype, torch.float32)
        delta = F.softplus(dt.to(wide) + self.dt_bias.to(wide))  # [B, T, H]
        A = -torch.exp(self.A_log.to(wide))
        heads = xs.unflatten(-1, (H, P))
        # Each group's B_t and C_t serve its H / G consecutive heads (official "(g n)" layout).
        Bt = Bt.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=2)
        Ct = Ct.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=2)
        y, ssm = eos(
            delta[..., None] * heads,
            Bt,
            Ct,
            (delta * A)[..., None, None],
            initial_state=state.ssm if state is not None else None,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        y = (y + self.D[:, None] * heads).flatten(-2)
        out = self.out_proj(self.gated_norm(y, z).to(x.dtype))
        if return_state:
            return out, Mamba2State(conv=conv_state, ssm=ssm)
        return out

    def init_state(self, batch_size: int) -> Mamba2State:
        p = self.in_proj.weight  # the conv buffer holds its outputs
        return Mamba2State(
            conv=torch.zeros(batch_size, self.d_conv - 1, self.conv_dim, dtype=p.dtype, device=p.device),
            ssm=torch.zeros(
                batch_size, self.nheads, self.d_state, self.headdim, dtype=self._memory_dtype(), device=p.device
            ),
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="mamba2",
            input="Delta_t x_t (x_t from SiLU(conv(xBC_t)))",
            expand="B_t (shared by the heads of a group)",
            oscillation="exp(Delta_t A_h) (one scalar per head)",
            shrink="C_t, then RMSNorm(y_t * SiLU(z_t))",
            memory=f"K x D = {self.d_state} x {self.headdim} per head, {self.nheads} heads",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Dao & Gu 2024, Transformers are SSMs: Generalized Models and Efficient Algorithms "
            "Through Structured State Space Duality (ICML 2024, arXiv:2405.21060), sections 6-7",
        )
