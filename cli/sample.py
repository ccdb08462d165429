"""sample.py: generate images from a checkpoint into a PNG folder, a grid, an ADM-format .npz and sampling.json."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from cli.errors import user_errors
from data import check_decodable, decode_to_uint8, model_shape
from evaluation.evaluator import decode_options
from evaluation.images import write_samples
from sampling import Guidance, generate, load_for_inference, parse_seeds, sampling_cost, text_conditioning
from schema import ConfigError, check_sample
from utils.checkpoints import run_dir_of
from utils.device import resolve_device


def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Everything sample.py does, callable without Hydra (cfg: the keys of configs/sample.yaml)."""
    check_sample(cfg)                            # every key, before the checkpoint is read
    check_out_dir(cfg.out_dir)
    guidance = Guidance.from_settings(cfg)
    device = resolve_device(cfg.device)
    net, diffusion, meta, config = load_for_inference(cfg.checkpoint, cfg.use_ema, device)
    guidance.check(net.model)                    # spans against this model's depth, before sampling
    decode = decode_options(cfg)
    check_decodable(meta, **decode)              # undecodable data (or a missing VAE) fails before sampling
    seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    classes = check_classes(cfg.classes, int(meta["num_classes"]))
    cond_fn = text_conditioning(net, meta, config)
    images, labels, stats, start = [], [], {}, time.time()
    for _, y, x in generate(net, diffusion, seeds, model_shape(meta), int(meta["num_classes"]), device,
                            batch_size=cfg.batch_size, classes=classes, num_steps=cfg.num_steps, cond_fn=cond_fn,
                            guidance=guidance, stats=stats):
        images.append(decode_to_uint8(x, meta, **decode).cpu())
        labels.append(y.cpu())
    sample_sec = time.time() - start
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir_of(cfg.checkpoint) / "samples" / \
        f"sample_{time.strftime('%Y%m%d-%H%M%S')}"
    paths = write_samples(torch.cat(images), torch.cat(labels), out, cfg.grid_nrow or int(meta["num_classes"]))
    cost = sampling_cost(net, guidance, stats, len(seeds), cond_fn, seeds[0])
    info = {"checkpoint": str(cfg.checkpoint), "num_samples": len(seeds), "use_ema": cfg.use_ema,
            "num_steps": cfg.num_steps or config.diffusion.get("num_steps"), **guidance.describe(), **cost,
            "sample_sec": round(sample_sec, 3), **paths}
    (out / "sampling.json").write_text(json.dumps(info, indent=2))
    print(f"Wrote {len(seeds)} samples: {paths}\n"
          f"sampling cost: {cost['forward_passes_per_image']:g} forward passes and "
          f"{cost['sample_gflops_per_image']:.4g} GFLOPs per image ({out / 'sampling.json'})")
    return info


SAMPLE_OUTPUTS = ("sampling.json", "samples.npz", "grid.png", "images")   # what write_samples + run put in out_dir


def check_out_dir(out_dir: Any) -> None:
    """out_dir: null, or a directory (new, or without an earlier run's samples: nothing written is overwritten)."""
    if out_dir is None:
        return
    path = Path(str(out_dir)).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out_dir='{out_dir}' is a file; allowed: null (<run dir>/samples/sample_<time>) or a "
                          f"directory.")
    found = [name for name in SAMPLE_OUTPUTS if (path / name).exists()]
    if found:
        raise ConfigError(f"out_dir='{out_dir}' already holds samples ({found[0]}); refusing to overwrite them. "
                          f"Choose another out_dir or delete those first.")


def check_classes(classes: Any, num_classes: int) -> Any:
    """The `classes` key against the checkpoint's class count."""
    bad = [c for c in classes or [] if not 0 <= int(c) < num_classes]
    if bad:
        raise ConfigError(f"classes={bad} are out of range: this model has {num_classes} classes "
                          f"(0..{num_classes - 1}).")
    return list(classes) if classes is not None else None
