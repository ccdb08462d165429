"""Image folders for precomputing latents: listing (class folders or a flat folder + labels file) and
ADM's center crop.

Two layouts (`list_image_folder`):

    class folders   root/<class name>/**/<image>     label = index of the class folder in sorted order,
                    (ImageNet train style)            class_names = the folder names
    flat + labels   root/<image> and a labels file    see below; every image needs exactly one label

Labels file: a JSON object {"<file name>": label, ...}, or a text file (CSV/TSV) with one `<file name>,<label>`
(or `<file name><TAB><label>`) per line; blank lines, `#` comments and a `filename,label` header are skipped.
File names are relative to root. Labels are either all integers (used as class indices; class_names is
None) or class names (sorted -> indices; class_names = the sorted names).

Image files: .png .jpg .jpeg .webp .bmp .tif .tiff (any case); hidden files and folders are ignored.
Order is deterministic: classes by folder name, files by relative path.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import numpy as np
from PIL import Image

from .latents import LatentDatasetError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
PathLike = Union[str, os.PathLike]
_INT = re.compile(r"^[+-]?\d+$")


class ImageFolderError(LatentDatasetError):
    """An image folder or labels file is missing, empty or inconsistent."""


def _is_image(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def _images_under(folder: Path) -> list[Path]:
    """Image files anywhere below `folder` (hidden entries skipped), sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        # os.walk's filenames are not folders: the name alone decides (no stat per file on huge folders)
        found.extend(Path(dirpath) / f for f in filenames
                     if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTS)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _short(items: list, n: int = 5) -> str:
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def read_labels_file(path: PathLike) -> dict[str, str]:
    """{file name: label string} from a JSON object or a CSV/TSV `file,label` file (see the module doc)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ImageFolderError(f"labels file '{path}' not found")
    text = path.read_text(encoding="utf-8-sig")
    entries: list[tuple[str, str]] = []
    if path.suffix.lower() == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise ImageFolderError(f"labels file '{path}': invalid JSON ({err})") from None
        if not isinstance(obj, dict):
            raise ImageFolderError(f"labels file '{path}': expected a JSON object {{\"file name\": label}}, got "
                                   f"{type(obj).__name__}")
        for name, label in obj.items():
            if isinstance(label, bool) or not isinstance(label, (int, str)):
                raise ImageFolderError(f"labels file '{path}': label of '{name}' is {label!r}; labels must be "
                                       f"integers or class-name strings")
            entries.append((name, str(label)))
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            sep = "\t" if "\t" in line else ","
            name, _, label = line.rpartition(sep)
            name, label = name.strip(), label.strip()
            if not name or not label:
                raise ImageFolderError(f"labels file '{path}' line {lineno}: {line!r} is not "
                                       f"'<file name>,<label>' (or tab-separated)")
            if not entries and name.lower() in ("filename", "file", "path") and label.lower() in ("label", "class"):
                continue  # header
            entries.append((name, label))
    labels: dict[str, str] = {}
    for name, label in entries:
        key = Path(name).as_posix()  # "./a.png" -> "a.png"
        if key in labels:
            raise ImageFolderError(f"labels file '{path}' lists '{name}' twice")
        labels[key] = label
    if not labels:
        raise ImageFolderError(f"labels file '{path}' has no entries")
    return labels


def list_image_folder(root: PathLike, labels_file: Optional[PathLike] = None
                      ) -> tuple[list[Path], np.ndarray, Optional[list[str]]]:
    """(image paths, int64 labels, class names or None) of an image folder; see the module doc for layouts."""
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise ImageFolderError(f"image folder '{root}' " + ("is a file, not a folder" if root.exists()
                                                            else "not found"))
    top_images = sorted((p for p in root.iterdir() if _is_image(p)), key=lambda p: p.name)
    class_dirs = sorted((p for p in root.iterdir() if p.is_dir() and _visible(p)), key=lambda p: p.name)
    per_class = {d.name: _images_under(d) for d in class_dirs}
    image_dirs = [d for d in class_dirs if per_class[d.name]]

    if labels_file is None:
        if top_images and image_dirs:
            raise ImageFolderError(
                f"image folder '{root}' mixes layouts: it has images directly inside "
                f"({_short([p.name for p in top_images])}) and class sub-folders "
                f"({_short([d.name for d in image_dirs])}). Use one sub-folder per class, or a flat folder with a "
                f"labels file (--labels).")
        if top_images:
            raise ImageFolderError(f"image folder '{root}' is flat (images directly inside, no class sub-folders): "
                                   f"give a labels file (--labels FILE, 'file name,label' lines or a JSON object) "
                                   f"or put the images in one sub-folder per class")
        if not image_dirs:
            raise ImageFolderError(f"no images ({' '.join(IMAGE_EXTS)}) found in '{root}' or its sub-folders")
        empty = [d.name for d in class_dirs if not per_class[d.name]]
        if empty:
            raise ImageFolderError(f"class folder(s) without images in '{root}': {_short(empty)}; every sub-folder is "
                                   f"a class and needs at least one image (remove the empty ones)")
        paths, labels = [], []
        for index, d in enumerate(class_dirs):
            paths.extend(per_class[d.name])
            labels.extend([index] * len(per_class[d.name]))
        return paths, np.asarray(labels, dtype=np.int64), [d.name for d in class_dirs]

    if image_dirs:
        raise ImageFolderError(
            f"image folder '{root}' mixes layouts: a labels file was given, so the images must lie directly in "
            f"the folder, but it has sub-folders with images ({_short([d.name for d in image_dirs])}). Drop --labels "
            f"to use the sub-folders as classes, or flatten the folder.")
    if not top_images:
        raise ImageFolderError(f"no images ({' '.join(IMAGE_EXTS)}) found directly in '{root}'")
    table = read_labels_file(labels_file)
    names = [p.name for p in top_images]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ImageFolderError(f"labels file '{labels_file}' names file(s) that are not images in '{root}': "
                               f"{_short(unknown)}")
    unlabelled = [n for n in names if n not in table]
    if unlabelled:
        raise ImageFolderError(f"image(s) in '{root}' have no label in '{labels_file}': {_short(unlabelled)}")
    raw = [table[n] for n in names]
    if all(_INT.match(v) for v in raw):
        labels = np.asarray([int(v) for v in raw], dtype=np.int64)
        if labels.min() < 0:
            bad = [n for n, v in zip(names, labels) if v < 0]
            raise ImageFolderError(f"labels file '{labels_file}' gives negative labels (class indices must be >= 0): "
                                   f"{_short(bad)}")
        return top_images, labels, None
    class_names = sorted(set(raw))
    index = {c: i for i, c in enumerate(class_names)}
    return top_images, np.asarray([index[v] for v in raw], dtype=np.int64), class_names


def center_crop_arr(pil_image: Image.Image, resolution: int) -> np.ndarray:
    """ADM's (guided-diffusion) center crop: uint8 (resolution, resolution, 3) RGB.

    Halve the image with BOX filtering while its short side is at least 2 * resolution, resize it with
    BICUBIC so the short side equals resolution (long side rounded), then cut the central square.
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    image = pil_image.convert("RGB")
    while min(image.size) >= 2 * resolution:
        image = image.resize(tuple(side // 2 for side in image.size), resample=Image.BOX)
    scale = resolution / min(image.size)
    image = image.resize(tuple(round(side * scale) for side in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - resolution) // 2, (arr.shape[1] - resolution) // 2
    return np.ascontiguousarray(arr[top:top + resolution, left:left + resolution])


def load_image(path: PathLike, resolution: int) -> np.ndarray:
    """One image file -> center-cropped uint8 (resolution, resolution, 3); unreadable files raise naming it."""
    try:
        with Image.open(path) as im:
            im.load()
            return center_crop_arr(im, resolution)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageFolderError(f"cannot read image '{path}': {err}") from None
