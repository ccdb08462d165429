"""Image-to-video training (model.i2v): the data's first frames condition a share of the samples
(train.i2v_probability), and the given frames are left out of the loss."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from tread.models.families.first_frame import FIRST_FRAME, I2V_KEYS, I2V_MASK, frame_loss_weight
from tread.data.info import DatasetInfo
from tread.schema.train import TrainConfig
from tread.training.feature import Feature
from tread.training.setup import TrainingParts


class FirstFrames(Feature):
    """model.i2v: first frames passed on (without it the step never passes them); one draw per sample on the
    training stream, after caption dropout, when train.i2v_probability < 1."""

    def __init__(self, probability: float, frames_in_loss: bool):
        self.probability = probability
        self.frames_in_loss = frames_in_loss   # the given frames replace the noisy ones: kept out of the loss

    @classmethod
    def build(cls, config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo]
              ) -> Optional["FirstFrames"]:
        if not config.model.i2v:
            return None
        return cls(float(config.train.i2v_probability), not parts.model.i2v_frames)

    def condition(self, cond: dict[str, torch.Tensor], extras: Mapping[str, torch.Tensor],
                  batch: int) -> dict[str, torch.Tensor]:
        if FIRST_FRAME not in extras:
            return cond
        cond = {**cond, **{k: extras[k] for k in I2V_KEYS if k in extras}}   # the frames (+ image embeddings)
        if self.probability < 1:
            cond[I2V_MASK] = torch.rand(batch, device=extras[FIRST_FRAME].device) < self.probability
        return cond

    def loss_weight(self, loss: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        return None if self.frames_in_loss else frame_loss_weight(loss, cond)
