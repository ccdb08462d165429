"""sample.py: generate images from a checkpoint into a PNG folder, a grid, an ADM-format .npz and sampling.json
(a video checkpoint: a video file per sample, a grid of their first, middle and last frames, the frames in the .npz);
by seed (classes, or the training data's text), or from prompts (prompts=[...] / prompts_file=PATH) for
text-conditioned checkpoints, encoded by the family's own text encoders (tread/sampling/prompts.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from tread.cli.errors import user_errors
from tread.data import check_decodable, decode_to_uint8, model_shape
from tread.evaluation.evaluator import decode_options
from tread.evaluation.images import write_samples
from tread.evaluation.videos import video_fps, write_video_samples
from tread.sampling import Guidance, generate, load_for_inference, parse_seeds, sampling_cost, text_conditioning
from tread.sampling.prompts import encode_for_model, generate_for_prompts, learned_unconditional, read_prompts_file
from tread.schema import ConfigError, check_sample
from tread.checkpoint.saved_config import check_checkpoint_config
from tread.checkpoint.files import run_dir_of
from tread.utils.device import resolve_device


def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Everything sample.py does, callable without Hydra (cfg: the keys of configs/sample.yaml)."""
    check_sample(cfg)                            # every key, before the checkpoint is read
    check_out_dir(cfg.out_dir)
    prompts = read_prompts_file(cfg.prompts_file) if cfg.prompts_file is not None else cfg.prompts
    guidance = Guidance.from_settings(cfg)
    device = resolve_device(cfg.device)
    check_checkpoint_config(cfg.checkpoint)
    net, diffusion, meta, config = load_for_inference(cfg.checkpoint, cfg.use_ema, device)
    guidance.check(net.model)                    # spans against this model's depth, before sampling
    decode = decode_options(cfg)
    check_decodable(meta, **decode)              # undecodable data (or a missing VAE) fails before sampling
    seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    stats: dict = {}
    start = time.time()
    if prompts is None:
        images, labels, cond_fn = sample_by_seed(cfg, net, diffusion, meta, config, seeds, guidance, stats, decode)
        captions, extra, nrow = None, {}, cfg.grid_nrow or int(meta["num_classes"])
    else:
        images, labels, cond_fn, extra = sample_prompts(cfg, list(prompts), net, diffusion, meta, config, seeds,
                                                        guidance, stats, decode)
        captions, nrow = [extra["prompts"][int(i)] for i in labels], cfg.grid_nrow or len(seeds)
    sample_sec = time.time() - start
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir_of(cfg.checkpoint) / "samples" / \
        f"sample_{time.strftime('%Y%m%d-%H%M%S')}"
    paths = write_outputs(images, labels, out, nrow, captions, meta)
    cost = sampling_cost(net, guidance, stats, len(images), cond_fn, seeds[0])
    info = {"checkpoint": str(cfg.checkpoint), "num_samples": len(images), "use_ema": cfg.use_ema,
            "num_steps": cfg.num_steps or config.diffusion.num_steps, **guidance.describe(), **extra, **cost,
            "sample_sec": round(sample_sec, 3), **paths}
    (out / "sampling.json").write_text(json.dumps(info, indent=2))
    print(f"Wrote {len(images)} samples: {paths}\n"
          f"sampling cost: {cost['forward_passes_per_image']:g} forward passes and "
          f"{cost['sample_gflops_per_image']:.4g} GFLOPs per image ({out / 'sampling.json'})")
    return info


def write_outputs(images: torch.Tensor, labels: torch.Tensor, out: Path, nrow: int, captions: Any,
                  meta: dict) -> dict:
    """Images: a PNG folder, grid.png and samples.npz (write_samples). Videos (uint8 (N, F, H, W, 3), F > 1): a
    video file per sample at the data's frame rate, a grid of each one's first, middle and last frame and the
    frames in samples.npz (write_video_samples)."""
    if images.ndim == 5 and images.shape[1] == 1:          # one-frame clips are images
        images = images[:, 0]
    if images.ndim == 5:
        return write_video_samples(images, labels, out, video_fps(meta), captions=captions)
    return write_samples(images, labels, out, nrow, captions=captions)


def sample_by_seed(cfg: Any, net, diffusion, meta: dict, config: Any, seeds: list[int], guidance: Guidance,
                   stats: dict, decode: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Images by seed: class-balanced labels (or `classes`), text models with the training data's text."""
    classes = check_classes(cfg.classes, int(meta["num_classes"]))
    cond_fn = text_conditioning(net, meta, config)
    images, labels = [], []
    for _, y, x in generate(net, diffusion, seeds, model_shape(meta), int(meta["num_classes"]), net_device(net),
                            batch_size=cfg.batch_size, classes=classes, num_steps=cfg.num_steps, cond_fn=cond_fn,
                            guidance=guidance, stats=stats, class_labels=cfg.class_labels):
        images.append(decode_to_uint8(x, meta, **decode).cpu())
        labels.append(y.cpu())
    return torch.cat(images), torch.cat(labels), cond_fn


def sample_prompts(cfg: Any, prompts: list[str], net, diffusion, meta: dict, config: Any, seeds: list[int],
                   guidance: Guidance, stats: dict, decode: dict) -> tuple[torch.Tensor, torch.Tensor, Any, dict]:
    """Images by prompt and seed (prompt-major: image k is prompt k // len(seeds) with seed seeds[k % len(seeds)]);
    labels are prompt indices. The text encoders: text_encoders, else the checkpoint's model.text_encoders."""
    path = cfg.text_encoders if cfg.text_encoders is not None else config.model.text_encoders
    unconditional = learned_unconditional(*config.caption_dropout, config.model.family)
    embeddings = encode_for_model(net.model, meta, prompts, cfg.negative_prompt, path, key="text_encoders",
                                  device=net_device(net), unconditional=unconditional)
    images, labels = [], []
    for index, batch, x in generate_for_prompts(net, diffusion, embeddings, seeds, model_shape(meta),
                                                int(meta["num_classes"]), net_device(net), batch_size=cfg.batch_size,
                                                num_steps=cfg.num_steps, guidance=guidance, stats=stats):
        images.append(decode_to_uint8(x, meta, **decode).cpu())
        labels.append(torch.full((len(batch),), index, dtype=torch.long))
    extra = {"prompts": prompts, "negative_prompt": cfg.negative_prompt, "text_encoders": str(path),
             "seeds": seeds, "image_order": "prompt-major: image k is prompts[k // len(seeds)] with "
                                            "seeds[k % len(seeds)]; samples.npz arr_1 holds the prompt index"}
    return torch.cat(images), torch.cat(labels), embeddings.cond_fn(0), extra


def net_device(net) -> torch.device:
    return next(net.parameters()).device


SAMPLE_OUTPUTS = ("sampling.json", "samples.npz", "grid.png", "images", "videos")   # what write_outputs + run write


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
