"""The root of lcsm's on-disk caches (tasks' prepared data, downloaded data, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LCSM_CACHE`` if set, else ``~/.cache/lcsm``."""
    root = os.environ.get("LCSM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lcsm"
