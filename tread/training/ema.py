"""Exponential moving average of model weights, updated with foreach kernels, and where it is kept (ema.mode:
full, trained, cpu or off; docs/configuration.md, `ema.mode`).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn

from tread.models.quantize import frozen_base
from tread.schema.train import EMA_MODES
from tread.utils.dtensor import local

# The start-up line of each mode but the default (tread/training/loop.py announce).
EMA_NOTES = {"trained": "EMA: the trained parameters only (ema.mode=trained); the frozen base is the model's",
             "cpu": "EMA: the trained parameters only, in host memory (ema.mode=cpu)",
             "off": "EMA: off (ema.mode=off): evaluation, samples, the checkpoints' EMA weights and the exported "
                    "adapter are the model itself"}


def make_ema(net: nn.Module, model: nn.Module, mode: str = "full") -> nn.Module:
    """The EMA of `net` (the preconditioned `model`) as ema.mode keeps it (see the module docstring), in eval mode
    and without gradients; `full` is the copy earlier versions made, bit for bit."""
    if mode == "off":
        return ModelAsEma(net)
    if mode not in EMA_MODES:
        raise ValueError(f"ema.mode={mode!r} is not allowed; allowed: one of {list(EMA_MODES)}.")
    shared = frozen_base(model) if mode == "full" else {id(p): p for p in model.parameters() if not p.requires_grad}
    ema = copy.deepcopy(net, shared).requires_grad_(False).eval()
    return HostEma(ema).eval() if mode == "cpu" else ema


class ModelAsEma(nn.Module):
    """ema.mode=off: what reads the EMA reads the trained `net` itself, which is not registered here (its
    parameters are the model's, held and counted once). A forward runs `net` in eval mode and restores its mode
    (sampling calls .eval() on the EMA, which stays here)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.__dict__["net"] = net

    @property
    def model(self) -> nn.Module:
        """The backbone (what checkpoints save as the EMA weights)."""
        return self.net.model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        was = self.net.training
        self.net.train(False)
        try:
            return self.net(*args, **kwargs)
        finally:
            self.net.train(was)


class HostEma(nn.Module):
    """ema.mode=cpu: the EMA copy `ema` (frozen base shared with the model, see make_ema) whose own parameters and
    buffers stay in host memory: .to() leaves them there (the meta device excepted: it frees them), and a forward
    runs `ema` with copies of them on the input's device, for that call only (torch.func.functional_call)."""

    def __init__(self, ema: nn.Module):
        super().__init__()
        self.ema = ema

    @property
    def model(self) -> nn.Module:
        return self.ema.model

    def to(self, *args: Any, **kwargs: Any) -> "HostEma":
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "meta":
            super().to(device)
        return self

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        moved = {name: t.to(x.device, non_blocking=True)
                 for name, t in (*self.ema.named_parameters(), *self.ema.named_buffers()) if t.device != x.device}
        return torch.func.functional_call(self.ema, moved, (x, *args), kwargs, strict=False)


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float, skip: Optional[torch.Tensor] = None) -> None:
    """ema <- decay * ema + (1 - decay) * model over the parameters that train; buffers are copied, a frozen base
    is skipped. `skip` (the non-finite guard's 0/1 device tensor) leaves the EMA unchanged when 1 without a host
    sync (foreach lerp's tensor-list form; tests/test_host_syncs.py). FSDP shards are averaged locally; a host
    EMA (ema.mode=cpu) gets the weights copied (one sync); ema.mode=off is left alone."""
    pairs = [(e, p) for e, p in zip(ema.parameters(), model.parameters()) if p.requires_grad]
    if not pairs:
        return
    ema_params = [local(e) for e, _ in pairs]
    model_params = [local(p.detach()).to(e.device) for e, (_, p) in zip(ema_params, pairs)]
    if skip is None:
        torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)
    else:
        weight = (1.0 - skip.to(ema_params[0].device)) * (1.0 - decay)
        torch._foreach_lerp_(ema_params, model_params, [weight] * len(ema_params))
    for b_ema, b in zip(ema.buffers(), model.buffers()):
        b_ema.copy_(b)


def ema_decay_at(step: int, decay: float, warmup: bool) -> float:
    """Decay for the update after `step` optimizer steps; warm-up averages early weights less."""
    return min(decay, (1 + step) / (10 + step)) if warmup else decay
