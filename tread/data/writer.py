"""Writing latent datasets (the format of tread/data/meta.py) atomically: whole arrays (write_latent_dataset) or piece
by piece into memory-mapped files (LatentDatasetWriter), built in a temporary sibling directory that is renamed
into place when complete."""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from tread.utils.io import WriteError, writing

from .integrity import integrity_record
from .layout import DECLARE, EXTRA_NDIM, EXTRA_WHAT, conditioning_layout
from .meta import (CAPTION_FILES, CAPTION_KEYS, DEFAULT_FILES, EXTRA_FILE_OF, EXTRA_FILES, EXTRA_KEYS, FORMAT,
                   INTEGRITY_KEY, VERSION, LatentDatasetError, LatentDatasetExistsError, PathLike,
                   caption_offsets, first_frame_shape, model_shape, repa_features_shape, validate_meta)


def _exists_error(root: Path) -> LatentDatasetExistsError:
    return LatentDatasetExistsError(f"'{root}' already exists; refusing to overwrite it. Delete it or "
                                    f"choose another path.")


def _check_target(root: Path) -> None:
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):
        raise _exists_error(root)


def _check_space(root: Path, folder: Path, need: int) -> None:
    """A WriteError (ENOSPC) naming `root` unless the disk of `folder` (its staging folder) has `need` bytes free:
    a write into a memory map on a full disk does not raise, it kills the process (SIGBUS)."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise WriteError(errno.ENOSPC, f"No space left on device: the dataset needs {_bytes(need)}, {_bytes(free)} "
                                       f"free", str(root))


def _bytes(n: float) -> str:
    """A byte count as people read it: '612 bytes', '6.0 KiB', '1.2 GiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _cast_finite(a: np.ndarray, dtype: str, what: str, start: int, stop: int, fix: str) -> np.ndarray:
    """`a` cast to the storage dtype; NaN/inf (float16 overflow included) is an error naming the samples."""
    with np.errstate(over="ignore"):  # overflow is reported below, with advice
        out = a.astype(dtype)
    if not np.isfinite(out).all():
        raise LatentDatasetError(f"{what} non-finite values (NaN/inf) in samples [{start}, {stop}) after casting to "
                                 f"{dtype}" + (f" (float16 overflows above 65504: {fix})" if dtype == "float16" else ""))
    return out


