"""tests/hf: lcsm.hf with transformers (the 'hf' extra, which ``make test`` installs). Nothing here
may reach the Hugging Face hub: every model is built from a config on this machine."""

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="transformers is not installed (lcsm's 'hf' extra: pip install -e '.[hf]')")
