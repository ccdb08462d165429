"""Throughput of what surrounds the training step: the sampler, the FID feature extractor and the data loader."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from tread.data import LatentDataset, LatentLoader, ensure_toy_dataset
from tread.diffusion import EDM, RectifiedFlow
from tread.evaluation.extractors import feature_extractor
from tread.perf.benchmark import StepBench, timed

SAMPLERS = {EDM: "edm_heun", RectifiedFlow: "rf_euler"}


def sampling_throughput(bench: StepBench, num_steps: int, model_name: str) -> dict:
    """Images/s of the config's sampler on the bench's EMA net (dense, the eager copy evaluation samples with), one
    batch of the bench's batch size, under the run's autocast."""
    diffusion, net, device = bench.parts.diffusion, bench.parts.ema, bench.device
    x = bench.batch[0]
    gen = torch.Generator(device).manual_seed(0)
    noise = torch.randn(x.shape, generator=gen, device=device)
    labels = torch.randint(0, bench.model.num_classes, (x.shape[0],), generator=gen, device=device)

    def run(n: int) -> None:
        with bench.accelerator.autocast():
            diffusion.sample(net, noise, labels, num_steps=n)

    run(2)  # warm-up
    sec = timed(lambda: run(num_steps), device)
    nfe = diffusion.sampling_nfe(num_steps)
    return {"model": model_name, "sampler": SAMPLERS[type(diffusion)], "num_steps": num_steps, "nfe": nfe,
            "batch": int(x.shape[0]), "routes": [], "cfg_scale": 1.0, "seconds": sec,
            "images_per_s": x.shape[0] / sec, "ms_per_nfe": 1e3 * sec / nfe}


def eval_feature_throughput(features: str, image_size: int, batch: int, repeats: int, device: torch.device,
                            cache_dir: str, inception_weights: Optional[str] = None) -> dict:
    """Images/s of the FID feature extractor's forward (forward_all: pool, spatial and logits when it has one)
    on random uint8 images; the median of `repeats` batches after one warm-up."""
    ext = feature_extractor(features, inception_weights=inception_weights, cache_dir=cache_dir, device=device,
                            resolution=image_size)
    fwd: Callable = getattr(ext, "forward_all", ext)
    gen = torch.Generator("cpu").manual_seed(0)
    imgs = torch.randint(0, 256, (batch, 3, image_size, image_size), generator=gen, dtype=torch.uint8).to(device)
    with torch.no_grad():
        fwd(imgs)  # warm-up
        times = [timed(lambda: fwd(imgs), device) for _ in range(repeats)]
    med = statistics.median(times)
    return {"features": features, "image_size": image_size, "batch": batch, "repeats": repeats,
            "median_batch_s": med, "images_per_s": batch / med, "dim": int(getattr(ext, "dim", 0))}


def loader_throughput(data_path: Optional[str], cache_dir: str, batch: int, workers: int, batches: int,
                      device: torch.device, step_ms: float) -> dict:
    """The training data loader alone (LatentLoader with workers, pinned memory, prefetch) on `data_path` or the toy
    data: the wait per step it cannot hide behind a step of `step_ms`."""
    path = data_path or ensure_toy_dataset(Path(cache_dir) / "toy_shapes_r16_n1000_s0", num_per_class=1000,
                                           resolution=16, seed=0)
    loader = LatentLoader(LatentDataset(path), batch, seed=0, num_workers=workers,
                          pin_memory=device.type == "cuda")
    for _ in range(3):
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)[0].to(device, non_blocking=True)
    ms = 1e3 * (time.perf_counter() - start) / batches
    wait = ms if workers == 0 else max(0.0, ms - step_ms)
    return {"data": str(path), "workers": workers, "batch": batch, "ms_per_batch": ms,
            "images_per_s": 1e3 * batch / ms, "step_ms": step_ms, "wait_ms_per_step": wait}
