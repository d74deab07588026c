"""Tasks: datasets (deterministic, cached on disk), loss, metrics and default head, by name.

Every task module of this package (and of its ``lra`` package) registers its tasks when imported;
importing the package imports every module, so ``available()`` lists everything without a
hand-kept index. ``base``, ``config``, ``data``, ``cache`` and ``metrics`` are the machinery the
tasks share.
"""

import importlib
import pkgutil

from .base import Task, available, build, config_model_fields, recorded_task_data, register, resolve, task_data
from .cache import default_cache_dir
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment, SegmentBatchSampler, SegmentedDataset
from .metrics import Evaluator

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
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
    "config_model_fields",
    "default_cache_dir",
    "recorded_task_data",
    "register",
    "resolve",
    "task_data",
]
