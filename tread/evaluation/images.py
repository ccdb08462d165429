"""uint8 NHWC image I/O: sample grids, PNG folders and ADM-format .npz files."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from tread.utils.io import atomic_write
from tread.utils.readers import image_size, npz_array_info, npz_names, read_image, read_npz

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


def as_frames(images: torch.Tensor, indices, per_clip: int) -> tuple[torch.Tensor, np.ndarray]:
    """Decoded samples as images for frame-level metrics: videos (B, F, H, W, 3) -> B * F frames, frame f of item i at
    index i * per_clip + f; images pass unchanged with their indices."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if images.dim() != 5:
        return images, idx
    b, f = images.shape[:2]
    if f > per_clip:
        raise ValueError(f"clips of {f} frames do not fit {per_clip} indices per clip")
    return images.reshape(b * f, *images.shape[2:]), (idx[:, None] * per_clip + np.arange(f)).reshape(-1)


def clip_frames(dataset) -> int:
    """Pixel frames per clip of video data (the most of any frame bucket), 1 for images."""
    if dataset.buckets is not None:
        return max([int(b.frames or 1) for b in dataset.buckets])
    return int((dataset.meta.get("video") or {}).get("frames", 1))


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


CAPTION_MIN_WIDTH = 128   # captioned cells are upscaled (nearest) to at least this many pixels across
CAPTION_MAX_LINES = 4     # caption lines under each image; a longer caption ends in "..."


def wrap_caption(text: str, width: int, font, max_lines: int = CAPTION_MAX_LINES) -> list[str]:
    """`text` in lines that fit `width` pixels in `font` (greedy by word; a word wider than a line is split),
    at most `max_lines`, the last one ending in "..." when the caption goes on."""
    lines: list[str] = []
    for word in text.split():
        while len(word) > 1 and font.getlength(word) > width:   # an over-long word: its head on a line of its own
            cut = len(word) - 1
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            lines, word = lines + [word[:cut]], word[cut:]
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        lines = lines[:max_lines - 1] + [last + "..."]
    return lines or [""]


