"""Load a checkpoint for inference and write samples: shared by sample.py and fid.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from training import checkpoint as ckpt_io


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_for_inference(checkpoint: str | Path, use_ema: bool = True, device: str | torch.device = "cpu"):
    """-> (net, diffusion, data_meta, config) from a checkpoint dir, model.pt or run dir."""
    path = Path(checkpoint).expanduser()
    if path.is_dir() and not (path / "model.pt").is_file():
        found = ckpt_io.list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"checkpoint={str(checkpoint)!r}: no checkpoints under '{path}'. Give a run directory, "
                                    f"a checkpoints/step_XXXXXXX directory or its model.pt.")
        path = found[-1]
    state = ckpt_io.load_model_file(path)
    config = OmegaConf.create(state["config"])
    torch.manual_seed(int(config.train.seed))  # the training's initialisation: the base of adapter-only checkpoints
    model = instantiate(config.model)
    ckpt_io.load_model_weights(model, state["ema" if use_ema else "model"], bool(state.get("adapter_only")), str(path))
    diffusion = instantiate(config.diffusion)
    net = diffusion.precondition(model).to(device).eval().requires_grad_(False)
    return net, diffusion, state["data_meta"], config


def text_conditioning(net, meta: dict, config) -> Optional[Any]:
    """For a text-conditioned checkpoint (a diffusers family trained on data with text embeddings): a
    cond_fn(seeds) giving sample i the text embeddings of training item i mod N, read from the training data
    (config.data). None for class-conditional checkpoints."""
    if not hasattr(getattr(net, "model", net), "conditioning") or not (meta.get("conditioning") or {}).get("text"):
        return None
    from data import LatentDatasetError, build_dataset
    from training.evaluate import text_conditioning_for_seeds
    try:
        dataset = build_dataset(config.data)
    except (LatentDatasetError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"this checkpoint is text-conditioned: samples take their text embeddings from the training data "
            f"(data.path={config.data.get('path')!r}), which cannot be read here: {err}") from None
    return text_conditioning_for_seeds(dataset, net)


def sampling_cost(net, guidance, stats: dict, num_images: int, cond_fn=None, seed: int = 0) -> dict[str, Any]:
    """What sampling `num_images` images cost per image, from the forward passes `generate` counted in
    `stats`: passes per image and theoretical forward GFLOPs per image (diffusion.guidance)."""
    from diffusion.guidance import backbone, sampling_flops_per_image
    model = backbone(net)
    cond = None
    if cond_fn is not None:
        param = next(model.parameters())
        cond = {k: v.to(param.device) for k, v in cond_fn([seed]).items()}
    flops = sampling_flops_per_image(model, guidance, stats, num_images, cond)
    passes = sum(stats.values()) / num_images if num_images else 0.0
    return {"forward_passes_per_image": passes, "sample_gflops_per_image": flops / 1e9,
            "passes_by_ratio": {("dense" if r is None else f"{r:g}"): n / max(num_images, 1) for r, n in stats.items()}}


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory that holds a checkpoint (given as run dir, step dir or model.pt)."""
    path = Path(checkpoint)
    if path.name == "model.pt":
        path = path.parent
    return path.parent.parent if path.parent.name == "checkpoints" else path


def parse_seeds(seeds: Any, num_samples: int) -> list[int]:
    """null -> 0..num_samples-1; "a-b" -> a..b inclusive; "1,5,7" or a list -> as given."""
    if seeds is None:
        return list(range(num_samples))
    if isinstance(seeds, int):
        return [seeds]
    if isinstance(seeds, str):
        out: list[int] = []
        for part in seeds.split(","):
            if "-" in part.strip()[1:]:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part.strip():
                out.append(int(part))
        return out
    return [int(s) for s in seeds]


def write_samples(images: torch.Tensor, labels: torch.Tensor, out_dir: Path, grid_nrow: Optional[int]) -> dict:
    """PNG folder, a grid and an ADM-format samples.npz (arr_0 uint8 NHWC, arr_1 labels)."""
    from evaluation.images import save_image_grid, save_npz, save_png_folder

    out_dir.mkdir(parents=True, exist_ok=True)
    save_png_folder(images, out_dir / "images")
    save_npz(images, out_dir / "samples.npz", labels=labels.numpy())
    save_image_grid(images[:256], out_dir / "grid.png", nrow=grid_nrow, upscale=max(1, 64 // images.shape[1]))
    return {"images": str(out_dir / "images"), "npz": str(out_dir / "samples.npz"), "grid": str(out_dir / "grid.png")}
