"""``rwkv7``: RWKV-7 "Goose" time mixing (Peng et al. 2025, arXiv:2503.14456), on :func:`lcsm.ops.eos_dplr`.

The official recurrence (BlinkDL/RWKV-LM, RWKV-v7/rwkv_v7_demo.py ``RWKV_Tmix_x070`` and its CUDA
kernel; state S [V, K] per head, value rows)::

    S_t = S_{t-1} (diag(w_t) - kk_t^T (kk_t * a_t)) + v_t k_t^T,     y_t = S_t r_t

Transposed to EOS's memory m = S^T [K, D] (key rows, value columns)::

    m_t = (diag(w_t) - (kk_t * a_t) kk_t^T) m_{t-1} + k_t v_t^T,     y_t = m_t^T r_t

i.e. eos_dplr with log_alpha = log w_t (per key row), a = kk_t * a_t, b = kk_t, e = k_t, i = v_t,
s = r_t. The decay is w_t = exp(-e^{-1/2} sigmoid(z_t)) in (0.545, 1): the official
w = -softplus(-z) - 1/2 then exp(-exp(w)) is the same number, since exp(-softplus(-z)) = sigmoid(z).

Around the recurrence (all as the official layer): token shift with six lerp mixes
(x_r, x_w, x_k, x_v, x_a, x_g), low-rank projections for the decay (tanh), the in-context
learning rate a (sigmoid) and the output gate g (sigmoid inside), kk = L2norm(k * k_k) per head,
k <- k (1 + (a - 1) k_a), a per-head GroupNorm (eps 64e-5) of y, the bonus
((r * k * r_k).sum per head) v, then output(y * g), and the value residual: a layer l > 0 mixes
the model's layer-0 values into its own, v <- v + (v_first - v) sigmoid(v0 + x_v V1 V2), v_first
handed between the layers by the model (``ValueFirst``). Departures
(docs/zoo/rwkv7_deltaproduct.md): the first factors of the low-rank projections (w1, a1, v1, g1),
zero in the official init, and the output projection, zero there too, are initialised small
instead, so that a standalone layer's parameters all get gradient.

Shape glossary: B batch, T time, H heads, N head size (K = D = N), C = d_model = H N, L LoRA rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_int

from ..ops import DPLR_MODES, eos_dplr
from .base import EOSRow, Mixer, State, ValueFirst, no_weight_decay, register
from .packing import last, previous

Tensor = torch.Tensor

# The official ln_x eps (64e-5, "notice eps value" in the official code): 1e-5 scaled by the head size 64.
_GROUP_NORM_EPS = 64e-5
# The official F.normalize default eps for kk.
_L2_EPS = 1e-12
# w = exp(-e^{-1/2} sigmoid(z)): the official soft clamp of the log-log decay to (-inf, -1/2).
_DECAY_SCALE = math.exp(-0.5)


def _lora_rank(C: int, factor: float) -> int:
    """The official rank suggestion: a multiple of 32 near factor sqrt(C), at least 32."""
    return max(32, int(round(factor * C**0.5 / 32) * 32))


@dataclass
class RWKV7State(State):
    """shift [B, C]: the last token x_T (token shift). memory [B, H, N, N]: m_T = S_T^T (key rows)."""

    shift: Tensor
    memory: Tensor


@register("rwkv7", "goose")
class RWKV7(Mixer):
    """RWKV-7 "Goose" time mixing (module docstring; channel mixing is a feed-forward block and
    belongs to the model).

    Args:
        d_model: model width C (the official dim_att equals n_embd).
        head_size: N (official 64); None: 64, or d_model when smaller.
        layer_id, n_layers: the layer's position, used by the official layer-dependent init
            (ratio_0_to_1, ratio_1_to_almost0) and to tell layer 0, whose values the later layers
            mix in, from those; a model sets them per layer (``layer_options``).
        value_residual: a layer > 0 mixes in layer 0's values (official; its forward then needs
            ``value_first``, which the model gives). False: every layer as the official layer 0.
        mode: eos_dplr mode.
    """

    model_owned_options = ("layer_id", "n_layers")
    modes = DPLR_MODES
    uses_value_first = True
    revision = 2  # 2: the value residual (layers > 0)

    @classmethod
    def revision_for(cls, options) -> int:
        return cls.revision if options.get("value_residual", True) else 1

    @classmethod
    def reads_value_first_at(cls, options, layer: int) -> bool:
        # Layer 0 is where the values come from; only later layers mix them in.
        return layer > 0 and options.get("value_residual", True)

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        return {**options, "layer_id": layer, "n_layers": n_layers}

    def __init__(
        self,
        d_model: int,
        head_size: int | None = None,
        layer_id: int = 0,
        n_layers: int = 1,
        value_residual: bool = True,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        C = d_model
        N = check_int("head_size", head_size, 1, allow_none=True) or min(64, C)
        if C % N:
            raise ValueError(f"head_size: expected a divisor of d_model={C}, got {N}")
        check_int("n_layers", n_layers, 1)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n_layers:
            raise ValueError(f"layer_id: expected an integer in [0, n_layers) = [0, {n_layers}), got {layer_id!r}")
        self.mode = check_choice("mode", mode, self.modes)
        check_bool("value_residual", value_residual)
        self.reads_value_first = self.reads_value_first_at({"value_residual": value_residual}, layer_id)
        self.head_size, self.heads = N, C // N
        self.layer_id, self.n_layers = layer_id, n_layers
        H = self.heads

        # Official init (train_temp/src/model.py RWKV_Tmix_x070). ratio_0_to_1 is 0/0 for a
        # one-layer stack there; we take 0, a first layer's value.
        ratio_0_to_1 = layer_id / (n_layers - 1) if n_layers > 1 else 0.0
        ratio_1_to_almost0 = 1.0 - layer_id / n_layers
        n = torch.arange(C, dtype=torch.float64)
        ddd = n / C
        linear = n / max(C - 1, 1) - 0.5
        zigzag = ((n % N) - (N - 1) / 2) / max((N - 1) / 2, 1)
        zigzag = zigzag * zigzag.abs()
        decay = -6 + 6 * (n / max(C - 1, 1)) ** (1 + ratio_0_to_1**0.3)
        dtype = torch.get_default_dtype()

        def vector(t: Tensor) -> nn.Parameter:
            return no_weight_decay(nn.Parameter(t.to(dtype)))

        self.x_r = vector(1 - ddd.pow(0.2 * ratio_1_to_almost0))
        self.x_w = vector(1 - ddd.pow(0.9 * ratio_1_to_almost0))
        self.x_k = vector(1 - ddd.pow(0.7 * ratio_1_to_almost0))
        self.x_v = vector(1 - ddd.pow(0.7 * ratio_1_to_almost0))
        self.x_a = vector(1 - ddd.pow(0.9 * ratio_1_to_almost0))
        self.x_g = vector(1 - ddd.pow(0.2 * ratio_1_to_almost0))
        self.w0 = vector(decay + 0.5 + 2.5 * zigzag)
        self.a0 = vector(-0.19 + 0.3 * zigzag + 0.4 * linear)
        self.k_k = vector(0.71 - 0.1 * linear)
        self.k_a = vector(torch.full((C,), 1.02, dtype=torch.float64))
        self.r_k = vector(torch.full((H, N), -0.04, dtype=torch.float64))

        # Low-rank projections x @ w1 @ w2. Officially the first factor is zero and the second
        # orthogonal with gain 0.1; a zero first factor gives the second an exactly zero gradient
        # at step 0, so here the first is orthogonal too, with gain 0.01 (docs: departures).
        def lora(factor: float) -> tuple[nn.Parameter, nn.Parameter]:
            L = _lora_rank(C, factor)
            first, second = torch.empty(C, L), torch.empty(L, C)
            nn.init.orthogonal_(first, gain=0.01 * (math.sqrt(C / L) if C > L else 1.0))
            nn.init.orthogonal_(second, gain=0.1 * (math.sqrt(L / C) if L > C else 1.0))
            # undecayed, as officially: its optimiser decays only parameters named ".weight"
            return no_weight_decay(nn.Parameter(first)), no_weight_decay(nn.Parameter(second))

        self.w1, self.w2 = lora(2.5)
        self.a1, self.a2 = lora(2.5)
        if self.reads_value_first:
            self.v0 = vector(0.73 - 0.4 * linear)
            self.v1, self.v2 = lora(1.7)
        self.g1, self.g2 = lora(5.0)

        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        with torch.no_grad():
            self.receptance.weight.uniform_(-0.5 / C**0.5, 0.5 / C**0.5)
            self.key.weight.uniform_(-0.05 / C**0.5, 0.05 / C**0.5)
            self.value.weight.uniform_(-0.5 / C**0.5, 0.5 / C**0.5)
            # Officially zero; a zero output would leave every other parameter without gradient
            # at step 0 (global init is the model's job), so small instead.
            self.output.weight.uniform_(-0.05 / C**0.5, 0.05 / C**0.5)
        self.ln_x = nn.GroupNorm(H, C, eps=_GROUP_NORM_EPS)
        no_weight_decay(self.ln_x.weight)
        no_weight_decay(self.ln_x.bias)

    def _heads(self, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.heads, self.head_size)

    def forward(
        self,
        x: Tensor,
        state: RWKV7State | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
        value_first: ValueFirst | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, C = x.shape
        memory0 = state.memory if state is not None else None
        xx = previous(x, state.shift if state is not None else None, cu_seqlens) - x
        xr, xw, xk = x + xx * self.x_r, x + xx * self.x_w, x + xx * self.x_k
        xv, xa, xg = x + xx * self.x_v, x + xx * self.x_a, x + xx * self.x_g

        r = self.receptance(xr)
        log_w = -_DECAY_SCALE * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2)
        k = self.key(xk)
        v = self.value(xv)
        if self.layer_id == 0 and value_first is not None:
            value_first.values = v
        elif self.reads_value_first:
            v = self._mix_first_values(v, xv, value_first)
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize(self._heads(k * self.k_k), dim=-1, eps=_L2_EPS)
        k = k * (1 + (a - 1) * self.k_a)
        r, k, v, a, log_w = (self._heads(t) for t in (r, k, v, a, log_w))

        y, memory = eos_dplr(
            v,
            k,
            r,
            kk * a,
            kk,
            log_w,
            mode=self.mode,
            initial_state=memory0,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        y = self.ln_x(y.to(x.dtype).reshape(B * T, C)).reshape(B, T, C)
        bonus = (r * k * self.r_k).sum(-1, keepdim=True) * v
        out = self.output((y + bonus.reshape(B, T, C)) * g)
        if not return_state:
            return out
        return out, RWKV7State(shift=last(x, cu_seqlens)[:, 0], memory=memory)

    def _mix_first_values(self, v: Tensor, xv: Tensor, value_first: ValueFirst | None) -> Tensor:
        first = None if value_first is None else value_first.values
        if first is None:
            raise ValueError(
                f"value_first: layer {self.layer_id} of RWKV-7 mixes in the values of the model's layer 0 "
                "(value_residual=True), got none: run it in a causal lcsm model whose layer 0 is rwkv7, pass "
                "value_first, or build it with value_residual=False"
            )
        if first.shape != v.shape:
            raise ValueError(
                f"value_first.values: expected {list(v.shape)} (this layer's values), got {list(first.shape)}"
            )
        return v + (first.to(v.dtype) - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)

    def init_state(self, batch_size: int) -> RWKV7State:
        p = self._param_like()
        N = self.head_size
        return RWKV7State(
            shift=p.new_zeros(batch_size, self.d_model),
            memory=p.new_zeros(batch_size, self.heads, N, N, dtype=self._memory_dtype()),
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="rwkv7",
            input="v_t",
            expand="k_t (1 + (a_t - 1) k_a)",
            oscillation="diag(w_t) - (kk_t * a_t) kk_t^T, kk_t = L2norm(k_t * k_k)",
            shrink="r_t (then GroupNorm, bonus, gate g_t)",
            memory=f"N x N = {self.head_size} x {self.head_size} per head, {self.heads} heads",
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper='Peng et al. 2025, RWKV-7 "Goose" with Expressive Dynamic State Evolution (arXiv:2503.14456)',
        )
