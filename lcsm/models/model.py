"""Models: a backbone of residual blocks with any registered mixer, and three heads.

    CausalLM            tokens [B, T] -> next-token logits [B, T, V]; ``generate`` decodes with
                        the mixers' recurrent states (constant cost per new token).
    SequenceClassifier  tokens [B, T] (or features [B, T, input_dim]) -> class logits [B, C],
                        pooled by mean over valid tokens or by the last valid token.
    DualClassifier      two sequences -> [B, C], pooled features u, v combined as
                        [u, v, u * v, u - v] (LRA retrieval, Tay et al. 2020, "NLI" interaction).

``build_model(config)`` picks the head from ``config.head.kind`` and reports the parameter count.

Shape glossary: B batch, T time, d d_model, V vocab_size, C n_classes. Model state: a list with
one mixer ``State`` per layer (tensors only), as the mixers' own ``forward(x, state, return_state)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.layers import State, ValueFirst
from lcsm.layers.packing import check_mask, pack_rows, unpack_rows

from .blocks import NORM_TYPES, Block, init_model_weights, make_norm
from .config import ModelConfig

Tensor = torch.Tensor
log = logging.getLogger(__name__)


def lengths_from_mask(mask: Tensor | None, batch: int, T: int, device) -> Tensor | None:
    """Valid lengths [B] from a right-padding mask [B, T] (True / 1 = token)."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask)  # a nested list too
    if mask.shape != (batch, T):
        raise ValueError(f"mask: expected [B, T] = [{batch}, {T}], got {list(mask.shape)}")
    mask = mask.to(device=device, dtype=torch.bool)
    lengths = mask.sum(1)
    prefix = torch.arange(T, device=device) < lengths[:, None]
    if not torch.equal(prefix, mask):
        raise ValueError("mask: expected right padding (each row a run of valid tokens followed by padding)")
    if bool((lengths == 0).any()):
        raise ValueError("mask: every sequence needs at least one valid token")
    return lengths


def integer_lengths(lengths, batch: int, T: int) -> Tensor:
    """``lengths`` (a tensor, or a list as ``generate`` takes it) checked: [B] integers in [1, T]."""
    lengths = torch.as_tensor(lengths)
    if (
        lengths.shape != (batch,)
        or lengths.is_floating_point()
        or lengths.is_complex()
        or lengths.dtype == torch.bool
        or bool((lengths < 1).any())
        or bool((lengths > T).any())
    ):
        raise ValueError(
            f"lengths: expected [B] = [{batch}] integers in [1, {T}], got {lengths.dtype} {lengths.tolist()}"
        )
    return lengths


