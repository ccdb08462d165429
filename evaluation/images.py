"""uint8 NHWC image I/O: sample grids, PNG folders and ADM-format .npz files."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch
from PIL import Image

ImagesLike = Union[torch.Tensor, np.ndarray]
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")


def to_nhwc_uint8(images: ImagesLike, what: str = "images") -> np.ndarray:
    """Validate (B, H, W, 3) uint8 images and return them as a numpy array."""
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"{what}: expected uint8 (N, H, W, 3) images, got {images.dtype} {images.shape}")
    return images


def atomic_write(path: Union[str, Path], write: Callable) -> Path:
    """Call write(file_object) on a temp file next to `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def make_grid(images: ImagesLike, nrow: Optional[int] = None, upscale: int = 1, padding: int = 2) -> np.ndarray:
    """Tile images into one (H', W', 3) array, `nrow` images per row, black `padding` px between them."""
    images = to_nhwc_uint8(images)
    if upscale > 1:  # nearest-neighbour so small images stay crisp
        images = images.repeat(upscale, axis=1).repeat(upscale, axis=2)
    n, h, w, _ = images.shape
    ncol = nrow or math.ceil(math.sqrt(n))
    nrows = math.ceil(n / ncol)
    grid = np.zeros((padding + nrows * (h + padding), padding + ncol * (w + padding), 3), np.uint8)
    for i, img in enumerate(images):
        y, x = padding + (i // ncol) * (h + padding), padding + (i % ncol) * (w + padding)
        grid[y:y + h, x:x + w] = img
    return grid


def save_image_grid(images: ImagesLike, path: Union[str, Path], nrow: Optional[int] = None,
                    upscale: int = 1) -> Path:
    grid = Image.fromarray(make_grid(images, nrow, upscale))
    return atomic_write(path, lambda f: grid.save(f, format="PNG"))


def save_png_folder(images: ImagesLike, folder: Union[str, Path], start_index: int = 0) -> Path:
    """One PNG per image, named {index:06d}.png (lossless, so features are unchanged on reload)."""
    images, folder = to_nhwc_uint8(images), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images, start=start_index):
        Image.fromarray(img).save(folder / f"{i:06d}.png")
    return folder


def save_npz(images: ImagesLike, path: Union[str, Path], labels: Optional[ImagesLike] = None) -> Path:
    """ADM sample format: arr_0 = uint8 (N, H, W, 3) images, arr_1 = labels (if given)."""
    arrays = {"arr_0": to_nhwc_uint8(images)}
    if labels is not None:
        arrays["arr_1"] = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    return atomic_write(path, lambda f: np.savez(f, **arrays))


def load_images(path: Union[str, Path]) -> np.ndarray:
    """uint8 (N, H, W, 3) images from an image folder (sorted by name) or an .npz with arr_0."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"images not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTS)
        if not files:
            raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) in folder {path}")
        images = []
        for f in files:
            with Image.open(f) as im:
                images.append(np.asarray(im.convert("RGB")))
            if images[-1].shape != images[0].shape:
                raise ValueError(f"image sizes differ in {path}: {files[0].name} is {images[0].shape[:2]}, "
                                 f"{f.name} is {images[-1].shape[:2]}")
        return np.stack(images)
    if path.suffix == ".npz":
        with np.load(path) as data:
            if "arr_0" not in data:
                raise ValueError(f"{path} has no 'arr_0' image array (keys: {list(data.keys())})")
            return to_nhwc_uint8(data["arr_0"], what=f"arr_0 in {path}")
    raise ValueError(f"{path} is neither an image folder nor an .npz file")
