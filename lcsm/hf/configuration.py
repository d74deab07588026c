"""``LcsmConfig``: the Hugging Face config of an lcsm causal LM (``model_type`` "lcsm").

The whole model is the lcsm ``ModelConfig``, carried as a plain dict under ``lcsm`` (its
``to_dict()``); ``vocab_size``, ``hidden_size`` and ``num_hidden_layers`` are copies of its fields
for the tools that read those names, and must agree with it when given or set later (the model is
built from ``lcsm`` alone, so another value there would describe a model that is not this one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

from lcsm.models import ModelConfig

# transformers' names for fields of the lcsm config: name -> the lcsm field it copies
COPIED = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers"}


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
            # the values given beside lcsm, before setting lcsm below overwrites them with its copies
            given = {name: getattr(self, name) for name in COPIED}
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
            self.lcsm = config.to_dict()  # (which sets the copies)
            for name, value in given.items():
                if value is not None:
                    self._check_copy(name, value, self.lcsm)
            if self.tie_word_embeddings:
                self._refuse_tie(self.lcsm)
        super().__post_init__(**kwargs)

    def __setattr__(self, key, value):
        # A value given after construction (from_pretrained(..., num_hidden_layers=1), update({...}),
        # an assignment) is checked as one given to the constructor: the model is built from lcsm.
        # (Before __post_init__ the lcsm config may still be a ModelConfig or a partial dict: what
        # it does not give yet is checked there.) None is the copies' default, not a value given.
        lcsm = value if key == "lcsm" else self.__dict__.get("lcsm")
        known = lcsm if isinstance(lcsm, Mapping) else {}
        resizing = key == "vocab_size" and self.__dict__.get("_resizing")
        if key == "tie_word_embeddings" and value:
            self._refuse_tie(known)
        if COPIED.get(key) in known and value is not None and not resizing:
            self._check_copy(key, value, known)
        super().__setattr__(key, value)
        if key == "lcsm":
            # the copies follow a new lcsm config
            for name, field in COPIED.items():
                if field in known:
                    super().__setattr__(name, known[field])

    @staticmethod
    def _refuse_tie(lcsm: Mapping) -> None:
        here = f", here {lcsm['tie_embeddings']!r}" if "tie_embeddings" in lcsm else ""
        raise ValueError(
            f"tie_word_embeddings: lcsm ties the LM head inside its model (lcsm's tie_embeddings{here}), so this "
            "stays False; got True (set lcsm's tie_embeddings)"
        )

    @staticmethod
    def _check_copy(name: str, value, lcsm: Mapping) -> None:
        want = lcsm[COPIED[name]]
        if value != want:
            raise ValueError(
                f"{name}: the lcsm config gives {want!r}, got {value!r} (a copy of lcsm's {COPIED[name]}: the model "
                "is built from lcsm alone; leave it out, or change lcsm, resize_token_embeddings for the vocabulary)"
            )

    def model_config(self) -> ModelConfig:
        """The lcsm ModelConfig this config carries."""
        if self.lcsm is None:
            raise ValueError(
                "lcsm: this LcsmConfig carries no lcsm model config; build it as "
                "LcsmConfig(lcsm=ModelConfig(...)) or LcsmConfig(lcsm={...})"
            )
        return ModelConfig.from_dict(self.lcsm)
