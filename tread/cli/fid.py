"""fid.py: build references (mode=ref), score images (mode=calc), benchmark checkpoints (mode=bench)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from omegaconf import DictConfig
from tqdm.auto import tqdm

from tread.cli.errors import user_errors
from tread.data import LatentDataset, model_shape, read_meta
from tread.encoders.errors import EncoderError
from tread.evaluation.checkpoint_fid import (BenchError, append_row, bench_settings, benchmark_checkpoint,
                                       expand_checkpoints, min_samples, read_rows, settings_key)
from tread.evaluation.evaluator import decode_options
from tread.evaluation.extractors import feature_extractor
from tread.evaluation.images import check_image_folder, image_files, iter_image_folder, npz_images_shape
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import build_reference, load_reference_full, read_reference_file
from tread.sampling import Guidance, parse_seeds
from tread.schema import check_fid
from tread.schema.saved import check_checkpoint_config
from tread.utils.checkpoints import load_model_file
from tread.utils.io import atomic_write_json
from tread.utils.readers import image_size, iter_npz_batches, read_npz


def main(cfg: DictConfig) -> None:
    with user_errors(ValueError):  # bad references and images are ValueErrors of the metric code
        run(cfg)


def run(cfg: DictConfig) -> Any:
    """Everything fid.py does, callable without Hydra (cfg: the keys of configs/fid.yaml)."""
    validate(cfg)
    state = PartialState(cpu=cfg.device == "cpu") if cfg.mode == "bench" else None   # seeds shard over processes
    try:
        extractor = feature_extractor(cfg.features, inception_weights=cfg.inception_weights,
                                      cache_dir=cfg.cache_dir, device=state.device if state else cfg.device,
                                      resolution=image_side(cfg))
    except EncoderError as err:  # e.g. Inception weights missing with no network: says how to provide them
        raise BenchError(str(err)) from None
    return {"ref": run_ref, "calc": run_calc, "bench": run_bench}[cfg.mode](cfg, extractor, state)


def validate(cfg: DictConfig) -> None:
    """Every key (the schema), then the files and amounts this mode needs, before any network is loaded."""
    check_fid(cfg)
    if cfg.inception_weights is not None and cfg.features == "inception":
        existing(cfg, "inception_weights")
    for key in {"ref": ("source",), "calc": ("ref", "images"), "bench": ("ref",)}[cfg.mode]:
        existing(cfg, key)
    for key in {"ref": ("out",), "calc": ("out_json",), "bench": ()}[cfg.mode]:
        if cfg[key] is not None and Path(str(cfg[key])).expanduser().exists():
            raise FileExistsError(f"{key}={cfg[key]} already exists; refusing to overwrite it. Delete it or choose "
                                  f"another path.")
    check_inputs(cfg)
    if cfg.mode != "bench":
        return
    for ckpt in expand_checkpoints(cfg.checkpoints):
        check_checkpoint_config(ckpt)            # every checkpoint's config (the launch's schema), before any work
    try:
        seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    except ValueError as err:
        raise BenchError(f"seeds={cfg.seeds!r} is not valid ({err}): use null, 'a-b', '1,5,7' or a list") from None
    if len(set(seeds)) != len(seeds):
        raise BenchError(f"seeds={cfg.seeds!r} repeats seeds: every image must have its own seed")
    need = min_samples(cfg.metrics, cfg.pr_k)
    if len(seeds) < need:
        raise BenchError(f"{len(seeds)} images (num_samples/seeds) are too few for metrics={list(cfg.metrics)}: "
                         f"need at least {need} (ADM reports 50000)")


def check_inputs(cfg: DictConfig) -> None:
    """The formats of the files this mode reads, before any network is loaded: the reference .npz (calc, bench),
    the images (calc: every image's header, or the .npz's arr_0 header) and the source (ref)."""
    if cfg.mode in ("calc", "bench"):
        read_reference_file(Path(str(cfg.ref)).expanduser())
    key = {"ref": "source", "calc": "images", "bench": None}[cfg.mode]
    path = Path(str(cfg[key])).expanduser() if key else None
    if path is None:
        return
    if key == "source" and (path / "meta.json").is_file():
        LatentDataset(str(path))                  # a latent dataset: meta.json and every array file
    elif path.is_dir():
        check_image_folder(path, key)
    elif path.suffix == ".npz":
        npz_images_shape(path, key)
    else:
        raise BenchError(f"{key}={path} is neither an image folder nor an .npz file (arr_0 = uint8 NHWC images)")


def existing(cfg: DictConfig, key: str) -> Path:
    path = Path(str(cfg[key])).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={path} does not exist")
    return path


def metric_kwargs(cfg: DictConfig) -> dict[str, Any]:
    return {"is_split_size": cfg.is_split_size, "pr_k": cfg.pr_k, "kid_subsets": cfg.kid_subsets,
            "kid_subset_size": cfg.kid_subset_size, "seed": cfg.metric_seed}


def print_metrics(title: str, metrics: dict[str, Any]) -> None:
    shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    print(f"{title}: {shown}")


def run_ref(cfg: DictConfig, extractor, state=None) -> dict[str, Any]:
    source, out = Path(cfg.source), Path(cfg.out)
    build_reference(out, extractor, source, max_images=cfg.max_images, store_images=cfg.store_images,
                    batch_size=cfg.batch_size, decode_kwargs=decode_options(cfg))
    num = int(read_npz(out, "reference", keys=("num_images",))["num_images"])
    print(f"Reference ({extractor.name}, {num} images from {source}) written to {out}")
    return {"out": str(out), "num_images": num, "features": extractor.name}


def iter_images(path: Path, batch_size: int) -> tuple[int, Any]:
    """(count, iterator of uint8 NHWC batches) of an image folder or an .npz's arr_0, streamed so that
    50K 256 px samples never sit in memory at once."""
    if path.is_dir():
        return len(image_files(path)), iter_image_folder(path, batch_size)
    if path.suffix == ".npz":
        return int(npz_images_shape(path, "images")[0]), iter_npz_batches(path, "arr_0", batch_size, "images")
    raise BenchError(f"images={path} is neither an image folder nor an .npz file (arr_0 = uint8 NHWC images)")


def run_calc(cfg: DictConfig, extractor, state=None) -> dict[str, Any]:
    metrics = list(cfg.metrics)
    total, batches = iter_images(Path(cfg.images), cfg.batch_size)
    if total < min_samples(metrics, cfg.pr_k):
        raise BenchError(f"images={cfg.images} holds {total} images: too few for metrics={metrics} (need at least "
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
    print_metrics(f"{extractor.name}, {total} images vs {Path(cfg.ref).name}", scores)
    if cfg.out_json:
        atomic_write_json(cfg.out_json, result)
        print(f"Metrics written to {cfg.out_json}")
    return result


def run_bench(cfg: DictConfig, extractor, state) -> list[dict[str, Any]]:
    metrics, guidance = list(cfg.metrics), Guidance.from_settings(cfg)
    seeds = parse_seeds(cfg.seeds, cfg.num_samples)
    reference = load_reference_full(cfg.ref, extractor, cfg.batch_size, need=metrics)
    out_dir = Path(cfg.out_dir)
    done = {settings_key(r) for r in read_rows(out_dir)}
    rows = []
    for ckpt in expand_checkpoints(cfg.checkpoints):
        settings = bench_settings(ckpt, use_ema=cfg.use_ema, seeds=seeds, num_steps=cfg.num_steps,
                                  features=extractor.name, reference=reference.path, metrics=metrics, guidance=guidance,
                                  class_labels=cfg.class_labels)
        if cfg.skip_existing and settings_key(settings) in done:
            if state.is_main_process:
                print(f"{ckpt}: already benchmarked with these settings in {out_dir}; skipped (skip_existing=false "
                      f"to redo)")
            continue
        row = benchmark_checkpoint(
            ckpt, extractor=extractor, reference=reference, metrics=metrics, seeds=seeds, out_dir=out_dir,
            device=state.device, batch_size=cfg.sample_batch_size, num_steps=cfg.num_steps, use_ema=cfg.use_ema,
            decode_kwargs=decode_options(cfg), keep_npz=cfg.keep_npz, metric_kwargs=metric_kwargs(cfg),
            guidance=guidance, class_labels=cfg.class_labels)
        if state.is_main_process:
            append_row(out_dir, row)
            print_metrics(f"{row['label']} ({len(seeds)} images, {extractor.name}, "
                          f"{row['sample_gflops_per_image']:.4g} sampled GFLOPs per image)",
                          {m: row[m] for m in metrics if m in row})
        rows.append(row)
    if state.is_main_process:
        print(f"Table: {out_dir / 'metrics.csv'} ({len(rows)} new row(s))")
    return rows


def image_side(cfg: DictConfig) -> int:
    """Side of the images to score: the toy classifier is trained at that resolution."""
    if cfg.mode == "bench":  # the first checkpoint's data
        meta = load_model_file(expand_checkpoints(cfg.checkpoints)[0])["data_meta"]
        return int(meta.get("image_resolution") or model_shape(meta)[-1])
    source = Path(str(cfg.source if cfg.mode == "ref" else cfg.images))
    if (source / "meta.json").is_file():
        meta = read_meta(source)
        return int(meta.get("image_resolution") or model_shape(meta)[-1])
    if cfg.features != "toy_classifier":
        return 32  # unused: Inception resizes to 299 itself
    if source.is_dir():
        return image_size(image_files(source)[0], "image")[1]
    return int(npz_images_shape(source, "images" if cfg.mode == "calc" else "source")[1])
