"""The on-disk latent dataset format: a directory with meta.json, latents.npy and labels.npy.

    meta.json    {"format": "tread-latents", "version": 1, "shape": [C, H, W], "dtype": "float16"|"float32",
                  "num_samples": N, "num_classes": K, "latent_scale": s, "decode": {"type": "identity"} or
                  {"type": "vae", "vae": "<hub id or path>", "subfolder": null|"vae", "scaling_factor": s,
                   "shift_factor": null|f}, "source": "...", "class_names": [...] | null,
                  "files": {"latents": "latents.npy", "labels": "labels.npy"},
                  "latent_kind": "sample" | "moments"   (optional, default "sample"), ...extra keys}
    latents.npy  (N, C, H, W) of `dtype`; model-space latents are stored values * latent_scale.
                 latent_kind "moments": (N, 2C, H, W) VAE posterior moments (mean, logvar) in raw VAE
                 units; every read draws one latent, mean + exp(logvar / 2) * eps, then shifts and scales it.
    labels.npy   (N,) int64 in [0, K)

VAE data: model space = (raw VAE latent - shift_factor) * latent_scale, so "sample" data stores
raw - shift_factor (shift_factor is null/0 for SD-VAE); decode.scaling_factor records the VAE config's
value (normally equal to latent_scale; decoding uses latent_scale). scripts/precompute_latents.py writes
such datasets from image folders, with extra keys "image_resolution", "flip", "num_source_images".

Latents are memory-mapped, so random access never loads the whole array into RAM.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

FORMAT, VERSION = "tread-latents", 1
DTYPES = ("float16", "float32")
DECODE_TYPES = ("identity", "vae")
LATENT_KINDS = ("sample", "moments")
DEFAULT_FILES = {"latents": "latents.npy", "labels": "labels.npy"}
# Top-level meta.json keys and the JSON types they must have (checked in detail in read_meta).
META_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "version": (int,), "shape": (list,), "dtype": (str,), "num_samples": (int,),
    "num_classes": (int,), "latent_scale": (int, float), "decode": (dict,), "source": (str,),
    "class_names": (list, type(None)), "files": (dict,),
}
REBUILD = "Rebuild the dataset (e.g. with data.write_latent_dataset)."
FIX_META = "Fix meta.json or rebuild the dataset (e.g. with data.write_latent_dataset)."
PathLike = Union[str, os.PathLike]


class LatentDatasetError(ValueError):
    """A latent dataset (or its description) is missing, malformed or does not fit the model."""


class LatentDatasetExistsError(LatentDatasetError):
    """write_latent_dataset's target directory already exists (possibly written concurrently)."""


# ----------------------------------------------------------------------------- metadata

