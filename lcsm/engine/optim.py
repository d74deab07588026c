"""AdamW with the no-weight-decay groups, and the learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import OptimConfig


def build_optimizer(model, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``model.parameter_groups``: decayed parameters, then the ones tagged
    no-weight-decay by their mixers (decays, A_log, D, ...), norms and biases at weight decay 0."""
    return adamw(model.parameter_groups(config.weight_decay), config)


def adamw(groups: list[dict], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over parameter groups made by ``Model.parameter_groups`` (under FSDP: of the sharded
    parameters, ``parallel.groups_of``)."""
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def lr_factor(config: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr before optimizer step ``step`` + 1 (``LambdaLR`` convention:
    the factor at step 0 applies to the first update).

    Warm-up is linear from lr / warmup_steps at the first update to lr at update warmup_steps,
    so no update is taken at lr 0.
    """
    warmup, floor, kind = config.warmup_steps, config.min_lr_ratio, config.schedule

    def factor(step: int) -> float:
        update = step + 1
        if update <= warmup:
            return update / warmup
        if kind == "constant":
            return 1.0
        if kind == "inverse_sqrt":
            return math.sqrt(warmup / update)
        # 0 at the first update after warm-up, just below 1 at the last (no update at the floor).
        progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return factor
