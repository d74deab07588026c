"""Tasks: datasets (deterministic, cached on disk), loss, metrics and default head, by name.

Every module of this package registers its tasks when imported; importing the package imports
them all, so ``available()`` lists everything without a hand-kept index.
"""

import importlib
import pkgutil

from .base import (
    IGNORE_INDEX,
    Evaluator,
    Segment,
    SegmentBatchSampler,
    SegmentedDataset,
    Task,
    TaskConfig,
    available,
    build,
    default_cache_dir,
    recorded_task_data,
    register,
    resolve,
    task_data,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base" and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "IGNORE_INDEX",
    "Evaluator",
    "Segment",
    "SegmentBatchSampler",
    "SegmentedDataset",
    "Task",
    "TaskConfig",
    "available",
    "build",
    "default_cache_dir",
    "recorded_task_data",
    "register",
    "resolve",
    "task_data",
]
