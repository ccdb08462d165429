"""DTensor helpers for sharded (FSDP2) modules and their state: local shards, full values, gathering a state
dict to rank 0 and cutting a full one into this process's shards. torch.distributed.tensor and .fsdp are looked up,
not imported: they take most of a second to import, and a process that never loaded them holds no DTensor and no
sharded module (tread/training/fsdp.py imports them when it shards)."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from tread.utils.distributed import comm_device, rank


def is_dtensor(value: Any) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(value, tensor.DTensor)


def is_sharded(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view: in-place updates change the parameter); other tensors as is."""
    return t.to_local() if is_dtensor(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective for a sharded one); other tensors as is."""
    return t.full_tensor() if is_dtensor(t) else t


def gather_full(value: Any, keep: Optional[bool] = None) -> Any:
    """A (nested) state dict with every DTensor all-gathered, one tensor at a time, in the dict's order (every
    rank must call it alike). Rank 0 keeps full tensors on the CPU; on other ranks (or keep=False) the gathered
    entries are left out, so their dicts hold only what was not sharded (buffers, step counts, settings)."""
    keep = rank() == 0 if keep is None else keep
    if isinstance(value, Mapping):
        out = {k: gather_full(v, keep) for k, v in value.items()}
        return out if keep else {k: v for k, v in out.items() if not (v is None and is_dtensor(value[k]))}
    if isinstance(value, list):
        return [gather_full(v, keep) for v in value]
    if is_dtensor(value):
        whole = value.to(comm_device()).full_tensor()     # offloaded shards go to the collective's device first
        return whole.cpu() if keep else None
    return value


def shard_state(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Full weights -> this process's shards, shaped like `module`'s sharded state dict (no communication:
    every process holds the full checkpoint). Keys the module lacks pass through for load_weights to report."""
    own = module.state_dict()
    return {k: _shard_like(v, own[k]) if k in own else v for k, v in weights.items()}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict (single-process format, ids in param-group order) -> this process's shards of
    each per-parameter tensor (moments), for optimizer.load_state_dict on sharded parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shards = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        shards[index] = {k: _shard_like(v, param) if torch.is_tensor(v) and v.shape == param.shape else v
                         for k, v in entry.items()}
    return {**state, "state": shards}


def _shard_like(value: torch.Tensor, like: Any) -> Any:
    if not is_dtensor(like):
        return value
    distribute = sys.modules["torch.distributed.tensor"].distribute_tensor    # loaded: `like` is a DTensor
    return distribute(value.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


@contextlib.contextmanager
def gathered_params(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """The parameters `names` of `module` as full plain tensors inside the block, the sharded ones back after
    (one all-gather per sharded parameter, in name order: every rank must enter it alike; no forward may run
    inside). For reading some weights of a sharded module on one rank, e.g. the adapter export."""
    swapped = []
    for name in sorted(names):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        param = owner._parameters[attr]
        if is_dtensor(param):
            owner._parameters[attr] = nn.Parameter(param.full_tensor().detach(), requires_grad=False)
            swapped.append((owner, attr, param))
    try:
        yield
    finally:
        for owner, attr, param in swapped:
            owner._parameters[attr] = param
