"""The built-in offline dataset "toy_shapes" (10 classes of coloured shapes, stored as identity-decoded latents;
with loss_masks, data=toy_masked), its feature network the toy classifier (ensure_toy_classifier) and the REPA
encoder loader (load_repa_encoder), whose toy encoders are that classifier (docs/data.md "Loading")."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from tread.encoders.patch import TOY_ENCODER_SEEDS, PatchEncoder, build_patch_encoder
from tread.encoders.toy_autoencoder import (AUTOENCODER_SEED, MLP_SEED, net_path, save_net, train_toy_autoencoder,
                                            train_toy_pixel_mlp)
from tread.encoders.toy_classifier import DEFAULT_SEED, cache_path, save_toy_classifier, train_toy_classifier

from tread.data.meta import LatentDatasetError, LatentDatasetExistsError, read_meta
from tread.data.writer import write_latent_dataset

TOY_CLASS_NAMES = ["red disc", "green square", "blue triangle", "yellow ring", "magenta plus",
                   "cyan horizontal stripes", "orange vertical stripes", "white checkerboard", "purple diamond",
                   "lime X"]
# Base RGB colours in [0, 1], one per class (jittered per sample).
TOY_COLOURS = np.array([[0.92, 0.15, 0.12], [0.15, 0.80, 0.20], [0.20, 0.35, 1.00], [0.95, 0.85, 0.10],
                        [0.92, 0.20, 0.85], [0.10, 0.85, 0.90], [1.00, 0.55, 0.05], [0.92, 0.92, 0.92],
                        [0.55, 0.22, 0.85], [0.60, 0.95, 0.15]], dtype=np.float32)


def _bands(t: np.ndarray, period: np.ndarray) -> np.ndarray:
    """Signed distance to bands of width period / 2 (negative inside), one band centred on t = 0."""
    return (np.abs((t / period + 0.5) % 1.0 - 0.5) - 0.25) * period


def _box(x: np.ndarray, y: np.ndarray, half: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(x), np.abs(y)) - half


def _bars(a: np.ndarray, b: np.ndarray, r: np.ndarray) -> np.ndarray:
    """A plus sign in the (a, b) frame: union of two bars of half-length r and half-width 0.27 r."""
    w = 0.27 * r
    return np.minimum(np.maximum(np.abs(a) - w, np.abs(b) - r), np.maximum(np.abs(b) - w, np.abs(a) - r))


def _cover(d: np.ndarray, px: float) -> np.ndarray:
    """Anti-aliased coverage of a signed distance: ramps linearly across one pixel around the edge."""
    return np.clip(0.5 - d / px, 0, 1)


def _checker(x: np.ndarray, y: np.ndarray, r: np.ndarray, px: float) -> np.ndarray:
    """5x5 checkerboard coverage: box coverage times a soft XNOR of per-axis band coverages."""
    # The outer cell edges coincide with the box edge; sampling the pattern at least a pixel inside the
    # box keeps the (invisible) next ring of cells from bleeding in as grey seams along the edge.
    lim = r - px
    cx, cy = (_cover(_bands(np.clip(t, -lim, lim), 0.8 * r), px) for t in (x, y))
    return _cover(_box(x, y, r), px) * (cx * cy + (1 - cx) * (1 - cy))


def _sdf(f: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda x, y, r, px: _cover(f(x, y, r), px)


# Coverage in [0, 1] of each class's shape, from x, y relative to its centre, its size r and the pixel size
# px: broadcastable (m, R, R) / (m, 1, 1) arrays in image units. Most are signed distances (negative
# inside). Every shape fits in a radius of about 1.2 r; stripe and checker periods scale with r, so the
# pattern ends cleanly at the box edges.
_S3 = np.sqrt(3) / 2
TOY_SHAPES: list[Callable[..., np.ndarray]] = [
    _sdf(lambda x, y, r: np.hypot(x, y) - r),                                                # disc
    _sdf(lambda x, y, r: _box(x, y, 0.8 * r)),                                               # square
    _sdf(lambda x, y, r: np.maximum(np.maximum(y, _S3 * x - 0.5 * y), -_S3 * x - 0.5 * y) - 0.58 * r),  # triangle
    _sdf(lambda x, y, r: np.abs(np.hypot(x, y) - 0.75 * r) - 0.22 * r),                      # ring
    _sdf(lambda x, y, r: _bars(x, y, r)),                                                    # plus
    _sdf(lambda x, y, r: np.maximum(_box(x, y, 0.85 * r), _bands(y, 0.68 * r))),             # 3 horizontal stripes
    _sdf(lambda x, y, r: np.maximum(_box(x, y, 0.85 * r), _bands(x, 0.68 * r))),             # 3 vertical stripes
    _checker,                                                                                # checkerboard
    _sdf(lambda x, y, r: (np.abs(x) + np.abs(y) - 1.15 * r) / np.sqrt(2)),                   # diamond
    _sdf(lambda x, y, r: _bars((x + y) / np.sqrt(2), (x - y) / np.sqrt(2), 1.1 * r)),        # X
]


def generate_toy_shapes(num_per_class: int = 1000, resolution: Union[int, tuple[int, int]] = 32, seed: int = 0,
                        loss_masks: bool = False) -> Union[tuple[torch.Tensor, torch.Tensor],
                                                           tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Deterministic toy_shapes: images float32 (N, 3, H, W) in [-1, 1], labels int64 (N,) interleaved (0..9, 0..),
    N = 10 * num_per_class; `resolution` R or (H, W) (a non-square canvas keeps the shapes' proportions). With
    loss_masks=True also each shape's coverage, uint8 (N, H, W) (255 = fully inside); images and labels are the same.
    """
    rng = np.random.default_rng(seed)
    H, W = (resolution, resolution) if isinstance(resolution, int) else resolution
    n, k, R = num_per_class * len(TOY_SHAPES), len(TOY_SHAPES), min(H, W)
    labels = np.tile(np.arange(k), num_per_class)
    # Per-sample jitter, drawn for all samples at once (in a fixed order, for determinism).
    centre = rng.uniform(-0.18, 0.18, (n, 2, 1, 1)).astype(np.float32)
    size = rng.uniform(0.5, 0.66, (n, 1, 1)).astype(np.float32)
    colour = np.clip(TOY_COLOURS[labels] + rng.uniform(-0.08, 0.08, (n, 3)), 0, 1).astype(np.float32)
    background = (rng.uniform(0.04, 0.16, (n, 1)) + rng.uniform(-0.03, 0.03, (n, 3))).clip(0, 1).astype(np.float32)

    def coords(side: int) -> np.ndarray:  # pixel centres; the short side's span [-1, 1]
        return (np.arange(side, dtype=np.float32) + 0.5 - side / 2) / R * 2

    x = coords(W)[None, None, :] - centre[:, 0]  # (n, 1, W): x runs along width
    y = coords(H)[None, :, None] - centre[:, 1]  # (n, H, 1): y runs down the image
    images = np.empty((n, 3, H, W), np.float32)
    masks = np.empty((n, H, W), np.uint8) if loss_masks else None
    for c, shape in enumerate(TOY_SHAPES):
        idx = np.flatnonzero(labels == c)
        alpha = shape(x[idx], y[idx], size[idx], 2 / R)[:, None]  # (m, 1, R, R); a pixel is 2 / R wide
        bg, fg = background[idx, :, None, None], colour[idx, :, None, None]
        images[idx] = bg + (fg - bg) * alpha
        if masks is not None:
            masks[idx] = np.rint(np.clip(alpha[:, 0], 0, 1) * 255).astype(np.uint8)
    out = torch.from_numpy(images * 2 - 1), torch.from_numpy(labels.astype(np.int64))
    return out if masks is None else (*out, torch.from_numpy(masks))


