"""Validation prompts during training (eval.validation_prompts): at every evaluation the EMA model samples each
prompt with fixed seeds into a captioned grid (and video files for video models). The prompts are encoded once
at start-up and do not count toward the metrics.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from tread.data import decode_to_uint8
from tread.evaluation.images import save_captioned_grid
from tread.evaluation.videos import STILL_NAMES, is_video, save_videos, slug, still_captions, stills, video_fps
from tread.sampling import Guidance
from tread.sampling.prompts import encode_for_model, generate_for_prompts
from tread.schema.train import Eval

VIDEO_DIR = "validation"    # under the run dir: validation/step_XXXXXXX/<index>_<slug>.mp4, a video per sample


def letterbox(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (B, h, w, 3) centred on a black (B, height, width, 3) canvas (a grid of several bucket shapes)."""
    out = torch.zeros(images.shape[0], height, width, 3, dtype=images.dtype)
    top, left = (height - images.shape[1]) // 2, (width - images.shape[2]) // 2
    out[:, top:top + images.shape[1], left:left + images.shape[2]] = images
    return out


def sample_shapes(dataset: Any) -> list[tuple[list[int], str]]:
    """The (latent shape, label) validation samples are drawn at: every bucket of bucketed data (labelled by its
    image size), else the data's one shape (no label)."""
    if dataset.buckets is not None:
        return [(list(shape), b.name) for b, shape in zip(dataset.buckets, dataset.shapes)]
    return [(list(dataset.shape), "")]


class ValidationPrompts:
    """The encoded validation prompts of a run, and the sampling of their captioned grid: each prompt with
    each seed at each shape of sample_shapes (bucketed data: every bucket, letterboxed to one grid)."""

    def __init__(self, settings: Eval, text_encoders: Optional[str], model: Any, dataset: Any, device: torch.device,
                 unconditional: str = "zeros"):
        self.cfg, self.dataset, self.device = settings, dataset, device
        self.seeds = list(range(int(settings.validation_per_prompt)))
        self.shapes = sample_shapes(dataset)
        self.embeddings = encode_for_model(model, dataset.meta, list(settings.validation_prompts),
                                           settings.negative_prompt,
                                           text_encoders, key="model.text_encoders", device=device,
                                           what="eval.validation_prompts", unconditional=unconditional)

    def sample(self, net: Any, diffusion: Any, guidance: Guidance,
               decode: dict) -> tuple[list[torch.Tensor], list[str]]:
        """Every prompt with every seed at every shape, prompt-major within a shape: (uint8 samples, each an image
        (H, W, 3) or, for video data, a video (F, H, W, 3); their captions). Run on every process (a sharded EMA
        (train.parallel=fsdp) samples in lockstep); the samples are the same on each."""
        samples, captions = [], []
        prompts, ds = self.embeddings.prompts, self.dataset
        for shape, label in self.shapes:
            for index, batch, x in generate_for_prompts(net, diffusion, self.embeddings, self.seeds, shape,
                                                        ds.num_classes, self.device, batch_size=self.cfg.batch_size,
                                                        num_steps=self.cfg.num_steps, guidance=guidance):
                decoded = decode_to_uint8(x, ds.meta, **decode).cpu()          # (B, H, W, 3) | (B, F, H, W, 3)
                samples += list(decoded[:, 0] if decoded.ndim == 5 and decoded.shape[1] == 1 else decoded)
                captions += [f"{prompts[index]} ({label})" if label else prompts[index]] * len(batch)
        return samples, captions

    def save(self, samples: list[torch.Tensor], captions: list[str], step: int, samples_dir: Path) -> dict[str, Any]:
        """Write the captioned grid (samples_dir/validation_step_XXXXXXX.png) and, for videos, one file each under
        <run dir>/validation/step_XXXXXXX/; returns {"validation_grid": path, "validation_videos": [paths]}."""
        grid_path = Path(samples_dir) / f"validation_step_{step:07d}.png"
        if any(is_video(x) for x in samples):
            return self.save_videos([x if x.ndim == 4 else x[None] for x in samples], captions, grid_path,
                                    Path(samples_dir).parent / VIDEO_DIR / f"step_{step:07d}")
        per_shape = len(self.embeddings.prompts) * len(self.seeds)     # several shapes (buckets): one row each
        nrow = per_shape if len(self.shapes) > 1 else len(self.seeds) if len(self.seeds) > 1 else None
        return {"validation_grid": str(save_captioned_grid(letterboxed(samples), captions, grid_path, nrow=nrow))}

    def save_videos(self, videos: list[torch.Tensor], captions: list[str], grid_path: Path,
                    folder: Path) -> dict[str, Any]:
        """Each uint8 (F, H, W, 3) video as folder/<index>_<slug>[_seed<s>].mp4 at the data's frame rate, and the
        grid of their first, middle and last frames (one row per video) at `grid_path`."""
        several = len(self.seeds) > 1
        names = [f"{i:02d}_{slug(c)}" + (f"_seed{self.seeds[i % len(self.seeds)]}" if several else "")
                 for i, c in enumerate(captions)]
        paths = save_videos(videos, names, folder, video_fps(self.dataset.meta))
        frames = letterboxed([still for video in videos for still in stills(video)])
        labels = [text for video, c in zip(videos, captions) for text in still_captions(c, len(video))]
        grid = save_captioned_grid(frames, labels, grid_path, nrow=len(STILL_NAMES))
        return {"validation_grid": str(grid), "validation_videos": [str(p) for p in paths]}


def letterboxed(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 (H, W, 3) images of several sizes as one uint8 (n, H_max, W_max, 3) batch (letterbox)."""
    height, width = max(im.shape[0] for im in images), max(im.shape[1] for im in images)
    return torch.cat([letterbox(im[None], height, width) for im in images])
