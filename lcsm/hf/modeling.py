"""``LcsmForCausalLM``: an lcsm ``CausalLM`` as a transformers ``PreTrainedModel``.

The wrapped model is ``self.model`` (an ``lcsm.models.CausalLM``), so the weights are lcsm's own
under a ``model.`` prefix and a tied LM head stays one matrix (lcsm reads the embedding; there is
no second parameter to tie). ``generate`` of transformers carries an ``LcsmCache``: the per-layer
lcsm ``State``s (the linear mixers' recurrent memories, the ``attention`` mixer's KV cache) and the
number of tokens they have read. After the prompt, each step feeds one token through the mixers'
recurrent forms, so a new token costs the same whatever the context length (a growing KV cache for
``attention``), and greedy decoding equals lcsm's own ``CausalLM.generate`` token for token.

Padding: an ``attention_mask`` with zeros, on either side, is lcsm's own (``CausalLM.forward``):
the kept tokens of each row run packed, one document per row, so a pad enters no state and no
output, and each row's state is that of its tokens alone (logits at the pads are to be ignored).
``generate`` on a left-padded batch (a tokenizer's ``padding_side="left"``) therefore equals
generating each prompt alone. Padding belongs to the prompt: once a cache has read tokens, the
mask columns of the tokens fed after them must be 1 (generate's growing mask is).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lcsm._checks import check_int
from lcsm.layers import Mixer, State
from lcsm.models import CausalLM
from lcsm.models.blocks import checkpoint_blocks

from .configuration import LcsmConfig

Tensor = torch.Tensor


class LcsmCache:
    """The recurrent states of an lcsm model, one lcsm ``State`` per layer (one row per sequence),
    and ``seen``: how many columns of the sequences they have read (a left-padded prompt's padding
    included, as transformers counts the attention mask's columns). Updated in place by each
    forward that is given it (as transformers' caches are), so one object follows a whole
    ``generate`` call."""

    # Not a transformers ``Cache``: generate reads these flags to decide about compilation and about
    # undoing steps, neither of which an lcsm state supports (a recurrent memory cannot drop tokens).
    is_compileable = False
    is_croppable = False

    def __init__(self, states: list[State], seen: int, linear: list[bool]):
        self.states = states
        self.seen = seen
        # Per layer: True for a constant-size recurrent state, False for a growing KV cache
        # (transformers' ``is_linear``: generate slices the prompt by ``get_seq_length`` only when
        # some layer is not linear).
        self.is_linear = linear

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keep the rows ``beam_idx`` of every state (beam search): every State tensor is batch-first."""
        self.states = [s.map(lambda t: t.index_select(0, beam_idx.to(t.device))) for s in self.states]

    def __repr__(self) -> str:
        return f"LcsmCache({len(self.states)} layers, {self.seen} tokens seen)"


class LcsmPreTrainedModel(PreTrainedModel):
    config_class = LcsmConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        # lcsm's constructors initialise every weight themselves (the model's layers normal(0.02),
        # each mixer by its paper's rule), which transformers' generic init would overwrite; a
        # checkpoint missing weights is refused by ``from_pretrained`` instead of filled in here.
        pass

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        # transformers' activation checkpointing (activation_checkpointing_enable, the Trainer's
        # gradient_checkpointing=True) recomputes lcsm's Blocks, as run.activation_checkpointing does
        keywords = getattr(gradient_checkpointing_func, "keywords", None) or {}
        # torch's checkpoint hands keywords it does not know to the function it runs (a Block, which
        # would fail at the first forward, far from here)
        known = _checkpoint_options()
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise ValueError(
                f"gradient_checkpointing_kwargs: unknown option(s) {unknown} of torch.utils.checkpoint.checkpoint; "
                f"it takes {sorted(known)}"
            )
        if keywords.get("use_reentrant"):
            raise ValueError(
                "gradient_checkpointing_kwargs: use_reentrant=True is not supported by lcsm models (their Blocks "
                "take keyword arguments and states holding tensors); leave it out (non-reentrant)"
            )
        if gradient_checkpointing_func is not None and "use_reentrant" not in keywords:
            # kwargs without it: torch's checkpoint would fall back to its reentrant form
            gradient_checkpointing_func = functools.partial(gradient_checkpointing_func, use_reentrant=False)
        check_int("every_n_layers", every_n_layers, 1)
        checkpoint_blocks(self, enable, every=every_n_layers, checkpoint_fn=gradient_checkpointing_func)
        # what transformers' is_activation_checkpointing reads
        self.gradient_checkpointing = enable

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not make a transformers DynamicCache: the model makes its LcsmCache itself.
        return False

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, except that a checkpoint without every weight is an
        error (transformers would leave the missing ones as uninitialised memory: lcsm's inits run
        in its constructors, which loading skips)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise ValueError(
                f"from_pretrained: the checkpoint lacks {len(missing)} weight(s) of the lcsm model its config "
                f"describes, e.g. {missing[:5]}"
            )
        if info.get("unexpected_keys"):
            # e.g. an untied head's matrix under a config that ties it: dropping it would give another model
            unexpected = sorted(info["unexpected_keys"])
            raise ValueError(
                f"from_pretrained: the checkpoint holds {len(unexpected)} weight(s) the lcsm model its config "
                f"describes does not have, e.g. {unexpected[:5]}; its config.json and weights disagree"
            )
        if info.get("mismatched_keys"):
            # (ignore_mismatched_sizes=True: transformers would leave them as uninitialised memory)
            mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info["mismatched_keys"])
            raise ValueError(
                f"from_pretrained: {len(mismatched)} weight(s) of the checkpoint have other shapes than the lcsm "
                f"model its config describes, e.g. {mismatched[:5]}; build the model from its config and copy "
                "the weights that fit instead"
            )
        return (model, info) if want_info else model


class LcsmForCausalLM(LcsmPreTrainedModel, GenerationMixin):
    """Any lcsm causal LM (any registered mixer or preset) with transformers' interface:
    ``forward(input_ids, attention_mask, cache, use_cache, labels)``, ``generate``,
    ``save_pretrained`` / ``from_pretrained``."""

    def __init__(self, config: LcsmConfig):
        super().__init__(config)
        # transformers builds a model for a dtype (from_config(dtype=...), from_pretrained(dtype=...))
        # under that default dtype: lcsm's layers would then form their float32 parameters (an SSM's
        # A, dt) in half precision. Built in float32 and converted, they stay float32, as with
        # lcsm's own .to() (Mixer._apply).
        dtype = torch.get_default_dtype()
        half = dtype in (torch.float16, torch.bfloat16)
        if half:
            torch.set_default_dtype(torch.float32)
        try:
            self.model = CausalLM(config.model_config())
        finally:
            torch.set_default_dtype(dtype)
        if half:
            self.model.to(dtype)
        # Loading in half precision (from_pretrained(dtype=torch.bfloat16)) keeps the mixers'
        # float32_parameters in float32, as lcsm's own .to() does (Mixer._apply): transformers
        # casts the weights whose names match these patterns (anchored: exact names) to float32.
        self._keep_in_fp32_modules_strict = [
            "^" + re.escape(f"model.{path}.{name}") + "$"
            for path, module in self.model.named_modules()
            if isinstance(module, Mixer)
            for name, _ in module.named_parameters()
            if module.keeps_float32(name)
        ]
        self.post_init()

    def get_input_embeddings(self):
        return self.model.backbone.embedding

    def set_input_embeddings(self, value):
        self.model.backbone.embedding = value

    def get_output_embeddings(self):
        # A tied head has no module of its own (lcsm reads the embedding matrix).
        return self.model.lm_head

    def set_output_embeddings(self, value):
        """A head of its own (an ``nn.Linear(d_model, vocab_size, bias=False)``, one logit per
        embedding row), or None for the embedding matrix (tied); the lcsm config's
        ``tie_embeddings`` follows, so that ``save_pretrained`` writes a config that builds this model."""
        vocab_size, d_model = self.get_input_embeddings().weight.shape
        if value is not None and not (
            isinstance(value, nn.Linear) and value.bias is None and tuple(value.weight.shape) == (vocab_size, d_model)
        ):
            got = (
                f"Linear({value.in_features}, {value.out_features}, bias={value.bias is not None})"
                if isinstance(value, nn.Linear)
                else type(value).__name__
            )
            raise ValueError(
                f"set_output_embeddings: expected None (tied to the embedding) or "
                f"nn.Linear({d_model}, {vocab_size}, bias=False), got {got}"
            )
        self.model.lm_head = value
        self._set_lcsm_config(tie_embeddings=value is None)

    def _set_lcsm_config(self, **changes) -> None:
        # the model's config (its checks read it) and the HF config's copy (save_pretrained writes it)
        config = dataclasses.replace(self.model.config, **changes)
        self.model.config = self.model.backbone.config = config
        self.config.lcsm = config.to_dict()

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize, with the lcsm config following the new vocabulary: the model's
        token-id check reads it, and ``save_pretrained`` writes it."""
        # transformers sets config.vocab_size before the lcsm config below follows it
        self.config.__dict__["_resizing"] = True
        try:
            embeddings = super().resize_token_embeddings(*args, **kwargs)
        finally:
            del self.config.__dict__["_resizing"]
        self._set_lcsm_config(vocab_size=embeddings.num_embeddings)
        self.config.vocab_size = embeddings.num_embeddings
        return embeddings

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: LcsmCache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """input_ids [B, T] -> logits [B, T, V]; with ``labels`` [B, T] (-100 = ignored) the mean
        next-token cross-entropy, labels shifted inside as in transformers. With ``cache`` the
        tokens continue the sequences it has read, and it is updated in place. ``attention_mask``
        [B, seen + T]: zeros (padding, either side) only among the columns of a first forward, whose
        kept tokens then run packed (padding as if absent; logits at the pads to be ignored)."""
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: lcsm models read token ids; pass input_ids")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = list(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids: expected token ids [B, T], got {got}")
        # transformers' callers may pass these flags (False by default); True asks for outputs lcsm's
        # model does not produce (it has no attention weights, and returns only the final hidden state).
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(name, None):
                raise ValueError(f"{name}: not supported by lcsm models, got True")
        # transformers' Trainer passes the labelled tokens of the whole accumulated batch, so that
        # the loss is a sum over this micro-batch divided by them (a forward with **kwargs is
        # read as taking it)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        # the cache's older transformers name, still used by callers written for it
        if (past := kwargs.pop("past_key_values", None)) is not None:
            if cache is not None:
                raise ValueError("cache / past_key_values: one cache under two names; give it once")
            cache = past
        # transformers' padding-free batches (DataCollatorWithFlattening): documents one after another
        marks = {name: kwargs.pop(name, None) for name in DOCUMENT_MARKS}
        marks = {name: value for name, value in marks.items() if value is not None}
        for name in ("max_length_q", "max_length_k"):  # the flash-attention kernels' bound, not read here
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(f"forward: unexpected argument(s) {', '.join(sorted(kwargs))}")
        if cache is not None and not isinstance(cache, LcsmCache):
            raise ValueError(
                f"cache: expected an LcsmCache (from a previous output's .cache), got {type(cache).__name__}"
            )
        B, T = input_ids.shape
        seen = cache.seen if cache is not None else 0
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] != seen + T
        ):
            raise ValueError(
                f"attention_mask: expected [B, seen + T] = [{B}, {seen + T}] (the tokens the cache has read and "
                f"these), got {list(attention_mask.shape)}"
            )
        # Only the columns of the tokens fed now: earlier ones were read when their tokens were fed
        # (and reading them again would make each decoding step cost O(context)).
        fed = attention_mask[:, -T:] if attention_mask is not None else None
        if fed is not None and not bool(((fed == 0) | (fed == 1)).all()):
            raise ValueError(f"attention_mask: expected 1 (a token) or 0 (padding), got values {fed.unique().tolist()}")
        padded = fed is not None and not bool(fed.all())
        continuing = cache is not None and cache.seen > 0
        if padded and continuing:
            raise ValueError(
                f"attention_mask: has zeros (padding) in the columns of the {T} token(s) fed after the cache's "
                f"{cache.seen}; padding belongs to the prompt, read in the first forward (left padding, as generate "
                "passes it), and every later token must be 1"
            )
        documents = None
        if marks:  # (reading the tokens before costs a device sync: not on every decoding step)
            documents = marked_documents(marks, B, T, fed if padded else None, _read_before(attention_mask, seen, B))
        if documents is not None and (use_cache or cache is not None):
            raise ValueError(
                f"use_cache: a batch of documents one after another ({', '.join(marks)} restarting inside a row) "
                "leaves one state per document, not per row; pass use_cache=False and no cache"
            )
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and documents is None
        # With padding the kept tokens of each row run packed (lcsm's attention_mask): padding is as if
        # absent from every state and output, and the logits at the pads are to be ignored.
        packing = {"attention_mask": fed} if padded else {}

        if documents is not None:
            # every row's documents, in one packed row
            cu = documents.to(input_ids.device)  # (found on the CPU; moved once, not by every block)
            logits = self.model(input_ids.reshape(1, B * T), cu_seqlens=cu).reshape(B, T, -1)
        elif use_cache or cache is not None:
            states = cache.states if continuing else None
            logits, states = self.model(input_ids, state=states, return_state=True, **packing)
            if cache is None:
                # A mixer's state is constant-size when it does not grow with the tokens read.
                linear = [b.mixer.state_size(1) == b.mixer.state_size(2) for b in self.model.backbone.blocks]
                cache = LcsmCache(states, T, linear)
            else:
                cache.states, cache.seen = states, cache.seen + T
        else:
            logits = self.model(input_ids, **packing)

        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels: expected the shape of input_ids {list(input_ids.shape)}, got {list(labels.shape)}"
                )
            # half-precision logits in float32; a float64 model's loss stays float64
            loss = F.cross_entropy(
                logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
                reduction="mean" if num_items_in_batch is None else "sum",
            )
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        if not (return_dict if return_dict is not None else self.config.return_dict):
            return tuple(v for v in (loss, logits, cache) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: LcsmCache | None = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        """The whole prompt first; once the cache has read ``seen`` tokens, only the tokens after
        them (generate passes the whole sequence so far: one new token per step). A prompt's
        padding must be on the left. transformers 5.24's generate makes no ``position_ids`` for
        this model (its forward takes none) and no ``cache_position`` (remote-code models only):
        positions are lcsm's own, counted in each row over its kept tokens."""
        if cache is not None and cache.seen > 0:
            if input_ids.shape[1] <= cache.seen:
                raise ValueError(
                    f"input_ids: with a cache that has read {cache.seen} tokens, generate expects the whole "
                    f"sequence so far (longer than {cache.seen} tokens), got {input_ids.shape[1]} tokens"
                )
            input_ids = input_ids[:, cache.seen :]
            if kwargs.get("position_ids") is not None:  # a caller's, which generate extends as the ids
                kwargs["position_ids"] = kwargs["position_ids"][:, cache.seen :]
        elif attention_mask is not None and not bool(attention_mask[:, -1].all()):
            # generate appends each new token after the last column and reads the logits there.
            raise ValueError(
                "attention_mask: generate needs left padding (a tokenizer's padding_side='left'); the last "
                "column is padding in some rows, whose first new token would be predicted at a pad"
            )
        # generate's bookkeeping for its own slicing, which the line above does; anything else a
        # caller gave generate goes on to forward, which refuses what it does not support.
        for name in ("next_sequence_length", "is_first_iteration"):
            kwargs.pop(name, None)
        inputs = {"input_ids": input_ids.contiguous(), "cache": cache, "use_cache": use_cache, **kwargs}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        return inputs


def _checkpoint_options() -> set[str]:
    # its keyword-only parameters, and preserve_rng_state, which it takes out of **kwargs
    parameters = inspect.signature(torch.utils.checkpoint.checkpoint).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY} | {"preserve_rng_state"}


