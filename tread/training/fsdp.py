"""Sharded data parallelism (train.parallel=fsdp): torch's FSDP2 `fully_shard`, one group per routable block,
the EMA sharded alongside; the checks of the launch against it. Why and how: docs/scaling.md, "FSDP"."""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from tread.schema import ConfigError


def check_parallel(t: Any, eval_settings: Any, world_size: int, cuda: bool) -> None:
    """train.parallel / train.fsdp (the train section `t`) against the launch (processes, device) and the
    evaluation, before any work. ConfigError names the key, the value and what is allowed."""
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
    if eval_settings.runs and eval_settings.num_samples % world_size:
        raise ConfigError(f"eval.num_samples={eval_settings.num_samples} must be a multiple of the number of processes "
                          f"({world_size}) with train.parallel=fsdp: every process samples the sharded EMA in "
                          f"lockstep, so each needs the same number of samples.")


def routable_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks routes index (DiT and every family define routable_blocks())."""
    return list(model.routable_blocks())


def shard_backbone(model: nn.Module, reshard_after_forward: bool, cpu_offload: bool,
                   forward_only: bool = False) -> nn.Module:
    """fully_shard each routable block, then the backbone as the root group (in place; returns `model`); build
    the optimizer after this. The root stays gathered from forward to backward, except with `forward_only` (the
    EMA), where every group reshards after forward."""
    # deferred: torch.distributed.fsdp (and .tensor) take most of a second to import; only sharding needs them
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in routable_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward or forward_only, offload_policy=offload)
    fully_shard(model, reshard_after_forward=True if forward_only else None, offload_policy=offload)
    return model
