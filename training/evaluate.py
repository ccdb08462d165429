"""Generation and FID for a model: shared by in-training evaluation and sample.py.

Seeds are sharded across processes and every sample has its own generator, so the
images (and the FID) are the same whatever the batch size or number of processes.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from data import check_decodable, decode_to_uint8
from diffusion import StackedRandomGenerator
from diffusion.guidance import Guidance, per_sample_routing
from evaluation.features import build_feature_extractor
from evaluation.images import save_image_grid
from data.vae import VAE_DTYPES
from evaluation.metrics import METRICS, FeatureAccumulator, check_metrics, compute_metrics
from training import ConfigError
from evaluation.reference import load_reference_full, reference_for_dataset


def class_for_seed(seed: int, num_classes: int) -> int:
    """Class-balanced labels: sample i gets class i mod K (the grid then has one column per class)."""
    return seed % num_classes


@torch.no_grad()
def generate(net, diffusion, seeds: Sequence[int], shape: Sequence[int], num_classes: int, device: torch.device,
             *, batch_size: int, classes: Optional[Sequence[int]] = None, cfg_scale: float = 1.0,
             num_steps: Optional[int] = None, cond_fn: Optional[Callable[[list[int]], dict]] = None,
             guidance: Optional[Guidance] = None, stats: Optional[dict] = None
             ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Yield (seeds, labels, latents) batches. `classes` defaults to class_for_seed; `cond_fn(seeds)` gives
    per-sample conditioning (text embeddings) for text-conditioned models. `guidance` (inference routing,
    TREAD guidance, CFG; replaces cfg_scale, which alone means Guidance(cfg_scale=...)) draws each sample's routed tokens from a generator seeded by its
    seed; `stats` counts forward passes per branch (diffusion.guidance.sampling_flops_per_image)."""
    net.eval()
    seeds = list(seeds)
    guidance = guidance if guidance is not None else Guidance(cfg_scale=cfg_scale)
    for i in range(0, len(seeds), batch_size):
        batch = seeds[i:i + batch_size]
        gen = StackedRandomGenerator(device, batch)
        if classes is None:
            labels = [class_for_seed(s, num_classes) for s in batch]
        else:
            labels = [classes[(i + j) % len(classes)] for j in range(len(batch))]
        labels = torch.tensor(labels, device=device, dtype=torch.long)
        noise = gen.randn([len(batch), *shape], device=device)
        extra = {}
        if cond_fn is not None:
            extra["cond"] = {k: v.to(device) for k, v in cond_fn(batch).items()}
        with per_sample_routing(net, batch, device, guidance):
            x = diffusion.sample(net, noise, labels, null_label=num_classes, num_steps=num_steps,
                                 randn_like=gen.randn_like, guidance=guidance, stats=stats, **extra)
        yield batch, labels, x


def text_conditioning_for_seeds(dataset, net) -> Optional[Callable[[list[int]], dict]]:
    """Text-conditioned data and model: sample seed i with the text embeddings of dataset item i mod N (so
    samples follow the data's caption distribution); None for class-conditional data or models."""
    if not (getattr(dataset, "conditioning", None) or {}).get("text"):
        return None
    if not hasattr(getattr(net, "model", net), "conditioning"):  # DiT: class labels only
        return None

    def cond(seeds: list[int]) -> dict:
        batch = dataset.__getitems__([s % len(dataset) for s in seeds])
        return {k: v for k, v in batch[2].items() if k in ("text", "text_mask", "pooled")}
    return cond


