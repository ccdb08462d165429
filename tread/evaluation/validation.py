"""Validation prompts during training (eval.validation_prompts): at every evaluation the EMA model samples each
prompt with fixed seeds (0..eval.validation_per_prompt-1, so grids are comparable across steps) into a
captioned grid, samples/validation_step_XXXXXXX.png. The prompts are encoded once, at start-up, by the
model's own text encoders (model.text_encoders), which are then freed; they do not count toward the metrics.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from tread.data import decode_to_uint8
from tread.evaluation.images import save_captioned_grid
from tread.sampling import Guidance
from tread.sampling.prompts import encode_for_model, generate_for_prompts


class ValidationPrompts:
    """The encoded validation prompts of a run, and the sampling of their captioned grid."""

    def __init__(self, eval_cfg: Any, model_cfg: Mapping[str, Any], model: Any, dataset: Any, device: torch.device):
        self.cfg, self.dataset, self.device = eval_cfg, dataset, device
        self.seeds = list(range(int(eval_cfg.validation_per_prompt)))
        self.embeddings = encode_for_model(model, dataset.meta, list(eval_cfg.validation_prompts),
                                           eval_cfg.negative_prompt,
                                           model_cfg.get("text_encoders"), key="model.text_encoders", device=device,
                                           what="eval.validation_prompts")

    def sample(self, net: Any, diffusion: Any, guidance: Guidance, decode: dict) -> tuple[torch.Tensor, list[str]]:
        """Every prompt with every seed: (uint8 images (n, H, W, 3), their captions). Run on every process (a
        sharded EMA (train.parallel=fsdp) samples in lockstep); the images are the same on each."""
        images, captions = [], []
        prompts, ds = self.embeddings.prompts, self.dataset
        for index, batch, x in generate_for_prompts(net, diffusion, self.embeddings, self.seeds, list(ds.shape),
                                                    ds.num_classes, self.device, batch_size=self.cfg.batch_size,
                                                    num_steps=self.cfg.num_steps, guidance=guidance):
            images.append(decode_to_uint8(x, ds.meta, **decode).cpu())
            captions += [prompts[index]] * len(batch)
        return torch.cat(images), captions

    def save(self, images: torch.Tensor, captions: list[str], step: int, samples_dir: Path) -> Path:
        """The captioned grid (one row per prompt when there are several seeds per prompt); returns its path."""
        nrow = len(self.seeds) if len(self.seeds) > 1 else None
        return save_captioned_grid(images, captions, Path(samples_dir) / f"validation_step_{step:07d}.png", nrow=nrow)
