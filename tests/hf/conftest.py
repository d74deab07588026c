"""tests/hf: lcsm.hf with transformers (the 'hf' extra, which ``make test`` installs). Nothing here
may reach the Hugging Face hub: every model is built from a config on this machine. Each module
skips itself when transformers is absent (``pytest.importorskip`` before importing it)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