def _is_type(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int subclass, but true/false is never a valid count or scale.
    return isinstance(value, types) and not isinstance(value, bool)


def _number(v: Any) -> bool:
    return _is_type(v, (int, float)) and math.isfinite(v)


# Optional keys of a {"type": "vae", ...} decode object: (key, check, what is allowed).
DECODE_VAE_KEYS = (
    ("subfolder", lambda v: v is None or (isinstance(v, str) and bool(v)),
     "null or a non-empty string (the VAE's folder inside a model repo, e.g. 'vae')"),
    ("scaling_factor", lambda v: v is None or (_number(v) and v > 0),
     "null or a finite number > 0 (the VAE config's scaling_factor, e.g. 0.18215)"),
    ("shift_factor", lambda v: v is None or _number(v),
     "null or a finite number (the VAE config's shift_factor; null/absent means 0)"),
)


def validate_meta(meta: Any, where: str, advice: str = FIX_META) -> dict:
    """Check every meta key and value; errors start with `where` (the meta.json path) and end with `advice`."""
    def fail(key: str, expected: str) -> LatentDatasetError:
        return LatentDatasetError(f"{where}: key '{key}' is {meta.get(key)!r} but must be {expected}. {advice}")

    if not isinstance(meta, dict):
        raise LatentDatasetError(f"{where}: expected a JSON object, got {type(meta).__name__}. {advice}")
    if meta.get("format") != FORMAT:
        raise fail("format", f"'{FORMAT}' (is this a tread latent dataset?)")
    missing = [k for k in META_TYPES if k not in meta]
    if missing:
        raise LatentDatasetError(f"{where}: missing key(s) {missing}; a v{VERSION} dataset needs all of "
                                 f"{list(META_TYPES)}. {advice}")
    for key, types in META_TYPES.items():
        if not _is_type(meta[key], types):
            raise fail(key, "of JSON type " + " or ".join("null" if t is type(None) else t.__name__ for t in types))
    if meta["version"] != VERSION:
        raise fail("version", f"{VERSION} (the only version this code reads)")
    shape = meta["shape"]
    if len(shape) != 3 or not all(_is_type(s, (int,)) and s > 0 for s in shape):
        raise fail("shape", "[C, H, W] with three positive integers")
    if meta["dtype"] not in DTYPES:
        raise fail("dtype", f"one of {list(DTYPES)}")
    if meta["num_samples"] < 1:
        raise fail("num_samples", "a positive integer")
    if meta["num_classes"] < 1:
        raise fail("num_classes", "a positive integer")
    if not (math.isfinite(meta["latent_scale"]) and meta["latent_scale"] > 0):
        raise fail("latent_scale", "a finite number > 0 (1.0 for identity)")
    decode = meta["decode"]
    if decode.get("type") not in DECODE_TYPES:
        raise fail("decode", f"an object with 'type' in {list(DECODE_TYPES)}")
    if decode["type"] == "vae":
        if not isinstance(decode.get("vae"), str) or not decode["vae"]:
            raise fail("decode", "{'type': 'vae', 'vae': '<hub id or path>'} (the VAE name is missing)")
        for key, ok, expected in DECODE_VAE_KEYS:
            if key in decode and not ok(decode[key]):
                raise LatentDatasetError(f"{where}: key 'decode.{key}' is {decode[key]!r} but must be {expected}. "
                                         f"{advice}")
    names = meta["class_names"]
    if names is not None and (len(names) != meta["num_classes"] or not all(isinstance(n, str) for n in names)):
        raise fail("class_names", f"null or a list of {meta['num_classes']} strings (one per class)")
    kind = meta.get("latent_kind", "sample")
    if kind not in LATENT_KINDS:
        raise fail("latent_kind", f"one of {list(LATENT_KINDS)} (absent means 'sample')")
    if kind == "moments" and shape[0] % 2:
        raise fail("shape", "[2C, H, W] with an even channel count for latent_kind 'moments' (mean and logvar)")
    files = meta["files"]
    if set(files) != set(DEFAULT_FILES) or not all(isinstance(f, str) and f for f in files.values()):
        raise fail("files", f"an object with file names for exactly {sorted(DEFAULT_FILES)}")
    return meta


def read_meta(path: PathLike) -> dict:
    """Read and validate `path`/meta.json; errors name the path, the key and the bad value."""
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "not found"
        raise LatentDatasetError(
            f"Latent dataset {what} at '{root}': expected a directory with meta.json, latents.npy, labels.npy. "
            f"Set data.path=... to such a directory, write one with data.write_latent_dataset(), "
            f"or use the built-in data (data=toy).")
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise LatentDatasetError(f"Latent dataset at '{root}' has no meta.json (expected '{meta_path}'). "
                                 f"The directory is not a latent dataset or was not written completely. {REBUILD}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LatentDatasetError(f"{meta_path}: invalid JSON ({err}). {FIX_META}") from None
    return validate_meta(meta, str(meta_path))


# ----------------------------------------------------------------------------- writing

def _exists_error(root: Path) -> LatentDatasetExistsError:
    return LatentDatasetExistsError(f"'{root}' already exists; refusing to overwrite it. Delete it or "
                                    f"choose another path.")


def _check_target(root: Path) -> None:
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):
        raise _exists_error(root)


class LatentDatasetWriter:
    """Write a dataset piece by piece, never holding it in RAM; atomic like write_latent_dataset.

        with LatentDatasetWriter(path, shape=(C, H, W), num_samples=N, num_classes=K, ...) as writer:
            writer.write(start, latents, labels)   # stored values (N_i, C, H, W) and labels (N_i,), any order

    Pieces go into memory-mapped files in a temporary sibling directory; leaving the block without an error
    checks that every sample was written and renames the directory into place (commit()); an error removes
    it (abort()). Raises LatentDatasetExistsError if `path` exists and is not an empty directory.
    """

    def __init__(self, path: PathLike, *, shape: Sequence[int], num_samples: int, num_classes: int,
                 latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                 class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                 extra_meta: Optional[Mapping[str, Any]] = None):
        self.root = root = Path(path).expanduser().absolute()
        to_int = lambda v: int(v) if isinstance(v, np.integer) else v  # numpy ints are not JSON-serialisable
        self.meta = {"format": FORMAT, "version": VERSION, "shape": [to_int(s) for s in shape], "dtype": dtype,
                     "num_samples": to_int(num_samples), "num_classes": to_int(num_classes),
                     "latent_scale": float(latent_scale), "decode": dict(decode or {"type": "identity"}),
                     "source": source, "class_names": None if class_names is None else list(class_names),
                     "files": dict(DEFAULT_FILES), **(extra_meta or {})}
        validate_meta(self.meta, f"meta for '{root}'", "Fix the write_latent_dataset() arguments.")
        _check_target(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        self._tmp: Optional[Path] = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            n = self.meta["num_samples"]
            self._latents = np.lib.format.open_memmap(self._tmp / DEFAULT_FILES["latents"], mode="w+", dtype=dtype,
                                                      shape=(n, *self.meta["shape"]))
            self._labels = np.lib.format.open_memmap(self._tmp / DEFAULT_FILES["labels"], mode="w+",
                                                     dtype=np.int64, shape=(n,))
            self._written = np.zeros(n, dtype=bool)
        except BaseException:
            self.abort()
            raise

    def write(self, start: int, latents: np.ndarray, labels: np.ndarray) -> None:
        """Store samples [start, start + len(latents)): stored values (cast to the dataset dtype) and labels."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        latents, labels = np.asarray(latents), np.asarray(labels)
        n, stop = self.meta["num_samples"], start + len(latents)
        if latents.shape[1:] != tuple(self.meta["shape"]) or latents.ndim != 4:
            want = ", ".join(map(str, self.meta["shape"]))
            raise LatentDatasetError(f"latents for '{self.root}' must be (n, {want}) arrays, got shape {latents.shape}")
        if labels.shape != (len(latents),) or not (np.issubdtype(labels.dtype, np.integer) or len(labels) == 0):
            raise LatentDatasetError(f"labels for '{self.root}' must be a 1-D integer array of length {len(latents)} "
                                     f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
        if not 0 <= start <= stop <= n:
            raise LatentDatasetError(f"samples [{start}, {stop}) lie outside [0, num_samples={n}) of '{self.root}'")
        if len(latents) == 0:
            return
        k = self.meta["num_classes"]
        if labels.min() < 0 or labels.max() >= k:
            raise LatentDatasetError(f"labels for '{self.root}' range over [{labels.min()}, {labels.max()}] but must "
                                     f"lie in [0, num_classes={k}); pass the right num_classes or remap the labels")
        dtype = self.meta["dtype"]
        with np.errstate(over="ignore"):  # overflow is reported below, with advice
            chunk = latents.astype(dtype)
        if not np.isfinite(chunk).all():
            raise LatentDatasetError(
                f"latents for '{self.root}' contain non-finite values (NaN/inf) in samples [{start}, {stop}) after "
                f"casting to {dtype}" + (" (float16 overflows above 65504: use dtype='float32' or a smaller scale)"
                                         if dtype == "float16" else ""))
        self._latents[start:stop] = chunk
        self._labels[start:stop] = labels
        self._written[start:stop] = True

    def commit(self) -> Path:
        """Check that every sample was written, flush, and rename the dataset into place."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        try:
            missing = np.flatnonzero(~self._written)
            if len(missing):
                raise LatentDatasetError(f"dataset '{self.root}' is incomplete: {len(missing)} of "
                                         f"{len(self._written)} samples were never written (first: "
                                         f"{missing[:5].tolist()})")
            tmp = self._tmp
            self._latents.flush()
            self._labels.flush()
            del self._latents, self._labels
            (tmp / "meta.json").write_text(json.dumps(self.meta, indent=2) + "\n")
            for f in tmp.iterdir():  # data on disk before the rename publishes it
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            try:
                os.replace(tmp, self.root)  # atomic; also replaces an empty directory, fails on a non-empty one
            except OSError:
                if self.root.exists():  # another writer got there first
                    raise _exists_error(self.root) from None
                raise
            self._tmp = None
        except BaseException:
            self.abort()
            raise
        return self.root

    def abort(self) -> None:
        """Remove the temporary directory (nothing is published)."""
        self.__dict__.pop("_latents", None)
        self.__dict__.pop("_labels", None)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "LatentDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_latent_dataset(path: PathLike, latents: np.ndarray, labels: np.ndarray, *, num_classes: int,
                         latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                         class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                         extra_meta: Optional[Mapping[str, Any]] = None, chunk_size: int = 4096) -> Path:
    """Write a dataset atomically: build it in a temporary sibling directory, then rename it into place.

    `latents` (N, C, H, W) are the *stored* values (model space / latent_scale). `extra_meta` adds keys to
    meta.json (e.g. "builtin"). Raises LatentDatasetExistsError if `path` exists and is not an empty directory.
    Datasets too big for RAM: LatentDatasetWriter.
    """
    root = Path(path).expanduser().absolute()
    latents, labels = np.asarray(latents), np.asarray(labels)
    if latents.ndim != 4 or min(latents.shape) < 1:
        raise LatentDatasetError(f"latents for '{root}' must be a non-empty (N, C, H, W) array, got shape "
                                 f"{latents.shape}")
    if labels.shape != (len(latents),) or not np.issubdtype(labels.dtype, np.integer):
        raise LatentDatasetError(f"labels for '{root}' must be a 1-D integer array of length N={len(latents)} "
                                 f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
    with LatentDatasetWriter(root, shape=latents.shape[1:], num_samples=len(latents), num_classes=num_classes,
                             latent_scale=latent_scale, decode=decode, source=source, class_names=class_names,
                             dtype=dtype, extra_meta=extra_meta) as writer:
        if not (labels.min() >= 0 and labels.max() < writer.meta["num_classes"]):  # checked before any copying
            raise LatentDatasetError(f"labels for '{root}' range over [{labels.min()}, {labels.max()}] but must lie "
                                     f"in [0, num_classes={num_classes}); pass the right num_classes or remap the "
                                     f"labels")
        # Chunked copy into the memmap: casting never needs a second full copy of the array in RAM.
        for start in range(0, len(latents), chunk_size):
            writer.write(start, latents[start:start + chunk_size], labels[start:start + chunk_size])
    return root


# ----------------------------------------------------------------------------- reading

def _open_npy(file: Path, key: str) -> np.ndarray:
    """Memory-map one .npy file; missing or unreadable files raise LatentDatasetError naming it."""
    if not file.is_file():
        raise LatentDatasetError(f"missing {key} file '{file}' (meta.json files.{key}='{file.name}'): the "
                                 f"dataset is incomplete. {REBUILD}")
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise LatentDatasetError(f"cannot read {key} file '{file}' as a .npy array ({err}): it is corrupt or "
                                 f"truncated. {REBUILD}") from None


class LatentMeta:
    """What every dataset reader derives from its meta dict (`self._meta`, our meta.json format) and
    `self.root`: shapes, counts, and the checks against what the model expects."""

    _meta: dict
    root: Path
    _FIX = "Point data.path at matching data, or change the data/model config to match it."

    def _shape_source(self) -> str:
        """Where the shape comes from, for error messages."""
        return f"meta.json shape {list(model_shape(self._meta))}"

    def _check_expected(self, channels: Optional[int], resolution: Optional[int],
                        num_classes: Optional[int]) -> None:
        c, h, w = model_shape(self._meta)
        head, src, fix = f"data at '{self.root}'", self._shape_source(), self._FIX
        if channels is not None and c != channels:
            raise LatentDatasetError(f"{head} has {c} channels ({src}) but the model expects in_channels={channels} "
                                     f"(data.channels). {fix}")
        if resolution is not None and (h, w) != (resolution, resolution):
            raise LatentDatasetError(f"{head} is {h}x{w} ({src}) but the model expects input_size={resolution} "
                                     f"(data.resolution). {fix}")
        if num_classes is not None and self._meta["num_classes"] != num_classes:
            raise LatentDatasetError(f"{head} has {self._meta['num_classes']} classes (num_classes) but the model "
                                     f"expects num_classes={num_classes} (data.num_classes). {fix}")

    @property
    def meta(self) -> dict:
        """The validated meta (meta.json format; `shape` is the stored shape)."""
        return self._meta

    @property
    def shape(self) -> tuple[int, int, int]:
        """Model-space latent shape (C, H, W) (for moments data: half the stored channels)."""
        return model_shape(self._meta)

    @property
    def channels(self) -> int:
        """Model-space latent channels C."""
        return self.shape[0]

    @property
    def latent_kind(self) -> str:
        """"sample" (items are model-space latents) or "moments" (items are raw (mean, logvar): see draw_latents)."""
        return latent_kind(self._meta)

    @property
    def resolution(self) -> int:
        """Latent side H (= W); non-square data has no single resolution."""
        _, h, w = self._meta["shape"]
        if h != w:
            raise LatentDatasetError(f"data at '{self.root}' is {h}x{w}: not square, so it has no single "
                                     f"resolution (the models take square latents)")
        return h

    @property
    def num_classes(self) -> int:
        """Number of classes K (labels lie in [0, K))."""
        return self._meta["num_classes"]

    @property
    def latent_scale(self) -> float:
        """Stored (or drawn) values are multiplied by this to give model-space latents."""
        return float(self._meta["latent_scale"])

    def __len__(self) -> int:
        return self._meta["num_samples"]


class LatentDataset(LatentMeta, torch.utils.data.Dataset):
    """Memory-mapped latent dataset; items are (float32 latent (C, H, W) * latent_scale, int64 label)."""

    def __init__(self, path: PathLike, expected_channels: Optional[int] = None,
                 expected_resolution: Optional[int] = None, expected_num_classes: Optional[int] = None):
        self.root = Path(path).expanduser().absolute()
        self._meta = read_meta(self.root)
        self._latents: Optional[np.ndarray] = None
        self._labels: Optional[np.ndarray] = None
        self._validate_files()
        self._check_expected(expected_channels, expected_resolution, expected_num_classes)

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        """Open the memmaps on first use in each process (they are dropped when pickled to workers)."""
        if self._latents is None:
            files = self._meta["files"]
            self._latents = _open_npy(self.root / files["latents"], "latents")
            self._labels = _open_npy(self.root / files["labels"], "labels")
        return self._latents, self._labels

    def __getstate__(self) -> dict:
        # Pickle only the path and meta: a worker re-maps the files instead of receiving a copy of them.
        return {**self.__dict__, "_latents": None, "_labels": None}

    def _validate_files(self) -> None:
        latents, labels = self._open()
        m, files = self._meta, self._meta["files"]
        lat_file, lab_file = self.root / files["latents"], self.root / files["labels"]
        want = (m["num_samples"], *m["shape"])
        if latents.shape != want or latents.dtype != np.dtype(m["dtype"]):
            raise LatentDatasetError(
                f"'{lat_file}' holds a {latents.dtype} array of shape {list(latents.shape)} but meta.json says "
                f"{m['dtype']} of shape {list(want)} (num_samples + shape). {REBUILD}")
        if labels.shape != (m["num_samples"],) or not np.issubdtype(labels.dtype, np.integer):
            raise LatentDatasetError(
                f"'{lab_file}' holds a {labels.dtype} array of shape {list(labels.shape)} but must be int64 of "
                f"shape [{m['num_samples']}] (meta.json num_samples). {REBUILD}")
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= m["num_classes"]:
            raise LatentDatasetError(f"'{lab_file}' has labels in [{lo}, {hi}] but meta.json num_classes="
                                     f"{m['num_classes']} allows only [0, {m['num_classes'] - 1}]. {REBUILD}")


    def _scale(self) -> float:
        # Moments stay in raw VAE units (logvar must not be scaled); draw_latents scales the drawn latent.
        return 1.0 if self.latent_kind == "moments" else self.latent_scale

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        latents, labels = self._open()
        x = torch.from_numpy(np.array(latents[index], dtype=np.float32))  # (C, H, W), copied off the memmap
        return x * self._scale(), torch.tensor(int(labels[index]), dtype=torch.int64)

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched fetch, (x (B, C, H, W) float32, y (B,) int64), with one fancy-indexed read of the memmap."""
        latents, labels = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")  # ascending reads are mostly sequential on disk
        x, y = np.empty((len(idx), *latents.shape[1:]), np.float32), np.empty(len(idx), np.int64)
        x[order], y[order] = latents[idx[order]], labels[idx[order]]  # read sorted, write back in request order
        return torch.from_numpy(x) * self._scale(), torch.from_numpy(y)


# ----------------------------------------------------------------------------- latent kinds

def latent_kind(meta: Mapping[str, Any]) -> str:
    """"sample" (stored values are latents) or "moments" (stored (mean, logvar) of the VAE posterior)."""
    return meta.get("latent_kind", "sample")


def shift_factor(meta: Mapping[str, Any]) -> float:
    """The VAE's shift_factor (decode.shift_factor; 0 when absent/null or not VAE data)."""
    decode = meta.get("decode") or {}
    return float(decode.get("shift_factor") or 0.0) if decode.get("type") == "vae" else 0.0


def model_shape(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """Shape (C, H, W) of the latents the model sees: the stored shape, halved in C for moments."""
    c, h, w = meta["shape"]
    return (c // 2, h, w) if latent_kind(meta) == "moments" else (c, h, w)


def draw_latents(x: torch.Tensor, meta: Mapping[str, Any], mode: str = "sample",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Dataset items -> model-space latents (B, C, H, W).

    "sample" data is returned as is (already scaled). "moments" data (B, 2C, H, W) = (mean, logvar) in raw
    VAE units gives latent_scale * (mean + exp(logvar / 2) * eps - shift) with eps ~ N(0, I) from `generator`
    (the device's global RNG if None; shift = decode.shift_factor, 0 for SD-VAE); mode="mean" returns
    latent_scale * (mean - shift) (no noise, e.g. for references).
    """
    if mode not in ("sample", "mean"):
        raise ValueError(f"draw_latents mode={mode!r}; allowed: 'sample', 'mean'")
    if latent_kind(meta) != "moments":
        return x
    if x.ndim != 4 or x.shape[1] % 2:
        raise LatentDatasetError(f"moments data needs (B, 2C, H, W) items, got shape {list(x.shape)}")
    mean, logvar = x.float().chunk(2, dim=1)
    if mode == "sample":
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))  # the clamp diffusers' DiagonalGaussianDistribution uses
        mean = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean - shift_factor(meta)) * float(meta["latent_scale"])


# ----------------------------------------------------------------------------- decoding

def _vae_location(decode: Mapping[str, Any], vae: Optional[str]) -> tuple[str, Optional[str]]:
    """(VAE name/path, subfolder) to load: meta's, or the `vae` override. An override directory that holds
    the VAE itself (config.json at its top) ignores meta's subfolder; a copy of a whole model repo keeps it."""
    subfolder = decode.get("subfolder") or None
    if vae is None:
        return decode["vae"], subfolder
    if subfolder and (Path(vae).expanduser() / "config.json").is_file():
        subfolder = None
    return str(vae), subfolder


def _load_decoder(meta: Mapping[str, Any], vae: Optional[str], vae_dtype: str, device: Any):
    from .vae import load_vae

    decode = meta["decode"]
    name, subfolder = _vae_location(decode, vae)
    try:
        return load_vae(name, subfolder=subfolder, device=device, dtype=vae_dtype)
    except LatentDatasetError as err:
        raise LatentDatasetError(f"data meta decode.type='vae', vae={decode.get('vae')!r}"
                                 f"{'' if vae is None else f' (overridden by vae={vae!r})'}: {err} Training needs "
                                 f"the VAE only for in-training evaluation: without it, turn that off with "
                                 f"eval.every_steps=0 eval.at_end=false.") from None


def decode_to_uint8(latents: torch.Tensor, meta: Mapping[str, Any], *, vae: Optional[str] = None,
                    vae_dtype: str = "float32", batch_size: int = 32) -> torch.Tensor:
    """Model-space latents (B, C, H, W) -> uint8 images (B, H', W', 3) on the latents' device, per meta["decode"].

    identity: pixels = latents / latent_scale in [-1, 1]. vae: raw = latents / latent_scale + shift_factor
    (decode.shift_factor, default 0) is decoded by the VAE named in decode.vae (or the local directory `vae`,
    e.g. on an offline machine) in `vae_dtype`, `batch_size` latents at a time; its [-1, 1] output is
    rounded to uint8 exactly as identity pixels are. The VAE is loaded once per process (data.vae.load_vae).
    """
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") == "vae":
        model = _load_decoder(meta, vae, vae_dtype, latents.device)
        from .vae import decode_raw_to_uint8

        raw = latents.float() / float(meta.get("latent_scale", 1.0)) + shift_factor(meta)
        return decode_raw_to_uint8(model, raw, batch_size=batch_size)
    if decode.get("type") != "identity":
        raise LatentDatasetError(f"meta decode.type={decode.get('type')!r} is unknown; allowed: {list(DECODE_TYPES)}")
    if latents.ndim != 4 or latents.shape[1] not in (1, 3):
        raise LatentDatasetError(f"identity decoding needs (B, C, H, W) latents with C = 1 or 3 (pixels), got shape "
                                 f"{list(latents.shape)}; data with other channel counts needs a decoder "
                                 f"(meta decode.type='vae')")
    x = latents.float() / float(meta.get("latent_scale", 1.0))
    images = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # [-1, 1] -> [0, 255]
    return images.expand(-1, -1, -1, 3).contiguous() if images.shape[-1] == 1 else images.contiguous()


def check_decodable(meta: Mapping[str, Any], *, vae: Optional[str] = None, vae_dtype: str = "float32",
                    batch_size: int = 32, device: Any = "cpu") -> None:
    """Raise LatentDatasetError now if samples of this data cannot be turned into pixels
    (so evaluation and sampling fail at start-up, not after hours of training).

    VAE data: loads the VAE (cached, so the later decode_to_uint8 on the same `device` reuses it) and checks
    that its latent channels match the data. Same keyword arguments as decode_to_uint8, plus `device`.
    """
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") != "vae":
        decode_to_uint8(torch.zeros(1, *model_shape(meta)), meta)
        return
    from .vae import vae_dtype as check_dtype

    check_dtype(vae_dtype)
    if batch_size < 1:
        raise LatentDatasetError(f"VAE decode batch size is {batch_size}; it must be >= 1")
    model = _load_decoder(meta, vae, vae_dtype, device)
    c = model_shape(meta)[0]
    if model.config.latent_channels != c:
        name, _ = _vae_location(decode, vae)
        raise LatentDatasetError(f"the data has {c}-channel latents (meta.json shape {meta['shape']}, latent_kind "
                                 f"{latent_kind(meta)!r}) but the VAE '{name}' takes {model.config.latent_channels} "
                                 f"channels: the data was encoded with another VAE")