class Backbone(nn.Module):
    """Input encoder (embedding or Linear) -> embedding norm (``embed_norm``) -> dropout -> n_layers
    Blocks -> final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        if config.vocab_size is not None:
            self.embedding = nn.Embedding(config.vocab_size, d)
        else:
            self.encoder = nn.Linear(config.input_dim, d)
        self.embed_norm = make_norm(config.norm, d, config.norm_eps) if config.embed_norm else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm = make_norm(config.norm, d, config.norm_eps) if config.final_norm else nn.Identity()
        owned = [self.embedding if config.vocab_size is not None else self.encoder]
        for block in self.blocks:
            owned += [
                m
                for m in (
                    getattr(block, "mixer_in", None),
                    getattr(block, "mixer_out", None),
                    block.gate,
                    block.channel,
                )
                if m is not None
            ]
        init_model_weights(owned, config.init_std)
        # The tags of ``no_weight_decay`` live on the Parameter objects, which deepcopy, assigning
        # load_state_dict and loading onto a meta-built model (transformers' from_pretrained)
        # replace: their names, kept here, outlive them.
        self.no_decay_names = frozenset(n for n, p in self.named_parameters() if getattr(p, "_no_weight_decay", False))

    def embed(self, inputs: Tensor) -> Tensor:
        if self.config.vocab_size is not None:
            if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"input_ids: expected integer token ids [B, T], got {inputs.dtype} {list(inputs.shape)}"
                )
            _check_ids(inputs, self.config.vocab_size)
            return self.embedding(inputs)
        if inputs.dim() != 3 or inputs.shape[-1] != self.config.input_dim or not inputs.is_floating_point():
            raise ValueError(
                f"inputs: expected float features [B, T, input_dim={self.config.input_dim}], "
                f"got {inputs.dtype} {list(inputs.shape)}"
            )
        return self.encoder(inputs.to(self.encoder.weight.dtype))

    def forward(
        self,
        inputs: Tensor,
        state: list[State] | None = None,
        return_state: bool = False,
        lengths: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ):
        """inputs [B, T] ids (or [B, T, input_dim]) -> hidden [B, T, d] (and the per-layer states).

        ``cu_seqlens`` [N + 1]: inputs are one packed row (B = 1) of N documents, each its own
        sequence (states: one row per document). ``attention_mask`` [B, T] (1 = token, 0 =
        padding, on either side): the kept tokens run packed, one document per row, so padding is
        as if absent; hidden states at the pads are zero."""
        x = self.dropout(self.embed_norm(self.embed(inputs)))
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state: expected one State per layer ({len(self.blocks)}), got {len(state)}")
        mask = None
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError(
                    "attention_mask: give either cu_seqlens (packed documents) or an attention mask, not both"
                )
            mask = check_mask(torch.as_tensor(attention_mask, device=x.device), x.shape[0], x.shape[1])
            x, cu_seqlens = pack_rows(x, mask)
        states = []
        value_first = ValueFirst()
        for i, block in enumerate(self.blocks):
            if state is not None or return_state:
                s_i = state[i] if state is not None else None
                x, s = block(x, state=s_i, return_state=True, cu_seqlens=cu_seqlens, value_first=value_first)
                states.append(s)
            else:
                x = block(x, lengths=lengths, cu_seqlens=cu_seqlens, value_first=value_first)
        x = self.norm(x)
        if mask is not None:
            x = unpack_rows(x, mask)
        return (x, states) if return_state else x

    def init_state(self, batch_size: int) -> list[State]:
        return [block.init_state(batch_size) for block in self.blocks]


class Model(nn.Module):
    """Shared parts of the heads: parameter count and the weight-decay parameter split."""

    config: ModelConfig

    def num_parameters(self) -> int:
        """Distinct trainable parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def no_weight_decay_parameters(self) -> list[nn.Parameter]:
        """Parameters the engine's AdamW should not decay: every parameter tagged by
        ``lcsm.layers.no_weight_decay`` (decays, A_log, skips, ...), every norm parameter and every
        bias. Embedding matrices are decayed, as in nanoGPT and Zoology (2-D parameters are
        decayed; a tied embedding is also the LM head's weight)."""
        tagged = {f"backbone.{n}" for n in self.backbone.no_decay_names}
        chosen = {}
        for path, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                full = f"{path}.{name}" if path else name
                if (
                    getattr(p, "_no_weight_decay", False)
                    or full in tagged
                    or isinstance(module, NORM_TYPES)
                    or name == "bias"
                ):
                    chosen[id(p)] = p
        return list(chosen.values())

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        """The two AdamW groups: decayed parameters, then the ``no_weight_decay_parameters``."""
        skip = {id(p) for p in self.no_weight_decay_parameters()}
        decay = [p for p in self.parameters() if id(p) not in skip]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": [p for p in self.parameters() if id(p) in skip], "weight_decay": 0.0},
        ]


