"""The training engine: configs, the training loop, checkpoints, evaluation.

    from lcsm.engine import load_config, train
    result = train(load_config("experiments/configs/mqar_demo.yaml", ["train.max_steps=200"]))

See docs/engine.md.
"""

from .checkpoint import latest_checkpoint, list_checkpoints, resolve_checkpoint
from .config import (
    EarlyStopConfig,
    OptimConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
    apply_overrides,
    load_config,
    parse_override,
    read_yaml,
)
from .distributed import Distributed
from .optim import build_optimizer, lr_factor
from .trainer import LoopState, Trainer, evaluate, load_run, train

__all__ = [
    "Distributed",
    "EarlyStopConfig",
    "LoopState",
    "OptimConfig",
    "RunConfig",
    "RuntimeConfig",
    "TrainConfig",
    "Trainer",
    "apply_overrides",
    "build_optimizer",
    "evaluate",
    "latest_checkpoint",
    "list_checkpoints",
    "load_config",
    "load_run",
    "lr_factor",
    "parse_override",
    "read_yaml",
    "resolve_checkpoint",
    "train",
]
