"""minLSTM (Feng et al. 2024, "Were RNNs All We Needed?", arXiv:2410.01201, section 3.2,
appendix B log-space code) as a configuration of the EOS operator.

Per channel of the hidden width d_hidden = expand * d_model::

    f_t  = sigmoid(W_f x_t + b_f),  i_t = sigmoid(W_i x_t + b_i)
    f'_t = f_t / (f_t + i_t),       i'_t = i_t / (f_t + i_t)      (time-independent scale)
    h~_t = g(W_h x_t + b_h)                           g(x) = x + 1/2 (x >= 0), sigmoid(x) (x < 0)
    h_t  = f'_t h_{t-1} + i'_t h~_t
    out_t = W_o h_t                                   (d_hidden -> d_model, no bias)

In log space (the paper's appendix code): with d = softplus(-k_f) - softplus(-k_i) = log i_t -
log f_t, log f'_t = -softplus(d) and log i'_t = -softplus(-d), exact and without cancellation.

EOS mapping: input i'_t h~_t, expand 1, oscillation f'_t, shrink 1; memory 1 x 1 per channel
(K = 1), laid out as the D columns of one head (lcsm/layers/_minrnn.py).

Source: the paper's section 3.2 and appendix B (no official repository; see mingru.py on the source).
Inits: PyTorch defaults of nn.Linear. Departures: the output projection W_o (as mingru.py) and the
scan carries h rather than log h (same recurrence).

Shape glossary: B batch, T time, d_hidden the hidden width (= memory columns D of the EOS call).
"""

from __future__ import annotations

import torch.nn.functional as F

from ._minrnn import MinRNN
from .base import EOSRow, register


@register("minlstm")
class MinLSTM(MinRNN):
    """minLSTM token mixer. Args: d_model, expand (hidden width expand * d_model, default 1),
    chunk_size (the operator's chunk, default 16; ``MinRNN``)"""

    n_gates = 2

    def log_coefficients(self, gates):
        diff = F.softplus(-gates[:, :, 0]) - F.softplus(-gates[:, :, 1])
        return -F.softplus(diff), -F.softplus(-diff)

    def describe(self) -> EOSRow:
        return EOSRow(
            name="minlstm",
            input="i'_t g(W_h x_t), i'_t = i_t / (f_t + i_t)",
            expand="1",
            oscillation="f'_t = f_t / (f_t + i_t)",
            shrink="1 (then W_o)",
            memory=f"1 x 1 per channel, {self.d_hidden} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=True,
            shrink_dd=False,
            paper="Feng et al. 2024, Were RNNs All We Needed? (arXiv:2410.01201), section 3.2",
        )
