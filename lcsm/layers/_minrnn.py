"""The shared body of minGRU and minLSTM (Feng et al. 2024, "Were RNNs All We Needed?",
arXiv:2410.01201): per channel, h_t = a_t h_{t-1} + b_t g(W_h x_t), with a_t + b_t = 1 and
(a_t, b_t) given by the subclass from gates of x_t alone, so the recurrence is an EOS with K = 1
per channel, laid out as the D columns of one head (as hgrn.py: the expand product e_t i_t^T of a
K = 1 column is the scalar b_t g(W_h x_t), passed as the op's input with e = s = 1, and log a_t is
the column decay).

g(x) = x + 1/2 for x >= 0, sigmoid(x) otherwise: the paper's log-space variant (appendix B) keeps
the candidate state positive so that its logarithm exists; g is continuous with g(0) = 1/2 and
positive everywhere. The paper then scans log h with a log-cumsum-exp; here the EOS op carries the
decay in log space (log a_t) and the positive input directly, the same recurrence without the log
of the state (a departure in arithmetic only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int
from ..ops import eos
from .base import Mixer, State, no_weight_decay

Tensor = torch.Tensor


def positive_g(x: Tensor) -> Tensor:
    """The paper's g: x + 1/2 for x >= 0, sigmoid(x) below (positive, continuous at 0)."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


@dataclass
class MinRNNState(State):
    """memory [B, 1, 1, d_hidden]: h_t in EOS layout [B, H, K, D] (one head, one row)."""

    memory: Tensor


class MinRNN(Mixer):
    """minGRU / minLSTM body. Subclasses define ``n_gates`` and ``log_coefficients``.

    Args:
        d_model: model width.
        expand: hidden width d_hidden = expand * d_model (the paper's hidden_size).
        chunk_size: C of the operator's chunk form (default 16: the gates' decays are strong,
            which sends chunks of 64 steps to the strong decays' slower form;
            bench/results/strong_decay_chunk.md). Changes no number beyond rounding.
    """

    n_gates = 1

    def __init__(self, d_model: int, expand: int = 1, chunk_size: int = 16):
        super().__init__(d_model)
        self.expand = check_int("expand", expand, 1)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        d_h = self.expand * d_model
        self.d_hidden = d_h
        # The paper's Linear_h and the gate Linear(s), fused into one projection (with bias, as the
        # paper's nn.Linear defaults); the candidate comes first.
        self.in_proj = nn.Linear(d_model, (1 + self.n_gates) * d_h)
        no_weight_decay(self.in_proj.bias)
        # The paper's module returns h of hidden_size; a mixer maps back to d_model, so that
        # expand can differ from 1 (bias-free, as the projections around the other mixers).
        self.out_proj = nn.Linear(d_h, d_model, bias=False)

    def log_coefficients(self, gates: Tensor) -> tuple[Tensor, Tensor]:
        """(log a_t, log b_t) from the gate pre-activations [B, T, n_gates, d_hidden]."""
        raise NotImplementedError

    def forward(
        self,
        x: Tensor,
        state: MinRNNState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        proj = self.in_proj(x).unflatten(-1, (1 + self.n_gates, self.d_hidden))
        candidate = positive_g(proj[:, :, 0])
        log_a, log_b = self.log_coefficients(proj[:, :, 1:])
        ones = x.new_ones(1, 1)
        y, memory = eos(
            (log_b.exp() * candidate).unsqueeze(2),
            ones,
            ones,
            log_a[:, :, None, None, :],
            initial_state=state.memory if state is not None else None,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        out = self.out_proj(y.squeeze(2).to(x.dtype))
        if return_state:
            return out, MinRNNState(memory=memory)
        return out

    def init_state(self, batch_size: int) -> MinRNNState:
        return MinRNNState(
            memory=torch.zeros(
                batch_size, 1, 1, self.d_hidden, dtype=self._memory_dtype(), device=self._param_like().device
            )
        )


def log_sigmoid_pair(logit: Tensor) -> tuple[Tensor, Tensor]:
    """(log sigmoid(-k), log sigmoid(k)) = (log(1 - z), log z) for z = sigmoid(k), without cancellation."""
    return F.logsigmoid(-logit), F.logsigmoid(logit)
