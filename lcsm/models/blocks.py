"""The one residual block of every model, its channel mixers and norms, and the bidirectional map.

Block (pre-norm residual; the token branch is optionally wrapped in an element-wise MLP and gated):

    u = norm1(x)
    z = mixer(u)                                         mixer_hidden None
    z = W_2 act(mixer(W_1 u))                            mixer_hidden H (ETSMLP section 3.2)
    z = sigmoid(W_g u) * z                               gate (ETSMLP-Gate)
    x = x + dropout(z)
    x = x + dropout(channel(norm2(x)))                   channel mixer "glu" / "mlp"; absent for "none"

Shape glossary: B batch, T time, d = d_model, H = mixer width (d or ``mixer_hidden``),
F = channel-mixer hidden width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lcsm.layers import Mixer, State, ValueFirst, build
from lcsm.layers.base import resolve
from lcsm.ops import native_serves, native_silu_mul

from .config import ModelConfig

Tensor = torch.Tensor

ACTIVATION_FNS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "identity": lambda x: x}


class BatchNorm(nn.Module):
    """BatchNorm1d over the channels of [B, T, d] (statistics over batch and time)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.bn = nn.BatchNorm1d(d, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(d, eps=eps)
    return BatchNorm(d, eps)


NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d, nn.GroupNorm)