class LatentDatasetWriter:
    """Write a dataset piece by piece into memory-mapped files, never holding it in RAM; atomic like
    write_latent_dataset.

        with LatentDatasetWriter(path, shape=(C, H, W), num_samples=N, num_classes=K, ...) as writer:
            writer.write(start, latents, labels, extras={...})   # stored values (N_i, ...), labels (N_i,), any order

    Each optional file declared here (text_shape=(L, D), text_mask=True, pooled_dim=P, llama_shape=(n, L, Dl),
    glyph_shape=(Lg, Dg) (with its glyph_mask), loss_mask_shape=(Hm, Wm), reference_latents=True, first_frame_latents=True with video=meta "video",
    repa_features=meta "repa_features") must come with every write as its extras key (EXTRA_KEYS). caption_counts
    and/or empty_prompt make the text parts a caption table, written with write_captions(start_row, ...) instead;
    conditioning_meta adds free keys to meta "conditioning". A clean exit checks every sample was written, records
    meta "integrity" and renames the directory into place (commit()); an error removes it (abort()). Raises
    LatentDatasetExistsError if `path` exists and is not an empty directory.
    """

    def __init__(self, path: PathLike, *, shape: Sequence[int], num_samples: int, num_classes: int,
                 latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                 class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                 extra_meta: Optional[Mapping[str, Any]] = None, text_shape: Optional[Sequence[int]] = None,
                 text_mask: bool = False, pooled_dim: Optional[int] = None,
                 loss_mask_shape: Optional[Sequence[int]] = None,
                 conditioning_meta: Optional[Mapping[str, Any]] = None, reference_latents: bool = False,
                 llama_shape: Optional[Sequence[int]] = None, caption_counts: Optional[Sequence[int]] = None,
                 empty_prompt: bool = False, video: Optional[Mapping[str, Any]] = None,
                 first_frame_latents: bool = False, repa_features: Optional[Mapping[str, Any]] = None,
                 glyph_shape: Optional[Sequence[int]] = None, image_embeds_shape: Optional[Sequence[int]] = None):
        self.root = root = Path(path).expanduser().absolute()
        to_int = lambda v: int(v) if isinstance(v, np.integer) else v  # numpy ints are not JSON-serialisable
        self.meta = {"format": FORMAT, "version": VERSION, "shape": [to_int(s) for s in shape], "dtype": dtype,
                     "num_samples": to_int(num_samples), "num_classes": to_int(num_classes),
                     "latent_scale": float(latent_scale), "decode": dict(decode or {"type": "identity"}),
                     "source": source, "class_names": None if class_names is None else list(class_names),
                     "files": dict(DEFAULT_FILES), **(extra_meta or {})}
        if video is not None:
            self.meta["video"] = {k: to_int(v) for k, v in dict(video).items()}
        if repa_features is not None:
            self.meta["repa_features"] = _json_ready(repa_features)
            self.meta["files"]["repa_features"] = EXTRA_FILES["repa_features"]
        clash = sorted({"conditioning", "loss_mask", INTEGRITY_KEY, "video", "repa_features"} & set(extra_meta or {}))
        if clash:
            raise LatentDatasetError(f"extra_meta for '{root}' sets {clash}: describe conditioning and loss masks "
                                     f"with text_shape/text_mask/pooled_dim/loss_mask_shape/conditioning_meta, video "
                                     f"data with video=..., stored REPA features with repa_features=... (the writer "
                                     f"records '{INTEGRITY_KEY}' itself)")
        self._offsets = caption_offsets(root, caption_counts, empty_prompt, to_int(num_samples))
        self.empty_row = int(self._offsets[-1]) if self._offsets is not None and empty_prompt else None
        captions = None if self._offsets is None else {"rows": int(self._offsets[-1]) + bool(empty_prompt),
                                                       "empty_prompt": bool(empty_prompt)}
        extra, self._specs = conditioning_layout(root, dtype, text_shape, text_mask, pooled_dim, loss_mask_shape,
                                                  conditioning_meta, llama_shape, captions, glyph_shape,
                                                  image_embeds_shape)
        self.meta.update(extra)
        if captions is not None:
            self.meta["files"].update(CAPTION_FILES)
        for name, flag in (("reference_latents", reference_latents), ("first_frame_latents", first_frame_latents)):
            if not isinstance(flag, (bool, np.bool_)):
                raise LatentDatasetError(f"{name} for '{root}' is {flag!r} but must be True or False")
            if flag:
                self.meta["files"][name] = EXTRA_FILES[name]
        self.meta["files"].update({EXTRA_FILE_OF[k]: EXTRA_FILES[EXTRA_FILE_OF[k]] for k in self._specs})
        validate_meta(self.meta, f"meta for '{root}'", "Fix the write_latent_dataset() arguments.")
        if reference_latents:   # the model-space shape (validated above): C halved for moments data
            self._specs["reference"] = (model_shape(self.meta), dtype)
        if first_frame_latents:
            self._specs["first_frame"] = (first_frame_shape(self.meta), dtype)
        if repa_features is not None:
            self._specs["repa_features"] = (repa_features_shape(self.meta), dtype)
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as err:
            raise LatentDatasetError(f"meta for '{root}' is not JSON-serialisable ({err}); pass plain "
                                     f"str/int/float/bool/list/dict values in extra_meta and conditioning_meta"
                                     ) from None
        self._open_files(captions, dtype)

    def _open_files(self, captions: Optional[dict], dtype: str) -> None:
        """The temporary sibling directory (the staging folder .<name>.tmp-*) and a memory-mapped .npy per stored
        array (the caption offsets saved), once the disk has room for them all. Failed writes: WriteError."""
        root = self.root
        _check_target(root)
        self._tmp: Optional[Path] = None
        self._maps: dict[str, np.ndarray] = {}
        with writing(root):
            root.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            n, files = self.meta["num_samples"], self.meta["files"]
            layout = {"latents": (tuple(self.meta["shape"]), dtype), "labels": ((), np.int64), **self._specs}
            shapes = {key: ((self._rows(key), *tail), dt) for key, (tail, dt) in layout.items()}
            _check_space(root, self._tmp, sum(int(np.prod(shape)) * np.dtype(dt).itemsize
                                              for shape, dt in shapes.values()))
            for key, (shape, dt) in shapes.items():
                path = self._tmp / files[EXTRA_FILE_OF.get(key, key)]
                with writing(path):
                    self._maps[key] = np.lib.format.open_memmap(path, mode="w+", dtype=dt, shape=shape)
            self._written = np.zeros(n, dtype=bool)
            self._rows_written = np.zeros(0 if captions is None else captions["rows"], dtype=bool)
            if captions is not None:
                with writing(self._tmp / CAPTION_FILES["caption_offsets"]):
                    np.save(self._tmp / CAPTION_FILES["caption_offsets"], self._offsets)
        except BaseException:
            self.abort()
            raise

    def _rows(self, key: str) -> int:
        """The rows of a stored array: one per caption for the text parts of a caption table, else per sample."""
        table = self._offsets is not None and key in CAPTION_KEYS
        return self.meta["conditioning"]["captions"]["rows"] if table else self.meta["num_samples"]

    def _check_extra_keys(self, got: Mapping[str, Any], want: Mapping[str, Any], captions: bool) -> None:
        """One write's extras keys against the declared arrays `want`: none unknown, missing or undeclared."""
        root = self.root
        if self._offsets is not None and not captions and set(got) & set(CAPTION_KEYS):
            raise LatentDatasetError(f"extras for '{root}' include {sorted(set(got) & set(CAPTION_KEYS))}, but the "
                                     f"dataset has a caption table: write the text parts with write_captions()")
        unknown = sorted(set(got) - set(EXTRA_KEYS))
        if unknown:
            raise LatentDatasetError(f"extras for '{root}' have unknown key(s) {unknown}; allowed: {list(EXTRA_KEYS)}")
        missing, undeclared = [k for k in want if k not in got], [k for k in got if k not in want]
        if missing:
            raise LatentDatasetError(f"extras for '{root}' lack {missing}: the dataset stores {list(want)} (declared "
                                     f"by the writer's text_shape/text_mask/pooled_dim/llama_shape/loss_mask_shape/"
                                     f"reference_latents), so every write must give them")
        if undeclared:
            raise LatentDatasetError(f"extras for '{root}' include {undeclared}, which the dataset does not store: "
                                     f"declare them when creating the writer ({DECLARE})")

    def _prepare_extras(self, extras: Optional[Mapping[str, Any]], n: int, start: int,
                        captions: bool = False) -> dict[str, np.ndarray]:
        """Check one write's extras against the declared arrays (with a caption table: the text parts when
        `captions`, the others when not); returns them cast for storage."""
        got, root = dict(extras or {}), self.root
        want = {k: v for k, v in self._specs.items() if self._offsets is None or (k in CAPTION_KEYS) == captions}
        self._check_extra_keys(got, want, captions)
        out = {}
        for key, (tail, dtype) in want.items():
            a, head = np.asarray(got[key]), f"extras['{key}'] for '{root}'"
            if a.shape != (n, *tail):
                want = ", ".join(map(str, (n, *tail)))
                raise LatentDatasetError(f"{head} must be a {EXTRA_WHAT[key]} of shape ({want}) (one per "
                                         f"{'caption row' if captions else 'latent'}), got shape {a.shape}")
            if key in ("text", "pooled", "llama", "glyph", "reference", "first_frame", "image_embeds",
                       "repa_features"):
                if not (np.issubdtype(a.dtype, np.floating) or a.size == 0):
                    raise LatentDatasetError(f"{head} must be a float array, got {a.dtype}")
                a = _cast_finite(a, dtype, f"{head} contains", start, start + n, "use dtype='float32'")
            elif key in ("text_mask", "glyph_mask"):
                if a.dtype != np.bool_:
                    if not (np.issubdtype(a.dtype, np.integer) and np.isin(a, (0, 1)).all()):
                        raise LatentDatasetError(f"{head} must be bool (True = real token) or 0/1 integers, got "
                                                 f"{a.dtype}" + (f" with values in [{a.min()}, {a.max()}]"
                                                                 if a.size else ""))
                    a = a.astype(bool)
                empty = np.flatnonzero(~a.any(axis=1)) if a.shape[1] else np.arange(n)
                if len(empty) and key == "text_mask":   # a glyph mask is all False without quoted text
                    raise LatentDatasetError(f"{head}: sample(s) {(start + empty[:5]).tolist()} have no real token "
                                             f"(all False); attention over no tokens is undefined (a tokenized "
                                             f"prompt keeps at least its end-of-sequence token)")
            else:  # loss_mask
                if a.dtype == np.bool_:
                    a = a.astype(np.uint8) * 255
                elif np.issubdtype(a.dtype, np.floating):
                    if a.size and not (np.isfinite(a).all() and a.min() >= 0 and a.max() <= 1):
                        raise LatentDatasetError(f"{head} is a float mask, so it must lie in [0, 1] (coverage), "
                                                 f"got values in [{np.nanmin(a)}, {np.nanmax(a)}]"
                                                 f"{' with NaN/inf' if not np.isfinite(a).all() else ''}")
                    a = np.rint(a.astype(np.float64) * 255).astype(np.uint8)
                elif np.issubdtype(a.dtype, np.integer):
                    if a.size and (a.min() < 0 or a.max() > 255):
                        raise LatentDatasetError(f"{head} is an integer mask, so it must lie in [0, 255] (uint8 "
                                                 f"coverage), got values in [{a.min()}, {a.max()}]")
                    a = a.astype(np.uint8)
                else:
                    raise LatentDatasetError(f"{head} must be uint8 (0..255) or float (0..1), got {a.dtype}")
            out[key] = a
        return out

    def write(self, start: int, latents: np.ndarray, labels: np.ndarray,
              extras: Optional[Mapping[str, np.ndarray]] = None) -> None:
        """Store samples [start, start + len(latents)): stored values (cast to the dataset dtype), labels, and
        (exactly) the declared extras {"text", "text_mask", "pooled", "llama", "loss_mask", "reference"}: see
        the class doc."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        latents, labels = np.asarray(latents), np.asarray(labels)
        n, stop = self.meta["num_samples"], start + len(latents)
        if latents.shape[1:] != tuple(self.meta["shape"]):
            want = ", ".join(map(str, self.meta["shape"]))
            raise LatentDatasetError(f"latents for '{self.root}' must be (n, {want}) arrays, got shape {latents.shape}")
        if labels.shape != (len(latents),) or not (np.issubdtype(labels.dtype, np.integer) or len(labels) == 0):
            raise LatentDatasetError(f"labels for '{self.root}' must be a 1-D integer array of length {len(latents)} "
                                     f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
        if not 0 <= start <= stop <= n:
            raise LatentDatasetError(f"samples [{start}, {stop}) lie outside [0, num_samples={n}) of '{self.root}'")
        prepared = self._prepare_extras(extras, len(latents), start)
        if len(latents) == 0:
            return
        k = self.meta["num_classes"]
        if labels.min() < 0 or labels.max() >= k:
            raise LatentDatasetError(f"labels for '{self.root}' range over [{labels.min()}, {labels.max()}] but must "
                                     f"lie in [0, num_classes={k}); pass the right num_classes or remap the labels")
        dtype = self.meta["dtype"]
        chunk = _cast_finite(latents, dtype, f"latents for '{self.root}' contain", start, stop,
                             "use dtype='float32' or a smaller scale")
        for key, value in {"latents": chunk, "labels": labels, **prepared}.items():
            self._maps[key][start:stop] = value
        self._written[start:stop] = True

    def write_captions(self, start: int, extras: Mapping[str, np.ndarray]) -> None:
        """Store caption rows [start, start + n) of a caption table: (exactly) the declared text parts {"text",
        "text_mask", "pooled", "llama"}, n rows each (sample i's captions are rows [offsets[i], offsets[i + 1]);
        the empty prompt is row `empty_row`)."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        if self._offsets is None:
            raise LatentDatasetError(f"'{self.root}' has no caption table (one caption per sample): give the text "
                                     f"parts to write(), or declare caption_counts/empty_prompt")
        n = len(np.asarray(next(iter(extras.values())))) if extras else 0
        rows, stop = len(self._rows_written), start + n
        if not 0 <= start <= stop <= rows:
            raise LatentDatasetError(f"caption rows [{start}, {stop}) lie outside [0, {rows}) of '{self.root}'")
        for key, value in self._prepare_extras(extras, n, start, captions=True).items():
            self._maps[key][start:stop] = value
        self._rows_written[start:stop] = True

    def commit(self) -> Path:
        """Check that every sample (and caption row) was written, flush, and rename the dataset into place."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        try:
            missing = np.flatnonzero(~self._written)
            if len(missing):
                raise LatentDatasetError(f"dataset '{self.root}' is incomplete: {len(missing)} of "
                                         f"{len(self._written)} samples were never written (first: "
                                         f"{missing[:5].tolist()})")
            missing = np.flatnonzero(~self._rows_written)
            if len(missing):
                raise LatentDatasetError(f"dataset '{self.root}' is incomplete: {len(missing)} of "
                                         f"{len(self._rows_written)} caption rows were never written (first: "
                                         f"{missing[:5].tolist()})")
            tmp = self._tmp
            with writing(tmp):
                for array in self._maps.values():
                    array.flush()
                self._maps.clear()
                self.meta[INTEGRITY_KEY] = integrity_record(tmp, self.meta["files"])   # digests, finiteness
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
        self.__dict__.get("_maps", {}).clear()
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


def _json_ready(value: Any) -> Any:
    """A plain-data meta value with numpy numbers and tuples made JSON's ints, floats and lists."""
    if isinstance(value, Mapping):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, np.ndarray)):
        return [_json_ready(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _check_arrays(root: Path, latents: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """The latents (N, C, H, W) (video: (N, C, T, H, W)) and integer labels (N,) of write_latent_dataset as arrays,
    or one error."""
    latents, labels = np.asarray(latents), np.asarray(labels)
    if latents.ndim not in (4, 5) or min(latents.shape) < 1:
        raise LatentDatasetError(f"latents for '{root}' must be a non-empty (N, C, H, W) array (video: (N, C, T, H, "
                                 f"W)), got shape {latents.shape}")
    if labels.shape != (len(latents),) or not np.issubdtype(labels.dtype, np.integer):
        raise LatentDatasetError(f"labels for '{root}' must be a 1-D integer array of length N={len(latents)} "
                                 f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
    return latents, labels


def write_latent_dataset(path: PathLike, latents: np.ndarray, labels: np.ndarray, *, num_classes: int,
                         latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                         class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                         extra_meta: Optional[Mapping[str, Any]] = None, chunk_size: int = 4096,
                         extras: Optional[Mapping[str, np.ndarray]] = None,
                         conditioning_meta: Optional[Mapping[str, Any]] = None,
                         caption_counts: Optional[Sequence[int]] = None,
                         empty_prompt: Optional[Mapping[str, np.ndarray]] = None,
                         video: Optional[Mapping[str, Any]] = None,
                         repa_features: Optional[Mapping[str, Any]] = None) -> Path:
    """Write a dataset atomically: build it in a temporary sibling directory, then rename it into place.

    `latents` (N, C, H, W) (video: (N, C, T, H, W) with `video`) are the *stored* values (model space /
    latent_scale); `extras` maps any of EXTRA_KEYS to full (N, ...) arrays (loss_mask uint8 or float in [0, 1]), the
    other arguments as LatentDatasetWriter's; with `caption_counts` the text parts hold sum(caption_counts) rows, and
    `empty_prompt` ({"text": (1, L, D), ...}) is stored as the table's last row. Returns the dataset path. Raises
    LatentDatasetExistsError if `path` exists and is not an empty directory.
    """
    root = Path(path).expanduser().absolute()
    latents, labels = _check_arrays(root, latents, labels)
    extras = {k: np.asarray(v) for k, v in (extras or {}).items()}
    unknown = sorted(set(extras) - set(EXTRA_KEYS))
    if unknown:
        raise LatentDatasetError(f"extras for '{root}' have unknown key(s) {unknown}; allowed: {list(EXTRA_KEYS)}")
    table = caption_counts is not None or empty_prompt is not None
    rows = int(np.sum(caption_counts)) if caption_counts is not None else len(latents)
    for key, value in extras.items():
        n, per = (rows, "caption row") if table and key in CAPTION_KEYS else (len(latents), "latent")
        if value.ndim != EXTRA_NDIM[key] or len(value) != n:
            raise LatentDatasetError(f"extras['{key}'] for '{root}' must be a {EXTRA_WHAT[key].replace('(n,', '(N,')} "
                                     f"with N={n} (one per {per}), got shape {value.shape}")
    shape_of = lambda key: extras[key].shape[1:] if key in extras else None  # noqa: E731
    with LatentDatasetWriter(root, shape=latents.shape[1:], num_samples=len(latents), num_classes=num_classes,
                             latent_scale=latent_scale, decode=decode, source=source, class_names=class_names,
                             dtype=dtype, extra_meta=extra_meta, text_shape=shape_of("text"),
                             text_mask="text_mask" in extras,
                             pooled_dim=extras["pooled"].shape[1] if "pooled" in extras else None,
                             loss_mask_shape=shape_of("loss_mask"), conditioning_meta=conditioning_meta,
                             reference_latents="reference" in extras, llama_shape=shape_of("llama"),
                             glyph_shape=shape_of("glyph"), image_embeds_shape=shape_of("image_embeds"),
                             caption_counts=caption_counts, empty_prompt=empty_prompt is not None, video=video,
                             first_frame_latents="first_frame" in extras, repa_features=repa_features) as writer:
        if not (labels.min() >= 0 and labels.max() < writer.meta["num_classes"]):  # checked before any copying
            raise LatentDatasetError(f"labels for '{root}' range over [{labels.min()}, {labels.max()}] but must lie "
                                     f"in [0, num_classes={num_classes}); pass the right num_classes or remap the "
                                     f"labels")
        # Chunked copy into the memmap: casting never needs a second full copy of the array in RAM.
        for start in range(0, len(latents), chunk_size):
            part = slice(start, start + chunk_size)
            writer.write(start, latents[part], labels[part],
                         {k: v[part] for k, v in extras.items() if not (table and k in CAPTION_KEYS)} or None)
        if table:
            _write_caption_rows(writer, {k: v for k, v in extras.items() if k in CAPTION_KEYS}, empty_prompt,
                                chunk_size)
    return root


def _write_caption_rows(writer: LatentDatasetWriter, text: Mapping[str, np.ndarray],
                        empty_prompt: Optional[Mapping[str, np.ndarray]], chunk_size: int) -> None:
    """A caption table's rows (whole arrays, `chunk_size` rows at a time), then the empty prompt's row."""
    rows = len(next(iter(text.values()))) if text else 0
    for start in range(0, rows, chunk_size):
        writer.write_captions(start, {k: v[start:start + chunk_size] for k, v in text.items()})
    if empty_prompt is not None:
        writer.write_captions(writer.empty_row, {k: np.asarray(v) for k, v in empty_prompt.items()})
