"""minGRU (Feng et al. 2024, "Were RNNs All We Needed?", arXiv:2410.01201, section 3.1,
appendix B log-space code) as a configuration of the EOS operator.

Per channel of the hidden width d_hidden = expand * d_model::

    z_t  = sigmoid(W_z x_t + b_z)                     update gate (x_t only: no h_{t-1})
    h~_t = g(W_h x_t + b_h)                           g(x) = x + 1/2 (x >= 0), sigmoid(x) (x < 0)
    h_t  = (1 - z_t) h_{t-1} + z_t h~_t
    out_t = W_o h_t                                   (d_hidden -> d_model, no bias)

EOS mapping: input z_t h~_t, expand 1, oscillation 1 - z_t (log o = logsigmoid(-k), no
cancellation), shrink 1; memory 1 x 1 per channel (K = 1), laid out as the D columns of one head
(lcsm/layers/_minrnn.py).

Source: the paper's section 3.1 and its appendix B pseudo-code (log-space minGRU: log z =
-softplus(-k), log(1 - z) = -softplus(k), log h~ = log g(h)); no official repository was released
with the paper, and only excerpts of its v3 text were reachable when this was written, so the
appendix code was not re-read line by line (docs/zoo/mlstm_minrnn.md). Inits: PyTorch defaults
of nn.Linear (the paper gives none). Departures: the output projection W_o (a mixer maps d_model
to d_model), and the scan carries h rather than log h (same recurrence).

Shape glossary: B batch, T time, d_hidden the hidden width (= memory columns D of the EOS call).
"""

from __future__ import annotations

from ._minrnn import MinRNN, log_sigmoid_pair
from .base import EOSRow, register


@register("mingru")
class MinGRU(MinRNN):
    """minGRU token mixer. Args: d_model, expand (hidden width expand * d_model, default 1),
    chunk_size (the operator's chunk, default 16; ``MinRNN``)"""

    n_gates = 1

    def log_coefficients(self, gates):
        return log_sigmoid_pair(gates[:, :, 0])

    def describe(self) -> EOSRow:
        return EOSRow(
            name="mingru",
            input="z_t g(W_h x_t), z_t = sigmoid(W_z x_t)",
            expand="1",
            oscillation="1 - z_t",
            shrink="1 (then W_o)",
            memory=f"1 x 1 per channel, {self.d_hidden} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=True,
            shrink_dd=False,
            paper="Feng et al. 2024, Were RNNs All We Needed? (arXiv:2410.01201), section 3.1",
        )