class GLU(nn.Module):
    """SwiGLU channel mixer (Shazeer 2020): W_down(SiLU(W_gate x) * W_up x), no biases (LLaMA,
    MetaLA's LM code). Eager on the CPU the gate is one native pass each way (``native_silu_mul``:
    two and four as PyTorch operations, the gate's largest tensors)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(native_silu_mul(gate, up) if native_serves(gate) else F.silu(gate) * up)


class MLP(nn.Module):
    """Linear(d -> F) -> GELU -> Linear(F -> d) with biases (the GPT-2 / Transformer FFN)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def reverse_valid(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Reverse each sequence of x [B, T, ...] within its own length (padding stays at the end).

    The map is an involution, so it also undoes itself. Without ``lengths`` it is a plain flip."""
    if lengths is None:
        return x.flip(1)
    T = x.shape[1]
    t = torch.arange(T, device=x.device)
    lengths = lengths.to(x.device)
    idx = torch.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)  # [B, T]
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)


class Bidirectional(nn.Module):
    """A non-causal map from two causal maps (MNet note, "a general mapping can be obtained by two
    causal mappings"):

        y_m = f(x_1, ..., x_m)_m + g(x_n, ..., x_{m+1})_{last}

    f reads the prefix up to m, g (separate parameters) reads the suffix after m in reverse. g runs
    causally on the reversed sequence delayed by one step (a zero vector first), so that position
    m of the backward pass has seen exactly x_n ... x_{m+1}, as in the note's f_m + f~_{n-m} and as
    CES's native two-sided kernel (ETSMLP eq. 14). The reversal is per sequence within ``lengths``,
    so right padding never enters a valid position from either side.
    """

    def __init__(self, forward_map: Mixer, backward_map: Mixer):
        super().__init__()
        self.forward_map = forward_map
        self.backward_map = backward_map

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        rev = reverse_valid(x, lengths)
        rev = F.pad(rev, (0, 0, 1, 0))[:, : x.shape[1]]
        return self.forward_map(x) + reverse_valid(self.backward_map(rev), lengths)


def layer_mixer_options(config: ModelConfig, layer: int) -> dict:
    """The mixer options of layer ``layer``: the config's (of that layer's mixer, in a hybrid),
    plus what the model sets (see ``layer_options``)."""
    name, options = config.layer_mixers()[layer]
    return layer_options(resolve(name)[0], options, layer, config.n_layers, config.bidirectional)


def layer_options(
    mixer: type[Mixer], options: Mapping[str, Any], layer: int, n_layers: int, bidirectional: bool
) -> dict:
    """``layer_mixer_options`` from the parts of the model config it reads: the mixer's per-layer
    options (``Mixer.layer_options``, e.g. RWKV-4's depth-dependent init), and ``bidirectional``
    for a mixer that reads both directions itself (``Mixer.native_bidirectional``). Sweeps compare
    these to tell whether two configs build the same layers."""
    options = mixer.layer_options(options, layer, n_layers)
    if mixer.native_bidirectional:
        options["bidirectional"] = bidirectional
    return options


class Block(nn.Module):
    """Pre-norm residual block: token mixer branch, then channel mixer branch (see module doc)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d, H = config.d_model, config.mixer_width
        name = config.layer_mixers()[layer][0]
        options = layer_mixer_options(config, layer)
        self.native_bidirectional = config.native_bidirectional_at(layer)
        self.bidirectional = config.bidirectional and not self.native_bidirectional
        if self.bidirectional:
            self.mixer = Bidirectional(build(name, H, **options), build(name, H, **options))
        else:
            self.mixer = build(name, H, **options)
        self.norm1 = make_norm(config.norm, d, config.norm_eps)
        if config.mixer_hidden is not None:
            self.mixer_in = nn.Linear(d, H)
            self.mixer_out = nn.Linear(H, d)
        self.activation = config.mixer_activation
        self.gate = nn.Linear(d, d) if config.gate else None
        hidden = config.resolved_channel_hidden() if config.channel_mixer != "none" else None
        if config.channel_mixer == "glu":
            self.channel = GLU(d, hidden)
        elif config.channel_mixer == "mlp":
            self.channel = MLP(d, hidden)
        else:
            self.channel = None
        self.norm2 = make_norm(config.norm, d, config.norm_eps) if self.channel is not None else None
        self.dropout = nn.Dropout(config.dropout)
        self.wrapped = config.mixer_hidden is not None
        # A two-map bidirectional block gets none: its maps run on two different orders.
        self.uses_value_first = not self.bidirectional and self.mixer.uses_value_first

    def forward(
        self,
        x: Tensor,
        state: State | None = None,
        return_state: bool = False,
        lengths: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        value_first: ValueFirst | None = None,
    ):
        """x [B, T, d] -> [B, T, d] (and the mixer's State when ``return_state``); ``cu_seqlens``:
        x is one packed row of documents (``Mixer.forward``); everything else in the block acts
        token by token. ``value_first``: the model's, handed to a mixer that uses it
        (``ValueFirst``)."""
        u = self.norm1(x)
        z = self.mixer_in(u) if self.wrapped else u
        new_state = None
        shared = {"value_first": value_first} if self.uses_value_first else {}
        if cu_seqlens is not None and (self.bidirectional or self.native_bidirectional):
            raise ValueError("cu_seqlens: packed sequences are for causal models; this block reads both directions")
        if self.bidirectional:
            if state is not None or return_state:
                raise ValueError("state: a bidirectional block is non-causal and has no recurrent state")
            z = self.mixer(z, lengths=lengths)
        elif state is not None or return_state:
            z, new_state = self.mixer(z, state=state, return_state=True, cu_seqlens=cu_seqlens, **shared)
        elif self.native_bidirectional:
            z = self.mixer(z, lengths=lengths)
        else:
            z = self.mixer(z, cu_seqlens=cu_seqlens, **shared)
        if self.wrapped:
            z = self.mixer_out(ACTIVATION_FNS[self.activation](z))
        if self.gate is not None:
            z = torch.sigmoid(self.gate(u)) * z
        x = x + self.dropout(z)
        if self.channel is not None:
            x = x + self.dropout(self.channel(self.norm2(x)))
        return (x, new_state) if return_state else x

    def init_state(self, batch_size: int) -> State:
        if self.bidirectional:
            raise ValueError("init_state: a bidirectional block is non-causal and has no recurrent state")
        return self.mixer.init_state(batch_size)


def blocks(model: nn.Module) -> list[Block]:
    """The model's Blocks (mixer and channel layer of one layer each), in order."""
    return [m for m in model.modules() if isinstance(m, Block)]


def checkpoint_blocks(
    model: nn.Module, enable: bool = True, *, every: int = 1, checkpoint_fn: Callable | None = None
) -> None:
    """Recompute the forward pass of every ``every``-th Block (the first, then every ``every``) in
    the backward pass instead of keeping its activations; ``enable=False`` keeps every Block's
    activations again. ``checkpoint_fn(function, *args, **kwargs)``: torch's non-reentrant
    checkpoint by default (the reentrant one takes no keyword arguments, and would not carry
    gradients through the tensors inside a State or ValueFirst).

    The instance's ``forward`` is replaced rather than the Block wrapped in another module, so the
    parameter names, and with them checkpoints, stay as they are. torch's checkpoint restores the
    RNG state for the recomputation: dropout draws the same masks, the gradients are the same."""
    checkpoint_fn = checkpoint_fn or functools.partial(checkpoint, use_reentrant=False)
    for i, block in enumerate(blocks(model)):
        block.__dict__.pop("forward", None)
        if enable and i % every == 0:
            block.forward = functools.partial(checkpoint_fn, block.forward)


def init_model_weights(modules: list[nn.Module], std: float) -> None:
    """normal(0, std) for the weights of the model's own Linear and Embedding layers, zero biases
    (GPT-2 / Zoology init, std 0.02). The mixers keep their own papers' inits."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
