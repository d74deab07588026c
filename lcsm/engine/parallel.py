"""FSDP2 sharding for the training loop (``run.parallel``), and the conversions that keep a sharded
run's checkpoints in the format of an unsharded one.

Under ``run.parallel: fsdp`` every Block is sharded with ``fully_shard``, then the root (the
embedding, final norm and head: what the Blocks leave). Checkpoints stay those of a one-process
run: the weights are gathered whole to rank 0 (``get_model_state_dict`` with a full state dict), and
AdamW's state, which torch gathers keyed by parameter name, is stored keyed by position in the
optimizer's groups as ``Optimizer.state_dict`` keys it. So a checkpoint written under FSDP resumes
under DDP or one process, and the other way round.
"""

from __future__ import annotations

from typing import Any

import torch

from lcsm.models.blocks import blocks

# torch.distributed's FSDP, DTensor and checkpoint modules are imported inside the functions that
# use them, which run under run.parallel: fsdp only (importing them took 0.7 s of the start of
# every process that imports the engine).


def _full() -> Any:
    """Gathered whole on rank 0 and moved to the CPU (the other ranks get an empty dict): a
    checkpoint never needs more device memory than the shards and one parameter at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded in place over the default process group: each Block, then the root. A Block
    is the unit of work of the forward and backward passes, so its parameters are gathered just
    before it runs and freed (and its gradients reduced) just after."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block)
    return fully_shard(model)


def named_groups(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` (optimizer parameter groups of ``model``) with parameter names for parameters.
    Sharding replaces every parameter with a new one, which loses the tags that chose its group
    (``_no_weight_decay``); the names survive it."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]


def groups_of(model: torch.nn.Module, named: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``named_groups``' groups with the (sharded) parameters of ``model`` for the names."""
    params = dict(model.named_parameters())
    return [{**g, "params": [params[name] for name in g["params"]]} for g in named]


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` for sharded gradients: clip them to a global norm of ``max_norm``; their
    norm before. Each rank's norm is of its shards only: the whole norm is put together before
    clipping, so every rank clips by the same factor, as DDP's replicas do."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return float(norm)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's whole weights on rank 0's CPU (an empty dict on the others); every rank
    must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full())


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's whole weights ``state`` into the sharded model (the other ranks pass an empty
    dict and receive their shards); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The sharded optimizer's whole state on rank 0, keyed as an unsharded optimizer's
    ``state_dict`` keys it: parameters numbered through the groups in order (an empty dict on the
    other ranks); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full())
    if not full:
        return {}
    index: dict[str, int] = {}
    param_groups = []
    for group in full["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        param_groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in full["state"].items()}, "param_groups": param_groups}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """An unsharded optimizer's ``state_dict`` (every rank reads it from the checkpoint) into the
    sharded optimizer; a ValueError, as ``Optimizer.load_state_dict`` raises, when the groups
    differ in size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    mine = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = state["param_groups"]
    if [len(g) for g in mine] != [len(g["params"]) for g in saved]:
        raise ValueError(
            f"loaded state dict has groups of {[len(g['params']) for g in saved]} parameters, "
            f"the optimizer {[len(g) for g in mine]}"
        )
    name_of = {}
    for group, saved_group in zip(mine, saved, strict=True):
        name_of.update(zip(saved_group["params"], group, strict=True))
    full = {
        "state": {name_of[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": group} for g, group in zip(saved, mine, strict=True)],
    }
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
