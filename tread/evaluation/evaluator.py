"""In-training evaluation: samples of the EMA model, decoded and scored with the ADM metrics against the dataset's
reference, plus a sample grid; per-sample generators make it independent of batch size and process count.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from tread.data import check_decodable, decode_to_uint8
from tread.evaluation.fdd import FDD, FddScorer, without_fdd
from tread.evaluation.fvd import FVD, FvdScorer, without_fvd
from tread.evaluation.extractors import feature_extractor, reference_cache_path
from tread.evaluation.images import as_frames, save_image_grid
from tread.schema.metric_names import TOY_METRICS, without_toy
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import load_reference_full, read_reference_file, reference_for_dataset
from tread.evaluation.toy_checks import ToyScorer, check_toy_metrics
from tread.evaluation.validation import ValidationPrompts
from tread.sampling import Guidance, generate, text_conditioning_for_seeds
from tread.schema.train import Eval
from tread.utils.distributed import all_gather_rows


def decode_options(settings: Eval) -> dict[str, Any]:
    """decode_to_uint8's keyword options from checked decode settings (eval.*, sample.py, fid.py:
    configs/decode/default.yaml); decode_rule=paper adds rule="paper"."""
    rule = {"rule": "paper"} if settings.decode_rule == "paper" else {}   # ours: the options (and cache keys) as before
    return {"vae": settings.vae, "vae_dtype": settings.vae_dtype, "batch_size": settings.decode_batch_size, **rule}


def metric_shape(dataset: Any, model: Any) -> tuple[int, ...]:
    """The latent shape metric samples are drawn at: the data's, or for bucketed data the model's square default grid
    (scored against center crops of the data's images)."""
    if dataset.buckets is None:
        return tuple(dataset.shape)
    frames = (model.frames,) if model.frames_axis and model.frames > 1 else ()
    return dataset.channels, *frames, model.input_size, model.input_size


class Evaluator:
    """ADM-style metrics (eval.metrics) of generated samples against the dataset's reference, a sample grid and the
    validation prompts' grid. The VAE, the reference and the prompts' embeddings are made once, here."""

    def __init__(self, settings: Eval, dataset, cache_dir: str | Path, accelerator, model: Any = None,
                 text_encoders: Optional[str] = None, unconditional: str = "zeros"):
        self.cfg = settings
        self.dataset = dataset
        self.accelerator = accelerator
        self.device = accelerator.device
        self.decode = decode_options(settings)
        self.metrics = tuple(settings.metrics)
        # fdd, fvd and the toy checks have networks of their own (tread/evaluation/fdd.py, fvd.py, toy_checks.py)
        self.main_metrics = without_toy(without_fvd(without_fdd(self.metrics)))
        check_toy_metrics(self.metrics, settings.features, dataset.meta, dataset.buckets is not None)
        self.guidance = Guidance.from_settings(settings)
        self.validation = ValidationPrompts(settings, text_encoders, model, dataset, self.device, unconditional) \
            if settings.validation_prompts else None
        # Loads the VAE now (once per process): missing weights fail before training.
        check_decodable(dataset.meta, **self.decode, device=self.device)
        self.sample_shape = metric_shape(dataset, model)
        zeros = torch.zeros(1, *self.sample_shape, device=self.device)
        decoded = decode_to_uint8(zeros, dataset.meta, **self.decode)       # (1, H, W, 3); video (1, F, H, W, 3)
        self.image_shape = tuple(decoded.shape[-3:])                        # (H, W, 3)
        self.frames = int(decoded.shape[1]) if decoded.dim() == 5 else 1   # video: FID/IS/FDD over every frame
        self.square = self.image_shape[0] if dataset.buckets is not None else None   # bucketed: crop references
        ref = settings.reference
        if ref:                 # a given reference: its file is checked before any feature network is made
            if not Path(ref).is_file():
                raise FileNotFoundError(f"eval.reference={ref!r} does not exist; build one with `python fid.py mode=ref ...`.")
            read_reference_file(ref)
        self.extractor = feature_extractor(
            settings.features, inception_weights=settings.inception_weights,
            cache_dir=str(cache_dir), device=str(self.device),
            resolution=self.image_shape[0])
        if ref:
            self.ref_path = Path(ref)
        else:
            self.ref_path = reference_cache_path(cache_dir, dataset, self.extractor.name,
                                                 settings.reference_max_images, self.square)
            with accelerator.main_process_first():  # the first process builds and caches it
                reference_for_dataset(dataset, self.extractor, self.ref_path,
                                      max_images=settings.reference_max_images, decode_kwargs=self.decode,
                                      square=self.square)
        self.reference = load_reference_full(self.ref_path, self.extractor, need=self.main_metrics or ("fid",))
        self.fdd = FddScorer(settings, dataset, cache_dir, accelerator, self.decode, self.square) \
            if FDD in self.metrics else None
        self.fvd = FvdScorer(settings, accelerator, self.frames) if FVD in self.metrics else None
        self.toy = ToyScorer(self.metrics, dataset, cache_dir, accelerator, self.decode, self.image_shape[0],
                             settings.reference_max_images) if set(TOY_METRICS) & set(self.metrics) else None

    def __call__(self, net, diffusion, step: int, samples_dir: Optional[Path]) -> dict[str, Any]:
        start = time.time()
        acc, cfg = self.accelerator, self.cfg
        offset = cfg.seed_offset                     # the paper code's FID-5K: seeds 100000..104999
        seeds = list(range(offset, offset + cfg.num_samples))[acc.process_index::acc.num_processes]
        shape = list(self.sample_shape)
        feats = FeatureAccumulator(self.extractor, self.main_metrics or ("fid",), device=self.device)  # a rank
        fdd = self.fdd.accumulator() if self.fdd is not None else None                             # may get none
        toy = self.toy.accumulator() if self.toy is not None else None
        fvd = self.fvd.accumulator() if self.fvd is not None else None                             # whole clips
        grid_n = min(cfg.grid_size, cfg.num_samples)
        grid: dict[int, torch.Tensor] = {}
        for batch, labels, x in generate(net, diffusion, seeds, shape, self.dataset.num_classes, self.device,
                                         batch_size=cfg.batch_size, num_steps=cfg.num_steps, guidance=self.guidance,
                                         cond_fn=text_conditioning_for_seeds(self.dataset, net),
                                         class_labels=cfg.class_labels):
            decoded = decode_to_uint8(x, self.dataset.meta, **self.decode)   # (B, H, W, 3) uint8, video (B, F, ...)
            images, index = as_frames(decoded, batch, self.frames)             # indexed by seed (and frame)
            feats.add(images.permute(0, 3, 1, 2), index)
            if fdd is not None:
                fdd.add(images.permute(0, 3, 1, 2), index)
            if fvd is not None:
                self.fvd.add(fvd, decoded)
            if toy is not None:                                                # image data: one frame per label
                toy.add(images.permute(0, 3, 1, 2), labels, index)
            stills = decoded[:, decoded.shape[1] // 2] if decoded.dim() == 5 else decoded   # video: middle frame
            grid.update({s - offset: img.cpu() for s, img in zip(batch, stills) if s - offset < grid_n})
        feats.gather()
        scores = compute_metrics(feats, self.reference, self.main_metrics) if self.main_metrics else {}
        if fdd is not None:
            scores[FDD] = self.fdd.score(fdd)
        if fvd is not None:
            scores[FVD] = self.fvd.score(fvd)
        if toy is not None:
            scores.update(self.toy.score(toy))
        grid_images = self._gather_grid(grid, grid_n, self.image_shape)
        extra = {}
        # A few images, outside the metrics; every process samples them (a sharded EMA needs all ranks).
        validation = self.validation.sample(net, diffusion, self.guidance, self.decode) if self.validation else None
        if acc.is_main_process and samples_dir is not None:
            save_image_grid(grid_images, Path(samples_dir) / f"step_{step:07d}.png",
                            nrow=min(self.dataset.num_classes, grid_n),
                            upscale=max(1, 64 // grid_images.shape[1]))
            if validation is not None:
                extra.update(self.validation.save(*validation, step, Path(samples_dir)))   # grid (+ videos)
        return {"type": "eval", "step": step, **scores, "num_samples": cfg.num_samples,
                "features": self.extractor.name, **extra, "eval_sec": time.time() - start}

    def _gather_grid(self, grid: dict[int, torch.Tensor], n: int, img_shape) -> torch.Tensor:
        """All grid images on every process, in seed order (seed i lives on rank i mod P)."""
        per_rank = -(-n // self.accelerator.num_processes)
        local = torch.zeros(per_rank, *img_shape, dtype=torch.uint8)
        index = torch.full((per_rank,), -1, dtype=torch.int64)
        for j, s in enumerate(sorted(grid)):
            local[j], index[j] = grid[s], s
        images, seeds = all_gather_rows([local, index])
        by_seed = {int(s): img for s, img in zip(seeds, images) if s >= 0}
        return torch.stack([by_seed[s] for s in range(n)])