# ----------------------------------------------------------------------------- language model


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row of logits [B, V]: greedy when temperature == 0, else a sample from
    softmax(logits / temperature) restricted to the top_k tokens and to the smallest set whose
    probability reaches top_p (nucleus sampling, Holtzman et al. 2020)."""
    if temperature == 0:
        return logits.argmax(-1)
    # shifted to a maximum of 0 first: a tiny temperature would divide the others to inf
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature < math.inf  # inf: uniform sampling, no model's choice
    ):
        raise ValueError(f"temperature: expected a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected None or a positive integer, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a probability in (0, 1], got {top_p!r}")


class CausalLM(Model):
    """Causal language model: backbone + LM head (tied to the embedding or its own Linear)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.head.kind != "lm":
            raise ValueError(f"head.kind: CausalLM needs head.kind='lm', got {config.head.kind!r}")
        self.config = config
        self.backbone = Backbone(config)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            init_model_weights([self.lm_head], config.init_std)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.backbone.embedding.weight)
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: Tensor,
        state: list[State] | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ):
        """input_ids [B, T] -> logits [B, T, V] (and the per-layer states after the last token);
        ``cu_seqlens`` and ``attention_mask`` as ``Backbone.forward`` (logits at pads are those of
        a zero hidden state: ignore them)."""
        packing = {"cu_seqlens": cu_seqlens, "attention_mask": attention_mask}
        if state is not None or return_state:
            hidden, states = self.backbone(input_ids, state=state, return_state=True, **packing)
            # as a mixer: the states only when asked for, whether or not a state was given
            return (self.logits(hidden), states) if return_state else self.logits(hidden)
        return self.logits(self.backbone(input_ids, **packing))

    def init_state(self, batch_size: int) -> list[State]:
        return self.backbone.init_state(batch_size)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
        vocab_size: int | None = None,
        attention_mask: Tensor | None = None,
        on_token: Callable[[Tensor], None] | None = None,
    ) -> Tensor:
        """Decode ``max_new_tokens`` tokens after each prompt; returns the new tokens [B, max_new_tokens].

        Prompts: a [B, T] tensor (all of length T; right-padded with ``lengths`` [B]; or padded on
        either side with ``attention_mask`` [B, T], 1 = token, 0 = padding, as a left-padding
        tokenizer gives) or a list of B token lists of any lengths. All prompts are read in one
        forward pass, their kept tokens packed (``Backbone.forward``'s ``attention_mask``), so no
        padding enters any state and the result equals generating each prompt alone. From then on
        every sequence advances one token per step through its own row of the mixers' recurrent
        states; each step costs the same whatever the context length (a growing KV cache for the
        ``attention`` mixer). Runs in eval mode (dropout off, batch-norm running statistics).
        ``vocab_size``: sample among the first ``vocab_size`` ids only, for a model whose
        vocabulary is larger than its data's (padding rows, never trained as targets); default:
        every id of the model. ``on_token``: called with each step's tokens [B] as they are drawn
        (to show them as they come: a stopped generation keeps what it showed).
        """
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        n_ids = self.config.vocab_size
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= n_ids
        ):
            raise ValueError(
                f"vocab_size: expected None or an integer in [1, {n_ids}] (the model's vocabulary), got {vocab_size!r}"
            )
        device = self.backbone.embedding.weight.device
        padded, mask = _padded_prompts(input_ids, lengths, attention_mask, device)
        _check_ids(padded, n_ids)
        B, T = padded.shape
        prompt_lengths = mask.sum(1) if mask is not None else torch.full((B,), T, device=device)
        if mask is not None and bool(mask.all()):
            mask = None  # prompts of one length: nothing to pack
        # each module's own mode back afterwards (a caller may hold some in eval while training)
        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            # Logits at each row's last prompt token only (the head reads one position per row).
            hidden, state = self.backbone(padded, return_state=True, attention_mask=mask)
            last_position = (torch.arange(T, device=device) * mask).argmax(1) if mask is not None else T - 1
            last = self.logits(hidden[torch.arange(B, device=device), last_position])
            out = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
            for k in range(max_new_tokens):
                finite = torch.isfinite(last[:, :vocab_size]).all(-1)
                if not bool(finite.all()):
                    position = int(prompt_lengths[~finite][0]) + k  # of the first such sequence
                    raise ValueError(
                        f"generate: the model's logits for position {position} are not finite (nan or inf); its "
                        "weights are likely those of a diverged run"
                    )
                out[:, k] = sample_next(last[:, :vocab_size], temperature, top_k, top_p, generator)
                if on_token is not None:
                    on_token(out[:, k])
                if k == max_new_tokens - 1:
                    break
                logits, state = self(out[:, k : k + 1], state=state, return_state=True)
                last = logits[:, -1]
        finally:
            for m, training in modes.items():
                m.training = training
        return out


