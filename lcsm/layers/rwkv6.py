"""RWKV-6 "Finch" time mixing (Peng et al. 2024, "Eagle and Finch: RWKV with Matrix-Valued States
and Dynamic Recurrence", arXiv:2404.05892, section 4) as one EOS scan plus a bonus term.

Official code read: BlinkDL/RWKV-LM ``RWKV-v5/src/model.py`` class ``RWKV_Tmix_x060`` (init and
``jit_func``/``jit_func_2``) and its ``generate_init_weight`` (the ``ln_x.weight`` init);
reference recurrence fla-core 0.6.0 ``fla/ops/rwkv6/recurrent_naive.py``.

Per layer (C = d_model channels, H heads of K = C / H channels; x_{t-1} the previous token)::

    dx_t   = x_{t-1} - x_t
    m_t    = tanh((x_t + dx_t * maa_x) A) B_*         low-rank (A [C, 5 R], B [5, R, C]), one per
    x*_t   = x_t + dx_t * (maa_* + m*_t)              * in {w, k, v, r, g}: ddlerp token shift
    r, k, v = W_r xr_t, W_k xk_t, W_v xv_t;   g_t = SiLU(W_g xg_t)
    w_t    = exp(-exp(time_decay + tanh(xw_t D_1) D_2))   data-dependent per-channel decay
    S_t    = diag(w_t) S_{t-1} + k_t v_t^T                per head, [K, K]
    y_t    = r_t^T (S_{t-1} + diag(u) k_t v_t^T)          u = time_faaaa, the bonus
    out_t  = W_o (GroupNorm_H(y_t) * g_t)                 eps = 1e-5 * head_size_divisor^2

EOS mapping (input v_t, expand k_t, oscillation w_t 1^T, shrink r_t, memory K x K per head).
The readout uses S_{t-1}, the memory *before* token t is written and before its decay w_t is
applied, so (as in ``rwkv4.py``) the scan runs on the previous tokens: EOS step t writes token
t - 1 with its decay w_{t-1} (step 1 writes nothing and keeps the carried memory), so the op's
memory at step t is exactly S_{t-1} and its output is r_t^T S_{t-1}. The current token enters
only through the bonus (r_t . (u * k_t)) v_t, computed outside the op; the last token is written
into the carried memory by one ``eos_step``. (Recovering S_{t-1} from S_t would divide by w_t,
which amplifies rounding by up to 1 / w_t = exp(exp(...)).)

Inits (``RWKV_Tmix_x060``, by layer position l of L: r01 = l / (L - 1), r10 = 1 - l / L)::

    maa_x, maa_w, maa_k = 1 - (n / C)^r10;   maa_v = 1 - ((n / C)^r10 + 0.3 r01)
    maa_r, maa_g = 1 - (n / C)^(0.5 r10);    A = 0*, B ~ U(-0.01, 0.01)   (R = 32)
    time_decay_n = -6 + 5 (n / (C - 1))^(0.7 + 1.3 r01);  D_1 = 0*, D_2 ~ U(-0.01, 0.01)  (rank 64)
    time_faaaa_n = r01 (1 - n / (C - 1)) + ((n + 1) % 3 - 1) 0.1
    ln_x.weight = ((1 + l) / L)^0.7  (generate_init_weight), ln_x.bias = 0

Departures. *The official first LoRA factors A and D_1 are zero; here they are U(-0.01, 0.01) like
the second ones: with A = D_1 = 0, maa_x, maa_w, B and D_2 get exactly zero gradient at the first
step (each reaches the output only through a product with a zero factor), which the registry's
every-parameter-learns contract refuses. The official model's global init pass sets the output
projection to zero and key / gate to orthogonal * 0.1; a standalone layer keeps PyTorch's default
Linear init (with a zero output every other parameter would get zero gradient at step 0; global
init is the model's job), as ``rwkv4`` does. For a 1-layer stack r01 = l / (L - 1) is 0/0 in the
official code; we use 0, the first layer's value. The official ranks double at n_embd = 4096 (64
and 128); here they are options (``mix_rank``, ``decay_rank``). The official head size is 64
(``num_heads`` = C / 64); the default here is 4 heads so the layer also builds at small widths.
Half precisions run the recurrence in float32 (the official CUDA kernel's state is float32).

Packed sequences (``cu_seqlens``): the token shift and the shifted scan input restart per document
(``packing.token_shift``), the EOS call restarts its memory per document, and the last token of
each document is written by one ``eos_step`` over the N documents.

Shape glossary: B batch, T time, C = d_model, H heads, K = C / H head size (keys = values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float, check_int

from ..ops import eos, eos_step
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import last, previous

Tensor = torch.Tensor


@dataclass
class RWKV6State(State):
    """shift [B, C]: the last token x_T. memory [B, H, K, K]: S_T (every token written), in EOS
    layout [B, H, K, D]."""

    shift: Tensor
    memory: Tensor


@register("rwkv6", "finch")
class RWKV6(Mixer):
    """RWKV-6 (Finch) time-mixing block (the attention replacement; channel mixing is a
    feed-forward block and belongs to the model).

    Options:
        num_heads: H (official: d_model / 64); d_model must be divisible by it.
        mix_rank: rank R of the ddlerp token-shift LoRA (official 32, 64 at n_embd 4096).
        decay_rank: rank of the decay LoRA (official 64, 128 at n_embd 4096).
        head_size_divisor: the GroupNorm eps is 1e-5 * head_size_divisor^2 (official 8).
        layer_id, n_layers: position of the layer in the stack, used only by the official
            layer-dependent inits; a model sets them per layer (``layer_options``).
    """

    model_owned_options = ("layer_id", "n_layers")

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        return {**options, "layer_id": layer, "n_layers": n_layers}

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        mix_rank: int = 32,
        decay_rank: int = 64,
        head_size_divisor: float = 8.0,
        layer_id: int = 0,
        n_layers: int = 1,
    ):
        super().__init__(d_model)
        H = check_int("num_heads", num_heads, 1)
        if d_model % H:
            raise ValueError(f"num_heads: expected a divisor of d_model = {d_model}, got {H}")
        R = check_int("mix_rank", mix_rank, 1)
        Rd = check_int("decay_rank", decay_rank, 1)
        divisor = check_float("head_size_divisor", head_size_divisor, 0, low_open=True)
        check_int("n_layers", n_layers, 1)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n_layers:
            raise ValueError(f"layer_id: expected an integer in [0, n_layers) = [0, {n_layers}), got {layer_id!r}")
        C = d_model
        self.num_heads, self.head_size = H, C // H
        self.layer_id, self.n_layers = layer_id, n_layers
        self.norm_eps = 1e-5 * divisor**2

        r01 = layer_id / (n_layers - 1) if n_layers > 1 else 0.0
        r10 = 1.0 - layer_id / n_layers
        n = torch.arange(C, dtype=torch.float64)
        ddd = n / C
        dtype = torch.get_default_dtype()

        def param(t: Tensor) -> nn.Parameter:
            return no_weight_decay(nn.Parameter(t.to(dtype)))

        self.maa_x = param(1 - ddd.pow(r10))
        self.maa_w = param(1 - ddd.pow(r10))
        self.maa_k = param(1 - ddd.pow(r10))
        self.maa_v = param(1 - (ddd.pow(r10) + 0.3 * r01))
        self.maa_r = param(1 - ddd.pow(0.5 * r10))
        self.maa_g = param(1 - ddd.pow(0.5 * r10))
        self.maa_w1 = param(torch.empty(C, 5 * R).uniform_(-0.01, 0.01))
        self.maa_w2 = param(torch.empty(5, R, C).uniform_(-0.01, 0.01))
        last_n = n / max(C - 1, 1)
        self.time_decay = param(-6 + 5 * last_n.pow(0.7 + 1.3 * r01))
        self.decay_w1 = param(torch.empty(C, Rd).uniform_(-0.01, 0.01))
        self.decay_w2 = param(torch.empty(Rd, C).uniform_(-0.01, 0.01))
        self.time_faaaa = param(r01 * (1 - last_n) + ((n + 1) % 3 - 1) * 0.1)

        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.gate = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_weight = param(torch.full((C,), ((1 + layer_id) / n_layers) ** 0.7, dtype=torch.float64))
        self.ln_bias = param(torch.zeros(C))

    def _heads(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_size))

    def _mix(self, x: Tensor, shift: Tensor | None, cu_seqlens: Tensor | None):
        """The ddlerp token shift and projections: (r, k, v, g, log w), each [B, T, C]."""
        dx = previous(x, shift, cu_seqlens) - x
        lora = torch.tanh((x + dx * self.maa_x) @ self.maa_w1).unflatten(-1, (5, -1))  # [B, T, 5, R]
        mw, mk, mv, mr, mg = torch.einsum("btjr,jrc->jbtc", lora, self.maa_w2).unbind(0)
        r = self.receptance(x + dx * (self.maa_r + mr))
        k = self.key(x + dx * (self.maa_k + mk))
        v = self.value(x + dx * (self.maa_v + mv))
        g = F.silu(self.gate(x + dx * (self.maa_g + mg)))
        xw = x + dx * (self.maa_w + mw)
        log_w = -torch.exp(self.time_decay + torch.tanh(xw @ self.decay_w1) @ self.decay_w2)
        return r, k, v, g, log_w

    def forward(
        self,
        x: Tensor,
        state: RWKV6State | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        r, k, v, g, log_w = self._mix(x, state.shift if state is not None else None, cu_seqlens)
        # Like the official kernel (float32 state), half precisions run the recurrence in float32.
        wdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        r, k, v, log_w = (t.to(wdt) for t in (r, k, v, log_w))
        u = self.time_faaaa.to(wdt)

        # Scan on the previous tokens: step t writes token t - 1 (decay w_{t-1}), so the op's memory
        # at step t is S_{t-1} and its output r_t^T S_{t-1} (see the module docstring).
        memory0 = state.memory.to(wdt) if state is not None else None
        past, memory = eos(
            self._heads(previous(v, None, cu_seqlens)),
            self._heads(previous(k, None, cu_seqlens)),
            self._heads(r),
            self._heads(previous(log_w, None, cu_seqlens)).unsqueeze(-1),
            initial_state=memory0,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        # The bonus: r_t^T diag(u) k_t v_t^T = (sum_c r u k) v_t per head.
        bonus = self._heads(r * u * k).sum(-1, keepdim=True) * self._heads(v)
        y = past + bonus  # [B, T, H, K]
        mean = y.mean(-1, keepdim=True)
        var = (y - mean).pow(2).mean(-1, keepdim=True)
        y = ((y - mean) * torch.rsqrt(var + self.norm_eps)).flatten(-2).to(x.dtype)
        out = self.output((y * self.ln_weight + self.ln_bias) * g)
        if not return_state:
            return out
        # The last token (of each document) is not in the scan's memory yet: one more step writes it.
        _, memory = eos_step(
            self._heads(last(v, cu_seqlens)),
            self._heads(last(k, cu_seqlens)),
            self._heads(last(r, cu_seqlens)),
            self._heads(last(log_w, cu_seqlens)).unsqueeze(-1),
            memory,
        )
        return out, RWKV6State(shift=last(x, cu_seqlens)[:, 0], memory=memory)

    def init_state(self, batch_size: int) -> RWKV6State:
        p = self._param_like()
        K = self.head_size
        return RWKV6State(
            shift=torch.zeros(batch_size, self.d_model, dtype=p.dtype, device=p.device),
            memory=torch.zeros(batch_size, self.num_heads, K, K, dtype=self._memory_dtype(), device=p.device),
        )

    def describe(self) -> EOSRow:
        K = self.head_size
        return EOSRow(
            name="rwkv6",
            input="v_t (token t - 1; token t through the bonus u)",
            expand="k_t (token t - 1)",
            oscillation="w_t 1^T, w_t = exp(-exp(time_decay + LoRA(x_t))) (token t - 1)",
            shrink="r_t",
            memory=f"{K} x {K} per head, {self.num_heads} heads",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Peng et al. 2024, Eagle and Finch (arXiv:2404.05892), section 4",
        )
