"""ADM-style evaluation: build references, score images, benchmark checkpoints.

    # reference statistics (mu/sigma, mu_s/sigma_s and 10K reference images arr_0) from images or a dataset
    python fid.py mode=ref source=<image folder | samples .npz | latent dataset dir> out=ref.npz
    # metrics of generated images against a reference (ours, or ADM's VIRTUAL_imagenet256_labeled.npz as is)
    python fid.py mode=calc images=<folder | .npz> ref=ref.npz out_json=metrics.json
    # checkpoint benchmarking: sample, decode, score, one table row per checkpoint
    accelerate launch fid.py mode=bench 'checkpoints=outputs/runs/<run>/checkpoints/step_*' ref=ref.npz \
        num_samples=50000 cfg_scale=1.5 features=inception

Metrics: fid, sfid, is, precision, recall, kid (metrics=[...]). Features default to the offline toy
classifier (built-in data); features=inception gives numbers comparable with the literature.
See configs/fid.yaml for every key.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from evaluation.bench import BenchError as FidError  # a fid.py input that cannot work: `error: ...`, exit 1

MODES = ("ref", "calc", "bench")


def _existing(cfg: DictConfig, key: str, what: str) -> Path:
    if cfg.get(key) is None:
        raise FidError(f"mode={cfg.mode} needs {key}=<{what}>")
    path = Path(str(cfg[key])).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={path} does not exist")
    return path


def _positive_int(cfg: DictConfig, key: str, allow_none: bool = False) -> None:
    value = cfg.get(key)
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FidError(f"{key}={value!r} must be a positive integer{' or null' if allow_none else ''}")


def metric_list(cfg: DictConfig) -> list[str]:
    from training.evaluate import metric_names

    try:
        return list(metric_names(cfg))
    except ValueError as err:
        raise FidError(str(err)) from None


def validate(cfg: DictConfig) -> None:
    """Cheap checks of every key this mode uses, before any network is loaded or any image is made."""
    if OmegaConf.is_missing(cfg, "mode") or cfg.mode not in MODES:
        mode = "???" if OmegaConf.is_missing(cfg, "mode") else cfg.mode
        raise FidError(f"mode={mode} is not valid: use mode=ref (build a reference), mode=calc (metrics of images "
                       f"against a reference) or mode=bench (sample and score checkpoints)")
    from evaluation.features import FEATURE_NAMES

    if cfg.features not in FEATURE_NAMES:
        raise FidError(f"features={cfg.features} is not valid: use one of {', '.join(FEATURE_NAMES)}")
    if cfg.inception_weights is not None and cfg.features == "inception":
        _existing(cfg, "inception_weights", "Inception weights file")
    decode_kwargs(cfg)
    _positive_int(cfg, "batch_size")
    if cfg.mode == "ref":
        _existing(cfg, "source", "image folder | .npz | latent dataset dir")
        if cfg.get("out") is None:
            raise FidError("mode=ref needs out=<reference .npz to write>")
        _positive_int(cfg, "max_images", allow_none=True)
        if not isinstance(cfg.store_images, int) or cfg.store_images < 0:
            raise FidError(f"store_images={cfg.store_images!r} must be an integer >= 0 (reference images kept as "
                           f"arr_0 for precision/recall; ADM keeps 10000)")
        return
    metric_list(cfg)
    for key in ("is_split_size", "pr_k", "kid_subsets", "kid_subset_size"):
        _positive_int(cfg, key)
    _existing(cfg, "ref", "reference .npz")
    if cfg.mode == "calc":
        _existing(cfg, "images", "image folder | .npz")
        return
    from evaluation.bench import expand_checkpoints, min_samples

    expand_checkpoints(cfg.checkpoints)
    for key in ("num_samples", "sample_batch_size"):
        _positive_int(cfg, key)
    _positive_int(cfg, "num_steps", allow_none=True)
    from training.inference import parse_seeds

    try:
        seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    except ValueError as err:
        raise FidError(f"seeds={cfg.seeds!r} is not valid ({err}): use null, 'a-b', '1,5,7' or a list") from None
    if len(set(seeds)) != len(seeds):
        raise FidError(f"seeds={cfg.seeds!r} repeats seeds: every image must have its own seed")
    need = min_samples(metric_list(cfg), cfg.pr_k)
    if len(seeds) < need:
        raise FidError(f"{len(seeds)} images (num_samples/seeds) are too few for metrics={metric_list(cfg)}: "
                       f"need at least {need} (ADM reports 50000)")
    from diffusion.guidance import Guidance

    Guidance.from_config(cfg)  # cfg_scale, inference routing, TREAD guidance (spans are checked per checkpoint)


def decode_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """How latents become pixels: the dataset's VAE (overridden by vae=PATH), in vae_dtype, in batches."""
    from training.evaluate import decode_options

    try:
        return decode_options(cfg)
    except ValueError as err:
        raise FidError(str(err)) from None


