"""RG-LRU recurrent block of Griffin / Hawk (De et al. 2024, "Griffin: Mixing Gated Linear
Recurrences with Local Attention for Efficient Language Models", arXiv:2402.19427, section 2.4,
figure 2) as a configuration of the EOS operator.

Per channel of the recurrence width (lru_width)::

    u_t   = Conv1D_4(W_x x_t + b_x)                        temporal conv, width 4
    r_t   = sigmoid(W_a u_t + b_a)                         recurrence gate (block-diagonal W_a)
    i_t   = sigmoid(W_i u_t + b_i)                         input gate (block-diagonal W_i)
    a_t   = a^(c r_t),  log a = -softplus(Lambda),  c = 8
    h_t   = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)        (h_{-1} = 0 and multiplier 1 at a sequence's first token)
    out_t = W_out (h_t * GeLU(W_y x_t + b_y)) + b_out

EOS mapping: one 1 x 1 memory per channel, laid out as the D = lru_width columns of one head with
K = 1 row (as HGRN's): input sqrt(1 - a_t^2) i_t u_t, e = s = 1, and the column decay
log o_t = c r_t log a [B, T, 1, 1, lru_width]. The GeLU branch multiplies the read-out after the scan.

Sources: the paper; google-deepmind/recurrentgemma at 2efa84dac0e68e63547a27a18fa943c98f1c312e,
``recurrentgemma/torch/layers.py`` (RGLRU, rnn_param_init, SqrtBoundDerivative, Conv1D,
BlockDiagonalLinear) and ``recurrentgemma/torch/modules.py`` (RecurrentBlock, gelu with the tanh
approximation). Λ is written as the official code stores it: log a = -softplus(Λ), i.e. the
paper's a = sigmoid(Λ_paper) with Λ = -Λ_paper.

Reset at a segment start (official ``segment_pos == 0``): the first token of a sequence is not
normalised (multiplier 1) and the memory before it is dropped. A carried state continues a
sequence, so its first token is normalised; the state therefore records ``position``, the tokens
seen, and a state with position 0 (``init_state``) starts a sequence. With packed documents each
document starts from its own state row likewise.

Inits (official): W_x, W_y ~ N(0, 1/d_model), W_out ~ N(0, 1/lru_width), their biases 0; conv
weight ~ N(0, 0.01 / 4), bias 0; gate blocks ~ N(0, 1/block width), biases 0; Λ such that
a = exp(-softplus(Λ)) has a^2 ~ U[0.9^2, 0.999^2] (``rnn_param_init``: the paper's text says a^c
uniform in [0.9, 0.999]; the code is followed). The square root's gradient is bounded at 1000 as in
the official ``SqrtBoundDerivative``, so a_t -> 1 cannot blow up the backward.

Departures: num_heads defaults to 4 (official 10-32 blocks of 128-256 channels at widths 2560-5632);
1 - a_t^2 is formed as -expm1(2 log a_t) (no cancellation as a_t -> 1; official 1 - exp(2 log a_t),
the same in exact arithmetic); the parameters are stored as in nn.Linear / nn.Conv1d layouts
(conv weight [lru_width, 1, 4], official [4, lru_width]); Lambda is kept float32 in half-precision
layers and the decay formed in float32 at least (official: the activations' dtype).

Shape glossary: B batch, T time, d_model model width, R = lru_width, G = num_heads (gate blocks),
W = conv_width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_int

from ..ops import eos
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import short_conv

Tensor = torch.Tensor

# Griffin's fixed exponent c of a_t = a^(c r_t) (paper section 2.4, official -8.0).
C = 8.0
# Official bound on the square root's gradient (layers._MAX_SQRT_GRADIENT).
MAX_SQRT_GRADIENT = 1000.0


class _BoundedSqrt(torch.autograd.Function):
    """sqrt whose backward divides by sqrt(max(4 x, 1 / MAX^2)): gradient at most MAX_SQRT_GRADIENT."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * x, min=MAX_SQRT_GRADIENT**-2))


@dataclass
class RGLRUState(State):
    """conv [B, W - 1, R]: the last W - 1 conv inputs, oldest first. memory [B, 1, 1, R]: h_t in EOS
    layout [B, H, K, D]. position [B] int64: tokens seen (0: the next token starts a sequence)."""

    conv: Tensor
    memory: Tensor
    position: Tensor


