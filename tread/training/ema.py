"""Exponential moving average of model weights, updated with foreach kernels, and where it is kept (ema.mode).

ema.mode:
- full (the default): a copy of the whole preconditioned backbone on the device; a quantized frozen base
  (model.quantize, model.base_dtype=fp8) is shared with the model, not copied (it never changes).
- trained: a copy whose frozen parameters are the model's own (shared), so it holds only what trains: for an
  adapter run the adapters and the class table, not a second frozen base. Averages, checkpoints and exports
  are those of `full` (a frozen parameter's average is itself).
- cpu: as trained, with the averaged parameters (and the copy's buffers) in host memory (HostEma); each update
  copies the trained weights to the host, and evaluation moves the averages to the device for each forward.
- off: no average. Evaluation, sampling, the checkpoint's EMA weights (ema.safetensors) and the adapter export
  are the trained model itself (ModelAsEma).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn

from tread.models.quantize import frozen_base
from tread.schema.train import EMA_MODES
from tread.training.fsdp import local

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
    """ema <- decay * ema + (1 - decay) * model, over the parameters that train (requires_grad in `model`: the
    frozen base of an adapter run never moves, so its average is itself and is skipped; it may be shared with the
    EMA); buffers are copied. `skip` (a 0/1 tensor on the device, the non-finite guard's flag) leaves the EMA
    unchanged when 1, without a host sync: the weight stays a device tensor, given once per parameter (foreach
    lerp's tensor-list form; its scalar form would read the tensor back to the host, a sync per step on CUDA, and
    the tensor-list form computes the same bits: tests/test_host_syncs.py). Sharded modules (train.parallel=fsdp:
    EMA and model sharded alike) are averaged shard by shard, with no communication. An EMA in host memory
    (ema.mode=cpu) gets the trained weights copied over (and `skip` read back: a sync); ema.mode=off holds no
    parameters and is left alone."""
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
