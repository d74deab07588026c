"""``gdn2``: Gated DeltaNet-2 (GDN-2), the gated delta rule with a channel-wise erase gate on the key
axis and a channel-wise write gate on the value axis.

A matrix-transition mixer on :func:`lcsm.ops.eos_dplr`; docs/zoo/longhorn_comba_gdn2.md.

Shape glossary: B batch, T time, H query/key heads, G value heads per key head (grouped value
heads), K key width per head (memory rows), D value width per head (memory columns), W width of a
short convolution, N documents of a packed row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_float, check_int

from ..ops import DPLR_MODES, eos_dplr
from ._gated_delta import GatedDeltaState, inverse_softplus_dt, l2norm_fla, value_width
from ._qkv import head_width
from .base import EOSRow, Mixer, no_weight_decay, register, short_convs
from .packing import short_conv

Tensor = torch.Tensor


@register("gdn2")
class GatedDeltaNet2(Mixer):
    """Gated DeltaNet-2 ("Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention", NVIDIA,
    NVlabs/GatedDeltaNet-2); layer as fla-core 0.6.0's ``fla/layers/gdn2.py`` and its recurrence
    ``fla/ops/gdn2`` (``naive_recurrent_gdn2``)::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x));  q, k L2-normalised per head
        b_t = sigmoid(W_b x)  [H, K]  erase gate   (2 sigmoid(W_b x) with negative_eigenvalues)
        w_t = sigmoid(W_w x)  [H, D]  write gate
        log alpha_t = -exp(A_log[h]) softplus(W_f2 W_f1 x + dt_bias)   [H, K]: one decay per key channel
        S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T,  o_t = S_t^T q_t K^-1/2
        y = o_proj(RMSNorm(o_t) * sigmoid(W_g2 W_g1 x + b_g))             (per head over D)

    eos_dplr with log_alpha = log alpha_t [B, T, H, K], a = e = k, b = alpha * b * k, i = w * v,
    s = q K^-1/2, since (I - k (b k)^T) Diag(alpha) = Diag(alpha) - k (alpha b k)^T. With b and w
    one scalar beta per head this is KDA. The decay and output-gate projections are low rank, of
    rank D (fla's head_v_dim).

    Grouped value heads (fla's num_v_heads = G H): q, k, b and log alpha of key head h serve the
    value heads h G .. h G + G - 1, each with its own memory.

    Options (fla's defaults, widths relative to d_model: fla's 16 heads of 128 at d_model 2048 are
    key width 1 d_model):
        num_heads: H (4).  num_v_heads: G H (None: H).
        expand_k: H K / d_model (1).  expand_v: D / K (1).
        conv_size: W (4); conv_bias (False).
        negative_eigenvalues: b in [0, 2] (fla's allow_neg_eigval).
        norm_eps: the output RMSNorm's eps (1e-5).  mode: eos_dplr's mode.

    Inits as fla: A ~ U(1, 16) per key head stored as A_log = log A; dt_bias [H K] = softplus^-1
    of dt ~ LogUniform[1e-3, 0.1] (floor 1e-4); projections and convolutions PyTorch's defaults.
    """

    modes = DPLR_MODES
    # A_log and dt_bias define the decay over the whole sequence; fla keeps them float32.
    float32_parameters = ("A_log", "dt_bias")

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        num_v_heads: int | None = None,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        conv_size: int = 4,
        conv_bias: bool = False,
        negative_eigenvalues: bool = False,
        norm_eps: float = 1e-5,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.num_v_heads = check_int("num_v_heads", num_v_heads, 1, allow_none=True) or self.num_heads
        if self.num_v_heads % self.num_heads:
            raise ValueError(
                f"num_v_heads: expected a multiple of num_heads = {self.num_heads} (each key head serves "
                f"a group of value heads), got {self.num_v_heads}"
            )
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = value_width(self.head_k, expand_v)
        self.conv_size = check_int("conv_size", conv_size, 1)
        conv_bias = check_bool("conv_bias", conv_bias)
        self.negative_eigenvalues = check_bool("negative_eigenvalues", negative_eigenvalues)
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self.mode = check_choice("mode", mode, DPLR_MODES)
        H, K, D = self.num_heads, self.head_k, self.head_v
        kd, vd = H * K, self.num_v_heads * D
        self.q_proj = nn.Linear(d_model, kd, bias=False)
        self.k_proj = nn.Linear(d_model, kd, bias=False)
        self.v_proj = nn.Linear(d_model, vd, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = short_convs((kd, kd, vd), conv_size, conv_bias)
        self.f_proj = nn.Sequential(nn.Linear(d_model, D, bias=False), nn.Linear(D, kd, bias=False))
        self.b_proj = nn.Linear(d_model, kd, bias=False)
        self.w_proj = nn.Linear(d_model, vd, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(inverse_softplus_dt(kd)))
        self.g_proj = nn.Sequential(nn.Linear(d_model, D, bias=False), nn.Linear(D, vd, bias=True))
        no_weight_decay(self.g_proj[1].bias)
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(D)))
        self.o_proj = nn.Linear(vd, d_model, bias=False)

    # -- pieces (the tests feed them to fla's reference recurrence) ---------------------------------
    def recurrence_inputs(self, row: Tensor, docs: Tensor | None, state: GatedDeltaState | None = None):
        """The recurrence's inputs in fla's naming, for a packed row [1, T, d_model] and its document
        bounds, or a batch [B, T, d_model] of sequences (docs None): q, k [B, T, G H, K] (after conv,
        SiLU and L2 norm, q not yet scaled), v [B, T, G H, D], g = log alpha [B, T, G H, K] (float32
        at least), b [B, T, G H, K], w [B, T, G H, D], and the three convolution histories."""
        H, K, D = self.num_heads, self.head_k, self.head_v
        hist = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        projected = (self.q_proj(row), self.k_proj(row), self.v_proj(row))
        (q, cq), (k, ck), (v, cv) = (
            short_conv(p, c.weight, c.bias, docs, h) for p, c, h in zip(projected, convs, hist, strict=True)
        )
        q, k = F.silu(q).unflatten(-1, (H, K)), F.silu(k).unflatten(-1, (H, K))
        v = F.silu(v).unflatten(-1, (self.num_v_heads, D))
        b = torch.sigmoid(self.b_proj(row)).unflatten(-1, (H, K))
        if self.negative_eigenvalues:
            # Grazzi et al. 2025: b in [0, 2] lets I - k (b k)^T reach eigenvalue -1.
            b = 2 * b
        w = torch.sigmoid(self.w_proj(row)).unflatten(-1, (self.num_v_heads, D))
        # In float32 at least (A_log, dt_bias are float32 parameters), as fla's layer computes it: a
        # half-precision softplus would round alpha_t near 1, where long memories live.
        f = self.f_proj(row)
        wide = torch.promote_types(f.dtype, torch.float32)
        g = -torch.exp(self.A_log.to(wide)).unsqueeze(-1) * F.softplus(
            (f.to(wide) + self.dt_bias.to(wide)).unflatten(-1, (H, K))
        )
        # The L2 norm is per key head, so normalising before or after the broadcast to the value
        # heads is the same.
        q, k = l2norm_fla(q), l2norm_fla(k)
        group = self.num_v_heads // H
        if group > 1:
            q, k, g, b = (t.repeat_interleave(group, dim=-2) for t in (q, k, g, b))
        return q, k, v, g, b, w, (cq, ck, cv)

    def recurrence(
        self, q, k, v, g, b, w, docs: Tensor | None, initial_state: Tensor | None = None, final: bool = True
    ):
        """S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T,
        o_t = S_t^T q_t K^-1/2 on eos_dplr, per document of the packed row (per row without docs);
        the final states too when ``final`` (None otherwise)."""
        return eos_dplr(
            w * v,
            k,
            q * self.head_k**-0.5,
            k,
            torch.exp(g).to(k.dtype) * b * k,
            g,
            mode=self.mode,
            initial_state=initial_state,
            output_final_state=final,
            cu_seqlens=docs,
        )

    def readout(self, row: Tensor, o: Tensor) -> Tensor:
        """The sigmoid-gated RMSNorm per head and o_proj: o [B, T, G H, D] -> [B, T, d_model]."""
        # Normalised and gated in float32 at least, as fla's fused gated norm does for half inputs.
        wide = torch.promote_types(row.dtype, torch.float32)
        o = F.rms_norm(o.to(wide), (self.head_v,), self.o_norm.to(wide), eps=self.norm_eps)
        o = o * torch.sigmoid(self.g_proj(row).to(wide).unflatten(-1, (self.num_v_heads, self.head_v)))
        return self.o_proj(o.to(row.dtype).flatten(-2))

    # -- mixer interface ---------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        state: GatedDeltaState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        # each row of the batch its own sequence, or the documents of one packed row
        docs = self.check_call(x, cu_seqlens)
        q, k, v, g, b, w, convs = self.recurrence_inputs(x, docs, state)
        o, m = self.recurrence(q, k, v, g, b, w, docs, None if state is None else state.memory, return_state)
        y = self.readout(x, o)
        if return_state:
            return y, GatedDeltaState(memory=m, conv_q=convs[0], conv_k=convs[1], conv_v=convs[2])
        return y

    def init_state(self, batch_size: int) -> GatedDeltaState:
        p = self.q_proj.weight
        kd, vd, W = self.num_heads * self.head_k, self.num_v_heads * self.head_v, self.conv_size - 1
        return GatedDeltaState(
            memory=p.new_zeros(batch_size, self.num_v_heads, self.head_k, self.head_v, dtype=self._memory_dtype()),
            conv_q=p.new_zeros(batch_size, W, kd),
            conv_k=p.new_zeros(batch_size, W, kd),
            conv_v=p.new_zeros(batch_size, W, vd),
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="GDN-2",
            input="w_t * v_t",
            expand="k_t",
            oscillation="(I_k - k_t (b_t * k_t)^T) Diag(alpha_t)",
            shrink="q_t",
            memory=f"K x D = {self.head_k} x {self.head_v} per head, {self.num_v_heads} heads",
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention (NVlabs/GatedDeltaNet-2); "
            "fla/layers/gdn2.py (fla-core 0.6.0)",
        )