@register("rg_lru", "hawk")
class RGLRU(Mixer):
    """Griffin's recurrent block with the RG-LRU (Hawk's temporal mixer).

    Args:
        d_model: model width.
        lru_width: R, width of the recurrence (None: d_model, the official default).
        num_heads: G, diagonal blocks of the two gates; must divide lru_width (default 4).
        conv_width: W, width of the temporal convolution (official 4).
    """

    # Lambda = log(1 / a - 1) is about -7 to -2.3 at init: rounded to bfloat16 it would move the
    # decay rate -log a = softplus(Lambda) by up to 3%, so it is stored float32 and the decay and
    # the normalisation are formed in float32 at least.
    float32_parameters = ("a_param",)

    def __init__(self, d_model: int, lru_width: int | None = None, num_heads: int = 4, conv_width: int = 4):
        super().__init__(d_model)
        R = self.lru_width = check_int("lru_width", lru_width, 1, allow_none=True) or d_model
        G = self.num_heads = check_int("num_heads", num_heads, 1)
        if R % G:
            raise ValueError(f"num_heads: expected a divisor of lru_width = {R}, got {num_heads!r}")
        W = self.conv_width = check_int("conv_width", conv_width, 1)
        bw = R // G
        self.linear_x = nn.Linear(d_model, R)
        self.linear_y = nn.Linear(d_model, R)
        self.linear_out = nn.Linear(R, d_model)
        self.conv1d = nn.Conv1d(R, R, kernel_size=W, groups=R, bias=True)
        self.gate_x_w = nn.Parameter(torch.empty(G, bw, bw))
        self.gate_x_b = nn.Parameter(torch.zeros(G, bw))
        self.gate_a_w = nn.Parameter(torch.empty(G, bw, bw))
        self.gate_a_b = nn.Parameter(torch.zeros(G, bw))
        self.a_param = nn.Parameter(torch.empty(R))
        with torch.no_grad():
            # Official variance-scaled normal inits, biases zero.
            for lin, fan_in in ((self.linear_x, d_model), (self.linear_y, d_model), (self.linear_out, R)):
                lin.weight.normal_(0.0, fan_in**-0.5)
                lin.bias.zero_()
            self.conv1d.weight.normal_(0.0, math.sqrt(0.01 / W))
            self.conv1d.bias.zero_()
            self.gate_x_w.normal_(0.0, bw**-0.5)
            self.gate_a_w.normal_(0.0, bw**-0.5)
            # a = exp(-softplus(Lambda)) with a^2 ~ U[0.9^2, 0.999^2]: softplus(Lambda) = -log a,
            # so Lambda = log(exp(-log a) - 1) = log(1 / a - 1).
            a = torch.empty(R).uniform_(0.9**2 + 1e-8, 0.999**2 + 1e-8).sqrt()
            self.a_param.copy_(torch.log(1 / a - 1))
        for p in (self.linear_x.bias, self.linear_y.bias, self.linear_out.bias, self.conv1d.bias):
            no_weight_decay(p)
        for p in (self.gate_x_b, self.gate_a_b, self.a_param):
            no_weight_decay(p)

    def gate(self, u: Tensor, w: Tensor, b: Tensor) -> Tensor:
        """sigmoid of a block-diagonal linear map: u [..., R] -> [..., R], block g maps u's g-th slice."""
        blocks = torch.einsum("...gi,gij->...gj", u.unflatten(-1, (self.num_heads, -1)), w) + b
        return torch.sigmoid(blocks.flatten(-2))

    def forward(
        self,
        x: Tensor,
        state: RGLRUState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, _ = x.shape
        rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is None:
            state = self.init_state(rows)
        if state.position.shape != (rows,):
            raise ValueError(f"state.position: expected [{rows}], got {list(state.position.shape)}")
        xb = self.linear_x(x)
        u, conv_state = short_conv(xb, self.conv1d.weight, self.conv1d.bias, cu_seqlens, state.conv)
        if cu_seqlens is not None:
            starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        else:
            starts, lengths = None, T
        wide = torch.promote_types(u.dtype, torch.float32)
        log_a = -C * self.gate(u, self.gate_a_w, self.gate_a_b).to(wide) * F.softplus(self.a_param.to(wide))
        multiplier = _BoundedSqrt.apply(-torch.expm1(2 * log_a))
        # A sequence's first token (its row's or document's position 0) is not normalised, and
        # the memory before it is dropped (official reset at segment_pos == 0).
        fresh = state.position == 0  # [rows]
        first = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        if starts is None:
            first[:, 0] = fresh
        else:
            first[0, starts[lengths > 0]] = fresh[lengths > 0]
        multiplier = torch.where(first[..., None], torch.ones_like(multiplier), multiplier)
        i = (multiplier * self.gate(u, self.gate_x_w, self.gate_x_b) * u).unsqueeze(2)
        memory = state.memory * ~fresh[:, None, None, None]
        ones = i.new_ones(1, 1)
        h, memory = eos(
            i,
            ones,
            ones,
            log_a[:, :, None, None, :],
            initial_state=memory,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        out = self.linear_out(h.squeeze(2).to(x.dtype) * F.gelu(self.linear_y(x), approximate="tanh"))
        if return_state:
            return out, RGLRUState(conv=conv_state, memory=memory, position=state.position + lengths)
        return out

    def init_state(self, batch_size: int) -> RGLRUState:
        p = self.linear_x.weight
        return RGLRUState(
            conv=torch.zeros(batch_size, self.conv_width - 1, self.lru_width, dtype=p.dtype, device=p.device),
            memory=torch.zeros(batch_size, 1, 1, self.lru_width, dtype=self._memory_dtype(), device=p.device),
            position=torch.zeros(batch_size, dtype=torch.int64, device=p.device),
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="rg_lru",
            input="sqrt(1 - a_t^2) (i_t * u_t), u_t = Conv1D(W_x x_t) (multiplier 1 at a sequence start)",
            expand="1",
            oscillation="a_t = a^(8 r_t), a = exp(-softplus(Lambda)), r_t = sigmoid(block-diag W_a u_t)",
            shrink="1, then h_t * GeLU(W_y x_t)",
            memory=f"1 x 1 per channel, {self.lru_width} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=True,
            shrink_dd=True,
            paper="De et al. 2024, Griffin: Mixing Gated Linear Recurrences with Local Attention for "
            "Efficient Language Models (arXiv:2402.19427), section 2.4",
        )
