"""HGRN (Qin et al. 2023, "Hierarchically Gated Recurrent Neural Network for Sequence Modeling",
NeurIPS 2023, section 3.1-3.2, eq. 3-7) as a configuration of the EOS operator. Alias ``lrn``
(the LCSM Table 1 row "HGRN/LRN"; LRN = Martin & Cundy 2018, the real-valued ancestor).

Per channel (d_model channels, complex hidden state)::

    mu_t     = sigmoid(W_f x_t + b_f)                          forget gate
    lambda_t = gamma + (1 - gamma) mu_t                        gamma = layer-wise lower bound
    c_t      = SiLU(W_cr x_t + b_cr) + i SiLU(W_ci x_t + b_ci) complex input
    h_t      = lambda_t e^{i theta} h_{t-1} + (1 - lambda_t) c_t
    g_t      = sigmoid(W_g x_t + b_g)                          output gate, 2 d_model
    out_t    = W_o LayerNorm(g_t * [Re h_t, Im h_t]) + b_o

EOS mapping (LCSM Table 1: input i_t, expand 1 - lambda_t, oscillation lambda_t, shrink o_t,
memory 1 x 1 per channel, complex). Every channel is an independent 1 x 1 memory, so the d_model
memories are laid out as the D = d_model columns of one head with K = 1 row: the oscillation is a
column decay log o_t = log lambda_t + i theta [B, T, 1, 1, d_model], and with K = 1 the expand
product e_t i_t^T of a column is the scalar product (1 - lambda_t) c_t, so it is passed as the
op's input with e = s = 1. This is the same recurrence as d_model heads with K = D = 1, and runs
faster in the op's chunk kernel on CPU (column decay: one head's matmuls instead of d_model tiny
ones). The output gate acts on the real and imaginary parts separately (2 d_model
gates, as in the paper), which a shrink state (one real factor scaling both parts) cannot
express, so it is applied after the scan.

The lower bound. In the paper gamma^k is the k-th entry of cumsum(softmax(Gamma)) over layers
(Gamma a learned [n_layers, d_model] parameter), so deeper layers are forced to remember longer.
It couples layers, so the model owns it; this mixer takes ``lower_bound`` as a fixed float
(0 = no bound, the first layer's value) and sets k / n_layers per layer (``HGRN.layer_options``).

The output gate follows the paper and hgru-pytorch's ``Hgru1dV3.forward`` (sigmoid, before the
norm). The official repository's v1 ``Hgru1d`` (Doraemonzzz/hgru-pytorch ``hgru/hgru1d.py``)
gates after the norm with SiLU, ``W_o (LayerNorm([Re h, Im h]) * SiLU(W_g x))``: on the same
weights its output differs from this layer's by 0.9-1.4 relative RMS (docs/zoo/gated_rnn.md).

Packed sequences (``cu_seqlens``): one EOS call over the row, the memory restarting per document.

Shape glossary: B batch, T time, d_model model width (= memory columns D of the EOS call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int
from ..ops import eos
from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor


@dataclass
class HGRNState(State):
    """memory [B, 1, 1, d_model], complex: h_t in EOS layout [B, H, K, D] (one head, one row)."""

    memory: Tensor


@register("hgrn", "lrn")
class HGRN(Mixer):
    """HGRN-1 token mixer (the paper's HGRU with complex recurrence).

    Args:
        d_model: model width.
        lower_bound: gamma in [0, 1), the lower bound of the forget gate lambda_t (|o_t| >= gamma).
            In a model, k / n_layers in layer k unless given (``layer_options``).
        chunk_size: C of the operator's chunk form (default 16: the forget gates' decays are
            strong, which sends chunks of 64 steps to the strong decays' slower form;
            bench/results/strong_decay_chunk.md). Changes no number beyond rounding.
    """

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        """gamma_k = k / n_layers unless the options fix a bound. The paper (section 3.2) learns
        gamma = cumsum(softmax(Gamma)) over layers, shifted so that the first layer is 0 (official
        code); with the official init Gamma = 1 this is exactly k / n_layers. The schedule stays
        fixed here because the mixer takes a float bound; the learned version couples the layers'
        parameters, which the mixer interface does not carry."""
        return dict(options) if "lower_bound" in options else {**options, "lower_bound": layer / n_layers}

    def __init__(self, d_model: int, lower_bound: float = 0.0, chunk_size: int = 16):
        super().__init__(d_model)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not 0 <= lower_bound < 1:
            raise ValueError(f"lower_bound: expected a float in [0, 1), got {lower_bound!r}")
        self.lower_bound = float(lower_bound)
        d = d_model
        # Official layout: input_proj gives the real and imaginary parts interleaved per channel.
        self.input_proj = nn.Linear(d, 2 * d)
        self.lambda_proj = nn.Linear(d, d)
        self.gate = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.out_proj = nn.Linear(2 * d, d)
        for bias in (self.input_proj.bias, self.lambda_proj.bias, self.gate.bias, self.out_proj.bias):
            no_weight_decay(bias)
        no_weight_decay(self.norm.weight)
        no_weight_decay(self.norm.bias)
        # Learned phase, initialised like rotary frequencies (official: 10000^(-2 j / d)); a
        # rotation angle rather than a weight, so it is kept out of weight decay.
        theta = 10000.0 ** (-2.0 / d * torch.arange(d, dtype=torch.float64))
        self.theta = no_weight_decay(nn.Parameter(theta.to(torch.get_default_dtype())))

    def log_forget(self, x: Tensor):
        """(log lambda_t, 1 - lambda_t), each [B, T, d_model], computed without cancellation:
        1 - lambda = (1 - gamma) sigmoid(-f), log lambda = logaddexp(log gamma, log(1 - gamma) + logsigmoid(f))."""
        f = self.lambda_proj(x)
        gamma = self.lower_bound
        one_minus = (1 - gamma) * torch.sigmoid(-f)
        if gamma == 0:
            return F.logsigmoid(f), one_minus
        log_lam = torch.logaddexp(torch.full_like(f, math.log(gamma)), math.log1p(-gamma) + F.logsigmoid(f))
        return log_lam, one_minus

    def forward(
        self,
        x: Tensor,
        state: HGRNState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        d = self.d_model
        # Half precisions run the recurrence in complex64 (there is no usable complex32).
        rdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        c = F.silu(self.input_proj(x)).unflatten(-1, (d, 2)).to(rdt)
        c = torch.complex(c[..., 0], c[..., 1])  # [B, T, d]
        log_lam, one_minus = (t.to(rdt) for t in self.log_forget(x))
        log_o = torch.complex(log_lam, self.theta.to(rdt).expand_as(log_lam))
        ones = one_minus.new_ones(1, 1)
        y, memory = eos(
            (one_minus * c).unsqueeze(2),
            ones,
            ones,
            log_o[:, :, None, None, :],
            initial_state=state.memory if state is not None else None,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        h = y.squeeze(2)  # [B, T, d] complex
        feature = torch.cat([h.real, h.imag], dim=-1).to(x.dtype) * torch.sigmoid(self.gate(x))
        out = self.out_proj(self.norm(feature))
        if return_state:
            return out, HGRNState(memory=memory)
        return out

    def init_state(self, batch_size: int) -> HGRNState:
        return HGRNState(
            memory=torch.zeros(
                batch_size, 1, 1, self.d_model, dtype=self._memory_dtype(True), device=self._param_like().device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="hgrn",
            input="i_t = SiLU(W_cr x_t) + i SiLU(W_ci x_t) (complex)",
            expand="1 - lambda_t",
            oscillation="lambda_t exp(i theta), lambda_t = gamma + (1 - gamma) sigmoid(f_t), "
            f"gamma = {self.lower_bound:g}",
            shrink="o_t (output gate on [Re h_t, Im h_t], then LayerNorm)",
            memory=f"1 x 1 per channel (complex), {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Qin et al. 2023, Hierarchically Gated Recurrent Neural Network for Sequence Modeling "
            "(NeurIPS 2023, arXiv:2311.04823), section 3",
        )
