"""Reading latent datasets: LatentMeta, what every reader derives from a meta dict, and LatentDataset, the
memory-mapped reader, with the per-batch NaN/inf warning (`warn_non_finite`) and the per-epoch caption choice of a
caption table (`caption_choice`; docs/data.md "Captions", "Loading")."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from tread.utils.readers import read_npy

from .meta import (CAPTION_KEYS, DTYPES, EXTRA_FILE_OF, EXTRA_KEYS, GLYPH_KEYS, IMAGE_EMBEDS_KEYS, INTEGRITY_KEY,
                   LLAMA_KEYS, REBUILD, LatentDatasetError, PathLike, first_frame_shape, latent_kind, model_shape, read_meta,
                   repa_features_shape)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step on uint64 values (wrapping arithmetic): a fixed, well-mixed integer hash."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix(*parts: Any) -> np.ndarray:
    """hash(a, b, ...) = splitmix64(... splitmix64(splitmix64(a) ^ b) ... ), elementwise over broadcast uint64."""
    h = _splitmix64(np.atleast_1d(np.asarray(parts[0], dtype=np.uint64)))   # arrays: wrapping, no overflow warning
    for part in parts[1:]:
        h = _splitmix64(h ^ np.atleast_1d(np.asarray(part, dtype=np.uint64)))
    return h


def caption_choice(seed: int, epoch: int, samples: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Which caption (0 .. counts[j] - 1) each of `samples` (int64 (B,), sample indices) takes in `epoch`: with
    K = counts[j], cycle c = epoch // K and position epoch % K, the caption ranked at that position when its K
    captions k are sorted by _mix(seed, sample, c, k) (ties by k), i.e. one seeded permutation per cycle."""
    counts = np.asarray(counts, dtype=np.int64)
    k = np.arange(int(counts.max(initial=1)), dtype=np.int64)
    keys = _mix(seed, np.asarray(samples, dtype=np.int64)[:, None], (epoch // counts)[:, None], k[None, :])
    keys[k[None, :] >= counts[:, None]] = np.iinfo(np.uint64).max   # past a sample's own captions: sorted last
    order = np.argsort(keys, axis=1, kind="stable")
    return order[np.arange(len(counts)), epoch % counts]


def _open_npy(file: Path, key: str) -> np.ndarray:
    """Memory-map one .npy file; missing or unreadable files raise LatentDatasetError naming it."""
    if not file.is_file():
        raise LatentDatasetError(f"missing {key} file '{file}' (meta.json files.{key}='{file.name}'): the "
                                 f"dataset is incomplete. {REBUILD}")
    return read_npy(file, f"cannot read {key} file", mmap=True, error=LatentDatasetError, hint=REBUILD)


def warn_non_finite(batch: np.ndarray, indices: np.ndarray, reported: set[int], where: Callable[[int], str]) -> None:
    """Warn once per sample (its index in `indices`, not yet in `reported`) whose row of `batch` holds NaN/inf,
    naming where(index): its file and index. Only a batch that is not all finite is looked at row by row."""
    if np.isfinite(batch).all():
        return
    rows = ~np.isfinite(batch.reshape(len(batch), -1)).all(axis=1)
    for i in sorted({int(k) for k in indices[rows]} - reported):
        reported.add(i)
        warnings.warn(f"non-finite latent (NaN/inf) in {where(i)}: returned as stored (training skips a step whose "
                      f"loss is non-finite); re-encode that sample or rebuild the dataset", stacklevel=2)


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
        c, *_, h, w = model_shape(self._meta)
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
    def shape(self) -> tuple[int, ...]:
        """Model-space latent shape (C, H, W), video (C, T, H, W) (for moments data: half the stored channels)."""
        return model_shape(self._meta)

    buckets = None       # single-shape data (a BucketedDataset lists its buckets)
    stores_repa_features = False    # the format stores REPA targets beside the latents (read_repa_features)

    @property
    def parts(self) -> list["LatentMeta"]:
        """The single-shape datasets this data is made of: itself (a BucketedDataset: one per bucket)."""
        return [self]

    @property
    def frames(self) -> int:
        """Latent frames T of each sample: 1 for images (shape (C, H, W))."""
        shape = self._meta["shape"]
        return shape[1] if len(shape) == 4 else 1

    @property
    def video(self) -> Optional[dict]:
        """meta "video" ({frames, frame_stride, fps, temporal_factor}: pixel frames per clip, ...), None for images."""
        return self._meta.get("video")

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
        h, w = self._meta["shape"][-2:]
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

    @property
    def conditioning(self) -> dict[str, Any]:
        """The optional per-sample data's shapes: {"text": (L, D) or None, "text_mask": bool, "pooled": P or None,
        "llama": (n, L, Dl) or None, "glyph": (Lg, Dg) or None, "loss_mask": (Hm, Wm) or None}, plus "reference" (C, H, W) and "first_frame"
        (C, 1, H, W) only where those files exist (read them with .get)."""
        cond = self._meta.get("conditioning") or {}
        text, pooled, lm = cond.get("text"), cond.get("pooled"), self._meta.get("loss_mask")
        llama, glyph, image = cond.get("llama"), cond.get("glyph"), cond.get("image_embeds")
        out = {"text": None if text is None else (text["seq_len"], text["dim"]),
               "text_mask": bool(text is not None and text.get("mask", False)),
               "pooled": None if pooled is None else pooled["dim"],
               "llama": None if llama is None else tuple(llama[k] for k in LLAMA_KEYS),
               "glyph": None if glyph is None else tuple(glyph[k] for k in GLYPH_KEYS),
               "image_embeds": None if image is None else tuple(image[k] for k in IMAGE_EMBEDS_KEYS),
               "loss_mask": None if lm is None else tuple(lm["shape"])}
        if "reference_latents" in self._meta["files"]:
            out["reference"] = model_shape(self._meta)
        if "first_frame_latents" in self._meta["files"]:
            out["first_frame"] = first_frame_shape(self._meta)
        return out

    @property
    def captions(self) -> Optional[dict]:
        """The caption table's meta {"rows": M, "empty_prompt": bool} (meta conditioning.captions), or None: one
        caption per sample."""
        return (self._meta.get("conditioning") or {}).get("captions")

    @property
    def has_extras(self) -> bool:
        """True when items carry an extras dict (text / pooled embeddings, loss masks, references) after (x, y)."""
        c = self.conditioning
        return any(c.get(k) is not None for k in ("text", "pooled", "llama", "glyph", "loss_mask", "reference",
                                                   "first_frame", "image_embeds")) \
            or (self.reads_repa_features and "repa_features" in self.meta["files"])

    def __len__(self) -> int:
        return self._meta["num_samples"]

    # Stored REPA features (files.repa_features) are read only once a run that aligns with them asks
    # (read_repa_features); every other reader sees the data as if they were not there.
    reads_repa_features = False


class LatentDataset(LatentMeta, torch.utils.data.Dataset):
    """Memory-mapped latent dataset; items are (float32 latent (C, H, W) (video: (C, T, H, W)) * latent_scale,
    int64 label), or (latent, label, extras) when the dataset has per-sample conditioning / loss masks (has_extras;
    docs/data.md)."""

    stores_repa_features = True

    def __init__(self, path: PathLike, expected_channels: Optional[int] = None,
                 expected_resolution: Optional[int] = None, expected_num_classes: Optional[int] = None):
        self.root = Path(path).expanduser().absolute()
        self._meta = read_meta(self.root)
        self._latents: Optional[np.ndarray] = None
        self._labels: Optional[np.ndarray] = None
        self._extras: Optional[dict[str, np.ndarray]] = None    # the extras items carry
        self._stored: Optional[dict[str, np.ndarray]] = None    # every extras file (stored REPA features too)
        self._offsets: Optional[np.ndarray] = None   # a caption table's (N + 1,) offsets
        self._reported: set[int] = set()  # samples already warned about (warn_non_finite)
        self._validate_files()
        self._check_expected(expected_channels, expected_resolution, expected_num_classes)

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        """Open the memmaps on first use in each process (they are dropped when pickled to workers)."""
        if self._latents is None:
            files = self._meta["files"]
            self._latents = _open_npy(self.root / files["latents"], "latents")
            self._labels = _open_npy(self.root / files["labels"], "labels")
            self._stored = {key: _open_npy(self.root / files[EXTRA_FILE_OF[key]], EXTRA_FILE_OF[key])
                            for key in EXTRA_KEYS if EXTRA_FILE_OF[key] in files}
            self._extras = {key: array for key, array in self._stored.items()
                            if key != "repa_features" or self.reads_repa_features}
            if "caption_offsets" in files:
                self._offsets = _open_npy(self.root / files["caption_offsets"], "caption_offsets")
        return self._latents, self._labels

    def __getstate__(self) -> dict:
        # Pickle only the path and meta: a worker re-maps the files instead of receiving a copy of them. The meta's
        # integrity record (tread/data/integrity.py) stays behind: only the start-up check reads it.
        meta = {k: v for k, v in self._meta.items() if k != INTEGRITY_KEY}
        return {**self.__dict__, "_meta": meta, "_latents": None, "_labels": None, "_extras": None, "_stored": None,
                "_offsets": None}

    def read_repa_features(self) -> None:
        """From now on items carry the stored REPA features, extras "repa_features" (dim, h, w) float32 (meta
        "repa_features" says whose; tread/training/repa.py checks them against the run's encoder first)."""
        self.reads_repa_features = True
        self._latents = None      # re-opened on next use, with them

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
        c, n = self.conditioning, m["num_samples"]
        t, rows = (self.captions["rows"], "conditioning.captions rows") if self.captions else (n, "num_samples")
        expected = {"text": ((t, *(c["text"] or ())), DTYPES, f"{rows}, conditioning.text seq_len and dim"),
                    "text_mask": ((t, (c["text"] or (0,))[0]), ("bool",), f"{rows}, conditioning.text seq_len"),
                    "pooled": ((t, c["pooled"]), DTYPES, f"{rows}, conditioning.pooled dim"),
                    "llama": ((t, *(c["llama"] or ())), DTYPES,
                              f"{rows}, conditioning.llama layers, seq_len and dim"),
                    "glyph": ((t, *(c["glyph"] or ())), DTYPES, f"{rows}, conditioning.glyph seq_len and dim"),
                    "glyph_mask": ((t, (c["glyph"] or (0,))[0]), ("bool",), f"{rows}, conditioning.glyph seq_len"),
                    "loss_mask": ((n, *(c["loss_mask"] or ())), ("uint8",), "num_samples, loss_mask.shape"),
                    "reference": ((n, *(c.get("reference") or ())), (m["dtype"],),
                                  "num_samples, dtype and the model-space shape"),
                    "first_frame": ((n, *(c.get("first_frame") or ())), (m["dtype"],),
                                    "num_samples, dtype and the model-space shape with T = 1"),
                    "image_embeds": ((n, *(c["image_embeds"] or ())), DTYPES,
                                     "num_samples, conditioning.image_embeds seq_len and dim"),
                    "repa_features": ((n, *(repa_features_shape(m) or ())), (m["dtype"],),
                                      "num_samples, dtype, repa_features.dim and grid")}
        for key, array in (self._stored or {}).items():
            shape, dtypes, source = expected[key]
            if array.shape != shape or array.dtype.name not in dtypes:
                raise LatentDatasetError(
                    f"'{self.root / files[EXTRA_FILE_OF[key]]}' (files.{EXTRA_FILE_OF[key]}) holds a {array.dtype} "
                    f"array of shape {list(array.shape)} but must be {' or '.join(dtypes)} of shape {list(shape)} "
                    f"(meta.json {source}). {REBUILD}")
        if self._offsets is not None:
            self._validate_offsets()

    def _validate_offsets(self) -> None:
        """A caption table's offsets: (N + 1,) integers from 0, strictly increasing, ending at the caption rows
        (the rows but the last with an empty prompt)."""
        off, n, table = self._offsets, self._meta["num_samples"], self.captions
        end = table["rows"] - table["empty_prompt"]
        steps = np.diff(off) if off.ndim == 1 else np.zeros(0)
        if off.shape != (n + 1,) or not np.issubdtype(off.dtype, np.integer) or off[0] != 0 or off[-1] != end \
                or (steps < 1).any():
            raise LatentDatasetError(
                f"'{self.root / self._meta['files']['caption_offsets']}' (files.caption_offsets) holds a {off.dtype} "
                f"array of shape {list(off.shape)} but must be int64 of shape [{n + 1}] (num_samples + 1), strictly "
                f"increasing from 0 to {end} (meta.json conditioning.captions rows {table['rows']}"
                f"{', less the empty prompt' if table['empty_prompt'] else ''}). {REBUILD}")

    def _scale(self) -> float:
        # Moments stay in raw VAE units (logvar must not be scaled); draw_latents scales the drawn latent.
        return 1.0 if self.latent_kind == "moments" else self.latent_scale

    def _where(self, index: int) -> str:
        return f"'{self.root / self._meta['files']['latents']}' index {index}"

    def __getitem__(self, index: int) -> Union[tuple[torch.Tensor, torch.Tensor],
                                               tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        latents, labels = self._open()
        arr = np.array(latents[index], dtype=np.float32)  # (C[, T], H, W), copied off the memmap
        warn_non_finite(arr[None], np.array([int(index) % len(self)]), self._reported, self._where)
        x, y = torch.from_numpy(arr) * self._scale(), torch.tensor(int(labels[index]), dtype=torch.int64)
        if not self._extras:
            return x, y
        row = index if self._offsets is None else int(self._offsets[int(index) % len(self)])   # its first caption
        return x, y, {key: _extra_tensor(key, np.array(array[row if key in CAPTION_KEYS else index])[None],
                                         self.latent_scale)[0]
                      for key, array in self._extras.items()}

    def caption_counts(self) -> np.ndarray:
        """(N,) int64 captions per sample (all 1 without a caption table)."""
        self._open()
        n = self._meta["num_samples"]
        return np.ones(n, np.int64) if self._offsets is None else np.diff(np.asarray(self._offsets, np.int64))

    def caption_rows(self, indices: Sequence[int]) -> np.ndarray:
        """The row of the text files each of `indices` (samples) reads: its caption by caption_choice for a loader
        batch (an EpochBatch: .epoch, .seed, .index_base, the global index of this dataset's sample 0), its first
        caption otherwise; the sample itself without a caption table."""
        self._open()
        idx = np.asarray(indices, dtype=np.int64)
        if self._offsets is None:
            return idx
        idx = idx % len(self)
        first = np.asarray(self._offsets[idx], np.int64)
        if not hasattr(indices, "epoch"):
            return first
        counts = np.asarray(self._offsets[idx + 1], np.int64) - first
        base = int(getattr(indices, "index_base", 0))
        return first + caption_choice(indices.seed, indices.epoch, idx + base, counts)

    def empty_prompt(self) -> Optional[dict[str, torch.Tensor]]:
        """The encoded empty prompt "" of a caption table stored with one (its last row), as one sample's text
        extras {"text": (L, D) float32, "text_mask": (L,) bool, "pooled": (P,), "llama": (n, L, Dl)} (the parts
        the data has); None without one."""
        self._open()
        table = self.captions
        if not (table and table["empty_prompt"]):
            return None
        row = table["rows"] - 1
        return {key: _extra_tensor(key, np.array(array[row])[None], self.latent_scale)[0]
                for key, array in self._extras.items() if key in CAPTION_KEYS}

    def __getitems__(self, indices: Sequence[int]) -> Union[tuple[torch.Tensor, torch.Tensor],
                                                            tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """Batched fetch, (x (B, C, H, W) float32 (video: (B, C, T, H, W)), y (B,) int64), with one fancy-indexed
        read of each memmap; with extras (x, y, {"text": (B, L, D) float32, "text_mask": (B, L) bool, "pooled":
        (B, P) float32, "llama": (B, n, L, Dl) float32, "loss_mask": (B, 1, Hm, Wm) float32 in [0, 1], "reference":
        (B, C, H, W) float32, "first_frame": (B, C, 1, H, W) float32, "repa_features": (B, dim, h, w) float32 once
        read_repa_features()}), the keys the dataset has, in request order. With a caption table the text parts are each
        sample's caption for this batch (caption_rows: drawn per epoch for a loader's EpochBatch)."""
        latents, labels = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")  # ascending reads are mostly sequential on disk
        x, y = np.empty((len(idx), *latents.shape[1:]), np.float32), np.empty(len(idx), np.int64)
        x[order], y[order] = latents[idx[order]], labels[idx[order]]  # read sorted, write back in request order
        warn_non_finite(x, idx % len(self), self._reported, self._where)
        x, y = torch.from_numpy(x) * self._scale(), torch.from_numpy(y)
        if not self._extras:
            return x, y
        extras = {}
        rows = self.caption_rows(indices) if self._offsets is not None else idx
        row_order = np.argsort(rows, kind="stable") if self._offsets is not None else order
        for key, array in self._extras.items():
            at, by = (rows, row_order) if key in CAPTION_KEYS else (idx, order)
            out = np.empty((len(idx), *array.shape[1:]), array.dtype)
            out[by] = array[at[by]]
            extras[key] = _extra_tensor(key, out, self.latent_scale)
        return x, y, extras


def _extra_tensor(key: str, batch: np.ndarray, latent_scale: float) -> torch.Tensor:
    """A batch read from an extras file -> its tensor: float32 embeddings (text, pooled, llama), bool mask,
    (B, 1, Hm, Wm) float loss mask in [0, 1] (uint8 / 255), float32 model-space reference / first-frame latents
    (stored values * latent_scale)."""
    t = torch.from_numpy(batch)
    if key in ("reference", "first_frame"):
        return t.float() * latent_scale
    if key in ("text_mask", "glyph_mask"):
        return t
    if key == "loss_mask":
        return t.unsqueeze(1).float().div_(255.0)
    return t.float()
