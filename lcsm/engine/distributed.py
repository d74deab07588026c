"""One process or many: the little the training loop needs from torch.distributed.

Under ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) the loop
runs DistributedDataParallel: gloo on CPU, nccl on CUDA (one GPU per process, ``cuda:LOCAL_RANK``).
A process group made by the caller before the run (``init_process_group`` under ``mp.spawn``) is
used as it is, and left to the caller at the end. Rank 0 logs, evaluates and writes checkpoints;
every rank takes part in the collectives.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
import torch.distributed as dist

from .config import check_device


def resolve_device(option: str, name: str) -> torch.device:
    """The device of this machine that ``option`` ("auto", "cpu", "cuda" or "cuda:N") names; errors
    name the option ``name`` it came from (``run.device``, ``--device``)."""
    check_device(name, option)
    if option == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(option)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {option!r} requested but CUDA is not available here (use 'cpu' or 'auto')")
    return device


class Distributed:
    """Rank, world size and device of this process, and the collectives the loop uses."""

    def __init__(self, device: torch.device, rank: int = 0, world: int = 1, owns_group: bool = False):
        self.device, self.rank, self.world, self._owns_group = device, rank, world, owns_group

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls, device_option: str) -> Distributed:
        device = resolve_device(device_option, "run.device")
        # A group the caller made (init_process_group before lcsm.engine.train, e.g. under
        # mp.spawn) decides the ranks; torchrun's environment does otherwise.
        owns = not dist.is_initialized()
        world = int(os.environ.get("WORLD_SIZE", "1")) if owns else dist.get_world_size()
        if world <= 1:
            return cls(device)
        if device.type == "cuda":
            # (a caller's group without LOCAL_RANK: the GPU the caller selected)
            local = os.environ.get("LOCAL_RANK", "0" if owns else None)
            device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
            torch.cuda.set_device(device)
        if owns:
            # torch.distributed.nn's functions take ``group=group.WORLD`` as a default argument,
            # evaluated when the module is first imported; DistributedDataParallel imports it. Imported
            # after init_process_group, those defaults pin the default group past
            # destroy_process_group, so its gloo threads outlive teardown and meet interpreter
            # shutdown, where a thread still dropping a work's tensor can abort the process (the
            # likely cause of a rare "terminate called without an active exception" at exit).
            # Imported first, they hold None. (importlib, not an import statement: a function-level
            # ``import torch.distributed.nn`` would make ``torch`` a local name of this whole function.)
            importlib.import_module("torch.distributed.nn")

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(device, dist.get_rank(), dist.get_world_size(), owns)

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over processes (a copy; the input is unchanged)."""
        values = values.detach().to(self.device, torch.float64).clone()
        if self.enabled:
            dist.all_reduce(values)
        return values

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()
