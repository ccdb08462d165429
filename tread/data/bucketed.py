"""Bucketed latent datasets: one latent dataset per bucket under one folder, with a "tread-buckets" meta.json and
each bucket's crops.npy, read as one dataset whose batches each come from one bucket (docs/buckets.md "The
bucketed format")."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from tread.utils.io import atomic_write, atomic_write_json
from tread.utils.readers import read_json, read_npy

from .buckets import CROP_COLUMNS, Bucket, BucketError
from .loader import PHASE_STRIDE, BatchSizeError, BucketBatchSampler, EpochBatch, PhasedSampler
from .meta import FIX_META, LatentDatasetExistsError, PathLike
from .reader import LatentDataset
from .writer import write_latent_dataset

BUCKETS_FORMAT, BUCKETS_VERSION = "tread-buckets", 1
SHARED_META = ("num_classes", "latent_scale", "decode", "class_names", "dtype")   # equal in every bucket


def is_bucketed(path: PathLike) -> bool:
    """Whether `path` holds a bucketed dataset (its meta.json says format tread-buckets)."""
    meta = Path(path).expanduser() / "meta.json"
    return meta.is_file() and f'"{BUCKETS_FORMAT}"' in meta.read_text(errors="replace")[:4096]


def _entry_problem(entry: Any) -> Optional[str]:
    if not isinstance(entry, dict):
        return "an object"
    for key in ("name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key] or "/" in entry[key] or entry[key].startswith("."):
            return f"an object whose '{key}' is a plain folder name"
    size = entry.get("image_size")
    if not (isinstance(size, list) and len(size) == 2 and all(map(_pos_int, size))):
        return "an object with 'image_size': [height, width] in pixels"
    if not _pos_int(entry.get("num_samples")):
        return "an object with 'num_samples' >= 1"
    frames = entry.get("frames", 0)
    if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
        return "an object whose optional 'frames' is a positive integer (pixel frames of a video bucket)"
    crops = entry.get("crops")
    if crops is not None and not (isinstance(crops, str) and crops and _inside(crops)):
        return "an object whose optional 'crops' is a file path inside the dataset folder (e.g. '<name>/crops.npy')"
    if entry.get("crop_columns", list(CROP_COLUMNS)) != list(CROP_COLUMNS):
        return f"an object whose optional 'crop_columns' is {list(CROP_COLUMNS)}"
    return None


def _inside(relative: str) -> bool:
    """Whether a path a meta.json gives stays inside the dataset folder (relative, no '..')."""
    path = Path(relative)
    return not path.is_absolute() and ".." not in path.parts


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_entries(where: Path, buckets: list) -> None:
    """Each entry's name is the bucket its image_size (and frames) make, and no name or folder is listed twice."""
    seen: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(buckets):
        size = Bucket(*entry["image_size"], entry.get("frames", 0))
        if entry["name"] != size.name:
            raise BucketError(f"{where}: buckets[{i}] has name '{entry['name']}' but image_size {entry['image_size']}"
                              f"{_frames_said(entry)}, which is bucket '{size.name}' (WIDTHxHEIGHT[xFRAMES]). "
                              f"{FIX_META}")
        for key in ("name", "path"):
            first = seen.setdefault((key, entry[key]), i)
            if first != i:
                raise BucketError(f"{where}: buckets[{first}] and buckets[{i}] both have {key} '{entry[key]}': each "
                                  f"bucket is listed once. {FIX_META}")


def _frames_said(entry: Mapping[str, Any]) -> str:
    return f" and frames {entry['frames']}" if entry.get("frames") else ""


def read_buckets_meta(root: Path) -> dict:
    """The bucketed meta.json, checked: format, version and every bucket entry."""
    where = root / "meta.json"
    meta = read_json(where, "", "a JSON object (the bucketed dataset's description)", BucketError, FIX_META)
    if not isinstance(meta, dict) or meta.get("format") != BUCKETS_FORMAT or meta.get("version") != BUCKETS_VERSION:
        raise BucketError(f"{where}: not a v{BUCKETS_VERSION} '{BUCKETS_FORMAT}' description. {FIX_META}")
    buckets = meta.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        raise BucketError(f"{where}: key 'buckets' is {buckets!r} but must be a non-empty list. {FIX_META}")
    for i, entry in enumerate(buckets):
        problem = _entry_problem(entry)
        if problem:
            raise BucketError(f"{where}: buckets[{i}] is {entry!r} but must be {problem}. {FIX_META}")
    if not _pos_int(meta.get("vae_factor")):
        raise BucketError(f"{where}: key 'vae_factor' is {meta.get('vae_factor')!r} but must be a positive integer "
                          f"(image pixels per latent cell). {FIX_META}")
    _check_entries(where, buckets)
    return meta