def metric_kwargs(cfg: DictConfig) -> dict[str, Any]:
    return {"is_split_size": cfg.is_split_size, "pr_k": cfg.pr_k, "kid_subsets": cfg.kid_subsets,
            "kid_subset_size": cfg.kid_subset_size, "seed": cfg.metric_seed}


def _print_metrics(title: str, metrics: dict[str, Any]) -> None:
    shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    print(f"{title}: {shown}")


def run_ref(cfg: DictConfig, extractor) -> dict[str, Any]:
    from evaluation.reference import build_reference

    source, out = Path(cfg.source), Path(cfg.out)
    build_reference(out, extractor, source, max_images=cfg.max_images, store_images=cfg.store_images,
                    batch_size=cfg.batch_size, decode_kwargs=decode_kwargs(cfg))
    import numpy as np

    with np.load(out) as data:
        num = int(data["num_images"])
    print(f"Reference ({extractor.name}, {num} images from {source}) written to {out}")
    return {"out": str(out), "num_images": num, "features": extractor.name}


def iter_images(path: Path, batch_size: int) -> tuple[int, Any]:
    """(count, iterator of uint8 NHWC batches) of an image folder or an .npz's arr_0, streamed so that
    50K 256 px samples never sit in memory at once."""
    from evaluation.images import image_files, iter_image_folder, iter_npz_batches, npz_array_info

    if path.is_dir():
        return len(image_files(path)), iter_image_folder(path, batch_size)
    if path.suffix == ".npz":
        shape, dtype = npz_array_info(path, "arr_0")
        if str(dtype) != "uint8" or len(shape) != 4 or shape[-1] != 3:
            raise FidError(f"images={path}: arr_0 must be uint8 (N, H, W, 3) images, got {dtype} {tuple(shape)}")
        return int(shape[0]), iter_npz_batches(path, "arr_0", batch_size)
    raise FidError(f"images={path} is neither an image folder nor an .npz file (arr_0 = uint8 NHWC images)")


def run_calc(cfg: DictConfig, extractor) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from evaluation.bench import min_samples
    from evaluation.images import atomic_write
    from evaluation.metrics import FeatureAccumulator, compute_metrics
    from evaluation.reference import load_reference_full

    metrics = metric_list(cfg)
    total, batches = iter_images(Path(cfg.images), cfg.batch_size)
    if total < min_samples(metrics, cfg.pr_k):
        raise FidError(f"images={cfg.images} holds {total} images: too few for metrics={metrics} (need at least "
                       f"{min_samples(metrics, cfg.pr_k)})")
    reference = load_reference_full(cfg.ref, extractor, cfg.batch_size, need=metrics)
    acc, done = FeatureAccumulator(extractor, metrics), 0
    with tqdm(total=total, desc=f"features ({extractor.name})", unit="img", dynamic_ncols=True, leave=False) as bar:
        for batch in batches:
            acc.add(torch.from_numpy(batch).permute(0, 3, 1, 2), list(range(done, done + len(batch))))
            done += len(batch)
            bar.update(len(batch))
    scores = compute_metrics(acc, reference, metrics, **metric_kwargs(cfg))
    result = {**scores, "num_images": total, "features": extractor.name, "ref": str(cfg.ref),
              "images": str(cfg.images)}
    _print_metrics(f"{extractor.name}, {total} images vs {Path(cfg.ref).name}", scores)
    if cfg.out_json:
        atomic_write(cfg.out_json, lambda f: f.write(json.dumps(result, indent=2).encode()))
        print(f"Metrics written to {cfg.out_json}")
    return result


def _checkpoint_image_side(ckpts: list[Path]) -> int:
    """Image side the toy classifier must be trained at: the first checkpoint's identity-decoded data."""
    import torch

    from data import model_shape

    meta = torch.load(ckpts[0] / "model.pt", map_location="cpu", weights_only=False, mmap=True)["data_meta"]
    return int(meta.get("image_resolution") or model_shape(meta)[-1])


