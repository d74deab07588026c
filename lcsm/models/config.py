"""Typed model configuration: one dataclass describes every model of the library.

A model is a config, never a per-model file: the token mixer is any registered mixer
(``lcsm.layers.available()``) with its options; the block, the channel mixer, the norm and the
head are fields. ``ModelConfig.from_dict`` rejects unknown keys naming the closest valid ones;
``__post_init__`` validates every value (and the mixer's option names against its signature),
so a bad config fails before any weight is allocated.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lcsm._checks import check_bool
from lcsm._names import did_you_mean
from lcsm.layers.base import check_implied, resolve

HEADS = ("lm", "classifier", "dual")
CHANNEL_MIXERS = ("glu", "mlp", "none")
NORMS = ("layernorm", "rmsnorm", "batchnorm")
POOLINGS = ("mean", "last")
HEAD_MLPS = ("lra", "etsmlp")
DUAL_COMBINES = ("nli", "concat")
ACTIVATIONS = ("relu", "gelu", "silu", "identity")

# Options the model sets per layer (they depend on the layer's position in the stack or on the
# model's own fields); a user value would be silently overridden, so it is refused instead.
MODEL_OWNED_OPTIONS = {
    "rwkv4": ("layer_id", "n_layers"),
    "ces": ("bidirectional",),
}


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer{' or None' if allow_none else ''}, got {value!r}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}{did_you_mean(str(value), choices)}"
        )


@dataclass
class ModelConfig:
    """Every field of a model.

    Token mixer:
        mixer: registered mixer name (``lcsm list``), e.g. "gla", "metala", "lcsm:1-9-1-0".
        mixer_options: keyword options of that mixer (validated against its signature).
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
        head: "lm" (next-token logits), "classifier" (one sequence) or "dual" (two sequences,
            LRA retrieval).
        tie_embeddings: LM head shares the embedding matrix (lm only).
        n_classes: classes of the classifier heads.
        pooling: "mean" (over valid tokens) or "last" (last valid token) for the classifier heads.
        dual_combine: "nli": [u, v, u * v, u - v] (LRA retrieval, Tay et al. 2020); "concat": [u, v]
            (the official ETSMLP code's retrieval head).
        head_hidden: 0: a Linear classifier on the pooled features; > 0: the LRA MLP head
            (classifier: Linear(h) -> ReLU -> Linear(classes); dual: Linear(h) -> ReLU ->
            Linear(h // 2) -> ReLU -> Linear(classes), Tay et al. 2020 code).
        head_mlp: "lra": the heads above. "etsmlp": the official ETSMLP classifier
            (``architectures/LRA_model.py``, LRAModel): head_hidden h > 0 gives one hidden
            Linear(h) -> GELU for either head, and the output Linear(classes) has no bias.
        init_std: std of the normal init of the model's own embeddings and linears (0.02).
    """

    mixer: str = "gla"
    mixer_options: dict[str, Any] = field(default_factory=dict)
    d_model: int = 64
    n_layers: int = 2
    vocab_size: int | None = None
    input_dim: int | None = None
    head: str = "lm"
    tie_embeddings: bool = True
    n_classes: int | None = None
    pooling: str = "mean"
    head_hidden: int = 0
    dual_combine: str = "nli"
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
    head_mlp: str = "lra"

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ construction

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Build from a plain mapping (a YAML/JSON config); unknown keys name the closest valid ones."""
        if not isinstance(values, Mapping):
            raise ValueError(f"model config: expected a mapping of field names to values, got {type(values).__name__}")
        valid = cls.field_names()
        unknown = [k for k in values if k not in valid]
        if unknown:
            hints = ", ".join(f"{k!r}{did_you_mean(str(k), valid)}" for k in unknown)
            raise ValueError(f"model config: unknown key(s) {hints}. Valid keys: {', '.join(valid)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated like ``from_dict``)."""
        return type(self).from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ validation

    @property
    def mixer_width(self) -> int:
        return self.mixer_hidden if self.mixer_hidden is not None else self.d_model

    @property
    def native_bidirectional(self) -> bool:
        """CES has its own two-sided kernel (ETSMLP eq. 14); other mixers get two causal maps."""
        return self.bidirectional and self.mixer_class.registry_name == "ces"

    @property
    def mixer_class(self):
        return resolve(self.mixer)[0]

    def resolved_channel_hidden(self) -> int:
        if self.channel_hidden is not None:
            return self.channel_hidden
        if self.channel_mixer == "glu":
            # LLaMA convention: 8d/3 (rounded up to a multiple of 8) keeps SwiGLU's three matrices
            # at the parameter count of a 4d two-matrix MLP.
            return 8 * -(-self.d_model // 3)
        return 4 * self.d_model

    def validate(self) -> None:
        if not isinstance(self.mixer, str):
            raise ValueError(f"mixer: expected a registered mixer name (str), got {self.mixer!r}")
        cls = resolve(self.mixer)[0]  # unknown names raise with the closest valid ones
        if not isinstance(self.mixer_options, Mapping):
            raise ValueError(f"mixer_options: expected a mapping of option names to values, got {self.mixer_options!r}")
        valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "d_model")]
        unknown = [k for k in self.mixer_options if k not in valid]
        if unknown:
            hints = ", ".join(f"{k!r}{did_you_mean(str(k), valid)}" for k in unknown)
            raise ValueError(
                f"mixer_options: mixer {self.mixer!r} has no option(s) {hints}. "
                f"Valid options: {', '.join(valid) or 'none'}"
            )
        check_implied(self.mixer, self.mixer_options)
        owned = [k for k in MODEL_OWNED_OPTIONS.get(cls.registry_name, ()) if k in self.mixer_options]
        if owned:
            raise ValueError(
                f"mixer_options: {', '.join(owned)} of mixer {cls.registry_name!r} are set by the model "
                "per layer (layer position / the model's 'bidirectional' field); remove them"
            )
        _positive_int("d_model", self.d_model)
        _positive_int("n_layers", self.n_layers)
        _positive_int("vocab_size", self.vocab_size, allow_none=True)
        _positive_int("input_dim", self.input_dim, allow_none=True)
        if (self.vocab_size is None) == (self.input_dim is None):
            raise ValueError(
                f"vocab_size / input_dim: expected exactly one (token or continuous inputs), "
                f"got vocab_size={self.vocab_size!r}, input_dim={self.input_dim!r}"
            )
        _choice("head", self.head, HEADS)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bidirectional", self.bidirectional)
        check_bool("gate", self.gate)
        check_bool("final_norm", self.final_norm)
        check_bool("embed_norm", self.embed_norm)
        _choice("head_mlp", self.head_mlp, HEAD_MLPS)
        if self.head == "lm":
            if self.vocab_size is None:
                raise ValueError("vocab_size: head='lm' predicts tokens and needs a vocab_size, got None")
            if self.bidirectional:
                raise ValueError("bidirectional: head='lm' must be causal, got bidirectional=True")
            if self.n_classes is not None:
                raise ValueError(f"n_classes: only for the classifier heads, got {self.n_classes!r} with head='lm'")
            # Set away from their defaults, these would be ignored by an LM: refuse them instead.
            if self.head_hidden:
                raise ValueError(f"head_hidden: only for the classifier heads, got {self.head_hidden!r} with head='lm'")
            if self.pooling != "mean":
                raise ValueError(f"pooling: only for the classifier heads, got {self.pooling!r} with head='lm'")
            if self.head_mlp != "lra":
                raise ValueError(f"head_mlp: only for the classifier heads, got {self.head_mlp!r} with head='lm'")
        else:
            _positive_int("n_classes", self.n_classes)
        _choice("pooling", self.pooling, POOLINGS)
        _choice("dual_combine", self.dual_combine, DUAL_COMBINES)
        if (
            isinstance(self.head_hidden, bool)
            or not isinstance(self.head_hidden, int)
            or self.head_hidden < 0
            or self.head_hidden == 1
        ):
            raise ValueError(f"head_hidden: expected 0 (linear head) or an integer >= 2, got {self.head_hidden!r}")
        _choice("channel_mixer", self.channel_mixer, CHANNEL_MIXERS)
        _positive_int("channel_hidden", self.channel_hidden, allow_none=True)
        if self.channel_mixer == "none" and self.channel_hidden is not None:
            raise ValueError(f"channel_hidden: channel_mixer='none' has no hidden width, got {self.channel_hidden!r}")
        _positive_int("mixer_hidden", self.mixer_hidden, allow_none=True)
        _choice("mixer_activation", self.mixer_activation, ACTIVATIONS)
        if self.mixer_hidden is None and self.mixer_activation != "relu":
            raise ValueError(
                f"mixer_activation: acts between the mixer_hidden projections, got "
                f"{self.mixer_activation!r} with mixer_hidden=None"
            )
        _choice("norm", self.norm, NORMS)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps: expected a positive number, got {self.norm_eps!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout!r}")
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float)) or not self.init_std > 0:
            raise ValueError(f"init_std: expected a positive number, got {self.init_std!r}")
