"""Typed model configuration: one dataclass describes every model of the library.

A model is a config, never a per-model file: the token mixer is any registered mixer
(``lcsm.layers.available()``) with its options; the block, the channel mixer, the norm and the
head are fields. ``ModelConfig.from_dict`` rejects unknown keys naming the closest valid ones;
``__post_init__`` validates every value (and the mixer's option names against its signature),
so a bad config fails before any weight is allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lcsm._checks import check_bool, check_choice, check_float, check_int, check_keys
from lcsm.layers.base import check_options, resolve

HEADS = ("lm", "classifier", "dual")
CHANNEL_MIXERS = ("glu", "mlp", "none")
NORMS = ("layernorm", "rmsnorm", "batchnorm")
POOLINGS = ("mean", "last")
HEAD_MLPS = ("lra", "etsmlp")
DUAL_COMBINES = ("nli", "concat")
ACTIVATIONS = ("relu", "gelu", "silu", "identity")


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
        check_keys("model config", values, cls.field_names())
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
        """Whether the mixer reads both directions itself (CES's two-sided kernel, ETSMLP eq. 14);
        other mixers of a bidirectional model get two causal maps."""
        return self.bidirectional and self.mixer_class.native_bidirectional

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
        check_options(self.mixer, self.mixer_options)
        owned = [k for k in cls.model_owned_options if k in self.mixer_options]
        if owned:
            raise ValueError(
                f"mixer_options: {', '.join(owned)} of mixer {cls.registry_name!r} are set by the model "
                "per layer (layer position / the model's 'bidirectional' field); remove them"
            )
        check_int("d_model", self.d_model, 1)
        check_int("n_layers", self.n_layers, 1)
        check_int("vocab_size", self.vocab_size, 1, allow_none=True)
        check_int("input_dim", self.input_dim, 1, allow_none=True)
        if (self.vocab_size is None) == (self.input_dim is None):
            raise ValueError(
                f"vocab_size / input_dim: expected exactly one (token or continuous inputs), "
                f"got vocab_size={self.vocab_size!r}, input_dim={self.input_dim!r}"
            )
        check_choice("head", self.head, HEADS)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bidirectional", self.bidirectional)
        check_bool("gate", self.gate)
        check_bool("final_norm", self.final_norm)
        check_bool("embed_norm", self.embed_norm)
        check_choice("head_mlp", self.head_mlp, HEAD_MLPS)
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
            check_int("n_classes", self.n_classes, 1)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("dual_combine", self.dual_combine, DUAL_COMBINES)
        if (
            isinstance(self.head_hidden, bool)
            or not isinstance(self.head_hidden, int)
            or self.head_hidden < 0
            or self.head_hidden == 1
        ):
            raise ValueError(f"head_hidden: expected 0 (linear head) or an integer >= 2, got {self.head_hidden!r}")
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
