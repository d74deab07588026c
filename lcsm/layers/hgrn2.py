"""HGRN2 (Qin et al. 2024, "HGRN2: Gated Linear RNNs with State Expansion", arXiv:2404.07904,
section 3) as a configuration of the EOS operator: HGRN's lower-bounded forget gate with the
elementwise state expanded to an outer product.

Per head (H heads; K = d_model / H forget / query channels, D = d_model / H input channels)::

    f_t = gamma + (1 - gamma) sigmoid(W_f x_t)          forget gate, gamma = layer-wise lower bound
    k_t = 1 - f_t                                        tied input gate (the key)
    q_t = SiLU(W_q x_t)                                  HGRN's output gate, now the query
    v_t = W_i x_t                                        input
    S_t = diag(f_t) S_{t-1} + k_t v_t^T,  y_t = S_t^T q_t K^-1/2
    out = W_o RMSNorm(y)                                 RMSNorm over all d_model channels

EOS mapping (i = v_t, e = 1 - f_t, o = f_t 1^T data-dependent rows, s = q_t; memory K x D per
head): HGRN2 is GLA with the key tied to the forget gate, so it runs the same EOS recurrence as
``gla`` (read after the write).

Sources read: the paper (section 3, eq. for the state expansion); fla ``fla/layers/hgrn2.py``
``HGRN2Attention`` (fla-org/flash-linear-attention at 0315a70e, the implementation behind the
authors' released HGRN2 checkpoints): q = swish(q_proj x), log f = logsigmoid(f_proj x) lifted by
the lower bound in log space (logaddexp), k = 1 - f, GLA kernels with their default query scale
K^-1/2, RMSNorm over the whole hidden size (weight, no bias, eps 1e-5), o_proj; no separate output
gate (the query plays HGRN1's output-gate role). All projections are bias-free.

The lower bound. As in ``hgrn``: the paper learns gamma = cumsum(softmax(Gamma)) over layers
(the first layer 0); with the official init that is k / n_layers in layer k, which a model sets
through ``layer_options``; here it is a fixed float per layer (the learned version couples the
layers' parameters). fla's HGRN2 bound is per channel; a fixed schedule is one value per layer.

Departures: fla's optional short convolutions (off by default) are not included; the default
4 heads (fla: head width expand_ratio = 128, so d_model / 128 heads) let the layer build at small
widths. Inits: PyTorch's Linear default (fla's model-level normal(0.02) init is the model's job).

Packed sequences (``cu_seqlens``): one EOS call over the row, the memory restarting per document.

Shape glossary: B batch, T time, H heads, K = D = d_model / H.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float, check_int

from ._qkv import QKVAttention
from .base import EOSRow, no_weight_decay, register

Tensor = torch.Tensor


@register("hgrn2")
class HGRN2(QKVAttention):
    """HGRN2 token mixer (fla ``HGRN2Attention`` without short convolutions).

    Options:
        num_heads: H; d_model must be divisible by it (fla: d_model / 128).
        lower_bound: gamma in [0, 1), the forget gate's lower bound; in a model k / n_layers in
            layer k unless given (``layer_options``).
        norm_eps: RMSNorm eps (1e-5, fla).
        chunk_size: C of the operator's chunk form (default 16: the forget gates' decays are
            strong, which sends chunks of 64 steps to the strong decays' slower form;
            bench/results/strong_decay_chunk.md). Changes no number beyond rounding.
    """

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        return dict(options) if "lower_bound" in options else {**options, "lower_bound": layer / n_layers}

    def __init__(
        self, d_model: int, num_heads: int = 4, lower_bound: float = 0.0, norm_eps: float = 1e-5, chunk_size: int = 16
    ):
        super().__init__(d_model)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        H = check_int("num_heads", num_heads, 1)
        if d_model % H:
            raise ValueError(f"num_heads: expected a divisor of d_model = {d_model}, got {H}")
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not 0 <= lower_bound < 1:
            raise ValueError(f"lower_bound: expected a float in [0, 1), got {lower_bound!r}")
        self.num_heads, self.head_k, self.head_v = H, d_model // H, d_model // H
        self.memory_rows = self.head_k
        self.lower_bound = float(lower_bound)
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.f_proj = nn.Linear(d_model, d_model, bias=False)
        self.i_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(d_model)))

    def log_forget(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(log f_t, 1 - f_t), each [B, T, d_model], without cancellation: 1 - f = (1 - gamma)
        sigmoid(-z), log f = logaddexp(log gamma, log(1 - gamma) + logsigmoid(z)), z = W_f x."""
        z = self.f_proj(x)
        gamma = self.lower_bound
        one_minus = (1 - gamma) * torch.sigmoid(-z)
        if gamma == 0:
            return F.logsigmoid(z), one_minus
        return torch.logaddexp(torch.full_like(z, math.log(gamma)), math.log1p(-gamma) + F.logsigmoid(z)), one_minus

    def eos_inputs(self, x: Tensor):
        log_f, k = self.log_forget(x)
        q = F.silu(self.q_proj(x)) * self.head_k**-0.5
        return self._split(self.i_proj(x)), self._split(k), self._split(q), self._split(log_f).unsqueeze(-1)

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        y = y.flatten(-2)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight
        return self.o_proj(y)

    def describe(self) -> EOSRow:
        return EOSRow(
            name="hgrn2",
            input="v_t = W_i x_t",
            expand="1 - f_t (tied to the forget gate)",
            oscillation=f"f_t 1^T, f_t = gamma + (1 - gamma) sigmoid(W_f x_t), gamma = {self.lower_bound:g}",
            shrink="q_t = SiLU(W_q x_t) K^-1/2",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Qin et al. 2024, HGRN2: Gated Linear RNNs with State Expansion (arXiv:2404.07904), sec. 3",
        )