class BucketedDataset(torch.utils.data.Dataset):
    """A bucketed dataset read as one: items as LatentDataset's, indices running through the buckets in order;
    `__getitems__` takes the indices of one bucket (a batch of one shape)."""

    stores_repa_features = True

    def __init__(self, path: PathLike, expected_channels: Optional[int] = None,
                 expected_num_classes: Optional[int] = None):
        self.root = Path(path).expanduser().absolute()
        self._buckets_meta = read_buckets_meta(self.root)
        self.entries = self._buckets_meta["buckets"]
        self.parts = [LatentDataset(self.root / e["path"], expected_channels, None, expected_num_classes)
                      for e in self.entries]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self._check_parts()

    def _check_parts(self) -> None:
        first = self.parts[0]
        for i, (entry, part) in enumerate(zip(self.entries, self.parts)):
            if len(part) != entry["num_samples"]:
                raise BucketError(f"bucket '{entry['name']}' at '{part.root}' holds {len(part)} samples but "
                                  f"'{self.root / 'meta.json'}' says {entry['num_samples']}. {FIX_META}")
            self._check_size(i, part)
            self._open_crops(i, mmap=True)
            differ = [k for k in SHARED_META if part.meta.get(k) != first.meta.get(k)]
            if part.channels != first.channels or part.latent_kind != first.latent_kind:
                differ.append("shape[0] / latent_kind")
            if _shared_video(part.meta) != _shared_video(first.meta):
                differ.append("video (frame_stride, fps, temporal_factor)")
            if (part.video or {}).get("frames", 0) != entry.get("frames", 0):
                differ.append(f"frames (meta video.frames {(part.video or {}).get('frames')} against the entry's "
                              f"{entry.get('frames')})")
            if {k for k, v in part.conditioning.items() if v} != {k for k, v in first.conditioning.items() if v}:
                differ.append("conditioning files")
            if _repa_identity(part.meta) != _repa_identity(first.meta):
                differ.append("repa_features (encoder, digest, dim)")
            if differ:
                raise BucketError(f"buckets '{self.entries[0]['name']}' and '{entry['name']}' of '{self.root}' differ "
                                  f"in {', '.join(differ)}: the buckets of one dataset share all but their shape. "
                                  f"Rebuild it with scripts/precompute_latents.py --buckets/--bucket-pixels.")

    def _check_size(self, bucket: int, part: LatentDataset) -> None:
        """The bucket's latent grid times the dataset's vae_factor is its entry's image_size."""
        entry, factor = self.entries[bucket], self._buckets_meta["vae_factor"]
        shape = part.meta["shape"]
        pixels = [side * factor for side in shape[-2:]]
        if pixels != entry["image_size"]:
            raise BucketError(f"'{part.root / 'meta.json'}' says latents of shape {shape}, which at vae_factor "
                              f"{factor} is image_size {pixels}, but buckets[{bucket}] '{entry['name']}' of "
                              f"'{self.root / 'meta.json'}' says image_size {entry['image_size']}. {FIX_META}")

    def _open_crops(self, bucket: int, mmap: bool) -> np.ndarray:
        """A bucket's crops file, checked against its sample count (mmap: the header and size only)."""
        entry = self.entries[bucket]
        file = self.root / str(entry.get("crops") or f"{entry['path']}/crops.npy")
        if not file.is_file():
            raise BucketError(f"missing crops file '{file}' of buckets[{bucket}] '{entry['name']}' in "
                              f"'{self.root / 'meta.json'}': the dataset is incomplete. {FIX_META}")
        arr = read_npy(file, "cannot read crops file", mmap=mmap, error=BucketError, hint=FIX_META)
        if arr.shape != (entry["num_samples"], len(CROP_COLUMNS)) or not np.issubdtype(arr.dtype, np.integer):
            raise BucketError(f"'{file}' holds a {arr.dtype} array of shape {list(arr.shape)} but must be integer of "
                              f"shape [{entry['num_samples']}, {len(CROP_COLUMNS)}] ({', '.join(CROP_COLUMNS)})")
        return arr

    # -- what the training code reads of a dataset (LatentMeta's interface, shape aside) ----------------------
    @property
    def meta(self) -> dict:
        """The first bucket's meta: the keys every bucket shares (its "shape" is that bucket's)."""
        return self.parts[0].meta

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Model-space latent shape (C, h, w) (video: (C, T, h, w)) of each bucket."""
        return [p.shape for p in self.parts]

    @property
    def shape(self) -> tuple[int, int, int]:
        raise BucketError(f"data at '{self.root}' is bucketed ({len(self.parts)} shapes: "
                          f"{', '.join(e['name'] for e in self.entries)}): it has no single shape")

    @property
    def buckets(self) -> list[Bucket]:
        return [Bucket(*e["image_size"], e.get("frames", 0)) for e in self.entries]

    @property
    def bucket_sizes(self) -> list[int]:
        return [len(p) for p in self.parts]

    @property
    def channels(self) -> int:
        return self.parts[0].channels

    @property
    def num_classes(self) -> int:
        return self.parts[0].num_classes

    @property
    def latent_scale(self) -> float:
        return self.parts[0].latent_scale

    @property
    def latent_kind(self) -> str:
        return self.parts[0].latent_kind

    @property
    def conditioning(self) -> dict[str, Any]:
        return self.parts[0].conditioning

    @property
    def has_extras(self) -> bool:
        return self.parts[0].has_extras

    @property
    def video(self) -> Optional[dict]:
        """The first bucket's meta "video" (None: image buckets); its frames are that bucket's."""
        return self.parts[0].video

    @property
    def reads_repa_features(self) -> bool:
        return self.parts[0].reads_repa_features

    def read_repa_features(self) -> None:
        """Every bucket's items carry its stored REPA features from now on (LatentDataset.read_repa_features)."""
        for part in self.parts:
            part.read_repa_features()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def bucket_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    def crops(self, bucket: int) -> np.ndarray:
        """(n, 6) int32 crop records of a bucket's samples (CROP_COLUMNS), checked against its sample count."""
        return self._open_crops(bucket, mmap=False)

    def __getitem__(self, index: int):
        b = self.bucket_of(int(index))
        return self.parts[b][int(index) - int(self.offsets[b])]

    def __getitems__(self, indices: Sequence[int]):
        idx = np.asarray(indices, dtype=np.int64)
        b = self.bucket_of(int(idx[0]))
        if not (self.offsets[b] <= idx).all() or not (idx < self.offsets[b + 1]).all():
            raise ValueError(f"a batch of a bucketed dataset must come from one bucket (BucketBatchSampler); "
                             f"indices {idx.tolist()[:8]} span several")
        local = (idx - self.offsets[b]).tolist()
        if hasattr(indices, "epoch"):   # a loader batch: its epoch and seed, and where this bucket starts (captions)
            local = EpochBatch(local, indices.epoch, indices.seed, indices.index_base + int(self.offsets[b]))
        return self.parts[b].__getitems__(local)



