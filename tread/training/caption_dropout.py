"""Caption dropout (train.caption_dropout, train.caption_dropout_mode): each sample of text data loses its
caption with probability p and trains on the unconditional input its family's pipeline would use: the
encoded empty prompt ("empty"), zero embeddings ("zeros") or the family's choice ("auto"). Drawn after
label dropout, only when p > 0; the table per family is in docs/data.md, "Caption dropout".
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from tread.data import build_dataset
from tread.models.families.base import null_text
from tread.sampling.prompts import PromptError, resolve_mode
from tread.schema.base import ConfigError
from tread.data.info import DatasetInfo
from tread.schema.train import TrainConfig
from tread.training.feature import Feature
from tread.training.setup import TrainingParts


class CaptionDropout(Feature):
    """train.caption_dropout > 0: each text sample's caption dropped with probability p (one draw per micro-batch,
    after label dropout) for its family's unconditional input."""

    def __init__(self, p: float, mode: str, empty: Optional[Mapping[str, torch.Tensor]], device: torch.device):
        self.p, self.mode = p, mode
        self.empty = {k: v.to(device) for k, v in (empty or {}).items()}   # mode empty: the data's encoded ""

    @classmethod
    def build(cls, config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo]
              ) -> Optional["CaptionDropout"]:
        meta = dataset.meta if dataset is not None else {}
        p, mode, empty = caption_dropout_settings(config.train, config.model.family, config.data, meta, dataset)
        return cls(p, mode, empty, parts.accelerator.device) if p > 0 else None

    def condition(self, cond: dict[str, torch.Tensor], extras: Mapping[str, torch.Tensor],
                  batch: int) -> dict[str, torch.Tensor]:
        return drop_captions(cond, self.p, self.mode, self.empty) if "text" in cond else cond


def caption_dropout_settings(train: Any, family: Optional[str], data: Any, data_meta: Mapping[str, Any],
                             dataset: Any = None) -> tuple[float, str, Optional[dict[str, torch.Tensor]]]:
    """(p, mode, empty prompt) of the train section: the mode resolved for model.family ("empty" | "zeros") and,
    for "empty", the data's encoded empty prompt (one sample's text parts, on the CPU). Data that does not fit
    (`data_meta`, `dataset`) is one error."""
    p, mode = float(train.caption_dropout), train.caption_dropout_mode
    if p <= 0:
        return 0.0, mode, None
    try:
        resolved = resolve_mode(mode, family)
    except PromptError as err:
        raise ConfigError(str(err)) from None
    where = f"'{data.path}'"
    cond = data_meta.get("conditioning") or {}
    if cond.get("text") is None:
        raise ConfigError(f"train.caption_dropout={p} needs text data (text_embeds.npy), but the data at {where} has "
                          f"none; allowed: train.caption_dropout=0 for class-conditional data.")
    if resolved == "zeros":
        return p, resolved, None
    if not (cond.get("captions") or {}).get("empty_prompt"):
        raise ConfigError(f"train.caption_dropout_mode={mode}{' (empty for this family)' if mode == 'auto' else ''} "
                          f"needs the encoded empty prompt in the data, but the data at {where} has none; allowed: "
                          f"precompute it with --empty-prompt, or train.caption_dropout_mode=zeros.")
    dataset = dataset if dataset is not None else build_dataset(data.plain())   # its stored empty prompt
    return p, resolved, dataset.parts[0].empty_prompt()


def drop_captions(cond: Mapping[str, torch.Tensor], p: float, mode: str,
                  empty: Optional[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`cond` (a batch's text parts) with each sample's caption dropped with probability `p` (one torch.rand(B)
    draw): replaced by `empty`'s text parts for "empty", by null_text's zeros for "zeros"."""
    text = cond["text"]
    drop = torch.rand(text.shape[0], device=text.device) < p
    if mode == "zeros":
        return null_text(cond, drop)
    out = dict(cond)
    for key, value in empty.items():
        if key in out:
            where = drop.view(-1, *([1] * (out[key].dim() - 1)))
            out[key] = torch.where(where, value.to(out[key].dtype).unsqueeze(0), out[key])
    return out
