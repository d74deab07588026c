"""``LcsmConfig``: the Hugging Face config of an lcsm causal LM (``model_type`` "lcsm").

The whole model is the lcsm ``ModelConfig``, carried as a plain dict under ``lcsm`` (its
``to_dict()``); ``vocab_size``, ``hidden_size`` and ``num_hidden_layers`` are copies of its fields
for the tools that read those names, and must agree with it when given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

from lcsm.models import ModelConfig


class LcsmConfig(PretrainedConfig):
    model_type = "lcsm"

    lcsm: dict[str, Any] | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    use_cache: bool = True
    # lcsm ties the LM head inside its own model (it reads the embedding matrix; there is no second
    # parameter), so transformers has nothing to tie: False keeps it from looking for a pair.
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        # ``lcsm=None`` is the empty default transformers builds to diff configs against; a model
        # needs one (``model_config`` says so).
        if self.lcsm is not None:
            if isinstance(self.lcsm, ModelConfig):
                self.lcsm = self.lcsm.to_dict()
            if not isinstance(self.lcsm, Mapping):
                raise ValueError(
                    f"lcsm: expected an lcsm ModelConfig or its dict (ModelConfig.to_dict()), got "
                    f"{type(self.lcsm).__name__}"
                )
            config = ModelConfig.from_dict(self.lcsm)
            if config.head.kind != "lm":
                raise ValueError(
                    f"lcsm: LcsmConfig describes causal language models (head.kind 'lm'), got head.kind "
                    f"{config.head.kind!r}"
                )
            if config.bidirectional:
                raise ValueError("lcsm: a causal language model cannot be bidirectional, got bidirectional=True")
            self.lcsm = config.to_dict()
            derived = {
                "vocab_size": config.vocab_size,
                "hidden_size": config.d_model,
                "num_hidden_layers": config.n_layers,
            }
            for name, value in derived.items():
                given = getattr(self, name)
                if given is not None and given != value:
                    raise ValueError(
                        f"{name}: the lcsm config gives {value!r}, got {given!r} (leave it out; it is read from lcsm)"
                    )
                setattr(self, name, value)
        super().__post_init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The lcsm ModelConfig this config carries."""
        if self.lcsm is None:
            raise ValueError(
                "lcsm: this LcsmConfig carries no lcsm model config; build it as "
                "LcsmConfig(lcsm=ModelConfig(...)) or LcsmConfig(lcsm={...})"
            )
        return ModelConfig.from_dict(self.lcsm)
