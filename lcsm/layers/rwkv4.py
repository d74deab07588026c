"""RWKV-4 time mixing (Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era",
section 3.1-3.2, eq. 11-17) as two EOS scans sharing one decay.

Per channel c (w = exp(time_decay) > 0 the decay rate, u = time_first the bonus)::

    wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t)
          / (sum_{s<t} e^{-(t-1-s) w + k_s}     + e^{u + k_t})
    out_t = W_o (sigmoid(r_t) * wkv_t)

with token shift: k_t = W_k (mu_k x_t + (1 - mu_k) x_{t-1}), likewise v_t (mu_v) and r_t (mu_r).

EOS mapping (LCSM Table 1, row "RWKV4": input v_t, expand exp(k_t), oscillation exp(-w),
shrink R_t, memory 1 x 1 per channel). The WKV ratio needs two such memories per channel, the
numerator (input v_t) and the denominator (input 1), sharing the expand state exp(k_t) and the
decay exp(-w). All 2 C memories are laid out as the D = 2 C columns of one head with K = 1 row
(numerators first, then denominators): the decay is a column decay [B, T, 1, 1, 2 C] (the same
per-channel values repeated for both halves), and with K = 1 the expand product e_t i_t^T of a
column is the scalar exp(k_t) v_t (resp. exp(k_t)), so it is passed as the op's input with
e = s = 1. So the two scans are one EOS call. This is the same recurrence as C heads with K = 1
and D = 2, and runs faster in the op's chunk kernel on CPU (one head's matmuls instead of C tiny
ones).

Order of decay and output. RWKV-4 reads the memory *before* the current token is added and before
the decay is applied (a_{t-1}, whose newest term has weight e^{k_{t-1}}, undecayed), and adds the
current token with the bonus e^{u + k_t}. The EOS output y_t = m_t includes the current token, so
the scan runs on the previous tokens: EOS step t adds token t - 1 (step 1 adds nothing, the
carried memory already holds the token before the call), giving y_t = a_{t-1} exactly; the last
token is added to the carried memory by one ``eos_step``. (Recovering a_{t-1} from a_t would mean
dividing by e^{-w}, which amplifies rounding by up to e^w.)

Stability. exp(k) overflows for large k (float32 at k ~ 89). Like the official CUDA kernel we
carry a per-channel log-scale o_t and store the memory divided by e^{o_t}, with the CUDA recursion

    o_t = max(o_{t-1} - w, k_t)      (o_t = the exponent of the largest term of a_t)

which in closed form is o_t = max(o_0, max_{1<=s<=t}(k_s + s w)) - t w: a cumulative maximum,
computed in float64 (t w grows with t) without gradient. In stabilised units the recurrence is
still an EOS recurrence, with expand e^{k_t - o_t} <= 1 and oscillation e^{-w + o_{t-1} - o_t}
<= e^{-w}: the op's decay becomes data-dependent, the model's decay is still exp(-w). At the
output both the memory term and the bonus term are rescaled by e^{-p_t}, p_t = max(o_{t-1},
u + k_t), so one of them is exactly 1 and the denominator is >= 1: nothing overflows and 0/0 cannot
occur. Every scale cancels exactly in the ratio, so none needs a gradient. o_T is part of the
carried state. An empty memory (denominator column exactly 0, e.g. ``init_state``) starts from
o_0 = -inf, as the CUDA kernel's -1e38, so zeros are a valid initial state.

Packed sequences (``cu_seqlens``): the token shift (``packing.token_shift``), the shifted scan input,
the log-scale's running maximum (a segmented scan of log2(longest document) doubling steps, so each
document's o_t is exactly the one it has alone: the same maxima of the same numbers) and the EOS
call all restart per document; the last token of each document is added by one ``eos_step`` over
the N documents.

Shape glossary: B batch, T time, d_model = C channels (2 C memory columns in the EOS call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lcsm._checks import check_int

from ..ops import eos, eos_step
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import document_index, document_positions, last, previous, running_max

Tensor = torch.Tensor


@dataclass
class RWKV4State(State):
    """shift [B, C]: the last token x_T. memory [B, 1, 1, 2 C]: the numerator sums (first C
    columns) and denominator sums (last C) of a_T, in EOS layout [B, H, K, D], divided by e^{scale}.
    scale [B, C]: the log-scale o_T."""

    shift: Tensor
    memory: Tensor
    scale: Tensor


@register("rwkv4")
class RWKV4(Mixer):
    """RWKV-4 time-mixing block (the attention replacement; channel mixing is a feed-forward
    block and belongs to the model).

    Args:
        d_model: model width C (the official attention size equals n_embd).
        layer_id, n_layers: position of the layer in the stack, used only by the official
            layer-dependent init of time_decay, time_first and the token-shift mixes; a model
            sets them per layer (``layer_options``).
        chunk_size: C of the operator's chunk form (default 8: the channels' decays, down to
            exp(-e^3) a step at init, send chunks of a few steps already to the strong decays'
            form, whose cost grows with C; 8 ran fastest, bench/results/strong_decay_chunk.md).
            Changes no number beyond rounding.
    """

    model_owned_options = ("layer_id", "n_layers")

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        return {**options, "layer_id": layer, "n_layers": n_layers}

    def __init__(self, d_model: int, layer_id: int = 0, n_layers: int = 1, chunk_size: int = 8):
        super().__init__(d_model)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        check_int("n_layers", n_layers, 1)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n_layers:
            raise ValueError(f"layer_id: expected an integer in [0, n_layers) = [0, {n_layers}), got {layer_id!r}")
        self.layer_id, self.n_layers = layer_id, n_layers
        C = d_model

        # Official RWKV-4 init (RWKV_TimeMix). ratio_0_to_1 is undefined for a 1-layer stack in the
        # official code (0/0); we use 0 there, the value of a first layer.
        ratio_0_to_1 = layer_id / (n_layers - 1) if n_layers > 1 else 0.0
        ratio_1_to_almost0 = 1.0 - layer_id / n_layers
        h = torch.arange(C, dtype=torch.float64)
        decay_speed = -5 + 8 * (h / max(C - 1, 1)) ** (0.7 + 1.3 * ratio_0_to_1)
        zigzag = ((h + 1) % 3 - 1) * 0.5
        ddd = h / C
        dtype = torch.get_default_dtype()
        self.time_decay = no_weight_decay(nn.Parameter(decay_speed.to(dtype)))
        self.time_first = no_weight_decay(nn.Parameter((math.log(0.3) + zigzag).to(dtype)))
        self.time_mix_k = no_weight_decay(nn.Parameter(ddd.pow(ratio_1_to_almost0).to(dtype)))
        self.time_mix_v = no_weight_decay(nn.Parameter((ddd.pow(ratio_1_to_almost0) + 0.3 * ratio_0_to_1).to(dtype)))
        self.time_mix_r = no_weight_decay(nn.Parameter(ddd.pow(0.5 * ratio_1_to_almost0).to(dtype)))

        # The official model zero-initialises key, receptance and output (scale_init = 0) in its
        # global init pass. A standalone layer keeps PyTorch's default init: with a zero output
        # projection every other parameter would get an exactly zero gradient at step 0, and
        # global init is the model's job.
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)

    def _scale(
        self, k: Tensor, w: Tensor, state: RWKV4State | None, cu_seqlens: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Log-scales before and after each token, (o_{t-1}, o_t), each [B, T, C], t counted in the
        token's own sequence (document) (no gradient; see the module docstring). o_0 is the
        carried scale, or -inf where the memory is empty (its denominator exactly 0): then
        o_t = max(o_{t-1} - w, k_t) is exactly the largest exponent of the memory, like the CUDA
        kernel's -1e38 start."""
        with torch.no_grad():
            B, T, C = k.shape
            S = B if cu_seqlens is None else cu_seqlens.numel() - 1  # sequences
            if cu_seqlens is None:
                t = torch.arange(1, T + 1, dtype=torch.float64, device=k.device)
            else:
                t = (document_positions(cu_seqlens, T) + 1).double()
            t = t.unsqueeze(-1)  # [T, 1], the step s of each token in its sequence
            w64 = w.detach().double()
            a = k.detach().double() + t * w64  # k_s + s w
            start = torch.full((S, C), -math.inf, dtype=torch.float64, device=k.device)
            if state is not None:
                empty = state.memory[:, 0, 0, C:] == 0  # [S, C]
                start = torch.where(empty, start, state.scale.detach().double())
            at = start.unsqueeze(1) if cu_seqlens is None else start[document_index(cu_seqlens, T)].unsqueeze(0)
            o_after = (torch.maximum(at, running_max(a, cu_seqlens)) - t * w64).to(k.dtype)
            return previous(o_after, start.to(k.dtype), cu_seqlens), o_after

    def forward(
        self,
        x: Tensor,
        state: RWKV4State | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        B, T, C = x.shape
        xx = previous(x, state.shift if state is not None else None, cu_seqlens)  # x_{t-1}
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r))
        # Like the official kernel (k.float(), v.float()), half precisions run the WKV in float32.
        wdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        k, v = k.to(wdt), v.to(wdt)
        w, u = torch.exp(self.time_decay.to(wdt)), self.time_first.to(wdt)

        o_before, o_after = self._scale(k, w, state, cu_seqlens)
        # An empty memory's o_0 = -inf only enters as the decay of that (zero) memory, so any
        # finite value is exact there; the token's own o_t keeps every decay finite.
        o_dec = torch.where(torch.isinf(o_before), o_after, o_before)
        # Token t's term as the memory takes it: the step that adds it decays the memory from
        # scale o_{t-1} to o_t (log e^{-w} e^{o_{t-1} - o_t} <= -w) and writes e^{k_t - o_t} <= 1
        # times [v_t, 1].
        e = torch.exp(k - o_after)
        add = torch.cat([e * v, e], -1)
        log_add = (o_dec - o_after) - w
        log_add = torch.cat([log_add, log_add], -1)
        # Scan on the previous tokens: EOS step t adds token t - 1, so its memory is exactly
        # a_{t-1} = sum_{s<t} e^{-(t-1-s) w + k_s} [v_s, 1], the past part of wkv_t (a sequence's
        # first step adds nothing: the carried memory already holds the token before it).
        # Recovering a_{t-1} from a_t instead would divide by e^{-w} and amplify rounding by up to e^w.
        ones = k.new_ones(1, 1)
        memory0 = state.memory.to(wdt) if state is not None else None
        past, memory = eos(
            previous(add, None, cu_seqlens).unsqueeze(2),
            ones,
            ones,
            previous(log_add, None, cu_seqlens)[:, :, None, None, :],
            initial_state=memory0,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        past = past.squeeze(2)  # [B, T, 2 C]

        # wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t}), both terms rescaled by
        # e^{-p_t}, p_t = max(o_{t-1}, u + k_t) (as the CUDA kernel), so one of them is exactly 1.
        with torch.no_grad():
            p = torch.maximum(o_before, u + k)
        alpha = torch.exp(o_before - p)
        beta = torch.exp(u + k - p)
        num = alpha * past[..., :C] + beta * v
        den = alpha * past[..., C:] + beta
        out = self.output(torch.sigmoid(r) * (num / den).to(x.dtype))
        if not return_state:
            return out
        # The last token (of each document) is not in the scan's memory yet: one more EOS step adds it.
        _, memory = eos_step(
            last(add, cu_seqlens).unsqueeze(2),
            ones,
            ones,
            last(log_add, cu_seqlens)[:, :, None, None, :],
            memory,
        )
        return out, RWKV4State(shift=last(x, cu_seqlens)[:, 0], memory=memory, scale=last(o_after, cu_seqlens)[:, 0])

    def init_state(self, batch_size: int) -> RWKV4State:
        p = self._param_like()

        def zeros(*shape, dtype=p.dtype):
            return torch.zeros(*shape, dtype=dtype, device=p.device)

        C, wdt = self.d_model, self._memory_dtype()
        return RWKV4State(
            shift=zeros(batch_size, C),
            memory=zeros(batch_size, 1, 1, 2 * C, dtype=wdt),
            scale=zeros(batch_size, C, dtype=wdt),
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="rwkv4",
            input="v_t (numerator) and 1 (denominator)",
            expand="exp(k_t)",
            oscillation="exp(-w), w = exp(time_decay)",
            shrink="R_t = sigmoid(r_t), applied to the ratio wkv_t",
            memory=f"1 x 1 per channel, x2 (numerator, denominator), {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="Peng et al. 2023, RWKV: Reinventing RNNs for the Transformer Era "
            "(arXiv:2305.13048), section 3.1-3.2, eq. 11-17",
        )
