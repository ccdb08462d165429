"""Generate samples from a checkpoint: a PNG folder, a grid, an ADM-format .npz and sampling.json.

    python sample.py checkpoint=outputs/runs/<run> num_samples=100 cfg_scale=1.5
    python sample.py checkpoint=... route_ratio=0.5                 # inference-time routing: fewer FLOPs
    python sample.py checkpoint=... tread_scale=1.5 tread_weak_ratio=0.5 guidance_interval='[0.3,10]'
"""
import json
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    from training.loop import USER_ERRORS

    try:
        run(cfg)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")


def run(cfg: DictConfig) -> dict:
    import torch

    from data import check_decodable, decode_to_uint8, model_shape
    from diffusion.guidance import Guidance
    from training.evaluate import decode_options, generate
    from training import ConfigError
    from training.inference import (load_for_inference, parse_seeds, resolve_device, run_dir_of, sampling_cost,
                                    text_conditioning, write_samples)

    guidance = Guidance.from_config(cfg)         # bad guidance settings fail before the checkpoint is read
    device = resolve_device(cfg.device)
    net, diffusion, meta, config = load_for_inference(cfg.checkpoint, cfg.use_ema, device)
    guidance.check(net.model)                    # spans against this model's depth, before sampling
    num_classes = int(meta["num_classes"])
    decode = decode_options(cfg)
    check_decodable(meta, **decode)  # undecodable data (or a missing VAE) fails before sampling
    seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    classes = list(cfg.classes) if cfg.classes is not None else None
    bad = [c for c in classes or [] if not 0 <= int(c) < num_classes]
    if bad:
        raise ConfigError(f"classes={bad} are out of range: this model has {num_classes} classes (0..{num_classes - 1}).")
    images, labels, stats = [], [], {}
    cond_fn = text_conditioning(net, meta, config)
    start = time.time()
    for _, y, x in generate(net, diffusion, seeds, model_shape(meta), num_classes, device, batch_size=cfg.batch_size,
                            classes=classes, num_steps=cfg.num_steps, cond_fn=cond_fn, guidance=guidance,
                            stats=stats):
        images.append(decode_to_uint8(x, meta, **decode).cpu())
        labels.append(y.cpu())
    sample_sec = time.time() - start
    run_dir = run_dir_of(cfg.checkpoint)
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir / "samples" / f"sample_{time.strftime('%Y%m%d-%H%M%S')}"
    paths = write_samples(torch.cat(images), torch.cat(labels), out, cfg.grid_nrow or num_classes)
    cost = sampling_cost(net, guidance, stats, len(seeds), cond_fn, seeds[0])
    info = {"checkpoint": str(cfg.checkpoint), "num_samples": len(seeds), "use_ema": cfg.use_ema,
            "num_steps": cfg.num_steps or config.diffusion.get("num_steps"), **guidance.describe(), **cost,
            "sample_sec": round(sample_sec, 3), **paths}
    (out / "sampling.json").write_text(json.dumps(info, indent=2))
    print(f"Wrote {len(seeds)} samples: {paths}\n"
          f"sampling cost: {cost['forward_passes_per_image']:g} forward passes and "
          f"{cost['sample_gflops_per_image']:.4g} GFLOPs per image ({out / 'sampling.json'})")
    return info


if __name__ == "__main__":
    main()