def _repa_identity(meta: Mapping[str, Any]) -> Optional[tuple]:
    """The stored REPA features' encoder, digest and width (their grid follows each bucket's size)."""
    repa = meta.get("repa_features")
    return None if repa is None else (repa["encoder"], repa["digest"], repa["dim"])


def _shared_video(meta: Mapping[str, Any]) -> Optional[dict]:
    """meta "video" less its frames (what the buckets of one dataset share), None for images."""
    video = meta.get("video")
    return None if video is None else {k: v for k, v in video.items() if k != "frames"}


def phase_buckets(dataset: BucketedDataset, schedule: Sequence[Any]) -> list[tuple[int, list[int]]]:
    """A resolution schedule -> [(first step, bucket indices)] per phase. Each phase {until_step, min_pixels,
    max_pixels} draws from the buckets whose image area lies in [min_pixels, max_pixels] (null: no bound), up to
    its until_step (null: to the end); one error line for a phase without buckets or steps out of order."""
    phases, start = [], 0
    for i, phase in enumerate(schedule):
        lo, hi, until = phase.get("min_pixels"), phase.get("max_pixels"), phase.get("until_step")
        chosen = [b for b, bucket in enumerate(dataset.buckets)
                  if (lo is None or bucket.area >= lo) and (hi is None or bucket.area <= hi)]
        if not chosen:
            raise BucketError(f"data.resolution_schedule[{i}] ({dict(phase)}) selects no bucket of '{dataset.root}' "
                              f"(bucket areas: {', '.join(f'{b.name}={b.area}' for b in dataset.buckets)})")
        if (until is None) != (i == len(schedule) - 1) or (until is not None and until <= start):
            raise BucketError(f"data.resolution_schedule[{i}].until_step={until!r}: the phases' until_step must "
                              f"increase, and only the last phase has until_step null (it runs to the end)")
        phases.append((start, chosen))
        start = until if until is not None else start
    return phases