def _check_ids(ids: Tensor, vocab_size: int) -> None:
    # nn.Embedding's own failure is an IndexError without the id or the vocabulary (and a device
    # assert on CUDA); one reduction here names both. Eager only: in a compiled graph the check's
    # bool() is a graph break a step (the engine's ids are its task's, whose vocabulary sets the model's).
    if torch.compiler.is_compiling():
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ids.numel() and bool(bad.any()):
        raise ValueError(
            f"input_ids: token ids must lie in [0, vocab_size={vocab_size}), got {int(ids[bad][0])} "
            f"(min {int(ids.min())}, max {int(ids.max())})"
        )


def _padded_prompts(input_ids, lengths, attention_mask, device) -> tuple[Tensor, Tensor | None]:
    """The prompts as ids [B, T] on ``device`` and their mask [B, T] bool (None: every position a token)."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected integer ids [B, T], got {input_ids.dtype} {list(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids: expected prompts of at least one token, got T = 0")
        B, T = input_ids.shape
        ids = input_ids.to(device=device, dtype=torch.long)
        if lengths is not None and attention_mask is not None:
            raise ValueError("lengths / attention_mask: give one of them, not both")
        if attention_mask is not None:
            mask = check_mask(torch.as_tensor(attention_mask, device=device), B, T)
            # The ids at the padding are never read: any pad id (a tokenizer's, or -100) is accepted.
            return ids.masked_fill(~mask, 0), mask
        if lengths is None:
            return ids, None
        lengths = integer_lengths(lengths, B, T)
        mask = torch.arange(T, device=device) < lengths.to(device)[:, None]
        return ids.masked_fill(~mask, 0), mask
    for name, given in (("lengths", lengths), ("attention_mask", attention_mask)):
        if given is not None:
            raise ValueError(f"{name}: only for a padded [B, T] tensor; a list of prompts carries its own lengths")
    prompts = [torch.as_tensor(p) for p in input_ids]
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("input_ids: expected a non-empty list of non-empty 1-D token sequences")
    # (as_tensor with dtype=long would cut 1.7 to 1)
    bad = [p.dtype for p in prompts if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool]
    if bad:
        raise ValueError(f"input_ids: expected integer token ids, got {bad[0]} values")
    prompts = [p.long() for p in prompts]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p.to(device)
        mask[b, : len(p)] = True
    return ids, mask


# ----------------------------------------------------------------------------- classifiers


class PooledClassifierBase(Model):
    """Encoder + pooling shared by the two classifier heads."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)

    def encode(self, inputs: Tensor, mask: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
        """inputs [B, T] (or [B, T, input_dim]) -> pooled features [B, d]. Padding (``mask`` [B, T]
        or ``lengths`` [B], right padding) is excluded from the pooling and, for the two-map
        bidirectional encoder, from both directions."""
        B, T = inputs.shape[:2]
        if mask is not None and lengths is not None:
            raise ValueError("mask / lengths: give one of them, not both")
        lengths = lengths_from_mask(mask, B, T, inputs.device) if lengths is None else integer_lengths(lengths, B, T)
        hidden = self.backbone(inputs, lengths=lengths)
        if lengths is None:
            return hidden.mean(1) if self.config.head.pooling == "mean" else hidden[:, -1]
        lengths = lengths.to(hidden.device)
        if self.config.head.pooling == "last":
            return hidden[torch.arange(B, device=hidden.device), lengths - 1]
        valid = (torch.arange(T, device=hidden.device) < lengths[:, None]).to(hidden.dtype)
        return (hidden * valid[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)


def _mlp_head(d_in: int, hidden: Sequence[int], n_classes: int, style: str = "lra") -> nn.Module:
    """Linear(h) -> act per hidden width, then Linear(classes). "lra": ReLU (Tay et al. 2020);
    "etsmlp": GELU and an output Linear without bias (official ETSMLP ``architectures/LRA_model.py``:
    classifier_activation_fn "gelu", ``sentence_projection_layer`` with bias=False)."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(d_in, h), nn.GELU() if style == "etsmlp" else nn.ReLU()]
        d_in = h
    layers.append(nn.Linear(d_in, n_classes, bias=style != "etsmlp"))
    return nn.Sequential(*layers)


class SequenceClassifier(PooledClassifierBase):
    """One sequence -> class logits [B, C] (mean or last-token pooling, linear or LRA MLP head)."""

    def __init__(self, config: ModelConfig):
        if config.head.kind != "classifier":
            raise ValueError(f"head.kind: SequenceClassifier needs head.kind='classifier', got {config.head.kind!r}")
        super().__init__(config)
        hidden = [config.head.hidden] if config.head.hidden else []
        self.head = _mlp_head(config.d_model, hidden, config.head.n_classes, config.head.mlp)
        init_model_weights([self.head], config.init_std)

    def forward(self, inputs: Tensor, mask: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
        return self.head(self.encode(inputs, mask=mask, lengths=lengths))


class DualClassifier(PooledClassifierBase):
    """Two sequences, one shared encoder -> class logits [B, C] from [u, v, u * v, u - v]
    (LRA retrieval, Tay et al. 2020: the "NLI" interaction of their dual classifier head, followed
    by Linear(h) -> ReLU -> Linear(h // 2) -> ReLU -> Linear(C) when head.hidden = h), or from
    [u, v] with ``head.combine="concat"`` (the official ETSMLP retrieval head, which with
    ``head.mlp="etsmlp"`` is Linear(h) -> GELU -> Linear(C, no bias))."""

    def __init__(self, config: ModelConfig):
        if config.head.kind != "dual":
            raise ValueError(f"head.kind: DualClassifier needs head.kind='dual', got {config.head.kind!r}")
        super().__init__(config)
        head = config.head
        if not head.hidden:
            hidden = []
        elif head.mlp == "etsmlp":
            hidden = [head.hidden]  # official ETSMLP retrieval: classifier_layers 1
        else:
            hidden = [head.hidden, head.hidden // 2]
        width = 4 * config.d_model if head.combine == "nli" else 2 * config.d_model
        self.head = _mlp_head(width, hidden, head.n_classes, head.mlp)
        init_model_weights([self.head], config.init_std)

    def combine(self, u: Tensor, v: Tensor) -> Tensor:
        if self.config.head.combine == "concat":
            return torch.cat([u, v], dim=-1)
        return torch.cat([u, v, u * v, u - v], dim=-1)

    def forward(
        self,
        inputs1: Tensor,
        inputs2: Tensor,
        mask1: Tensor | None = None,
        mask2: Tensor | None = None,
        lengths1: Tensor | None = None,
        lengths2: Tensor | None = None,
    ) -> Tensor:
        u = self.encode(inputs1, mask=mask1, lengths=lengths1)
        v = self.encode(inputs2, mask=mask2, lengths=lengths2)
        return self.head(self.combine(u, v))


HEAD_CLASSES = {"lm": CausalLM, "classifier": SequenceClassifier, "dual": DualClassifier}


def build_model(config: ModelConfig | Mapping, verbose: bool = True) -> Model:
    """Build the model a config describes (a ModelConfig or a plain mapping, validated) and report
    its parameter count on the ``lcsm.models`` logger (INFO)."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_dict(config)
    model = HEAD_CLASSES[config.head.kind](config)
    if verbose:
        log.info(
            "built %s (%s, %d layers, d_model %d): %s parameters",
            type(model).__name__,
            config.stack_summary() if config.hybrid else config.mixer,
            config.n_layers,
            config.d_model,
            f"{model.num_parameters():,}",
        )
    return model
