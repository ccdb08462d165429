"""fid.py: build references (mode=ref), score images (mode=calc), benchmark checkpoints (mode=bench).
FDD (tread/evaluation/fdd.py) has its own DINOv2 network and reference: mode=ref fdd_out=... builds it from the
same images, mode=calc metrics=[...,fdd] fdd_ref=... scores it."""
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
from tread.encoders.features import build_dino_features
from tread.encoders.videomae import build_video_features
from tread.evaluation.checkpoint_fid import (BenchError, append_row, bench_settings, benchmark_checkpoint,
                                       expand_checkpoints, min_samples, read_rows, settings_key)
from tread.evaluation.evaluator import decode_options
from tread.evaluation.fdd import FDD, load_fdd_reference, without_fdd
from tread.evaluation.fvd import FVD, build_fvd_reference, load_fvd_reference, score_fvd, video_source
from tread.evaluation.extractors import feature_extractor
from tread.evaluation.images import check_image_folder, image_files, iter_image_folder, npz_images_shape
from tread.schema.metric_names import METRICS, TOY_METRICS, without_toy
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import build_reference, load_reference_full, read_reference_file
from tread.sampling import Guidance, parse_seeds
from tread.schema import check_fid
from tread.checkpoint.saved_config import check_checkpoint_config
from tread.checkpoint.files import load_model_file
from tread.utils.device import resolve_device
from tread.utils.io import atomic_write_json
from tread.utils.readers import image_size, iter_npz_batches, read_npz


def main(cfg: DictConfig) -> None:
    with user_errors(ValueError):  # bad references and images are ValueErrors of the metric code
        run(cfg)


def run(cfg: DictConfig) -> Any:
    """Everything fid.py does, callable without Hydra (cfg: the keys of configs/fid.yaml)."""
    validate(cfg)
    if is_fvd(cfg):
        return run_fvd(cfg)
    state = PartialState(cpu=cfg.device == "cpu") if cfg.mode == "bench" else None   # seeds shard over processes
    device = state.device if state else cfg.device
    try:
        extractor = feature_extractor(cfg.features, inception_weights=cfg.inception_weights,
                                      cache_dir=cfg.cache_dir, device=device,
                                      resolution=image_side(cfg)) if needs_main(cfg) else None
        dino = build_dino_features(cfg.dinov2_weights, "dinov2_weights", device) if needs_fdd(cfg) else None
    except EncoderError as err:  # e.g. Inception weights missing with no network: says how to provide them
        raise BenchError(str(err)) from None
    if cfg.mode == "bench":
        return run_bench(cfg, extractor, state)
    return {"ref": run_ref, "calc": run_calc}[cfg.mode](cfg, extractor, dino)


def needs_main(cfg: DictConfig) -> bool:
    """Whether this mode uses the main feature network (not for FDD alone: out=null or metrics=[fdd])."""
    return {"ref": cfg.out is not None, "calc": bool(without_fdd(cfg.metrics)), "bench": True}[cfg.mode]


def needs_fdd(cfg: DictConfig) -> bool:
    """Whether this mode uses FDD's DINOv2 network (mode=ref fdd_out=..., mode=calc with fdd in metrics)."""
    return (cfg.mode == "ref" and cfg.fdd_out is not None) or (cfg.mode == "calc" and FDD in cfg.metrics)


def is_fvd(cfg: DictConfig) -> bool:
    """FVD runs alone (the schema says so): mode=ref fvd_out=..., mode=calc metrics=[fvd]."""
    return cfg.fvd_out is not None or FVD in cfg.metrics


def run_fvd(cfg: DictConfig) -> dict[str, Any]:
    """An FVD reference of the clips at `source` (ref), or the FVD of the clips at `images` against `fvd_ref`."""
    try:
        net = build_video_features(cfg.videomae_weights, "videomae_weights", resolve_device(cfg.device))
    except EncoderError as err:
        raise BenchError(str(err)) from None
    if cfg.mode == "ref":
        stats = build_fvd_reference(cfg.fvd_out, net, cfg.source, cfg.batch_size)
        print(f"FVD reference ({net.name}, {stats.n} clips from {cfg.source}) written to {cfg.fvd_out}")
        return {"fvd_out": str(cfg.fvd_out), "num_clips": stats.n, "fvd_features": net.name}
    score = score_fvd(net, cfg.images, load_fvd_reference(cfg.fvd_ref, net), cfg.batch_size)
    result = {FVD: score, "fvd_features": net.name, "fvd_ref": str(cfg.fvd_ref), "images": str(cfg.images)}
    print_metrics(f"{net.name}, clips of {cfg.images} vs {Path(str(cfg.fvd_ref)).name}", {FVD: score})
    if cfg.out_json:
        atomic_write_json(cfg.out_json, result)
        print(f"Metrics written to {cfg.out_json}")
    return result


