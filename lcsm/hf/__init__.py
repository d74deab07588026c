"""lcsm models with Hugging Face transformers (the ``hf`` extra: ``pip install 'lcsm[hf]'``).

    import lcsm.hf  # registers model_type "lcsm" with AutoConfig / AutoModelForCausalLM
    from lcsm.hf import LcsmConfig, LcsmForCausalLM
    model = LcsmForCausalLM(LcsmConfig(lcsm=ModelConfig(mixer="gla", vocab_size=256)))
    model.generate(input_ids, max_new_tokens=32, do_sample=False)

See docs/hf.md.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:
    raise ImportError(
        "lcsm.hf needs the transformers package, which is not installed; install lcsm's 'hf' extra: "
        "pip install 'lcsm[hf]' (or pip install -e '.[hf]' in a checkout)"
    ) from err

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import LcsmConfig
from .modeling import LcsmCache, LcsmForCausalLM

AutoConfig.register(LcsmConfig.model_type, LcsmConfig, exist_ok=True)
AutoModelForCausalLM.register(LcsmConfig, LcsmForCausalLM, exist_ok=True)

__all__ = ["LcsmCache", "LcsmConfig", "LcsmForCausalLM"]