def ensure_toy_dataset(path: Union[str, os.PathLike], num_per_class: int = 1000, resolution: int = 32,
                       seed: int = 0, loss_masks: bool = False) -> Path:
    """Return `path`, first generating the toy_shapes dataset there unless it already holds these parameters;
    loss_masks=True also stores loss_mask.npy and records "loss_masks": true in meta "builtin"."""
    root = Path(path).expanduser().absolute()
    if not isinstance(loss_masks, (bool, np.bool_)):
        raise LatentDatasetError(f"data.builtin_args.loss_masks={loss_masks!r} must be true or false")
    params = {"name": "toy_shapes", "num_per_class": int(num_per_class), "resolution": int(resolution),
              "seed": int(seed)}
    if loss_masks:  # absent when false: the default dataset's meta.json stays as it always was
        params["loss_masks"] = True

    def write() -> None:
        generated = generate_toy_shapes(num_per_class, resolution, seed,
                                        **({"loss_masks": True} if loss_masks else {}))
        images, labels = generated[:2]
        write_latent_dataset(
            root, images.numpy(), labels.numpy(), num_classes=len(TOY_CLASS_NAMES), class_names=TOY_CLASS_NAMES,
            source=f"built-in toy_shapes generator (tread/data/builtin/toy.py): {num_per_class} per class x "
                   f"{len(TOY_CLASS_NAMES)} classes, {resolution}x{resolution} RGB in [-1, 1], seed {seed}"
                   + (", with shape-coverage loss masks" if loss_masks else ""),
            dtype="float16", extra_meta={"builtin": params},
            extras={"loss_mask": generated[2].numpy()} if loss_masks else None)

    return ensure_builtin(root, params, write)


