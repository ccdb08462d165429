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


def letterbox(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (B, h, w, 3) centred on a black (B, height, width, 3) canvas (a grid of several bucket shapes)."""
    out = torch.zeros(images.shape[0], height, width, 3, dtype=images.dtype)
    top, left = (height - images.shape[1]) // 2, (width - images.shape[2]) // 2
    out[:, top:top + images.shape[1], left:left + images.shape[2]] = images
    return out


def sample_shapes(dataset: Any) -> list[tuple[list[int], str]]:
    """The (latent shape, label) validation samples are drawn at: every bucket of bucketed data (labelled by its
    image size), else the data's one shape (no label)."""
    if hasattr(dataset, "buckets"):
        return [(list(shape), b.name) for b, shape in zip(dataset.buckets, dataset.shapes)]
    return [(list(dataset.shape), "")]


class ValidationPrompts:
    """The encoded validation prompts of a run, and the sampling of their captioned grid: each prompt with
    each seed at each shape of sample_shapes (bucketed data: every bucket, letterboxed to one grid)."""

    def __init__(self, eval_cfg: Any, model_cfg: Mapping[str, Any], model: Any, dataset: Any, device: torch.device,
                 unconditional: str = "zeros"):
        self.cfg, self.dataset, self.device = eval_cfg, dataset, device
        self.seeds = list(range(int(eval_cfg.validation_per_prompt)))
        self.shapes = sample_shapes(dataset)
        self.embeddings = encode_for_model(model, dataset.meta, list(eval_cfg.validation_prompts),
                                           eval_cfg.negative_prompt,
                                           model_cfg.get("text_encoders"), key="model.text_encoders", device=device,
                                           what="eval.validation_prompts", unconditional=unconditional)

    def sample(self, net: Any, diffusion: Any, guidance: Guidance, decode: dict) -> tuple[torch.Tensor, list[str]]:
        """Every prompt with every seed: (uint8 images (n, H, W, 3), their captions). Run on every process (a
        sharded EMA (train.parallel=fsdp) samples in lockstep); the images are the same on each."""
        images, captions = [], []
        prompts, ds = self.embeddings.prompts, self.dataset
        for shape, label in self.shapes:
            for index, batch, x in generate_for_prompts(net, diffusion, self.embeddings, self.seeds, shape,
                                                        ds.num_classes, self.device, batch_size=self.cfg.batch_size,
                                                        num_steps=self.cfg.num_steps, guidance=guidance):
                images.append(decode_to_uint8(x, ds.meta, **decode).cpu())
                captions += [f"{prompts[index]} ({label})" if label else prompts[index]] * len(batch)
        height, width = max(im.shape[1] for im in images), max(im.shape[2] for im in images)
        return torch.cat([letterbox(im, height, width) for im in images]), captions

    def save(self, images: torch.Tensor, captions: list[str], step: int, samples_dir: Path) -> Path:
        """The captioned grid (one row per bucket with several shapes, else one row per prompt when there are several
        seeds per prompt); returns its path."""
        per_shape = len(self.embeddings.prompts) * len(self.seeds)     # several shapes (buckets): one row each
        nrow = per_shape if len(self.shapes) > 1 else len(self.seeds) if len(self.seeds) > 1 else None
        return save_captioned_grid(images, captions, Path(samples_dir) / f"validation_step_{step:07d}.png", nrow=nrow)
