"""Typed model configuration: one dataclass describes every model of the library.

A model is a config, never a per-model file: the token mixer is any registered mixer
(``lcsm.layers.available()``) with its options; the block, the channel mixer, the norm and the
head are fields. ``ModelConfig.from_dict`` rejects unknown keys naming the closest valid ones;
``__post_init__`` validates every value (and the mixer's option names against its signature),
so a bad config fails before any weight is allocated. The head is a config of its own,
``HeadConfig``, nested under ``head``.

Hybrid stacks: ``mixer`` may also give a mixer per layer (``layer_mixers``), as a list of
n_layers names or as a pattern,

    mixer: ["mamba", "mamba", "mamba", "attention"]
    mixer: {default: mamba, every: {k: 4, mixer: attention, offset: 3}}

(layers offset, offset + k, ... get the rule's mixer; ``every`` may be a list of rules, a later
one overriding an earlier one where they meet; offset defaults to k - 1, the last layer of each
group of k). A hybrid's ``mixer_options`` maps each mixer name of the stack to its options
(``{attention: {window: 64}}``), or is a list of n_layers option mappings, one per layer. A
single name keeps its one options mapping, as always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lcsm._checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_keys,
    named_fields,
    with_older_spelling,
)
from lcsm.layers.base import check_options, resolve

HEADS = ("lm", "classifier", "dual")
CHANNEL_MIXERS = ("glu", "mlp", "none")
NORMS = ("layernorm", "rmsnorm", "batchnorm")
POOLINGS = ("mean", "last")
HEAD_MLPS = ("lra", "etsmlp")
DUAL_COMBINES = ("nli", "concat")
ACTIVATIONS = ("relu", "gelu", "silu", "identity")


@named_fields
@dataclass(frozen=True)
class HeadConfig:
    """The model's head.

    kind: "lm" (next-token logits), "classifier" (one sequence) or "dual" (two sequences, LRA
        retrieval). The fields below are the classifier heads'; with "lm" they keep their defaults.
    n_classes: classes of the classifier heads.
    pooling: "mean" (over valid tokens) or "last" (last valid token).
    combine: how "dual" joins its two pooled vectors u, v: "nli": [u, v, u * v, u - v] (LRA
        retrieval, Tay et al. 2020); "concat": [u, v] (the official ETSMLP code's retrieval head).
    hidden: 0: a Linear classifier on the pooled features; > 0: the LRA MLP head (classifier:
        Linear(h) -> ReLU -> Linear(classes); dual: Linear(h) -> ReLU -> Linear(h // 2) -> ReLU ->
        Linear(classes), Tay et al. 2020 code).
    mlp: "lra": the heads above. "etsmlp": the official ETSMLP classifier
        (``architectures/LRA_model.py``, LRAModel): hidden h > 0 gives one hidden Linear(h) -> GELU
        for either head, and the output Linear(classes) has no bias.
    """

    kind: str = "lm"
    n_classes: int | None = None
    pooling: str = "mean"
    hidden: int = 0
    combine: str = "nli"
    mlp: str = "lra"

    def __post_init__(self):
        check_choice("head.kind", self.kind, HEADS)
        check_choice("head.pooling", self.pooling, POOLINGS)
        check_choice("head.combine", self.combine, DUAL_COMBINES)
        check_choice("head.mlp", self.mlp, HEAD_MLPS)
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 0 or self.hidden == 1:
            raise ValueError(f"head.hidden: expected 0 (linear head) or an integer >= 2, got {self.hidden!r}")
        if self.kind != "lm":
            check_int("head.n_classes", self.n_classes, 1)
            return
        if self.n_classes is not None:
            raise ValueError(
                f"head.n_classes: only for the classifier heads, got {self.n_classes!r} with head.kind='lm'"
            )
        # Set away from their defaults, these would be ignored by an LM: refuse them instead.
        for name, default in (("hidden", 0), ("pooling", "mean"), ("mlp", "lra")):
            if getattr(self, name) != default:
                raise ValueError(
                    f"head.{name}: only for the classifier heads, got {getattr(self, name)!r} with head.kind='lm'"
                )

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_value(cls, value: HeadConfig | str | Mapping[str, Any]) -> HeadConfig:
        """A HeadConfig from what a config gives under ``head``: a mapping of its fields (unknown keys
        name the closest valid ones), or a kind's name alone, shorthand for ``{kind: <name>}``."""
        if isinstance(value, HeadConfig):
            return value
        if isinstance(value, str):
            value = {"kind": value}
        check_keys("model.head", value, cls.field_names())
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The flat model-level spelling of the head's fields, from before the head was nested: committed
# run configs and checkpoints give it, and their run ids hash it as written, so it is read (never
# rewritten) as the field of ``head`` it names.
OLD_HEAD_KEYS = {
    "n_classes": "n_classes",
    "pooling": "pooling",
    "head_hidden": "hidden",
    "dual_combine": "combine",
    "head_mlp": "mlp",
}


def nest_head(values: Mapping[str, Any]) -> dict[str, Any]:
    """A model mapping with its head as a mapping: ``head: <kind>`` read as ``{kind: <kind>}``, the
    old flat keys (``head_hidden``, ...) moved into it; the other keys as they are. A HeadConfig is
    kept whole. A field given both ways (a HeadConfig gives them all) fails rather than one
    silently winning."""
    if not isinstance(values, Mapping):
        raise ValueError(f"model: expected a mapping of ModelConfig fields, got {values!r}")
    values = dict(values)
    old = {key: values.pop(key) for key in OLD_HEAD_KEYS if key in values}
    if "head" not in values and not old:
        return values
    head = values.get("head", {})
    if isinstance(head, HeadConfig) and not old:
        return values
    if isinstance(head, str):
        head = {"kind": head}
    elif isinstance(head, HeadConfig):
        head = head.to_dict()
    elif not isinstance(head, Mapping):
        raise ValueError(f"model.head: expected a mapping of head fields or a head kind's name, got {head!r}")
    older = {OLD_HEAD_KEYS[key]: (key, value) for key, value in old.items()}
    values["head"] = with_older_spelling(head, older, "model", "model.head")
    return values


MIXER_PATTERN_KEYS = ("default", "every")
MIXER_RULE_KEYS = ("k", "mixer", "offset")


def _mixer_name(where: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a registered mixer name (str), got {value!r}")
    resolve(value)  # unknown names raise with the closest valid ones
    return value


def expand_mixers(mixer, n_layers: int) -> list[str]:
    """The mixer name of every layer from a config's ``mixer``: one name (every layer), a list of
    n_layers names, or a pattern ``{default: <name>, every: <rule> | [<rule>, ...]}`` with rules
    ``{k, mixer, offset = k - 1}`` (layers offset, offset + k, ... get ``mixer``)."""
    if isinstance(mixer, str):
        return [_mixer_name("mixer", mixer)] * n_layers
    if isinstance(mixer, (list, tuple)):
        if len(mixer) != n_layers:
            raise ValueError(
                f"mixer: a list gives one mixer per layer: expected {n_layers} names (n_layers), got {len(mixer)}"
            )
        return [_mixer_name(f"mixer[{i}]", name) for i, name in enumerate(mixer)]
    if isinstance(mixer, Mapping):
        check_keys("mixer", mixer, MIXER_PATTERN_KEYS)
        if "default" not in mixer:
            raise ValueError("mixer.default: a mixer pattern needs the mixer of the layers no rule picks, got none")
        names = [_mixer_name("mixer.default", mixer["default"])] * n_layers
        rules = mixer.get("every", [])
        rules = [rules] if isinstance(rules, Mapping) else rules
        if not isinstance(rules, (list, tuple)):
            raise ValueError(f"mixer.every: expected a rule {{k, mixer, offset}} or a list of them, got {rules!r}")
        for i, rule in enumerate(rules):
            where = f"mixer.every[{i}]"
            check_keys(where, rule, MIXER_RULE_KEYS)
            k = check_int(f"{where}.k", rule.get("k"), 1)
            name = _mixer_name(f"{where}.mixer", rule.get("mixer"))
            offset = check_int(f"{where}.offset", rule.get("offset", k - 1), 0)
            if offset >= k:
                raise ValueError(f"{where}.offset: expected 0 <= offset < k = {k}, got {offset}")
            for layer in range(offset, n_layers, k):
                names[layer] = name
        return names
    raise ValueError(
        f"mixer: expected a registered mixer name, a list of one name per layer, or a pattern "
        f"{{default, every}}, got {mixer!r}"
    )


def layer_mixers(mixer, mixer_options, n_layers: int) -> list[tuple[str, dict[str, Any]]]:
    """(mixer name, its options as given) of every layer, from a config's ``mixer``,
    ``mixer_options`` and ``n_layers`` (``expand_mixers``). One name: its options on every layer.
    A hybrid: ``mixer_options`` maps names of the stack to their options, or lists one options
    mapping per layer."""
    names = expand_mixers(mixer, n_layers)
    if isinstance(mixer, str):
        if not isinstance(mixer_options, Mapping):
            raise ValueError(f"mixer_options: expected a mapping of options, got {mixer_options!r}")
        return [(name, dict(mixer_options)) for name in names]
    if isinstance(mixer_options, (list, tuple)):
        if len(mixer_options) != n_layers:
            raise ValueError(
                f"mixer_options: a list gives options per layer: expected {n_layers} mappings (n_layers), "
                f"got {len(mixer_options)}"
            )
        for i, options in enumerate(mixer_options):
            if not isinstance(options, Mapping):
                raise ValueError(f"mixer_options[{i}]: expected a mapping of layer {i}'s options, got {options!r}")
        return [(name, dict(options)) for name, options in zip(names, mixer_options, strict=True)]
    if not isinstance(mixer_options, Mapping):
        raise ValueError(f"mixer_options: expected a mapping of mixer names to options, got {mixer_options!r}")
    stack = list(dict.fromkeys(names))
    absent = [name for name in mixer_options if name not in stack]
    if absent:
        raise ValueError(
            f"mixer_options: a hybrid's options are keyed by its mixers' names; "
            f"{', '.join(map(repr, absent))} not in the stack (mixers: {', '.join(stack)})"
        )
    for name, options in mixer_options.items():
        if not isinstance(options, Mapping):
            raise ValueError(f"mixer_options.{name}: expected a mapping of {name}'s options, got {options!r}")
    return [(name, dict(mixer_options.get(name, {}))) for name in names]


def merge_model_values(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base`` (model mappings, either spelling): the head field by field, so that
    ``head: classifier`` over a preset's head changes its kind and keeps its classes, as the flat
    fields did; a HeadConfig in ``update`` replaces the whole head."""
    base, update = nest_head(base), nest_head(update)
    merged = {**base, **update}
    if isinstance(update.get("head"), Mapping) and "head" in base:
        below = base["head"]
        merged["head"] = {**(below.to_dict() if isinstance(below, HeadConfig) else below), **update["head"]}
    return merged


@named_fields
@dataclass
class ModelConfig:
    """Every field of a model.

    Token mixer:
        mixer: registered mixer name (``lcsm list``), e.g. "gla", "metala", "lcsm:1-9-1-0"; or a
            hybrid stack, a mixer per layer: a list of n_layers names or a pattern
            ``{default: mamba, every: {k: 4, mixer: attention, offset: 3}}`` (module doc).
        mixer_options: keyword options of that mixer (validated against its signature); for a
            hybrid, a mapping from each mixer name of the stack to its options, or a list of one
            options mapping per layer.
        mixer_hidden: None: the mixer runs at width d_model. An integer H: the mixer runs inside an
            element-wise MLP, Linear(d -> H) -> mixer(H) -> mixer_activation -> Linear(H -> d)
            (the ETSMLP block, ETSMLP section 3.2).
        mixer_activation: activation after the mixer when ``mixer_hidden`` is set.
        gate: multiply the token branch by sigmoid(W_g norm(x)) (ETSMLP-Gate, section 3.2).
        bidirectional: non-causal encoder, y = f(x) + reverse(g(shifted reverse(x))) from two
            causal maps f, g (MNet note); CES uses its native two-sided kernel instead.
    Block:
        d_model, n_layers: width and depth.
        channel_mixer: "glu" (SwiGLU), "mlp" (Linear-GELU-Linear) or "none".
        channel_hidden: hidden width of the channel mixer (default: glu 8d/3 rounded up to a
            multiple of 8, mlp 4d).
        norm: "layernorm", "rmsnorm" or "batchnorm" (over the channels; ETSMLP's image tasks).
        norm_eps: epsilon of every norm of the model.
        final_norm: a norm after the last block.
        dropout: dropout on the embedding and on every residual branch (default 0).
        embed_norm: a norm (of kind ``norm``) on the embeddings before dropout and the first block
            (the official ETSMLP encoder's ``emb_layer_norm``, ``module/smlp_encoder.py``).
    Input and head:
        vocab_size: token inputs (an embedding table); input_dim: continuous inputs [B, T, input_dim]
            through a Linear encoder (pixels of the image tasks). Exactly one of them.
        head: a ``HeadConfig`` (kind, n_classes, pooling, hidden, combine, mlp). ``from_dict`` and
            ``replace`` also take a mapping of its fields, or a kind's name alone
            (``head="classifier"``), and the older flat spelling of its fields (``n_classes``,
            ``pooling``, ``head_hidden``, ``dual_combine``, ``head_mlp``; ``OLD_HEAD_KEYS``).
        tie_embeddings: LM head shares the embedding matrix (lm only).
        init_std: std of the normal init of the model's own embeddings and linears (0.02).
    """

    mixer: str | list[str] | dict[str, Any] = "gla"
    mixer_options: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)
    d_model: int = 64
    n_layers: int = 2
    vocab_size: int | None = None
    input_dim: int | None = None
    head: HeadConfig = field(default_factory=HeadConfig)
    tie_embeddings: bool = True
    bidirectional: bool = False
    channel_mixer: str = "glu"
    channel_hidden: int | None = None
    mixer_hidden: int | None = None
    mixer_activation: str = "relu"
    gate: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    final_norm: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    embed_norm: bool = False

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ construction

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Build from a plain mapping (a YAML/JSON config); unknown keys name the closest valid ones.
        The head may be given as a mapping, a kind's name or the old flat fields (``nest_head``)."""
        values = nest_head(values)
        check_keys("model config", values, cls.field_names())
        if "head" in values:
            values["head"] = HeadConfig.from_value(values["head"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated like ``from_dict``); a mapping or kind's name
        under ``head`` changes the fields it gives (``replace(head={"hidden": 64})``), a
        HeadConfig replaces the head."""
        return type(self).from_dict(merge_model_values(self.to_dict(), changes))

    # ------------------------------------------------------------------ validation

    @property
    def mixer_width(self) -> int:
        return self.mixer_hidden if self.mixer_hidden is not None else self.d_model

    @property
    def hybrid(self) -> bool:
        """Whether ``mixer`` gives a mixer per layer (a list or a pattern) rather than one name."""
        return not isinstance(self.mixer, str)

    def layer_mixers(self) -> list[tuple[str, dict[str, Any]]]:
        """(mixer name, options as given) of every layer (``layer_mixers``)."""
        return layer_mixers(self.mixer, self.mixer_options, self.n_layers)

    def stack_summary(self) -> str:
        """The layers' mixers for a log line: "2 x gla", or runs of a hybrid ("3 x mamba, attention")."""
        runs: list[list] = []
        for name, _ in self.layer_mixers():
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        return ", ".join(name if count == 1 else f"{count} x {name}" for name, count in runs)

    def native_bidirectional_at(self, layer: int) -> bool:
        """Whether layer ``layer``'s mixer reads both directions itself (CES's two-sided kernel,
        ETSMLP eq. 14); other mixers of a bidirectional model get two causal maps."""
        return self.bidirectional and resolve(self.layer_mixers()[layer][0])[0].native_bidirectional

    @property
    def native_bidirectional(self) -> bool:
        """``native_bidirectional_at`` of a single-mixer model (every layer alike)."""
        return self.native_bidirectional_at(0)

    @property
    def mixer_class(self):
        """The mixer class of a single-mixer model; a hybrid has one per layer (``layer_mixers``)."""
        if self.hybrid:
            raise ValueError(f"mixer: a hybrid stack has a mixer per layer ({self.mixer!r}); use layer_mixers()")
        return resolve(self.mixer)[0]

    def resolved_channel_hidden(self) -> int:
        if self.channel_hidden is not None:
            return self.channel_hidden
        if self.channel_mixer == "glu":
            # LLaMA convention: 8d/3 (rounded up to a multiple of 8) keeps SwiGLU's three matrices
            # at the parameter count of a 4d two-matrix MLP.
            return 8 * -(-self.d_model // 3)
        return 4 * self.d_model

    def _check_value_first(self) -> None:
        """A layer whose mixer reads layer 0's values (RWKV-7's value residual) gets them only from
        a causal model whose layer 0 makes them (``Mixer.uses_value_first``): refused here, not at
        the first forward."""
        mixers = self.layer_mixers()
        first = resolve(mixers[0][0])[0]
        for layer, (name, options) in enumerate(mixers):
            if not resolve(name)[0].reads_value_first_at(options, layer):
                continue
            if self.bidirectional or not first.uses_value_first:
                why = (
                    "a bidirectional model passes no values between its layers"
                    if self.bidirectional
                    else f"layer 0's mixer {mixers[0][0]!r} makes none"
                )
                raise ValueError(
                    f"mixer_options: layer {layer}'s {name!r} mixes in layer 0's values (value_residual), but {why}; "
                    "build it with value_residual: false"
                )

    def validate(self) -> None:
        check_int("n_layers", self.n_layers, 1)
        checked = []
        for name, options in self.layer_mixers():  # unknown names raise with the closest valid ones
            if (name, options) in checked:
                continue
            checked.append((name, options))
            cls = resolve(name)[0]
            check_options(name, options)
            owned = [k for k in cls.model_owned_options if k in options]
            if owned:
                raise ValueError(
                    f"mixer_options: {', '.join(owned)} of mixer {cls.registry_name!r} are set by the model "
                    "per layer (layer position / the model's 'bidirectional' field); remove them"
                )
        self._check_value_first()
        check_int("d_model", self.d_model, 1)
        check_int("vocab_size", self.vocab_size, 1, allow_none=True)
        check_int("input_dim", self.input_dim, 1, allow_none=True)
        if (self.vocab_size is None) == (self.input_dim is None):
            raise ValueError(
                f"vocab_size / input_dim: expected exactly one (token or continuous inputs), "
                f"got vocab_size={self.vocab_size!r}, input_dim={self.input_dim!r}"
            )
        if not isinstance(self.head, HeadConfig):
            raise ValueError(
                f"head: expected a HeadConfig (from_dict also takes a mapping of its fields or a kind's "
                f"name), got {self.head!r}"
            )
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bidirectional", self.bidirectional)
        check_bool("gate", self.gate)
        check_bool("final_norm", self.final_norm)
        check_bool("embed_norm", self.embed_norm)
        if self.head.kind == "lm":
            if self.vocab_size is None:
                raise ValueError("vocab_size: head.kind='lm' predicts tokens and needs a vocab_size, got None")
            if self.bidirectional:
                raise ValueError("bidirectional: head.kind='lm' must be causal, got bidirectional=True")
        check_choice("channel_mixer", self.channel_mixer, CHANNEL_MIXERS)
        check_int("channel_hidden", self.channel_hidden, 1, allow_none=True)
        if self.channel_mixer == "none" and self.channel_hidden is not None:
            raise ValueError(f"channel_hidden: channel_mixer='none' has no hidden width, got {self.channel_hidden!r}")
        check_int("mixer_hidden", self.mixer_hidden, 1, allow_none=True)
        check_choice("mixer_activation", self.mixer_activation, ACTIVATIONS)
        if self.mixer_hidden is None and self.mixer_activation != "relu":
            raise ValueError(
                f"mixer_activation: acts between the mixer_hidden projections, got "
                f"{self.mixer_activation!r} with mixer_hidden=None"
            )
        check_choice("norm", self.norm, NORMS)
        check_float("norm_eps", self.norm_eps, 0, low_open=True)
        check_float("dropout", self.dropout, 0, 1, high_open=True)
        check_float("init_std", self.init_std, 0, low_open=True)