def ensure_builtin(root: Path, params: dict, write: Callable[[], None]) -> Path:
    """`root`, first calling write() (which writes a dataset whose meta.json builtin is `params` atomically at
    root) unless root already holds one; a dataset there with other parameters is an error. Concurrent
    processes may race: the loser uses the winner's (identical) dataset."""
    def check_existing() -> Path:
        found = read_meta(root).get("builtin")
        if found != params:
            raise LatentDatasetError(
                f"'{root}' already holds a dataset with meta.json builtin={found}, but {params['name']} with "
                f"{params} was requested (data.builtin_args). Delete the directory to regenerate it, or point "
                f"data.path at a directory for these parameters.")
        return root

    if (root / "meta.json").is_file():
        return check_existing()
    try:
        write()
    except LatentDatasetExistsError:
        if not (root / "meta.json").is_file():  # not a concurrent writer's dataset: something else is there
            raise
        return check_existing()  # another process finished first: use its (identical) dataset
    return root


CLASSIFIER_IMAGES_PER_CLASS = 300   # the toy classifier's training images per class (a quarter more are held out)


def _toy_uint8(num_per_class: int, resolution: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = generate_toy_shapes(num_per_class, resolution, seed)
    # The same [-1, 1] -> uint8 quantisation as decoding, so the net sees what it will be fed.
    return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8), labels.long()


