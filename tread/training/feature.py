"""The hooks an optional part of training plugs into (caption dropout, first frames, REPA, the non-finite guard):
each is one `Feature` built only when its config asks for it, registered once in tread/training/features.py."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional

import torch


class Feature:
    """An optional part of training. Every hook's default leaves the step and the loop as they are; the step calls
    the hooks of a run's features in registration order (the order of their draws on the training stream)."""

    aux: ClassVar[bool] = False            # the backbone hands out its auxiliary outputs (loss_term reads them)
    term: ClassVar[Optional[str]] = None   # the name of loss_term's term (logged as {term}_loss)
    weight: float = 0.0                    # that term's weight in the loss

    def condition(self, cond: dict[str, torch.Tensor], extras: Mapping[str, torch.Tensor],
                  batch: int) -> dict[str, torch.Tensor]:
        """A micro-batch's conditioning (after label dropout), from the batch's `extras`."""
        return cond

    def loss_weight(self, loss: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Weights of the unreduced loss (broadcast over it), or None."""
        return None

    def loss_term(self, aux: Mapping[str, Any], x: torch.Tensor,
                  extras: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """A term added to the loss (times `weight`), from the backbone's auxiliary outputs and the clean latents."""
        return None

    def after_update(self, nonfinite: torch.Tensor) -> None:
        """After each optimizer update; `nonfinite` is 1.0 on the device when it was skipped."""

    def log(self, record: dict[str, Any], step: int) -> Optional[str]:
        """At a training record: add its keys; returns a warning line to show, or None."""
        return None

    def before_checkpoint(self, step: int) -> None:
        """Before a checkpoint is written (raise to keep it from being written)."""

    def totals(self) -> dict[str, Any]:
        """What summary.json keeps of this feature at the end of a launch."""
        return {}