def decode_options(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """decode_to_uint8 keyword options from a config node's vae / vae_dtype / decode_batch_size keys (eval.*,
    sample.py, fid.py), checked: a bad value raises ConfigError naming `prefix + key`."""
    dtype, batch = cfg.get("vae_dtype", "float32"), cfg.get("decode_batch_size", 32)
    if dtype not in VAE_DTYPES:
        raise ConfigError(f"{prefix}vae_dtype={dtype!r} is not allowed; use one of {list(VAE_DTYPES)}.")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError(f"{prefix}decode_batch_size={batch!r} must be a positive integer (latents per VAE call).")
    return {"vae": cfg.get("vae"), "vae_dtype": dtype, "batch_size": batch}


def metric_names(cfg: Any, key: str = "metrics") -> tuple[str, ...]:
    """The config's metric list (default FID), checked against evaluation.metrics.METRICS."""
    try:
        return check_metrics(cfg.get("metrics") or ["fid"])
    except ValueError:
        raise ConfigError(f"{key}={cfg.get('metrics')} is not valid: choose a non-empty list from "
                          f"{list(METRICS)}.") from None


class Evaluator:
    """ADM-style metrics (eval.metrics; FID by default) of generated samples against the dataset's
    reference, plus a sample grid. The VAE (if any) and the reference are loaded once, here."""

    def __init__(self, eval_cfg: Any, dataset, cache_dir: str | Path, accelerator):
        self.cfg = eval_cfg
        self.dataset = dataset
        self.accelerator = accelerator
        self.device = accelerator.device
        self.decode = decode_options(eval_cfg, "eval.")
        self.metrics = metric_names(eval_cfg, "eval.metrics")
        # Loads the VAE now (once per process): missing weights fail before training.
        check_decodable(dataset.meta, **self.decode, device=self.device)
        zeros = torch.zeros(1, *dataset.shape, device=self.device)
        self.image_shape = tuple(decode_to_uint8(zeros, dataset.meta, **self.decode).shape[1:])  # (H, W, 3)
        self.extractor = build_feature_extractor(
            eval_cfg.features, inception_weights=eval_cfg.get("inception_weights"),
            cache_dir=str(cache_dir), device=str(self.device),
            resolution=self.image_shape[0])
        ref = eval_cfg.get("reference")
        if ref:
            if not Path(ref).is_file():
                raise FileNotFoundError(f"eval.reference={ref!r} does not exist; build one with `python fid.py mode=ref ...`.")
            self.ref_path = Path(ref)
        else:
            name = dataset.root.name
            self.ref_path = Path(cache_dir) / "references" / f"{name}_{self.extractor.name}.npz"
            with accelerator.main_process_first():  # the first process builds and caches it
                reference_for_dataset(dataset, self.extractor, self.ref_path,
                                      max_images=eval_cfg.get("reference_max_images"), decode_kwargs=self.decode)
        self.reference = load_reference_full(self.ref_path, self.extractor, need=self.metrics)

    def __call__(self, net, diffusion, step: int, samples_dir: Optional[Path]) -> dict[str, Any]:
        start = time.time()
        acc, cfg = self.accelerator, self.cfg
        seeds = list(range(cfg.num_samples))[acc.process_index::acc.num_processes]
        shape = list(self.dataset.shape)
        feats = FeatureAccumulator(self.extractor, self.metrics, device=self.device)  # a rank may get no seeds
        grid_n = min(cfg.grid_size, cfg.num_samples)
        grid: dict[int, torch.Tensor] = {}
        for batch, _, x in generate(net, diffusion, seeds, shape, self.dataset.num_classes, self.device,
                                    batch_size=cfg.batch_size, cfg_scale=cfg.cfg_scale, num_steps=cfg.num_steps,
                                    cond_fn=text_conditioning_for_seeds(self.dataset, net)):
            images = decode_to_uint8(x, self.dataset.meta, **self.decode)            # (B, H, W, 3) uint8
            feats.add(images.permute(0, 3, 1, 2), batch)                             # indexed by seed
            grid.update({s: img.cpu() for s, img in zip(batch, images) if s < grid_n})
        feats.gather()
        scores = compute_metrics(feats, self.reference, self.metrics)
        grid_images = self._gather_grid(grid, grid_n, self.image_shape)
        if acc.is_main_process and samples_dir is not None:
            save_image_grid(grid_images, Path(samples_dir) / f"step_{step:07d}.png",
                            nrow=min(self.dataset.num_classes, grid_n),
                            upscale=max(1, 64 // grid_images.shape[1]))
        return {"type": "eval", "step": step, **scores, "num_samples": cfg.num_samples,
                "features": self.extractor.name, "eval_sec": time.time() - start}

    def _gather_grid(self, grid: dict[int, torch.Tensor], n: int, img_shape) -> torch.Tensor:
        """All grid images on every process, in seed order (seed i lives on rank i mod P)."""
        acc = self.accelerator
        per_rank = -(-n // acc.num_processes)
        local = torch.zeros(per_rank, *img_shape, dtype=torch.uint8)
        for j, s in enumerate(sorted(grid)):
            local[j] = grid[s]
        if acc.num_processes > 1 and dist.is_initialized():
            parts = [torch.zeros_like(local) for _ in range(acc.num_processes)]
            dist.all_gather(parts, local.to(acc.device) if dist.get_backend() == "nccl" else local)
            parts = [p.cpu() for p in parts]
        else:
            parts = [local]
        ordered = [parts[s % acc.num_processes][s // acc.num_processes] for s in range(n)]
        return torch.stack(ordered)
