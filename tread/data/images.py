"""Image folders for precomputing latents: listing (class folders, or a flat folder with a labels file), the full
decode that finds unreadable images before any encoding, and ADM's center crop (docs/data.md, "Precomputing
latents")."""
from __future__ import annotations

import csv
import os
import re
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
from PIL import Image

from tread.utils.readers import image_problem, parse_json, read_image

from .meta import LatentDatasetError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
PathLike = Union[str, os.PathLike]
_INT = re.compile(r"^[+-]?\d+$")


class ImageFolderError(LatentDatasetError):
    """An image folder or labels file is missing, empty or inconsistent."""


def _is_image(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def _claim(folder: Path, seen: dict[str, Path], error: type[Exception]) -> None:
    """Note `folder` as walked; one already walked under another path (a symbolic link to it, or to a folder above
    it: a loop) is `error` naming both, since its files would be listed again (each time round a loop)."""
    real = os.path.realpath(folder)
    first = seen.setdefault(real, folder)
    if first is folder:
        return
    how = "a symbolic link loop: it leads back to a folder above it" if folder.is_relative_to(first) else \
        "a symbolic link leads to a folder listed already"
    raise error(f"folder '{folder}' is '{first}' again ({how}; both are '{real}'), so its files would be listed "
                f"twice; remove the link (links to files are fine; a folder may be reached by one path only)")


def _entries(folder: Path, error: type[Exception]) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise error(f"cannot list folder '{folder}' ({err.strerror or err}); make it readable or remove it") from None


def walk_folders(top: Path, error: type[Exception] = ImageFolderError, seen: Optional[dict[str, Path]] = None
                 ) -> Iterator[tuple[Path, list[Path], list[os.DirEntry]]]:
    """(folder, its visible sub-folders, its other entries: files, hidden ones too) for `top` and every visible
    folder below it, top-down, each folder's sub-folders in name order (prune them in place to skip some).
    Links to folders are followed, but every folder is walked once: one reached again (a link loop, or two links
    to one folder; `seen`, {real path: path}, may carry on from other walks) or one that cannot be listed is one
    `error` naming it."""
    seen = {} if seen is None else seen
    _claim(top, seen, error)
    pending = [top]
    while pending:
        here = pending.pop()
        entries = _entries(here, error)
        dirs = [Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")]
        yield here, dirs, [e for e in entries if not e.is_dir()]
        for d in dirs:
            _claim(d, seen, error)
        pending.extend(reversed(dirs))


def dangling(entry: os.DirEntry) -> bool:
    """Whether a directory entry is a symbolic link to nothing (a stat only for links)."""
    return entry.is_symlink() and not os.path.exists(entry.path)


def broken_link_error(path: PathLike, error: type[Exception]) -> Exception:
    return error(f"'{path}' is a broken symbolic link (to '{os.readlink(path)}', which does not exist); fix or "
                 f"remove it")


def images_under(folder: Path, skipped: Optional[list[Path]] = None, seen: Optional[dict[str, Path]] = None
                 ) -> list[Path]:
    """Image files anywhere below `folder` (hidden folders skipped; walk_folders: links followed, a folder reached
    twice is an error), sorted by relative path; the other files (hidden ones included) are appended to
    `skipped` when given. A broken link named as an image is an error."""
    found, others = [], []
    for _, _, files in walk_folders(folder, ImageFolderError, seen):
        # the name alone decides (no stat per file on huge folders; links only are looked at)
        for entry in files:
            image = not entry.name.startswith(".") and os.path.splitext(entry.name)[1].lower() in IMAGE_EXTS
            if image and dangling(entry):
                raise broken_link_error(entry.path, ImageFolderError)
            (found if image else others).append(Path(entry.path))
    if skipped is not None:
        skipped.extend(sorted(others))
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def short_list(items: Sequence[Any], n: int = 5) -> str:
    """The first `n` items, comma-separated, and how many there are in all when that is more."""
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _json_label(name: str, label: object) -> str:
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise ValueError(f"label of '{name}' is {label!r}; labels must be integers or class-name strings")
    return str(label)


def read_labels_file(path: PathLike) -> dict[str, str]:
    """{file name: label string} from a JSON object or a CSV/TSV `file,label` file (docs/data.md)."""
    return read_name_value_file(path, what="label", error_cls=ImageFolderError, split="last",
                                header=(("filename", "file", "path"), ("label", "class")),
                                json_value=_json_label, json_example='{"file name": label}')


def _split_line(line: str, split: str) -> Optional[tuple[str, str]]:
    """`<name><sep><value>` (sep: a tab when the line has one, else a comma) -> (name, value); None if malformed.

    split="last": at the last separator; name and value must not be empty.
    split="first": at the first separator, so the value is the rest of the line (it may hold the separator,
    may be empty and may be quoted as in CSV); the name may be quoted too."""
    sep = "\t" if "\t" in line else ","
    if split == "last":
        name, _, value = line.rpartition(sep)
        name, value = name.strip(), value.strip()
        return (name, value) if name and value else None
    name, found, value = line.partition(sep)
    name, value = name.strip().strip('"'), value.strip()
    if not found or not name:
        return None
    if value.startswith('"'):  # CSV quoting ("a, b" or "say ""hi""")
        value = sep.join(next(csv.reader([value], delimiter=sep)))
    return name, value


def read_name_value_file(path: PathLike, *, what: str, error_cls: type[Exception], split: str = "last",
                         header: tuple[Sequence[str], Sequence[str]] = ((), ()),
                         json_value: Callable[[str, Any], str], json_example: str,
                         say_where: bool = False) -> dict[str, str]:
    """{file name (posix, "./a.png" -> "a.png"): value} from a `<what>s file`: a JSON object {name: value} or
    CSV/TSV `<file name>,<value>` lines (`split` as `_split_line`; blank lines, `#` comments and a first line of
    `header` names skipped). json_value(name, value) checks a JSON value and returns it as a string or raises
    ValueError. Errors are `error_cls`, naming the file (and the line; with `say_where`, a duplicate's both places)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise error_cls(f"{what}s file '{path}' not found")
    text = path.read_text(encoding="utf-8-sig")
    entries: list[tuple[str, str, str]] = []  # (name, value, where)
    if path.suffix.lower() == ".json":
        obj = parse_json(text, f"{what}s file '{path}'", f"a JSON object {json_example}", error_cls,
                         unique_keys=True)
        if not isinstance(obj, dict):
            raise error_cls(f"{what}s file '{path}': expected a JSON object {json_example}, got {type(obj).__name__}")
        for name, value in obj.items():
            try:
                entries.append((name, json_value(name, value), f"key '{name}'"))
            except ValueError as err:
                raise error_cls(f"{what}s file '{path}': {err}") from None
    else:
        names, values = header
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if split == "last":
                line = line.strip()
            parsed = _split_line(line, split)
            if parsed is None:
                raise error_cls(f"{what}s file '{path}' line {lineno}: {line!r} is not '<file name>,<{what}>' "
                                f"(or tab-separated)")
            name, value = parsed
            if not entries and name.lower() in names and value.lower() in values:
                continue  # header
            entries.append((name, value, f"line {lineno}"))
    table: dict[str, str] = {}
    for name, value, where in entries:
        key = Path(name).as_posix()  # "./a.png" -> "a.png"
        if key in table:
            raise error_cls(f"{what}s file '{path}' lists '{name}' twice" + (f" ({where})" if say_where else ""))
        table[key] = value
    if not table:
        raise error_cls(f"{what}s file '{path}' has no entries")
    return table


def list_image_folder(root: PathLike, labels_file: Optional[PathLike] = None,
                      skipped: Optional[list[Path]] = None) -> tuple[list[Path], np.ndarray, Optional[list[str]]]:
    """(image paths, int64 labels, class names or None) of an image folder (docs/data.md for layouts).
    The files passed over (not images by extension, or hidden) are appended to `skipped` when given."""
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise ImageFolderError(f"image folder '{root}' " + ("is a file, not a folder" if root.exists()
                                                            else "not found"))
    inside = [Path(e.path) for e in _entries(root, ImageFolderError)]     # sorted by name
    top_images = [p for p in inside if _is_image(p)]
    class_dirs = [p for p in inside if p.is_dir() and _visible(p)]
    if skipped is not None:
        skipped.extend(p for p in inside if not p.is_dir() and not _is_image(p))
    seen: dict[str, Path] = {}          # every folder walked once (a link loop or a second link is an error)
    _claim(root, seen, ImageFolderError)
    per_class = {d.name: images_under(d, skipped, seen) for d in class_dirs}
    if labels_file is None:
        return _list_class_folders(root, top_images, class_dirs, per_class)
    image_dirs = [d for d in class_dirs if per_class[d.name]]
    if image_dirs:
        raise ImageFolderError(
            f"image folder '{root}' mixes layouts: a labels file was given, so the images must lie directly in "
            f"the folder, but it has sub-folders with images ({short_list([d.name for d in image_dirs])}). Drop "
            f"--labels to use the sub-folders as classes, or flatten the folder.")
    if not top_images:
        raise ImageFolderError(f"no images ({' '.join(IMAGE_EXTS)}) found directly in '{root}'")
    return _list_flat_folder(root, top_images, labels_file)


def _list_class_folders(root: Path, top_images: list[Path], class_dirs: list[Path], per_class: dict[str, list[Path]]
                        ) -> tuple[list[Path], np.ndarray, list[str]]:
    """The class-folder layout: every visible sub-folder is a class (sorted by name) holding its images."""
    image_dirs = [d for d in class_dirs if per_class[d.name]]
    if top_images and image_dirs:
        raise ImageFolderError(
            f"image folder '{root}' mixes layouts: it has images directly inside "
            f"({short_list([p.name for p in top_images])}) and class sub-folders "
            f"({short_list([d.name for d in image_dirs])}). Use one sub-folder per class, or a flat folder with a "
            f"labels file (--labels).")
    if top_images:
        raise ImageFolderError(f"image folder '{root}' is flat (images directly inside, no class sub-folders): "
                               f"give a labels file (--labels FILE, 'file name,label' lines or a JSON object) "
                               f"or put the images in one sub-folder per class")
    if not image_dirs:
        raise ImageFolderError(f"no images ({' '.join(IMAGE_EXTS)}) found in '{root}' or its sub-folders")
    empty = [d.name for d in class_dirs if not per_class[d.name]]
    if empty:
        raise ImageFolderError(f"class folder(s) without images in '{root}': {short_list(empty)}; every sub-folder "
                               f"is a class and needs at least one image (remove the empty ones)")
    paths, labels = [], []
    for index, d in enumerate(class_dirs):
        paths.extend(per_class[d.name])
        labels.extend([index] * len(per_class[d.name]))
    return paths, np.asarray(labels, dtype=np.int64), [d.name for d in class_dirs]


def _list_flat_folder(root: Path, top_images: list[Path], labels_file: PathLike
                      ) -> tuple[list[Path], np.ndarray, Optional[list[str]]]:
    """The flat layout: the images directly in `root`, each labelled by the labels file (integers or names)."""
    table = read_labels_file(labels_file)
    names = [p.name for p in top_images]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ImageFolderError(f"labels file '{labels_file}' names file(s) that are not images in '{root}': "
                               f"{short_list(unknown)}")
    unlabelled = [n for n in names if n not in table]
    if unlabelled:
        raise ImageFolderError(f"image(s) in '{root}' have no label in '{labels_file}': {short_list(unlabelled)}")
    raw = [table[n] for n in names]
    if all(_INT.match(v) for v in raw):
        labels = np.asarray([int(v) for v in raw], dtype=np.int64)
        if labels.min() < 0:
            bad = [n for n, v in zip(names, labels) if v < 0]
            raise ImageFolderError(f"labels file '{labels_file}' gives negative labels (class indices must be >= 0): "
                                   f"{short_list(bad)}")
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
    return center_crop_arr(read_image(path, "cannot read image", error=ImageFolderError), resolution)


def unreadable_images(paths: Sequence[Path], pool: Optional[Executor] = None,
                      progress: Optional[Callable[[int], Any]] = None) -> list[tuple[int, str]]:
    """(position in `paths`, reason) of every image that does not decode fully (image_problem), in
    order; a thread pool decodes them in parallel, 1024 at a time. progress(n) is called after each n images."""
    bad = []
    for start in range(0, len(paths), 1024):
        chunk = paths[start:start + 1024]
        reasons = pool.map(image_problem, chunk) if pool else map(image_problem, chunk)  # None: decodes fully
        bad.extend((start + i, r) for i, r in enumerate(reasons) if r is not None)
        if progress is not None:
            progress(len(chunk))
    return bad
