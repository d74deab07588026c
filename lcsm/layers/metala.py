"""MetaLA: Meta Linear Attention (Chou et al., NeurIPS 2024), the improved layer of appendix A3.2.

    x~_t  = SiLU(CausalDepthwiseConv1d(x)_t)                       (eq. A31, short convolution)
    q_t   = x~_t W_Q,   alpha_t = sigmoid(x~_t W_alpha)^(1/16)      (eq. A32), d_k = d/2
    v_t   = x~_t W_V,   g_t = SiLU(x~_t W_G + b_G)                  (eq. A33), d_v = d
    S_t^h = diag(alpha_t^h) S_{t-1}^h + (1 - alpha_t^h)^T v_t^h     (eq. A34, no key)
    o_t^h = c q_t^h S_t^h + sigmoid(q_t^h (w_aug^h * (1 - alpha_t^h))^T v_t^h)   (eq. A35)
    o_t   = LayerNorm_per_head(o_t),   y_t = (g_t * o_t) W_O         (eq. A36-A37)

As an EOS recurrence (LCSM eq. 2-3) per head: input v_t, expand 1 - alpha_t, oscillation
alpha_t 1^T (a GLA-style row decay), shrink c q_t, with c = (d_k / H)^-1/2. The scan runs in
``lcsm.ops.eos``; the self-augmentation term touches only the output, never the memory, so it
is added after the scan (the paper's "separation of output and memory", section A3.2).

Facts taken from the official code (``BICLab/MetaLA``, ``QVMetaLA_self_aug``), where the paper
is silent or differs:
  * c = key_head_dim^-0.5: the official layer calls fla's ``fused_chunk_gla`` with its default
    scale, which is q.shape[-1]^-0.5 (the per-head query/decay width d/(2H)). The paper's
    eq. A35 has no scale. The self-augmentation uses the unscaled q (as the code does).
  * The self-augmentation nonlinearity wraps ``aug_t * v_t`` elementwise (eq. A35 and the code);
    the parallel-form eq. A38 writes the same term without sigmoid, which we do not follow.
  * w_aug starts at zeros; the conv has no bias; LayerNorm eps 1e-5 without affine.

Packed sequences (``cu_seqlens``): the short convolution restarts per document
(``packing.causal_conv``) and one EOS call runs the row; the rest is per token.

Shape glossary: B batch, T time, H heads, K = d_model / (2H) query/decay width per head,
D = d_model / H value width per head, W = conv_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_int
from lcsm.ops import eos

from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import short_conv

Tensor = torch.Tensor


@dataclass
class MetaLAState(State):
    """memory: S_t of every head [B, H, K, D]; conv: the last W - 1 raw inputs [B, d_model, W - 1]
    (None when ``conv=False``)."""

    memory: Tensor
    conv: Tensor | None = None


@register("metala")
class MetaLA(Mixer):
    """MetaLA token mixer (appendix A3.2, eq. A31-A37), with the paper's ablations as options.

    Args:
        d_model: model width d; must be even (d_k = d/2) with d/2 divisible by ``heads``.
        heads: number of heads H. The official LM uses 8 heads of value width 128 at d = 1024;
            the default 4 keeps K >= 2 at the small widths of the synthetic tasks.
        conv_size: kernel W of the short causal depthwise convolution (4 in the official LM
            code, 2 in the paper's MQAR setup).
        self_augmentation: add the eq. A35 self-augmentation term (False: eq. A26's plain output).
        conv: apply the short convolution + SiLU (eq. A31) before all projections (False: the
            projections read x directly, as in the basic layer eq. A23).
        use_key: restore a key k_t = x~ W_K (Linear d -> d/2, on the convolved x~ like q and
            alpha) in place of 1 - alpha_t (the section 6 ablation "restoring the Key matrix");
            the decay is unchanged and the self-augmentation then uses k_t where it used
            1 - alpha_t.
    """

    TAU = 16.0  # decay temperature: alpha = sigmoid(.)^(1/tau), tau = 16 (section A3.1)
    option_variants = ({"conv": False},)

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        conv_size: int = 4,
        self_augmentation: bool = True,
        conv: bool = True,
        use_key: bool = False,
    ):
        super().__init__(d_model)
        check_int("heads", heads, 1)
        if d_model % 2 or (d_model // 2) % heads:
            raise ValueError(
                f"heads: d_model / 2 (the query/decay width) must be divisible by heads, got d_model={d_model}, "
                f"heads={heads}"
            )
        self.heads = heads
        self.conv_size = check_int("conv_size", conv_size, 1)
        self.self_augmentation = check_bool("self_augmentation", self_augmentation)
        self.use_conv = check_bool("conv", conv)
        self.use_key = check_bool("use_key", use_key)
        d_k = d_model // 2
        self.key_dim = d_k // heads
        self.head_dim = d_model // heads

        if self.use_conv:
            self.conv1d = nn.Conv1d(d_model, d_model, kernel_size=conv_size, groups=d_model, bias=False)
        self.q_proj = nn.Linear(d_model, d_k, bias=False)
        self.decay_proj = nn.Linear(d_model, d_k, bias=False)
        if self.use_key:
            self.k_proj = nn.Linear(d_model, d_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.g_proj = nn.Linear(d_model, d_model, bias=True)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        if self.self_augmentation:
            self.w_aug = nn.Parameter(torch.zeros(d_k))
        # The official layer's own init (post_init): small xavier for the query and decay maps.
        # Its bias-carrying gate is zero-initialised by both official model-level inits.
        nn.init.xavier_uniform_(self.q_proj.weight, gain=2**-2.5)
        nn.init.xavier_uniform_(self.decay_proj.weight, gain=2**-2.5)
        nn.init.zeros_(self.g_proj.bias)
        no_weight_decay(self.g_proj.bias)

    # ------------------------------------------------------------------ pieces

    def _short_conv(self, x: Tensor, buffer: Tensor | None, cu_seqlens: Tensor | None = None):
        """Causal depthwise conv + SiLU over x [B, T, d] continuing from ``buffer`` [B, d, W-1]
        (the previous raw inputs; zeros at the start). Returns (x~ [B, T, d], new buffer).
        With ``cu_seqlens`` x is a packed row, the buffer holds one row per document and the
        convolution restarts at each document's start."""
        history = None if buffer is None else buffer.transpose(1, 2)
        out, last = short_conv(x, self.conv1d.weight, None, cu_seqlens, history, silu=True)
        return out, last.transpose(1, 2)

    def _heads(self, t: Tensor, width: int) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.heads, width)

    # ------------------------------------------------------------------ interface

    def forward(
        self,
        x: Tensor,
        state: MetaLAState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, d_model] -> y [B, T, d_model] (and the final MetaLAState when asked)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, d = x.shape
        H, K, D = self.heads, self.key_dim, self.head_dim
        memory = state.memory if state is not None else None
        conv_buffer = None
        h = x
        if self.use_conv:
            h, conv_buffer = self._short_conv(x, state.conv if state is not None else None, cu_seqlens)

        q = self._heads(self.q_proj(h), K)  # [B, T, H, K]
        log_alpha = F.logsigmoid(self._heads(self.decay_proj(h), K)) / self.TAU
        v = self._heads(self.v_proj(h), D)  # [B, T, H, D]
        # 1 - alpha as -expm1(log alpha): exact for alpha close to 1, where the decays live.
        k = self._heads(self.k_proj(h), K) if self.use_key else -torch.expm1(log_alpha)

        o, memory = eos(
            v,
            k,
            q * K**-0.5,
            log_alpha.unsqueeze(-1),
            initial_state=memory,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        # The augmentation's sigmoid, its sum with o and the norm in float32 at least:
        # sigmoid(aug v) is about 1/2 (w_aug starts at 0) where o is small (k = 1 - alpha), and a
        # bfloat16 sum would keep two or three bits of o, which the norm then scales up (about 0.2-0.3
        # relative error for a 16-wide bfloat16 layer).
        wide = torch.promote_types(o.dtype, torch.float32)
        o = o.to(wide)
        if self.self_augmentation:
            aug = (q * k * self.w_aug.view(H, K)).sum(-1, keepdim=True)  # [B, T, H, 1]
            o = o + torch.sigmoid(aug.to(wide) * v.to(wide))
        o = F.layer_norm(o, (D,), eps=1e-5).reshape(B, T, d).to(x.dtype)
        y = self.out_proj(F.silu(self.g_proj(h)) * o)
        if return_state:
            return y, MetaLAState(memory=memory, conv=conv_buffer)
        return y

    def init_state(self, batch_size: int) -> MetaLAState:
        p = self._param_like()
        memory = p.new_zeros(batch_size, self.heads, self.key_dim, self.head_dim, dtype=self._memory_dtype())
        conv = p.new_zeros(batch_size, self.d_model, self.conv_size - 1) if self.use_conv else None
        return MetaLAState(memory=memory, conv=conv)

    def describe(self) -> EOSRow:
        H, K, D = self.heads, self.key_dim, self.head_dim
        return EOSRow(
            name="MetaLA",
            input="v_t",
            expand="k_t" if self.use_key else "1 - alpha_t",
            oscillation="alpha_t 1^T",
            shrink="q_t",
            memory=f"K x D = {K} x {D} per head, {H} heads",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="MetaLA (Chou et al., NeurIPS 2024), section 5 eq. 21-22, appendix A3.2 eq. A31-A38",
        )