def make_sampler(dataset: BucketedDataset, batch_size: int, seed: int, rank: int, world_size: int,
                 schedule: Optional[Sequence[Any]] = None, batches_per_step: int = 1):
    """The batch sampler of a bucketed dataset: BucketBatchSampler, or with a resolution schedule a
    PhasedSampler (phase p from batch first_step * batches_per_step, seeded seed + PHASE_STRIDE * p)."""
    sizes = dataset.bucket_sizes
    if not schedule:
        return BucketBatchSampler(sizes, batch_size, seed, rank, world_size)
    phases = []
    for p, (step, chosen) in enumerate(phase_buckets(dataset, schedule)):
        try:
            sampler = BucketBatchSampler(sizes, batch_size, seed + PHASE_STRIDE * p, rank, world_size, chosen)
        except BatchSizeError as err:
            drawn = ", ".join(f"{dataset.buckets[b].name} ({sizes[b]} samples)" for b in chosen)
            raise BatchSizeError(f"data.resolution_schedule[{p}] ({dict(schedule[p])}) draws from bucket(s) {drawn} "
                                 f"of '{dataset.root}': {err}") from None
        phases.append((step * batches_per_step, sampler))
    return PhasedSampler(phases)


class BucketedWriter:
    """Writes a bucketed dataset atomically: every bucket into a hidden staging folder beside `out`, which is
    renamed into place with its meta.json when the `with` block ends without error (removed otherwise). Each
    bucket's latent dataset is written at `bucket_dir(bucket)` (by LatentDatasetWriter / write_latent_dataset),
    then `add(bucket, crops)` records it."""

    def __init__(self, out: PathLike, vae_factor: int, stride: int, **extra_meta: Any):
        self.out = Path(out).expanduser().absolute()
        if self.out.exists() and not (self.out.is_dir() and not any(self.out.iterdir())):
            raise LatentDatasetExistsError(f"'{self.out}' already exists; refusing to overwrite it. Delete it or choose another "
                              f"path.")
        self.meta = {"format": BUCKETS_FORMAT, "version": BUCKETS_VERSION, "vae_factor": vae_factor,
                     "bucket_stride": stride, "buckets": [], **extra_meta}
        self.staging: Optional[Path] = None

    def __enter__(self) -> "BucketedWriter":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self

    def bucket_dir(self, bucket: Bucket) -> Path:
        return self.staging / bucket.name

    def add(self, bucket: Bucket, crops: np.ndarray) -> None:
        crops = np.asarray(crops, dtype=np.int32)
        atomic_write(self.bucket_dir(bucket) / "crops.npy", lambda f: np.save(f, crops), fsync=True)
        self.meta["buckets"].append({"name": bucket.name, "path": bucket.name, "image_size": [bucket.height,
                                     bucket.width], "num_samples": int(len(crops)), "crops": f"{bucket.name}/crops.npy",
                                     "crop_columns": list(CROP_COLUMNS), **({"frames": bucket.frames}
                                                                            if bucket.frames else {})})

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self.meta["buckets"]:
            shutil.rmtree(self.staging, ignore_errors=True)
            if exc_type is None:
                raise BucketError(f"no bucket was written to '{self.out}'")
            return
        atomic_write_json(self.staging / "meta.json", self.meta, fsync=True)
        try:
            if self.out.is_dir() and not any(self.out.iterdir()):
                self.out.rmdir()                              # the empty folder __init__ allowed
            self.staging.rename(self.out)
        except OSError as err:                                # another process renamed its copy into place first
            shutil.rmtree(self.staging, ignore_errors=True)
            if self.out.exists():
                raise LatentDatasetExistsError(f"'{self.out}' was written by another process meanwhile") from err
            raise


def write_bucketed_dataset(out: PathLike, parts: Sequence[Mapping[str, Any]], *, vae_factor: int = 1,
                           stride: int = 1, source: str = "", builtin: Optional[dict] = None, **common: Any) -> Path:
    """A bucketed dataset from whole arrays: parts [{"bucket": Bucket, "latents": (n, C, h, w) (video: (n, C, T, h,
    w)), "labels": (n,), "extras": {...} or absent, "crops": (n, 6) or absent (zeros), "video": meta "video" of a
    video bucket or absent}], `common` passed to every bucket's
    write_latent_dataset (num_classes, latent_scale, decode, ...); `builtin`: the built-in generator's parameters,
    kept in meta.json."""
    extra = {"builtin": builtin} if builtin is not None else {}
    with BucketedWriter(out, vae_factor, stride, source=source, **extra) as writer:
        for part in parts:
            bucket = part["bucket"]
            write_latent_dataset(writer.bucket_dir(bucket), part["latents"], part["labels"], source=source,
                                 extras=part.get("extras"), video=part.get("video"), **common)
            crops = part.get("crops")
            writer.add(bucket, np.zeros((len(part["labels"]), len(CROP_COLUMNS)), np.int32) if crops is None
                       else crops)
    return Path(out).expanduser().absolute()
