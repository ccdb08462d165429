"""Exponential moving average of model weights, updated with foreach kernels."""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, over parameters; buffers are copied."""
    ema_params = [p for p in ema.parameters()]
    model_params = [p.detach() for p in model.parameters()]
    torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)
    for b_ema, b in zip(ema.buffers(), model.buffers()):
        b_ema.copy_(b)


def ema_decay_at(step: int, decay: float, warmup: bool) -> float:
    """Decay for the update after `step` optimizer steps; warm-up averages early weights less."""
    return min(decay, (1 + step) / (10 + step)) if warmup else decay
