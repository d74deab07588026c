"""``gla`` (``gateloop``): gated linear attention (Yang et al. 2023, GLA).

One mixer of the linear-attention family (q/k/v projections feeding one EOS recurrence): the family
table, the shared machinery and the shape glossary are in ``_qkv.py`` (W: the short convolution's
width); docs/zoo/linear_attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_float, check_int

from ..ops import eos
from ._qkv import LinearAttentionState, QKVAttention, head_norm, head_width
from .base import EOSRow, no_weight_decay, register, short_convs
from .packing import silu_short_conv

Tensor = torch.Tensor


@dataclass
class GLAState(LinearAttentionState):
    """memory [B, H, K, D]; with ``use_short_conv`` conv_q, conv_k [B, W - 1, H K] and conv_v
    [B, W - 1, H D]: the last W - 1 projected inputs of each short convolution, oldest first
    (None without)."""

    conv_q: Tensor | None = None
    conv_k: Tensor | None = None
    conv_v: Tensor | None = None


@register("gla", "gateloop")
class GLA(QKVAttention):
    """Gated linear attention, Yang et al. 2023 (GLA), section 4 (the gated recurrence and the GLA
    Transformer layer); official code fla ``GatedLinearAttention``; LCSM Table 1 row "GLA/GateLoop".

    Computation, in order::

        q = q_proj(x) * K^-1/2, k = k_proj(x), v = v_proj(x)           (no biases)
          (use_short_conv: q, k, v = SiLU(conv_W(q_proj(x))) * K^-1/2, SiLU(conv_W(k_proj(x))), ...)
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
        use_short_conv: q, k and v each through a depthwise causal convolution of width
            ``conv_size`` and SiLU before the recurrence (fla's ``use_short_conv``, off by default
            as there; not in the paper). The convolutions restart at every document of a packed
            row and their last W - 1 inputs ride in the state.
        conv_size: W (4, fla); conv_bias: a bias per channel in the convolutions (False, fla).
    """

    option_variants = ({"use_short_conv": True},)

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
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
    ):
        super().__init__(d_model)
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_k = head_width("expand_k", d_model, expand_k, num_heads)
        self.head_v = head_width("expand_v", d_model, expand_v, num_heads)
        rank = check_int("gate_low_rank_dim", gate_low_rank_dim, 1)
        self.tau = check_float("gate_logit_normalizer", gate_logit_normalizer, 0, low_open=True)
        self.norm = check_choice("norm", norm, ("layernorm", "rmsnorm"))
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self._make_qkv(d_model, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(d_model, rank, bias=False), nn.Linear(rank, self.num_heads * self.head_k, bias=True)
        )
        no_weight_decay(self.gk_proj[1].bias)
        self.g_proj = nn.Linear(d_model, self.num_heads * self.head_v, bias=True)
        no_weight_decay(self.g_proj.bias)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(self.head_v)))
        self.use_short_conv = check_bool("use_short_conv", use_short_conv)
        self.conv_size = check_int("conv_size", conv_size, 1)
        conv_bias = check_bool("conv_bias", conv_bias)
        if self.use_short_conv:
            kd, vd = self.num_heads * self.head_k, self.num_heads * self.head_v
            self.q_conv1d, self.k_conv1d, self.v_conv1d = short_convs((kd, kd, vd), conv_size, conv_bias)
        elif conv_size != 4 or conv_bias:
            # The options only shape the convolutions: given without them they would do nothing.
            raise ValueError(
                f"conv_size, conv_bias: set only with use_short_conv=True, got conv_size={conv_size}, "
                f"conv_bias={conv_bias}"
            )

    def _system(self, x: Tensor, state: GLAState | None, cu_seqlens: Tensor | None):
        """(i, e, s, log_o) of the recurrence and the convolutions' new histories (None without)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        histories = (None, None, None)
        if self.use_short_conv:
            given = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            (q, cq), (k, ck), (v, cv) = (
                silu_short_conv(c, t, h, cu_seqlens) for c, t, h in zip(convs, (q, k, v), given, strict=True)
            )
            histories = (cq, ck, cv)
        log_alpha = F.logsigmoid(self._split(self.gk_proj(x))) / self.tau
        q = self._split(q) * self.head_k**-0.5
        return (self._split(v), self._split(k), q, log_alpha.unsqueeze(-1)), histories

    def eos_inputs(self, x):
        return self._system(x, None, None)[0]

    def _scan(
        self, x: Tensor, state: GLAState | None, cu_seqlens: Tensor | None, final: bool = True
    ) -> tuple[Tensor, GLAState | None]:
        """x [B, T, d_model] -> (read-out [B, T, H, D], final state; one row per document with
        ``cu_seqlens``). Without ``final`` the state is None and not computed: with ``cu_seqlens``
        the documents' final memories are a pass of their own (``ops.packed``)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        (i, e, s, log_o), (cq, ck, cv) = self._system(x, state, cu_seqlens)
        m0 = None if state is None else state.memory
        y, m = eos(i, e, s, log_o, initial_state=m0, output_final_state=final, cu_seqlens=cu_seqlens)
        # eos promotes to the state's dtype (float32 for half-precision inputs): back to x's.
        return y.to(x.dtype), GLAState(memory=m, conv_q=cq, conv_k=ck, conv_v=cv) if final else None

    def eos_readout(
        self, x: Tensor, state: GLAState | None = None, cu_seqlens: Tensor | None = None, final: bool = True
    ):
        y, last = self._scan(x, state, cu_seqlens, final)
        return y, None if last is None else last.memory

    def forward(
        self, x: Tensor, state: GLAState | None = None, return_state: bool = False, cu_seqlens: Tensor | None = None
    ):
        y, final = self._scan(x, state, cu_seqlens, final=return_state)
        out = self._output(y, x)
        return (out, final) if return_state else out

    def init_state(self, batch_size: int) -> GLAState:
        memory = super().init_state(batch_size).memory
        if not self.use_short_conv:
            return GLAState(memory=memory)
        kd, vd, w = self.num_heads * self.head_k, self.num_heads * self.head_v, self.conv_size - 1
        p = self._param_like()
        return GLAState(
            memory=memory,
            conv_q=p.new_zeros(batch_size, w, kd),
            conv_k=p.new_zeros(batch_size, w, kd),
            conv_v=p.new_zeros(batch_size, w, vd),
        )

    def _output(self, y, x):
        y = head_norm(y, self.norm, self.norm_eps, self.norm_weight)
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
            paper="Yang et al. 2023, Gated Linear Attention, sec. 4; LCSM Table 1 (GLA/GateLoop)"
            + (
                "; short convolution on q, k, v: fla GatedLinearAttention(use_short_conv=True)"
                if self.use_short_conv
                else ""
            ),
        )
