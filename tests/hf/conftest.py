"""tests/hf: lcsm.hf with transformers (the 'hf' extra) and lm-evaluation-harness (the 'eval' extra),
both of which ``make test`` installs. Nothing here may reach the Hugging Face hub or download a data
set: every model is built from a config on this machine, every task reads a local file. Each module
skips itself when its extra is absent (``pytest.importorskip`` before importing it)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
