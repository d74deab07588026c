"""Lightning Attention (Qin et al. 2024, "Lightning Attention-2" / TransNormerLLM; MiniMax 2025,
"MiniMax-01: Scaling Foundation Models with Lightning Attention", section 2.2) as a configuration
of the EOS operator: linear attention with a constant per-head decay.

Per head h (H heads of width D = d_model / H)::

    q, k, v = SiLU(W_qkv x_t)               one projection, per head [q | k | v], SiLU on all three
    S_t = lambda_h S_{t-1} + k_t v_t^T,  y_t = S_t^T q_t       (no query scale)
    lambda_h = exp(-s_h),  s_h = alibi_h (1 - l / (L - 1) + 1e-5)        (layer l of L)
    out = W_o (sigmoid(W_g x_t) * RMSNorm(y_t))      RMSNorm over all H D channels, eps 1e-6

alibi_h are the ALiBi slopes (Press et al. 2022): 2^(-8 (h + 1) / H) for H a power of two;
otherwise those of the power of two P below H, then every other slope of 2 P for the rest.
Deeper layers decay less; the last layer is nearly decay-free (s = 1e-5 alibi).

EOS mapping (i = v_t, e = k_t, s = q_t, o = lambda_h J: one real data-independent decay
per head, log_o [H, 1, 1]; memory D x D per head), read after the write.

Sources read: the MiniMax-Text-01 modelling code (``MiniMaxText01LightningAttention``:
``qkv_proj`` + SiLU, view (b, n, h, -1) then split into q, k, v, the recurrence
kv = exp(-slope) kv + k^T v, o = q kv, ``MiniMaxText01RMSNorm`` over h * d (eps 1e-6), sigmoid
``output_gate``, ``out_proj``; all bias-free) and its slope schedule ``_build_slope_tensor`` with
the per-layer factor (1 - layer_idx / (num_hidden_layers - 1) + 1e-5) (1 + 1e-5 for a single
layer); TransNormerLLM (OpenNLPLab/TransnormerLLM) is the same linear attention with the same
ALiBi-like decays. fla's ``chunk_lightning_attn`` (fla-core 0.6.0 ``fla/ops/lightning_attn``) uses
another schedule, g_h = -(8 / H)(1 - l / L) h (head 0 decay-free), and the K^-1/2 query scale by
default; this layer follows MiniMax's.

Departures: the default 4 heads (MiniMax-Text-01: 64 heads of 128) let the layer build at small
widths; PyTorch's Linear init (model-level init is the model's job).

Packed sequences (``cu_seqlens``): one EOS call over the row, the memory restarting per document.

Shape glossary: B batch, T time, H heads, D = d_model / H (keys = values).
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


def alibi_slopes(n: int) -> list[float]:
    """ALiBi's head slopes: a geometric sequence 2^(-8 (h + 1) / n) for n a power of two; else
    the slopes of the largest power of two P < n followed by every other slope of 2 P."""
    if math.log2(n).is_integer():
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    p = 2 ** math.floor(math.log2(n))
    return alibi_slopes(p) + alibi_slopes(2 * p)[0::2][: n - p]


@register("lightning", "lightning_attention")
class Lightning(QKVAttention):
    """Lightning Attention token mixer (MiniMax-01's layer).

    Options:
        num_heads: H; d_model must be divisible by it.
        norm_eps: RMSNorm eps (1e-6, MiniMax).
        layer_id, n_layers: position of the layer in the stack, which sets the decay; a model sets
            them per layer (``layer_options``).
    """

    model_owned_options = ("layer_id", "n_layers")

    @classmethod
    def layer_options(cls, options, layer: int, n_layers: int) -> dict:
        return {**options, "layer_id": layer, "n_layers": n_layers}

    def __init__(self, d_model: int, num_heads: int = 4, norm_eps: float = 1e-6, layer_id: int = 0, n_layers: int = 1):
        super().__init__(d_model)
        H = check_int("num_heads", num_heads, 1)
        if d_model % H:
            raise ValueError(f"num_heads: expected a divisor of d_model = {d_model}, got {H}")
        check_int("n_layers", n_layers, 1)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n_layers:
            raise ValueError(f"layer_id: expected an integer in [0, n_layers) = [0, {n_layers}), got {layer_id!r}")
        self.norm_eps = check_float("norm_eps", norm_eps, 0, low_open=True)
        self.num_heads, self.head_k, self.head_v = H, d_model // H, d_model // H
        self.memory_rows = self.head_k
        self.layer_id, self.n_layers = layer_id, n_layers
        depth = 1 - layer_id / (n_layers - 1) if n_layers > 1 else 1.0
        # A fixed schedule, not a parameter (as MiniMax's slope_rate), kept as Python floats so a
        # half-precision layer does not round it (the op computes half inputs in float32).
        self.slopes = tuple(a * (depth + 1e-5) for a in alibi_slopes(H))
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.output_gate = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.norm_weight = no_weight_decay(nn.Parameter(torch.ones(d_model)))

    def eos_inputs(self, x: Tensor):
        q, k, v = F.silu(self.qkv_proj(x)).unflatten(-1, (self.num_heads, -1)).chunk(3, dim=-1)
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        log_decay = -torch.tensor(self.slopes, dtype=dtype, device=x.device)
        return v, k, q, log_decay[:, None, None]

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        y = y.flatten(-2)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight
        return self.o_proj(torch.sigmoid(self.output_gate(x)) * y)

    def describe(self) -> EOSRow:
        return EOSRow(
            name="lightning",
            input="v_t (SiLU)",
            expand="k_t (SiLU)",
            oscillation=f"lambda_h J, lambda_h = exp(-alibi_h (1 - l/(L-1) + 1e-5)), layer {self.layer_id} of "
            f"{self.n_layers}",
            shrink="q_t (SiLU)",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=False,
            shrink_dd=True,
            paper="MiniMax 2025, MiniMax-01 (arXiv:2501.08313), sec. 2.2; Qin et al. 2024, Lightning Attention-2",
        )