def ensure_toy_classifier(cache_dir: Union[str, os.PathLike], resolution: int = 32, seed: int = DEFAULT_SEED,
                          verbose: bool = True) -> Path:
    """The toy classifier's file in `cache_dir` (tread.encoders.toy_classifier.cache_path), first training it
    unless it is there: on fresh toy_shapes of generator seed `seed` (held out: seed + 1), torch seeded with
    `seed`. Writes are atomic, so concurrent processes at worst train it twice and never read a partial file."""
    path = cache_path(cache_dir, resolution, seed)
    if path.is_file():
        return path
    if verbose:
        print(f"Training the toy-classifier feature network (one-off, cached at {path}) ...", flush=True)
    start = time.time()
    x, y = _toy_uint8(CLASSIFIER_IMAGES_PER_CLASS, resolution, seed)
    x_val, y_val = _toy_uint8(max(20, CLASSIFIER_IMAGES_PER_CLASS // 4), resolution, seed + 1)
    model, acc = train_toy_classifier(x, y, x_val, y_val, seed=seed, verbose=verbose)
    info = {"accuracy": acc, "train_seconds": round(time.time() - start, 1), "seed": seed,
            "resolution": resolution, **model.config, "torch": str(torch.__version__)}
    if verbose:
        print(f"Toy classifier: held-out accuracy {acc:.4f}, {info['train_seconds']} s", flush=True)
    if acc < 0.9:
        print(f"WARNING: toy classifier accuracy is only {acc:.3f}; its FID features may be weak.", flush=True)
    return save_toy_classifier(model, path, info)


def ensure_toy_autoencoder(cache_dir: Union[str, os.PathLike], resolution: int = 32, seed: int = AUTOENCODER_SEED,
                           images_per_class: int = CLASSIFIER_IMAGES_PER_CLASS, epochs: int = 4) -> Path:
    """The independent evaluator's autoencoder file in `cache_dir` (toy_autoencoder.net_path), first training it
    unless it is there: on fresh toy_shapes of generator seed `seed` (held out: seed + 1), torch seeded with
    `seed`; no labels. Atomic writes, as ensure_toy_classifier."""
    path = net_path("toy_autoencoder", cache_dir, resolution, seed)
    if path.is_file():
        return path
    start = time.time()
    x, _ = _toy_uint8(images_per_class, resolution, seed)
    model, mse = train_toy_autoencoder(x, _toy_uint8(max(2, images_per_class // 4), resolution, seed + 1)[0],
                                       seed=seed, epochs=epochs)
    return save_net(model, path, {"val_mse": mse, "train_seconds": round(time.time() - start, 1), "seed": seed,
                                  "images_per_class": images_per_class, "epochs": epochs, **model.config})


def ensure_toy_pixel_mlp(cache_dir: Union[str, os.PathLike], resolution: int = 32, seed: int = MLP_SEED,
                         images_per_class: int = CLASSIFIER_IMAGES_PER_CLASS, epochs: int = 8) -> Path:
    """The held-out pixel-MLP classifier's file in `cache_dir` (class_acc), first training it unless it is there:
    on fresh toy_shapes of generator seed `seed` (held out: seed + 1), torch seeded with `seed`."""
    path = net_path("toy_pixel_mlp", cache_dir, resolution, seed)
    if path.is_file():
        return path
    start = time.time()
    x, y = _toy_uint8(images_per_class, resolution, seed)
    model, acc = train_toy_pixel_mlp(x, y, *_toy_uint8(max(2, images_per_class // 4), resolution, seed + 1),
                                     seed=seed, epochs=epochs)
    if acc < 0.9:
        print(f"WARNING: the held-out pixel MLP's accuracy is only {acc:.3f}; class_acc may be weak.", flush=True)
    return save_net(model, path, {"accuracy": acc, "train_seconds": round(time.time() - start, 1), "seed": seed,
                                  "images_per_class": images_per_class, "epochs": epochs, **model.config})


def load_repa_encoder(name: str, weights: Optional[Union[str, Path]], *, cache_dir: Union[str, Path],
                      resolution: int, device: Union[str, torch.device] = "cpu"
                      ) -> tuple[PatchEncoder, Optional[str]]:
    """The frozen REPA encoder `name` (tread/encoders/patch.py) and the weights it was read from: the trained toy
    encoders' toy classifier file for `resolution` px (trained once in `cache_dir`, as the toy FID's is), a
    Dinov2Model folder (`weights`), or None (toy_random: built from its seed)."""
    if name in TOY_ENCODER_SEEDS:
        weights = ensure_toy_classifier(str(cache_dir), resolution=int(resolution), seed=TOY_ENCODER_SEEDS[name])
    encoder = build_patch_encoder(name, weights=weights, device=device, resolution=int(resolution))
    return encoder, None if weights is None else str(weights)
