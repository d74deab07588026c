"""mLSTM (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", NeurIPS 2024,
arXiv:2405.04517, section 2.3 and appendix B.3, figure 11) as a configuration of the EOS operator:
the matrix-memory LSTM cell inside the original xLSTM mLSTM layer (pre-up-projection block).

Cell, per head (k scaled by 1/sqrt(d), d the head width)::

    C_t = f_t C_{t-1} + i_t k_t v_t^T          f_t = sigmoid(f~_t), i_t = exp(i~_t) (scalars per head)
    n_t = f_t n_{t-1} + i_t k_t
    h_t = C_t^T q_t / (max(|n_t^T q_t|, 1) + eps)          (unstabilised units, see below)

Stabilised as in the official code: a log-scale m_t with C_t, n_t stored divided by e^{m_t},

    m_t = max(log f_t + m_{t-1}, i~_t)
    C_t = e^{log f_t + m_{t-1} - m_t} C_{t-1} + e^{i~_t - m_t} k_t v_t^T       (likewise n_t)
    h_t = C_t^T q_t / (max(|n_t^T q_t|, e^{-m_t}) + eps)

e^{-m_t} is the floor 1 of the unstabilised form expressed in stored units; m_t cancels in the
ratio except in the eps term (eps e^{m_t} in unstabilised units), so it is part of the layer's
function and carries its gradient here, as in the official autograd kernels.

EOS mapping (LCSM / MetaLA row of linear attention with a scalar gate): input [v_t, 1] (the
normaliser n_t is the memory's extra column, as in linear_attention.py), expand e^{i~_t - m_t}
k_t / sqrt(d), oscillation e^{log f_t + m_{t-1} - m_t} (scalar per head, [B, T, H, 1, 1]), shrink
q_t; memory d x (d + 1) per head. The stabilised recurrence is itself an EOS recurrence with a
data-dependent decay (as RWKV-4's, rwkv4.py), so one EOS call gives both C_t^T q_t and n_t^T q_t.
m_t in closed form: with F_t = sum_{s<=t} log f_s (from the sequence start),

    m_t = F_t + max(m_0, max_{s<=t} (i~_s - F_s))

a running maximum (torch.cummax; packed rows: rwkv4.running_max, segmented per document),
computed in float64 (F_t drifts like t) and differenced there before casting, so that the op's
decay and input scale are exact to the working precision. m_0 = 0 for a fresh sequence, as the
official recurrent and chunkwise kernels (mlstm_kernels ``native_sequence``, ``chunkwise/native``).

Layer (the original xLSTM mLSTM layer, ``xlstm/blocks/mlstm/layer.py``, not the xLSTM-7B
``xlstm_large`` layer, which has no up-projection, convolution or skip)::

    [x_m, z]  = W_up x_t                               d_model -> 2 inner (inner = expand d_model)
    c_t       = SiLU(CausalDepthwiseConv1d_W(x_m)_t)   width W, with bias
    q_t, k_t  = BlockDiag_q(c_t), BlockDiag_k(c_t)     blocks of qkv_blocksize, no bias
    v_t       = BlockDiag_v(x_m_t)
    i~_t, f~_t = W_i [q_t, k_t, v_t] + b_i, W_f [...] + b_f    (one scalar per head each)
    h~_t      = GroupNorm_heads(mLSTM cell)            per-head LayerNorm, weight 1 + w, no bias
    out_t     = W_down ((h~_t + skip * c_t) * SiLU(z_t))

Sources read: NX-AI/xlstm @ 032a6fb8ee19a8c0db80ae6111ff4744a09414a9
(https://github.com/NX-AI/xlstm: ``xlstm/blocks/mlstm/layer.py``, ``cell.py``, ``backends.py``,
``components/ln.py``, ``components/init.py``, ``components/linear_headwise.py``,
``components/conv.py``, ``xlstm_large/model.py``) and NX-AI/mlstm_kernels @
39d3c61741e5d2c0e6ab8922106dd236632c5139 (https://github.com/NX-AI/mlstm_kernels:
``mlstm_kernels/torch/recurrent/native_step.py``, ``native_sequence.py``, ``parallel/native/fw.py``,
``chunkwise/native/fw.py``).

Inits (official): W_up, q/k/v blocks ~ N(0, 2 / (5 d_model)) (small init, with d_model, not inner);
W_down ~ N(0, (2 / n_blocks / sqrt(d_model))^2) with n_blocks = 1 (wang init; a model may rescale);
skip = 1; W_f = 0, b_f = linspace(3, 6) over heads; W_i = 0, b_i ~ N(0, 0.1^2); norm weight w = 0
(scale 1 + w); conv: PyTorch default. Biases, skip and norm weight are tagged ``no_weight_decay``.

Departures: the original layer's forward runs the parallel (quadratic) form, which has no initial
state, i.e. m_0 = -inf, while its ``step`` starts from m_0 = 0; this layer uses m_0 = 0 throughout
(the kernels' convention), so forward and step agree. The two differ only where the floor
e^{-m_t} or the eps term binds (measured: 1e-9 to 4e-7 relative, docs/zoo/mlstm_minrnn.md).
Dropout (0 by default) is left to the model.

Packed sequences (``cu_seqlens``): the convolution (``packing.causal_conv``), F_t and the running
maximum, m_{t-1} and the EOS call all restart per document.

Shape glossary: B batch, T time, H heads, d = inner / H head width, W conv width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int
from ..ops import eos, native_block_diag, native_mlstm_readout, native_serves
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import document_index, previous, running_max, short_conv

Tensor = torch.Tensor

# The official kernels' eps in the read-out denominator (all backends: 1e-6).
EPS = 1e-6
# The official MultiHeadLayerNorm's eps (components/ln.py default).
NORM_EPS = 1e-5


@dataclass
class MLSTMState(State):
    """conv [B, W - 1, inner]: the last W - 1 conv inputs, oldest first. memory [B, H, d, d + 1]:
    C_t (first d columns) and n_t (last column), stored divided by e^{m_t}. scale [B, H]: m_t."""

    conv: Tensor
    memory: Tensor
    scale: Tensor


def stabiliser(log_f: Tensor, log_i: Tensor, m0: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """(m_{t-1}, m_t), each [B, T, H] float64, from log f_t, i~_t [B, T, H] and m_0 [B | N, H]
    (see the module docstring); each sequence (document) starts from its own row of m_0."""
    lf, li, m0 = log_f.double(), log_i.double(), m0.double()
    cum = lf.cumsum(1)
    if cu_seqlens is not None:
        doc = document_index(cu_seqlens, lf.shape[1])
        start = cu_seqlens[:-1]
        cum = cum - (cum[:, start] - lf[:, start])[:, doc]  # F_t restarts at each document
        first = m0[doc].unsqueeze(0)
    else:
        first = m0.unsqueeze(1)
    m = cum + torch.maximum(first, running_max(li - cum, cu_seqlens))
    return previous(m, m0, cu_seqlens), m


@register("mlstm")
class MLSTM(Mixer):
    """The original xLSTM mLSTM layer (up-projection, conv, block-diagonal q/k/v, mLSTM cell,
    multi-head norm, learnable skip, SiLU output gate, down-projection).

    Args:
        d_model: model width.
        heads: number of heads H (official num_heads 4); inner must be a multiple.
        expand: inner width = expand * d_model (official proj_factor 2).
        d_conv: width W of the causal depthwise convolution (official 4).
        qkv_blocksize: block size of the block-diagonal q/k/v projections (official 4).
    """

    def __init__(self, d_model: int, heads: int = 4, expand: int = 2, d_conv: int = 4, qkv_blocksize: int = 4):
        super().__init__(d_model)
        self.heads = check_int("heads", heads, 1)
        self.expand = check_int("expand", expand, 1)
        self.d_conv = check_int("d_conv", d_conv, 1)
        self.qkv_blocksize = check_int("qkv_blocksize", qkv_blocksize, 1)
        inner = self.inner = self.expand * d_model
        for name, div in (("heads", self.heads), ("qkv_blocksize", self.qkv_blocksize)):
            if inner % div:
                raise ValueError(f"{name}: must divide inner = expand * d_model = {inner}, got {div}")
        self.head_dim = inner // self.heads
        nb, bs = inner // self.qkv_blocksize, self.qkv_blocksize
        small = math.sqrt(2 / (5 * d_model))
        self.up_proj = nn.Linear(d_model, 2 * inner, bias=False)
        nn.init.normal_(self.up_proj.weight, std=small)
        self.conv1d = nn.Conv1d(inner, inner, kernel_size=self.d_conv, groups=inner, bias=True)
        no_weight_decay(self.conv1d.bias)
        # Block-diagonal projections [blocks, out, in] (official LinearHeadwiseExpand layout).
        self.q_blocks = nn.Parameter(torch.randn(nb, bs, bs) * small)
        self.k_blocks = nn.Parameter(torch.randn(nb, bs, bs) * small)
        self.v_blocks = nn.Parameter(torch.randn(nb, bs, bs) * small)
        self.igate = nn.Linear(3 * inner, self.heads)
        self.fgate = nn.Linear(3 * inner, self.heads)
        with torch.no_grad():
            self.igate.weight.zero_()
            self.igate.bias.normal_(0.0, 0.1)
            self.fgate.weight.zero_()
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, self.heads))
        no_weight_decay(self.igate.bias)
        no_weight_decay(self.fgate.bias)
        # Norm scale stored as w with scale 1 + w (official residual weight), so decay pulls to 1.
        self.norm_weight = no_weight_decay(nn.Parameter(torch.zeros(inner)))
        self.skip = no_weight_decay(nn.Parameter(torch.ones(inner)))
        self.down_proj = nn.Linear(inner, d_model, bias=False)
        nn.init.normal_(self.down_proj.weight, std=2 / math.sqrt(d_model))

    @staticmethod
    def _blocks(x: Tensor, w: Tensor) -> Tensor:
        """The block-diagonal projection x [B, T, inner] -> [B, T, inner] by w [blocks, out, in]: eagerly
        on the CPU by the native kernel (``lcsm.ops.native_block_diag``; torch's bmm of 64 4 x 4
        blocks per token ran at a few percent of its speed, with transposing copies), else einsum."""
        if native_serves(x):
            return native_block_diag(x, w)
        return torch.einsum("btno,nuo->btnu", x.unflatten(-1, (w.shape[0], w.shape[2])), w).flatten(-2)

    def _gates(self, c: Tensor, x_m: Tensor) -> Tensor:
        """[i~_t, f~_t] = [W_i; W_f] [q_t, k_t, v_t] + [b_i; b_f], [B, T, 2H], with the q/k/v blocks
        folded into the gate weights (a product of [2H, inner] by the blocks, per token nothing):
        W_q q_t + W_k k_t = (W_q Q + W_k K) c_t and W_v v_t = (W_v V) x_m,t. The same function; it
        leaves out the [B, T, 3 inner] concatenation of q, k, v and the gradient of that width."""
        w = torch.cat([self.igate.weight, self.fgate.weight])  # [2H, 3 inner]
        b = torch.cat([self.igate.bias, self.fgate.bias])

        def folded(part: Tensor, blocks: Tensor) -> Tensor:  # [2H, inner] @ blockdiag(blocks)
            nb, bo, _ = blocks.shape
            return torch.einsum("gnu,nuo->gno", part.unflatten(-1, (nb, bo)), blocks).flatten(-2)

        w_q, w_k, w_v = w.chunk(3, dim=-1)
        return F.linear(c, folded(w_q, self.q_blocks) + folded(w_k, self.k_blocks)) + F.linear(
            x_m, folded(w_v, self.v_blocks), b
        )

    def _readout(self, y: Tensor, floor: Tensor, c: Tensor, z: Tensor) -> Tensor:
        """(GroupNorm_heads(h~_t) + skip * c_t) * SiLU(z_t) from the EOS outputs y [B, T, H, d + 1]
        (C_t^T q_t, then n_t^T q_t) and the floor e^{-m_t} [B, T, H]: eagerly on the CPU in one
        native pass each way (``lcsm.ops.native_mlstm_readout``; as the PyTorch operations below,
        about ten passes over [B, T, inner] forward and twenty backward), else those operations."""
        if native_serves(c) and y.dtype == c.dtype:
            return native_mlstm_readout(y, floor, c, z, 1 + self.norm_weight, self.skip, EPS, NORM_EPS)
        d = self.head_dim
        # split (its backward joins the two gradients; slicing would zero-fill y's shape for each)
        # and one reciprocal per head and step, multiplied in: the division's backward makes
        # three passes over [B, T, H, d] where the product's makes one
        num, nrm = y.split([d, 1], dim=-1)
        h = num * (torch.maximum(nrm.abs(), floor.unsqueeze(-1)) + EPS).reciprocal()
        # the official MultiHeadLayerNorm is a group norm with one group a head: each head's d
        # channels normalised, then scaled per channel; as layer_norm, half group_norm's CPU time
        h = F.layer_norm(h, (d,), None, None, NORM_EPS).flatten(-2) * (1 + self.norm_weight.to(y.dtype))
        return torch.addcmul(h.to(c.dtype), self.skip, c) * F.silu(z)

    def _conv(self, x: Tensor, history: Tensor | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
        """SiLU(causal depthwise conv(x)) and the last W - 1 inputs of each sequence."""
        return short_conv(x, self.conv1d.weight, self.conv1d.bias, cu_seqlens, history, silu=True)

    def forward(
        self,
        x: Tensor,
        state: MLSTMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, _ = x.shape
        H, d = self.heads, self.head_dim
        x_m, z = self.up_proj(x).chunk(2, dim=-1)
        c, conv_last = self._conv(x_m, state.conv if state is not None else None, cu_seqlens)
        q, k, v = self._blocks(c, self.q_blocks), self._blocks(c, self.k_blocks), self._blocks(x_m, self.v_blocks)
        log_i, pre_f = self._gates(c, x_m).split(H, dim=-1)  # [B, T, H] each
        log_f = F.logsigmoid(pre_f)
        # Half precisions run the cell in float32, as the EOS op does.
        rdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
        m0 = state.scale if state is not None else log_i.new_zeros(rows, H, dtype=torch.float64)
        m_prev, m = stabiliser(log_f, log_i, m0, cu_seqlens)
        log_o = (log_f.double() + m_prev - m).to(rdt)
        gain = (log_i.double() - m).exp().to(rdt)

        def heads(t: Tensor) -> Tensor:
            return t.unflatten(-1, (H, d)).to(rdt)

        values = torch.cat([heads(v), heads(v).new_ones(B, T, H, 1)], dim=-1)
        y, memory = eos(
            values,
            heads(k) * (gain.unsqueeze(-1) / math.sqrt(d)),
            heads(q),
            log_o[..., None, None],
            initial_state=state.memory if state is not None else None,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        floor = (-m).exp().to(rdt)
        out = self.down_proj(self._readout(y, floor, c, z))
        if return_state:
            last_m = m[:, -1] if cu_seqlens is None else m[0, cu_seqlens[1:] - 1]
            return out, MLSTMState(conv=conv_last, memory=memory, scale=last_m.to(memory.dtype))
        return out

    def init_state(self, batch_size: int) -> MLSTMState:
        p = self._param_like()
        mdt = self._memory_dtype()
        return MLSTMState(
            conv=torch.zeros(batch_size, self.d_conv - 1, self.inner, dtype=p.dtype, device=p.device),
            memory=torch.zeros(batch_size, self.heads, self.head_dim, self.head_dim + 1, dtype=mdt, device=p.device),
            scale=torch.zeros(batch_size, self.heads, dtype=mdt, device=p.device),
        )

    def describe(self) -> EOSRow:
        d = self.head_dim
        return EOSRow(
            name="mlstm",
            input="v_t and 1 (normaliser n_t)",
            expand="exp(i_t - m_t) k_t / sqrt(d) (m_t the max-stabiliser)",
            oscillation="sigmoid(f_t) exp(m_(t-1) - m_t) 1 1^T (scalar per head)",
            shrink="q_t, then / (max(|n_t^T q_t|, exp(-m_t)) + eps)",
            memory=f"K x D = {d} x {d}+1 (normaliser column) per head, {self.heads} heads",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Beck et al. 2024, xLSTM: Extended Long Short-Term Memory (NeurIPS 2024, arXiv:2405.04517), "
            "section 2.3",
        )