def make_captioned_grid(images: ImagesLike, captions: list[str], nrow: Optional[int] = None,
                        min_width: int = CAPTION_MIN_WIDTH, padding: int = 2) -> np.ndarray:
    """Tile images as make_grid does, each with its caption beneath (wrapped to the image width); images are upscaled
    (nearest) to at least `min_width` pixels so captions stay legible."""
    images = to_nhwc_uint8(images)
    if len(captions) != len(images):
        raise ValueError(f"captioned grid: {len(images)} images but {len(captions)} captions")
    upscale = max(1, min_width // images.shape[2])
    images = images.repeat(upscale, axis=1).repeat(upscale, axis=2)
    n, h, w, _ = images.shape
    font = ImageFont.load_default()
    line_height = font.getbbox("Ag")[3] + 2
    wrapped = [wrap_caption(c, w - 4, font) for c in captions]
    strip = 4 + line_height * max(len(lines) for lines in wrapped)
    cells = np.zeros((n, h + strip, w, 3), np.uint8)
    for cell, img, lines in zip(cells, images, wrapped):
        canvas = Image.new("RGB", (w, strip))
        draw = ImageDraw.Draw(canvas)
        for i, line in enumerate(lines):
            draw.text((2, 2 + i * line_height), line, fill=(255, 255, 255), font=font)
        cell[:h], cell[h:] = img, np.asarray(canvas)
    return make_grid(cells, nrow, padding=padding)


def save_captioned_grid(images: ImagesLike, captions: list[str], path: Union[str, Path],
                        nrow: Optional[int] = None) -> Path:
    """make_captioned_grid as a PNG file (written atomically)."""
    grid = Image.fromarray(make_captioned_grid(images, captions, nrow))
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


def image_files(folder: Union[str, Path]) -> list[Path]:
    """The image files (IMAGE_EXTS) in a folder, sorted by name."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS)
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) in folder {folder}")
    return files


def read_image_files(files: list[Path], first: Optional[Path] = None,
                     first_shape: Optional[tuple] = None) -> np.ndarray:
    """uint8 (N, H, W, 3) RGB images from files that must all share one size (that of `first_shape`, the
    size of the image file `first`, if given; else the first file's)."""
    images = []
    for f in files:
        images.append(np.asarray(read_image(f, "image", hint=f"Fix or remove it from {f.parent}.")))
        if first_shape is None:
            first, first_shape = f, images[-1].shape
        if images[-1].shape != first_shape:
            raise ValueError(f"image sizes differ in {f.parent}: {first.name} is {first_shape[:2]}, "
                             f"{f.name} is {images[-1].shape[:2]}")
    return np.stack(images) if images else np.zeros((0, *(first_shape or (0, 0, 3))), np.uint8)


def check_image_folder(folder: Union[str, Path], what: str = "images") -> tuple[int, tuple[int, int]]:
    """(count, (height, width)) of an image folder, every header checked without decoding pixels: a corrupt, empty or
    odd-sized image is refused (FileFormatError / ValueError naming it)."""
    files = image_files(folder)
    first = image_size(files[0], "image", hint=f"Fix or remove it from {what}={folder}.")
    for f in files[1:]:
        size = image_size(f, "image", hint=f"Fix or remove it from {what}={folder}.")
        if size != first:
            raise ValueError(f"{what}={folder}: image sizes differ: {files[0].name} is {first[0]}x{first[1]}, "
                             f"{f.name} is {size[0]}x{size[1]}; all images must have one size")
    return len(files), (first[1], first[0])


def npz_images_shape(path: Union[str, Path], what: str = "images") -> tuple[int, ...]:
    """(N, H, W, 3) of an .npz's arr_0 images, from its header; ValueError naming `what` and the file unless they
    are uint8 NHWC RGB images of at least 1x1 pixels (FileFormatError if it is no readable .npz)."""
    shape, dtype = npz_array_info(path, "arr_0", what)
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or min(shape[1:3]) < 1:
        raise ValueError(f"{what}={path}: arr_0 must be uint8 (N, H, W, 3) images of at least 1x1 pixels, got "
                         f"{dtype} {tuple(shape)}")
    return tuple(shape)


def iter_image_folder(folder: Union[str, Path], batch_size: int = 250,
                      indices: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
    """uint8 NHWC batches of the folder's images (sorted by name; only `indices` of them, if given), read
    batch by batch so a large folder never sits in memory at once. Sizes must agree (ValueError)."""
    files = image_files(folder)
    if indices is not None:
        files = [files[int(i)] for i in indices]
    first = first_shape = None
    for i in range(0, len(files), batch_size):
        batch = read_image_files(files[i:i + batch_size], first, first_shape)
        if first_shape is None and len(batch):
            first, first_shape = files[0], batch.shape[1:]
        yield batch


def load_images(path: Union[str, Path]) -> np.ndarray:
    """uint8 (N, H, W, 3) images from an image folder (sorted by name) or an .npz with arr_0."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"images not found: {path}")
    if path.is_dir():
        return read_image_files(image_files(path))
    if path.suffix == ".npz":
        data = read_npz(path, "images", keys=("arr_0",))
        if "arr_0" not in data:
            raise ValueError(f"{path} has no 'arr_0' image array (keys: {npz_names(path)})")
        return to_nhwc_uint8(data["arr_0"], what=f"arr_0 in {path}")
    raise ValueError(f"{path} is neither an image folder nor an .npz file")


def write_samples(images: torch.Tensor, labels: torch.Tensor, out_dir: Path, grid_nrow: Optional[int],
                  captions: Optional[list[str]] = None) -> dict:
    """A PNG folder, a grid and an ADM-format samples.npz (arr_0 uint8 NHWC, arr_1 labels) under out_dir;
    with `captions` (one per image: prompts), the grid has each image's caption beneath it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_png_folder(images, out_dir / "images")
    save_npz(images, out_dir / "samples.npz", labels=labels.numpy())
    if captions is not None:
        save_captioned_grid(images[:256], captions[:256], out_dir / "grid.png", nrow=grid_nrow)
    else:
        save_image_grid(images[:256], out_dir / "grid.png", nrow=grid_nrow, upscale=max(1, 64 // images.shape[1]))
    return {"images": str(out_dir / "images"), "npz": str(out_dir / "samples.npz"), "grid": str(out_dir / "grid.png")}
