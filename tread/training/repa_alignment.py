"""REPA in the training step: the alignment term of model.repa, one Feature."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from tread.data.info import DatasetInfo
from tread.models.repa import REPA_AUX
from tread.schema.train import TrainConfig
from tread.training.feature import Feature
from tread.training.repa import Repa
from tread.training.setup import TrainingParts


class RepaAlignment(Feature):
    """model.repa in the step: the alignment term (its weight model.repa.weight) of the backbone's projected tokens
    against the encoder's features, and the seconds spent on the targets in each training record."""

    aux, term = True, "repa"

    def __init__(self, repa: Repa, meta: Mapping[str, Any]):
        self.repa, self.meta, self.weight = repa, meta, repa.weight

    @classmethod
    def build(cls, config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo]
              ) -> Optional["RepaAlignment"]:
        if parts.repa is None:
            return None
        return cls(parts.repa, dict(dataset.meta) if dataset is not None else {})

    def loss_term(self, aux: Mapping[str, Any], x: torch.Tensor,
                  extras: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        return self.repa.loss(*aux[REPA_AUX], x, self.meta, features=extras.get("repa_features"))

    def log(self, record: dict[str, Any], step: int) -> Optional[str]:
        record["repa_target_sec"] = self.repa.timer.take()   # this process's seconds in the window (decode + encoder)
        return None
