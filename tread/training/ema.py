"""Exponential moving average of model weights, updated with foreach kernels."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from tread.training.fsdp import local


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float, skip: Optional[torch.Tensor] = None) -> None:
    """ema <- decay * ema + (1 - decay) * model, over the parameters that train (requires_grad in `model`: the
    frozen base of an adapter run never moves, so its average is itself and is skipped; a quantized one may be
    shared with the EMA); buffers are copied. `skip` (a 0/1 tensor on the device, the non-finite guard's flag)
    leaves the EMA unchanged when 1, without a host sync: the weight stays a device tensor, given once per parameter
    (foreach lerp's tensor-list form; its scalar form would read the tensor back to the host, a sync per step on
    CUDA, and the tensor-list form computes the same bits: tests/test_host_syncs.py). Sharded modules
    (train.parallel=fsdp: EMA and model sharded alike) are averaged shard by shard, with no communication."""
    pairs = [(e, p) for e, p in zip(ema.parameters(), model.parameters()) if p.requires_grad]
    ema_params = [local(e) for e, _ in pairs]
    model_params = [local(p.detach()) for _, p in pairs]
    if skip is None:
        torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)
    else:
        weight = (1.0 - skip) * (1.0 - decay)
        torch._foreach_lerp_(ema_params, model_params, [weight] * len(ema_params))
    for b_ema, b in zip(ema.buffers(), model.buffers()):
        b_ema.copy_(b)


def ema_decay_at(step: int, decay: float, warmup: bool) -> float:
    """Decay for the update after `step` optimizer steps; warm-up averages early weights less."""
    return min(decay, (1 + step) / (10 + step)) if warmup else decay
