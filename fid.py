"""FID: build reference statistics, or score generated images against them.

    python fid.py mode=ref source=.cache/toy_shapes_r32_n1000_s0 out=ref_toy.npz
    python fid.py mode=calc images=outputs/runs/<run>/samples/<...>/samples.npz ref=ref_toy.npz
    python fid.py mode=ref features=inception inception_weights=/path/weights.pth source=imgs/ out=ref.npz
    python fid.py mode=calc features=inception images=samples.npz ref=VIRTUAL_imagenet256_labeled.npz

Features default to the offline toy classifier (built-in data); use features=inception for
FID numbers comparable to the literature. See configs/fid.yaml for every key.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

MODES = ("ref", "calc")


def _existing(cfg: DictConfig, key: str, what: str) -> Path:
    if cfg.get(key) is None:
        raise ValueError(f"mode={cfg.mode} needs {key}=<{what}>")
    path = Path(str(cfg[key])).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={path} does not exist")
    return path


def validate(cfg: DictConfig) -> None:
    """Cheap checks of modes and paths, before any network is loaded or trained."""
    if OmegaConf.is_missing(cfg, "mode") or cfg.mode not in MODES:
        mode = "???" if OmegaConf.is_missing(cfg, "mode") else cfg.mode
        raise ValueError(f"mode={mode} is not valid: use mode=ref (build reference statistics) "
                         f"or mode=calc (FID against a reference)")
    if cfg.mode == "ref":
        _existing(cfg, "source", "image folder | .npz | dataset dir")
        if cfg.get("out") is None:
            raise ValueError("mode=ref needs out=<reference .npz to write>")
    else:
        _existing(cfg, "images", "image folder | .npz")
        _existing(cfg, "ref", "reference .npz")
    from evaluation.features import FEATURE_NAMES

    if cfg.features not in FEATURE_NAMES:
        raise ValueError(f"features={cfg.features} is not valid: use one of {', '.join(FEATURE_NAMES)}")
    if cfg.inception_weights is not None and cfg.features == "inception":
        _existing(cfg, "inception_weights", "Inception weights file")


def run_ref(cfg: DictConfig, extractor) -> dict[str, Any]:
    from evaluation.images import load_images
    from evaluation.reference import compute_stats, reference_for_dataset, save_reference, subset_indices

    source, out = Path(cfg.source), Path(cfg.out)
    if (source / "meta.json").is_file():  # a latent dataset: decode it, as in-training evaluation does
        from data import LatentDataset

        if cfg.store_images:
            raise ValueError("store_images=true is only supported for image folders / .npz sources")
        dataset = LatentDataset(str(source))
        reference_for_dataset(dataset, extractor, out, max_images=cfg.max_images, batch_size=cfg.batch_size,
                              force=True)
        num = len(subset_indices(len(dataset), cfg.max_images))
    else:
        images = load_images(source)
        images = images[subset_indices(len(images), cfg.max_images)]
        stats = compute_stats(extractor, images, cfg.batch_size)
        save_reference(out, stats, extractor.name, images if cfg.store_images else None)
        num = stats.n
    print(f"Reference statistics ({extractor.name}, {num} images from {source}) written to {out}")
    return {"out": str(out), "num_images": num, "features": extractor.name}


def run_calc(cfg: DictConfig, extractor) -> dict[str, Any]:
    from evaluation.images import atomic_write, load_images
    from evaluation.reference import fid_against_reference

    images = load_images(cfg.images)
    fid = fid_against_reference(extractor, images, cfg.ref, cfg.batch_size)
    metrics = {"fid": fid, "num_images": len(images), "features": extractor.name, "ref": str(cfg.ref),
               "images": str(cfg.images)}
    print(f"FID ({extractor.name}, {len(images)} images vs {Path(cfg.ref).name}): {fid:.4f}")
    if cfg.out_json:
        atomic_write(cfg.out_json, lambda f: f.write(json.dumps(metrics, indent=2).encode()))
        print(f"Metrics written to {cfg.out_json}")
    return metrics


def _image_side(cfg: DictConfig) -> int:
    """Side of the images to score: the toy classifier is trained at that resolution."""
    from evaluation.images import load_images

    source = Path(str(cfg.source if cfg.mode == "ref" else cfg.images))
    if (source / "meta.json").is_file():
        from data import read_meta

        return int(read_meta(source)["shape"][-1])
    return int(load_images(source).shape[1]) if cfg.features == "toy_classifier" else 32


def run(cfg: DictConfig) -> dict[str, Any]:
    """Everything fid.py does, callable without Hydra (cfg: the keys of configs/fid.yaml)."""
    validate(cfg)
    from evaluation.features import build_feature_extractor

    extractor = build_feature_extractor(cfg.features, inception_weights=cfg.inception_weights,
                                        cache_dir=cfg.cache_dir, device=cfg.device, resolution=_image_side(cfg))
    return run_ref(cfg, extractor) if cfg.mode == "ref" else run_calc(cfg, extractor)


@hydra.main(version_base="1.3", config_path="configs", config_name="fid")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
