"""optimizer=adamw8bit: torchao's 8-bit AdamW as the training loop drives it."""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch


def adamw8bit(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """optimizer=adamw8bit: torchao's AdamW8bit (block-wise 8-bit moments, bitsandbytes' scheme: each moment of a
    parameter with >= 4096 values, a multiple of block_size, is stored as uint8 codes plus one fp32 scale per
    block_size values; smaller parameters keep fp32 moments), as the training loop drives it (_adamw8bit_class)."""
    return _adamw8bit_class()(params, **kwargs)


@functools.cache
def _adamw8bit_class() -> type:
    # deferred: torchao takes seconds to import, and only optimizer=adamw8bit needs its optimizer
    from torchao.optim import AdamW8bit

    class LoopAdamW8bit(AdamW8bit):
        """torchao's AdamW8bit taking the plain-float lr the loop sets every step (tread.training.step.set_lr), with
        the per-parameter update run eagerly when every parameter is on the CPU (compiling it there is slow)."""

        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                if not torch.is_tensor(group["lr"]):
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            cpu = all(p.device.type == "cpu" for group in self.param_groups for p in group["params"])
            with torch.compiler.set_stance("force_eager") if cpu else contextlib.nullcontext():
                return super().step(closure)

    return LoopAdamW8bit