def run_bench(cfg: DictConfig, extractor, state) -> list[dict[str, Any]]:
    from evaluation.bench import (append_row, bench_settings, benchmark_checkpoint, expand_checkpoints, read_rows,
                                  settings_key)
    from evaluation.reference import load_reference_full
    from training.inference import parse_seeds

    from diffusion.guidance import Guidance

    metrics = metric_list(cfg)
    guidance = Guidance.from_config(cfg)
    ckpts = expand_checkpoints(cfg.checkpoints)
    seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    reference = load_reference_full(cfg.ref, extractor, cfg.batch_size, need=metrics)
    out_dir = Path(cfg.out_dir)
    done = {settings_key(r) for r in read_rows(out_dir)}
    rows = []
    for ckpt in ckpts:
        settings = bench_settings(ckpt, use_ema=cfg.use_ema, seeds=seeds, cfg_scale=cfg.cfg_scale,
                                  num_steps=cfg.num_steps, features=extractor.name, reference=reference.path,
                                  metrics=metrics, guidance=guidance)
        if cfg.skip_existing and settings_key(settings) in done:
            if state.is_main_process:
                print(f"{ckpt}: already benchmarked with these settings in {out_dir}; skipped (skip_existing=false "
                      f"to redo)")
            continue
        row = benchmark_checkpoint(
            ckpt, extractor=extractor, reference=reference, metrics=metrics, seeds=seeds, out_dir=out_dir,
            device=state.device, batch_size=cfg.sample_batch_size, cfg_scale=cfg.cfg_scale,
            num_steps=cfg.num_steps, use_ema=cfg.use_ema, decode_kwargs=decode_kwargs(cfg), keep_npz=cfg.keep_npz,
            metric_kwargs=metric_kwargs(cfg), guidance=guidance)
        if state.is_main_process:
            append_row(out_dir, row)
            _print_metrics(f"{row['label']} ({len(seeds)} images, {extractor.name}, "
                           f"{row['sample_gflops_per_image']:.4g} sampled GFLOPs per image)",
                           {m: row[m] for m in metrics if m in row})
        rows.append(row)
    if state.is_main_process:
        print(f"Table: {out_dir / 'metrics.csv'} ({len(rows)} new row(s))")
    return rows


def _image_side(cfg: DictConfig) -> int:
    """Side of the images to score: the toy classifier is trained at that resolution."""
    if cfg.mode == "bench":
        from evaluation.bench import expand_checkpoints

        return _checkpoint_image_side(expand_checkpoints(cfg.checkpoints))
    source = Path(str(cfg.source if cfg.mode == "ref" else cfg.images))
    if (source / "meta.json").is_file():
        from data import model_shape, read_meta

        meta = read_meta(source)
        return int(meta.get("image_resolution") or model_shape(meta)[-1])
    if cfg.features != "toy_classifier":
        return 32  # unused: Inception resizes to 299 itself
    if source.is_dir():
        from evaluation.images import image_files
        from PIL import Image

        with Image.open(image_files(source)[0]) as im:
            return im.size[1]
    from evaluation.images import npz_array_info

    return int(npz_array_info(source, "arr_0")[0][1])


def run(cfg: DictConfig) -> Any:
    """Everything fid.py does, callable without Hydra (cfg: the keys of configs/fid.yaml)."""
    validate(cfg)
    from evaluation.features import build_feature_extractor

    state = None
    device = cfg.device
    if cfg.mode == "bench":  # seeds are sharded over the processes `accelerate launch` starts
        from accelerate import PartialState

        state = PartialState(cpu=cfg.device == "cpu")
        device = state.device
    try:
        extractor = build_feature_extractor(cfg.features, inception_weights=cfg.inception_weights,
                                            cache_dir=cfg.cache_dir, device=device, resolution=_image_side(cfg))
    except RuntimeError as err:  # e.g. Inception weights missing with no network: says how to provide them
        raise FidError(str(err)) from None
    if cfg.mode == "ref":
        return run_ref(cfg, extractor)
    if cfg.mode == "calc":
        return run_calc(cfg, extractor)
    return run_bench(cfg, extractor, state)


@hydra.main(version_base="1.3", config_path="configs", config_name="fid")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as err:  # FidError, LatentDatasetError, bad references: user errors
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