# The names transformers' DataCollatorWithFlattening gives the documents of a flattened batch by.
DOCUMENT_MARKS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _read_before(attention_mask: Tensor | None, seen: int, B: int) -> Tensor:
    """Per row, the tokens a cache has read before (its padding left out): where positions go on."""
    if attention_mask is None or seen == 0:
        return torch.full((B,), seen, dtype=torch.long)
    return attention_mask[:, :seen].sum(1).long().cpu()


def marked_documents(marks: dict, B: int, T: int, mask: Tensor | None, before: Tensor) -> Tensor | None:
    """The cu_seqlens [N + 1] over the B * T tokens read as one row, of the documents that
    ``marks`` (``DOCUMENT_MARKS`` a caller gave) mark inside the rows; None when each row is one
    sequence, as without them. ``position_ids`` [B, T] must be lcsm's own positions, counted from 0
    in each document (a restart at 0 starts one), or going on from the ``before`` tokens a cache
    has read, at the kept tokens of a padded batch (``mask``) only; ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` [N + 1] (B = 1) and ``seq_idx`` [B, T] (a change starts one) must mark the
    same documents. Anything else is refused by name: the mixers count positions themselves."""
    starts = {}
    for name, value in marks.items():
        value = torch.as_tensor(value).cpu()
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected integer values, got {value.dtype}")
        value = value.long()
        if name.startswith("cu_seq_lens"):
            if B != 1 or value.dim() != 1 or value.numel() < 2 or value[0] != 0 or value[-1] != T:
                raise ValueError(
                    f"{name}: expected the document offsets [N + 1] of one flattened row (B = 1), from 0 to "
                    f"T = {T}, got {list(value.shape)} offsets for a batch of {B} row(s)"
                    + (f" from {int(value[0])} to {int(value[-1])}" if value.dim() == 1 and value.numel() else "")
                )
            if bool((value[1:] <= value[:-1]).any()):
                raise ValueError(
                    f"{name}: expected increasing offsets (documents of at least one token), got {value.tolist()}"
                )
            mark = torch.zeros(1, T, dtype=torch.bool)
            mark[0, value[:-1]] = True
            starts[name] = mark
            continue
        if value.dim() == 1 and B == 1:
            value = value[None]
        if value.shape != (B, T):
            raise ValueError(f"{name}: expected [B, T] = [{B}, {T}] (one per token fed), got {list(value.shape)}")
        if name == "seq_idx":
            starts[name] = F.pad(value[:, 1:] != value[:, :-1], (1, 0), value=True)
            continue
        # position_ids
        if mask is not None or bool((before > 0).any()):
            # a padded prompt, or tokens after those a cache has read: one document a row
            kept = mask.cpu().bool() if mask is not None else torch.ones(B, T, dtype=torch.bool)
            own = before[:, None] + kept.long().cumsum(1) - 1
            wrong = kept & (value != own)
            if bool(wrong.any()):
                b, t = (int(i) for i in wrong.nonzero()[0])
                raise ValueError(
                    f"position_ids: expected lcsm's own positions, {own[b, kept[b]].tolist()} at the tokens of row "
                    f"{b} (counted from 0 over its kept tokens, the cache's included), got {int(value[b, t])} at "
                    f"column {t}"
                )
            starts[name] = F.pad(torch.zeros(B, T - 1, dtype=torch.bool), (1, 0), value=True)
            continue
        start = F.pad(value[:, 1:] != value[:, :-1] + 1, (1, 0), value=True)
        bad = start & (value != 0)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"position_ids: expected positions counted from 0 in each document (as lcsm's mixers count them), "
                f"got a sequence starting at {int(value[b, t])} (row {b}, column {t})"
            )
        starts[name] = start
    if not starts:
        return None
    (first, mark), *others = starts.items()
    for name, other in others:
        if not torch.equal(other, mark):
            raise ValueError(f"{first} / {name}: they mark different documents; give one, or both alike")
    if not bool(mark[:, 1:].any()):
        return None  # one sequence a row, as without them
    if mask is not None:
        raise ValueError(
            f"attention_mask / {first}: padding and documents one after another in one batch; give one of them"
        )
    offsets = mark.reshape(-1).nonzero().squeeze(1)
    return F.pad(offsets, (0, 1), value=B * T)
