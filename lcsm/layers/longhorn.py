"""``longhorn``: Longhorn (Liu et al. 2024, "Longhorn: State Space Models are Amortized Online
Learners"), as its official kernel reference; docs/zoo/longhorn_comba_gdn2.md.

Shape glossary: B batch, T time, E = expand * d_model inner channels (memory columns), N state
width (memory rows, the key), R the step projection's rank, W the conv width, N_doc documents.
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


@dataclass
class LonghornState(State):
    """conv [B, W - 1, E]: the last W - 1 conv inputs, oldest first; memory [B, 1, N, E]."""

    conv: Tensor
    memory: Tensor


@register("longhorn")
class Longhorn(Mixer):
    """Longhorn, as the official code runs it (Cranial-XIX/Longhorn ``models/longhorn.py`` and the
    reference ``selective_scan_online7_ref`` of Cranial-XIX/longhorn_cuda)::

        x, z = in_proj(x_in)                                     (E channels each, no bias)
        u = silu(conv_W(x))                                      (depthwise causal, with bias)
        [dt_low, k, q] = x_proj(u)                               (R, N, N; no bias)
        s_t = sigmoid(dt_head(dt_low))                           [E]   (dt_head with bias)
        eps_t = s_t / (1 + s_t ||k_t||^2)                        [E], one step per value channel
        M_t[n, c] = (1 - eps_t[c] k_t[n]^2) M_{t-1}[n, c] + eps_t[c] k_t[n] u_t[c]
        y_t = M_t^T q_t + D * u_t,   out = out_proj(y_t * silu(z_t))

    The paper's S_t = (I - eps k k^T) S_{t-1} + eps k v^T keeps only its diagonal in the
    official code: the forgetting is elementwise, 1 - eps_t[c] k_t[n]^2 differs per row n AND
    column c, so this runs on the elementwise operator :func:`lcsm.ops.eos` with a full [N, E]
    log-oscillation (it is not a DPLR transition: eos_dplr's D(alpha) scales rows only, and its
    low-rank term would have to be rank E). 1 - eps k_n^2 > 0 always (eps ||k||^2 < 1), so its
    log is finite.

    Inits as the official model: PyTorch's default Linear / Conv1d inits, dt_head bias 0, D = 1.
    (The model-level rescaling of out_proj by 1/sqrt(n_layer) belongs to their MixerModel.)

    Options: expand (2), d_state N (16), d_conv W (4), dt_rank R (ceil(d_model / 16)).
    """

    float32_parameters = ("D",)

    def __init__(self, d_model: int, expand: int = 2, d_state: int = 16, d_conv: int = 4, dt_rank: int | None = None):
        super().__init__(d_model)
        self.expand = check_int("expand", expand, 1)
        self.d_state = check_int("d_state", d_state, 1)
        self.d_conv = check_int("d_conv", d_conv, 1)
        self.dt_rank = check_int("dt_rank", math.ceil(d_model / 16) if dt_rank is None else dt_rank, 1)
        E = self.d_inner = self.expand * d_model
        self.in_proj = nn.Linear(d_model, 2 * E, bias=False)
        self.conv1d = nn.Conv1d(E, E, self.d_conv, groups=E, bias=True)
        self.x_proj = nn.Linear(E, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_head = nn.Linear(self.dt_rank, E, bias=True)
        # Zero, as the official model's _init_weights leaves it (Longhorn does not mark it
        # _no_reinit as Mamba does): every channel starts at s_t = sigmoid(dt_head(dt_low)) ~ 1/2.
        nn.init.zeros_(self.dt_head.bias)
        no_weight_decay(self.dt_head.bias)
        self.D = no_weight_decay(nn.Parameter(torch.ones(E)))
        self.out_proj = nn.Linear(E, d_model, bias=False)

    def init_state(self, batch_size: int) -> LonghornState:
        p = self.in_proj.weight  # the conv history holds its outputs
        return LonghornState(
            conv=p.new_zeros(batch_size, self.d_conv - 1, self.d_inner),
            memory=p.new_zeros(batch_size, 1, self.d_state, self.d_inner, dtype=self._memory_dtype()),
        )

    def forward(self, x: Tensor, state: LonghornState | None = None, return_state: bool = False, cu_seqlens=None):
        # each row of the batch its own sequence, or the documents of one packed row
        docs = self.check_call(x, cu_seqlens)
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        u, conv = short_conv(
            xs, self.conv1d.weight, self.conv1d.bias, docs, None if state is None else state.conv, silu=True
        )
        conv = conv.to(xs.dtype)
        dt_low, k, q = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        sig = torch.sigmoid(self.dt_head(dt_low))  # [B, T, E]
        eps = sig / (1 + sig * k.square().sum(-1, keepdim=True))
        # log(1 - eps_c k_n^2) [B, T, 1, N, E]: the per-row-and-column forgetting.
        log_o = torch.log1p(-eps[..., None, :] * k.square()[..., :, None]).unsqueeze(2)
        y, m = eos(
            (eps * u).unsqueeze(2),
            k.unsqueeze(2),
            q.unsqueeze(2),
            log_o,
            initial_state=None if state is None else state.memory,
            output_final_state=return_state,
            cu_seqlens=docs,
        )
        y = y.squeeze(2).to(x.dtype) + self.D.to(x.dtype) * u
        out = self.out_proj(y * F.silu(z))
        return (out, LonghornState(conv=conv, memory=m)) if return_state else out

    def describe(self) -> EOSRow:
        return EOSRow(
            name="Longhorn",
            input="eps_t * u_t",
            expand="k_t",
            oscillation="1 - k_t^2 eps_t^T  (diagonal of I - eps k k^T per value channel)",
            shrink="q_t",
            memory=f"N x E = {self.d_state} x {self.d_inner}, 1 head",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Liu et al. 2024, Longhorn: State Space Models are Amortized Online Learners; "
            "official code Cranial-XIX/Longhorn + longhorn_cuda",
        )
