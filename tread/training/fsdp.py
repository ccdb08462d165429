"""Sharded data parallelism (train.parallel=fsdp): torch's FSDP2 `fully_shard`, one group per routable block.

Each routable block (`routable_blocks()`: DiT's blocks, a family's double/single-stream blocks, ...) is its own
FSDP group and the backbone is the root group (embedders, head, class table). Routing is untouched: run_blocks
gathers and scatters token *activations* between blocks, and FSDP's hooks all-gather a block's *weights* when
the block is called, whatever subset of tokens it sees. Parameters become DTensors sharded on dim 0; FSDP2
shards parameter by parameter, so frozen LoRA base weights and trainable adapters share a group (what FSDP1
called use_orig_params).

Why torch's `fully_shard` and not accelerate's FSDP plugin: accelerate 1.15 turns its plugin on only for
multi-GPU runs (DistributedType.MULTI_GPU), so the same code could not run (or be tested) on CPU processes
(gloo), and its auto-wrap by class name cannot name "the routable blocks". Accelerate keeps everything else:
autocast, the optimizer wrapper, clip_grad_norm_ (torch's, which reduces DTensor norms), gather and reduce.

Mixed precision stays accelerate's autocast over fp32 master weights (no FSDP param_dtype): routing's
fp32_after_route blocks run with autocast off and need fp32 weights, as in a DDP run.

The EMA is sharded alongside (the same groups, resharded after forward): a full EMA would cost every GPU 4
bytes per parameter (48 GB for FLUX's 12B). It is updated shard by shard (tread/training/ema.py), and evaluation
samples with it on every process in lockstep.

Checkpoints (checkpoint.layout): sharded by default here, each process writing and reading only its shards
through torch.distributed.checkpoint (tread/utils/sharded_files.py; a resume at another number of processes, or in
one process, reads the slices it needs). With checkpoint.layout=single, `gather_full` all-gathers one tensor at a
time and keeps the full tensor (on the CPU) on rank 0 only; `shard_state` cuts such a full checkpoint into this
process's shards to resume into FSDP. Both layouts load in sample.py and convert into each other
(scripts/convert_checkpoint.py --layout).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from tread.schema import ConfigError
from tread.utils.distributed import comm_device, rank

def check_parallel(cfg: Any, world_size: int, cuda: bool) -> None:
    """train.parallel / train.fsdp against the launch (processes, device) and the other settings, before any
    work. ConfigError names the key, the value and what is allowed."""
    t = cfg.train
    if t.parallel != "fsdp":
        return
    if world_size < 2:
        raise ConfigError(f"train.parallel=fsdp shards the model over processes but this launch has {world_size}; "
                          f"launch several (`accelerate launch --multi_gpu --num_processes N train.py ...` or "
                          f"torchrun) or set train.parallel=ddp.")
    if t.fsdp.cpu_offload and not cuda:
        raise ConfigError("train.fsdp.cpu_offload=true moves sharded weights and optimizer state from the GPU to "
                          "host memory and needs CUDA; this run is on the CPU (allowed here: false).")
    if t.mixed_precision == "fp16":
        raise ConfigError("train.mixed_precision=fp16 is not supported with train.parallel=fsdp (its grad scaler "
                          "is not wired for sharded gradients); allowed: no or bf16.")
    evaluating = cfg.eval.every_steps or cfg.eval.at_end
    if evaluating and cfg.eval.num_samples % world_size:
        raise ConfigError(f"eval.num_samples={cfg.eval.num_samples} must be a multiple of the number of processes "
                          f"({world_size}) with train.parallel=fsdp: every process samples the sharded EMA in "
                          f"lockstep, so each needs the same number of samples.")


def routable_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks routes index (DiT and every family define routable_blocks())."""
    return list(model.routable_blocks())


def shard_backbone(model: nn.Module, reshard_after_forward: bool, cpu_offload: bool,
                   forward_only: bool = False) -> nn.Module:
    """fully_shard each routable block, then the backbone as the root group (in place; returns `model`).
    Parameters are replaced by DTensors: build the optimizer after this. The root stays gathered from forward to
    backward (torch's default), except `forward_only` (the EMA: no backward reshards it), where every group is
    resharded after forward."""
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in routable_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward or forward_only, offload_policy=offload)
    fully_shard(model, reshard_after_forward=True if forward_only else None, offload_policy=offload)
    return model


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view: in-place updates change the parameter); other tensors as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective for a sharded one); other tensors as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_full(value: Any, keep: Optional[bool] = None) -> Any:
    """A (nested) state dict with every DTensor all-gathered, one tensor at a time, in the dict's order (every
    rank must call it alike). Rank 0 keeps full tensors on the CPU; on other ranks (or keep=False) the gathered
    entries are left out, so their dicts hold only what was not sharded (buffers, step counts, settings)."""
    keep = rank() == 0 if keep is None else keep
    if isinstance(value, Mapping):
        out = {k: gather_full(v, keep) for k, v in value.items()}
        return out if keep else {k: v for k, v in out.items() if not (v is None and isinstance(value[k], DTensor))}
    if isinstance(value, list):
        return [gather_full(v, keep) for v in value]
    if isinstance(value, DTensor):
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
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


@contextlib.contextmanager
def gathered_params(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """The parameters `names` of `module` as full plain tensors inside the block, the sharded ones back after: for
    code that reads some weights of a sharded module on one rank (the adapter export). One all-gather per sharded
    parameter, in name order, so every rank enters it alike; only these are gathered (a 12B model's adapter export
    gathers the adapters, never the frozen base), and no forward may run inside."""
    swapped = []
    for name in sorted(names):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        param = owner._parameters[attr]
        if isinstance(param, DTensor):
            owner._parameters[attr] = nn.Parameter(param.full_tensor().detach(), requires_grad=False)
            swapped.append((owner, attr, param))
    try:
        yield
    finally:
        for owner, attr, param in swapped:
            owner._parameters[attr] = param
