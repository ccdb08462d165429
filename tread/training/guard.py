"""The non-finite guard: a step whose loss or gradient norm is NaN/inf changes nothing (train.nonfinite=skip
counts and logs it, =stop ends the run at the next log record). The device-side flag feeds the fused AdamW's
`found_inf` and the EMA weight, so no host sync per step; how and why: docs/reliability.md.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tread.data.info import DatasetInfo
from tread.schema.train import TrainConfig
from tread.training.feature import Feature
from tread.training.setup import TrainingParts
from tread.utils.distributed import all_reduce_max
from tread.utils.errors import UserError

MODES = ("skip", "stop")


class NonFiniteError(UserError):
    """The run stopped because its loss or gradients were not finite."""


class NonFiniteGuard(Feature):
    """Device-side counters of skipped steps, checked on the host when the loop syncs anyway (at a training record
    and before a checkpoint: never one past a stop condition)."""

    def __init__(self, mode: str, max_consecutive: int, device: torch.device):
        self.mode, self.max_consecutive = mode, max_consecutive
        self.total = torch.zeros((), device=device)      # skipped steps in this launch
        self.streak = torch.zeros((), device=device)     # skipped steps in a row, now
        self.longest = torch.zeros((), device=device)    # the longest streak since the last check
        self.reported = 0
        self.skips = 0                                   # skipped steps counted on the host (summary.json)

    @classmethod
    def build(cls, config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo]) -> "NonFiniteGuard":
        return cls(config.train.nonfinite, config.train.max_nonfinite_skips, parts.accelerator.device)

    def after_update(self, nonfinite: torch.Tensor) -> None:
        self.update(nonfinite)

    def log(self, record: dict[str, Any], step: int) -> Optional[str]:
        skipped = self.check(step)
        self.skips += skipped
        record["nonfinite_skips"] = skipped
        if not skipped:
            return None
        return (f"warning: {skipped} step(s) before step {step} had a non-finite loss or gradient norm; their "
                f"updates were skipped (train.nonfinite={self.mode})")

    def before_checkpoint(self, step: int) -> None:
        self.skips += self.check(step)

    def totals(self) -> dict[str, Any]:
        return {"nonfinite_skips": self.skips}

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
