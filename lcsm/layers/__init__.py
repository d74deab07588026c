"""Token mixers of the papers, each a configuration of the EOS operator (``lcsm.ops``).

Each mixer lives in the module named by its registry name (``gla.py`` registers "gla") and
registers itself when imported; importing the package imports them all, so ``available()`` lists
everything without a hand-kept index. Private modules (``_qkv.py``, ``_ssm.py``, ...) hold bodies
that several mixers share.
"""

import importlib
import pkgutil

from .base import EOSRow, Mixer, State, ValueFirst, aliases, available, build, no_weight_decay, register, resolve

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base" and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "EOSRow",
    "Mixer",
    "State",
    "ValueFirst",
    "aliases",
    "available",
    "build",
    "no_weight_decay",
    "register",
    "resolve",
]
