"""Models built from any registered token mixer: one residual block, three heads, named presets.

    from lcsm.models import ModelConfig, build_model, preset
    model = build_model(ModelConfig(mixer="gla", vocab_size=256, d_model=64, n_layers=2))
    new_tokens = model.generate(prompts, max_new_tokens=32, temperature=0)

See docs/models.md.
"""

from .blocks import Bidirectional, Block, reverse_valid
from .config import HeadConfig, ModelConfig
from .model import CausalLM, DualClassifier, Model, SequenceClassifier, build_model, sample_next
from .presets import PRESET_REVISIONS, PRESETS, model_revisions, preset

__all__ = [
    "Bidirectional",
    "Block",
    "CausalLM",
    "DualClassifier",
    "HeadConfig",
    "Model",
    "ModelConfig",
    "PRESETS",
    "PRESET_REVISIONS",
    "SequenceClassifier",
    "build_model",
    "model_revisions",
    "preset",
    "reverse_valid",
    "sample_next",
]
