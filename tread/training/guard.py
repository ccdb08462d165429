"""The non-finite guard: a step whose loss or gradient norm is NaN/inf changes nothing.

Each step computes a 0/1 flag on the device. The fused AdamW kernel takes it as `found_inf` (the mechanism
torch's GradScaler uses) and leaves weights, moments and step count untouched when it is 1, and the EMA
update's weight is multiplied by (1 - flag): no host sync per step on any device. Counts are kept on the
device too and read at log records, where the loop already syncs:

    train.nonfinite=skip   the update is skipped, counted, logged (`nonfinite_skips` in train records);
                           train.max_nonfinite_skips skips in a row end the run with an error
    train.nonfinite=stop   skipped the same way, and the run ends at the next log record

An optimizer without a fused kernel (optimizer.fused=false) is skipped on the host instead (one sync).
Checkpoints are never written with non-finite weights (tread/training/checkpoint.py checks), so the newest
checkpoint on disk is always a finite one.
"""
from __future__ import annotations

import torch

from tread.utils.distributed import all_reduce_max
from tread.utils.errors import UserError

MODES = ("skip", "stop")


class NonFiniteError(UserError):
    """The run stopped because its loss or gradients were not finite."""


class NonFiniteGuard:
    """Device-side counters of skipped steps, checked on the host when the loop syncs anyway."""

    def __init__(self, mode: str, max_consecutive: int, device: torch.device):
        self.mode, self.max_consecutive = mode, max_consecutive
        self.total = torch.zeros((), device=device)      # skipped steps in this launch
        self.streak = torch.zeros((), device=device)     # skipped steps in a row, now
        self.longest = torch.zeros((), device=device)    # the longest streak since the last check
        self.reported = 0

    def update(self, bad: torch.Tensor) -> None:
        """Count this step's flag (0/1 float tensor) without leaving the device."""
        self.total += bad
        self.streak = (self.streak + 1) * bad
        torch.maximum(self.longest, self.streak, out=self.longest)

    def check(self, step: int) -> int:
        """At a log record: raise NonFiniteError when the run must stop; returns the skips since the last check."""
        counts = all_reduce_max(torch.stack([self.total, self.longest])).tolist()  # every rank decides alike
        total, longest = int(counts[0]), int(counts[1])
        new = total - self.reported
        self.reported = total
        self.longest.zero_()
        if new and self.mode == "stop":
            raise NonFiniteError(f"training stopped at step {step}: the loss or gradient norm was non-finite in {new} "
                                 f"step(s) since the previous log record (train.nonfinite=stop; those updates were "
                                 f"skipped). {ADVICE}")
        if longest >= self.max_consecutive:
            raise NonFiniteError(f"training stopped at step {step}: the loss or gradient norm was non-finite for "
                                 f"{longest} steps in a row (train.max_nonfinite_skips={self.max_consecutive}). "
                                 f"{ADVICE}")
        return new


ADVICE = ("No update was applied from a non-finite step and the checkpoints on disk are finite. Check the data "
          "(the readers report non-finite latents), the learning rate and the diffusion settings.")


def nonfinite_flag(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 when the loss or the gradient norm is NaN/inf, else 0.0 (on the device)."""
    return (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