def validate(cfg: DictConfig) -> None:
    """Every key (the schema), then the files and amounts this mode needs, before any network is loaded."""
    check_fid(cfg)
    if is_fvd(cfg):
        validate_fvd(cfg)
        return
    toy = [m for m in cfg.metrics if m in TOY_METRICS]
    if toy:   # in-training evaluation only: they need the samples' labels and the dataset's images
        raise BenchError(f"metrics={list(cfg.metrics)}: {toy} are computed by in-training evaluation only "
                         f"(eval.metrics on data=toy); allowed here: {list(without_toy(METRICS))}")
    if cfg.inception_weights is not None and cfg.features == "inception":
        existing(cfg, "inception_weights")
    for key in {"ref": ("source",), "calc": ("ref", "images", "fdd_ref"), "bench": ("ref",)}[cfg.mode]:
        if cfg[key] is not None:
            existing(cfg, key)
    for key in {"ref": ("out", "fdd_out"), "calc": ("out_json",), "bench": ()}[cfg.mode]:
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


def validate_fvd(cfg: DictConfig) -> None:
    """FVD's files: the source clips or the scored clips and the reference (their headers), and no output that
    exists already."""
    if cfg.mode == "ref":
        existing(cfg, "source")
        if Path(str(cfg.fvd_out)).expanduser().exists():
            raise FileExistsError(f"fvd_out={cfg.fvd_out} already exists; refusing to overwrite it. Delete it or "
                                  f"choose another path.")
        video_source(existing(cfg, "source"), "source")
        return
    video_source(existing(cfg, "images"), "images")
    load_fvd_reference(existing(cfg, "fvd_ref"))
    if cfg.out_json is not None and Path(str(cfg.out_json)).expanduser().exists():
        raise FileExistsError(f"out_json={cfg.out_json} already exists; refusing to overwrite it. Delete it or "
                              f"choose another path.")


def check_inputs(cfg: DictConfig) -> None:
    """The formats of the files this mode reads, before any network is loaded: the reference .npz (calc, bench),
    the images (calc: every image's header, or the .npz's arr_0 header) and the source (ref)."""
    for key in {"ref": (), "calc": ("ref", "fdd_ref"), "bench": ("ref",)}[cfg.mode]:
        if cfg[key] is not None:
            read_reference_file(Path(str(cfg[key])).expanduser())
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


def run_ref(cfg: DictConfig, extractor, dino=None) -> dict[str, Any]:
    """The reference of `source` for the main features (out) and/or FDD's DINOv2 (fdd_out)."""
    result = {}
    for out, net, what in ((cfg.out, extractor, ""), (cfg.fdd_out, dino, "fdd_")):
        if out is None:
            continue
        build_reference(out, net, Path(cfg.source), max_images=cfg.max_images, store_images=cfg.store_images,
                        batch_size=cfg.batch_size, decode_kwargs=decode_options(cfg))
        num = int(read_npz(out, "reference", keys=("num_images",))["num_images"])
        print(f"{'FDD r' if what else 'R'}eference ({net.name}, {num} images from {cfg.source}) written to {out}")
        result.update({f"{what}out": str(out), "num_images": num, f"{what}features": net.name})
    return result


def iter_images(path: Path, batch_size: int) -> tuple[int, Any]:
    """(count, iterator of uint8 NHWC batches) of an image folder or an .npz's arr_0, streamed so that
    50K 256 px samples never sit in memory at once."""
    if path.is_dir():
        return len(image_files(path)), iter_image_folder(path, batch_size)
    if path.suffix == ".npz":
        return int(npz_images_shape(path, "images")[0]), iter_npz_batches(path, "arr_0", batch_size, "images")
    raise BenchError(f"images={path} is neither an image folder nor an .npz file (arr_0 = uint8 NHWC images)")


def run_calc(cfg: DictConfig, extractor, dino=None) -> dict[str, Any]:
    """The metrics of `images`: the main ones against `ref`, fdd (DINOv2) against `fdd_ref`; one pass over them."""
    metrics, main = list(cfg.metrics), list(without_fdd(cfg.metrics))
    total, batches = iter_images(Path(cfg.images), cfg.batch_size)
    need = min_samples(main + (["fid"] if dino is not None else []), cfg.pr_k)
    if total < need:
        raise BenchError(f"images={cfg.images} holds {total} images: too few for metrics={metrics} (need at least "
                         f"{need})")
    reference = load_reference_full(cfg.ref, extractor, cfg.batch_size, need=main) if main else None
    fdd_reference = load_fdd_reference(cfg.fdd_ref, dino) if dino is not None else None
    accs = {name: FeatureAccumulator(net, m) for name, net, m in (("main", extractor, main), (FDD, dino, ["fid"]))
            if net is not None and m}
    done = 0
    with tqdm(total=total, desc="features", unit="img", dynamic_ncols=True, leave=False) as bar:
        for batch in batches:
            for acc in accs.values():
                acc.add(torch.from_numpy(batch).permute(0, 3, 1, 2), list(range(done, done + len(batch))))
            done += len(batch)
            bar.update(len(batch))
    scores = compute_metrics(accs["main"], reference, main, **metric_kwargs(cfg)) if main else {}
    if dino is not None:
        scores[FDD] = compute_metrics(accs[FDD], fdd_reference, ("fid",))["fid"]
    names = [n for n in (extractor.name if main else None, dino.name if dino else None) if n]
    result = {**scores, "num_images": total, "features": extractor.name if main else None, "ref": cfg.ref,
              **({"fdd_features": dino.name, "fdd_ref": str(cfg.fdd_ref)} if dino else {}), "images": str(cfg.images)}
    print_metrics(f"{' + '.join(names)}, {total} images vs {Path(str(cfg.ref or cfg.fdd_ref)).name}", scores)
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
