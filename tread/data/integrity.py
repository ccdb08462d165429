"""A latent dataset's integrity record (meta.json "integrity": per file its size, mtime, data digest and non-finite
samples), written once by LatentDatasetWriter.commit and checked cheaply when training opens the data: a file whose
size and mtime match is trusted without a read (docs/data.md "Integrity")."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from tread.utils.io import atomic_write_json

from .meta import INTEGRITY_KEY, LatentDatasetError, PathLike, read_meta
from .reader import LatentDataset
from .reader import _open_npy as open_npy   # the reader's own opening of a file: the same errors

try:
    import xxhash
except ImportError:          # wandb (a dependency) brings it; without it the record uses sha256
    xxhash = None

DIGESTS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256}
if xxhash is not None:
    DIGESTS["xxh3_128"] = xxhash.xxh3_128
DIGEST = "xxh3_128" if xxhash is not None else "sha256"
CHUNK_BYTES = 4 << 20        # bytes read per step of a scan (1-8 MiB: 3.2 GB/s; 32 MiB: 2.3 GB/s, out of cache)
# float dtype -> (its bits as an unsigned int, the mask without the sign, the all-ones exponent: NaN/inf at or above)
_FLOAT_BITS = {np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
               np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
               np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
RECORD_KEYS = {"bytes": int, "mtime_ns": int, "digest": str, "nonfinite_samples": int,
               "first_nonfinite": (int, type(None))}
RECORD = "tread.data.record_integrity('{root}')"


@dataclass
class FileCheck:
    """What check_integrity found for one file of a dataset."""

    key: str                  # its meta "files" key: latents, labels, text_embeds, ...
    path: Path
    how: str                  # trusted (size and mtime as recorded: not read) | verified (read: the recorded digest)
    #                           | changed (read: another digest than recorded) | scanned (no record: read)
    nonfinite: int            # samples holding NaN/inf
    first: Optional[int]      # the first of them (None: all finite)
    nbytes: int               # the file's size
    secs: float = 0.0         # time spent reading it

    @property
    def read(self) -> bool:
        return self.how != "trusted"


def nonfinite_rows(chunk: np.ndarray) -> Optional[np.ndarray]:
    """None if every value of `chunk` (rows = samples) is finite, else a bool per row: it holds NaN/inf."""
    if chunk.dtype.kind != "f":
        return None
    bits = _FLOAT_BITS.get(chunk.dtype)
    if bits is None:
        bad = not np.isfinite(chunk).all()
    else:
        uint, magnitude, exponent = bits
        bad = (chunk.view(uint) & uint(magnitude)).max(initial=0) >= exponent
    if not bad:
        return None
    return ~np.isfinite(chunk.reshape(len(chunk), -1)).all(axis=1)


def scan_array(array: np.ndarray, digest: str = DIGEST) -> dict[str, Any]:
    """Digest of the array's data bytes (C order) and its non-finite samples (rows), read in CHUNK_BYTES steps."""
    hasher = DIGESTS[digest]()
    row_bytes = max(1, array[:1].nbytes)
    step, count, first = max(1, CHUNK_BYTES // row_bytes), 0, None
    for start in range(0, len(array), step):
        chunk = np.ascontiguousarray(array[start:start + step])
        hasher.update(chunk.reshape(-1).view(np.uint8))
        bad = nonfinite_rows(chunk)
        if bad is not None and bad.any():
            count += int(bad.sum())
            first = start + int(np.argmax(bad)) if first is None else first
    return {"digest": hasher.hexdigest(), "nonfinite_samples": count, "first_nonfinite": first}


def file_record(path: Path, key: str, digest: str = DIGEST) -> dict[str, Any]:
    """One file's record: its size and mtime (taken after reading it) and scan_array's digest and counts."""
    array = open_npy(path, key)
    scanned = scan_array(array, digest) if array.ndim else scan_array(array.reshape(1), digest)
    del array
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, **scanned}


def integrity_record(root: PathLike, files: Mapping[str, str]) -> dict[str, Any]:
    """meta.json's "integrity" value for the files (meta "files": key -> name) of the dataset at `root`."""
    root = Path(root)
    return {"digest": DIGEST, "files": {key: file_record(root / name, key) for key, name in files.items()}}


def record_integrity(root: PathLike) -> Path:
    """(Re)write the integrity record into the meta.json of the dataset at `root`: for a dataset written before
    records were kept (training then skips its scan), or after an intended edit of its files. Returns meta.json."""
    root = Path(root).expanduser().absolute()
    meta = read_meta(root)
    meta[INTEGRITY_KEY] = integrity_record(root, meta["files"])
    return atomic_write_json(root / "meta.json", meta, fsync=True)


def _checked_record(meta: Mapping[str, Any], where: str) -> Optional[dict]:
    """meta's integrity record (None without one), its form checked; a malformed one names the key."""
    record = meta.get(INTEGRITY_KEY)
    if record is None:
        return None
    files = record.get("files") if isinstance(record, dict) else None
    good = isinstance(files, dict) and isinstance(record.get("digest"), str) and record["digest"] in DIGESTS and all(
        isinstance(r, dict) and all(k in r and isinstance(r[k], t) and not isinstance(r[k], bool)
                                    for k, t in RECORD_KEYS.items()) for r in files.values())
    if not good:
        shown = json.dumps(record)[:200]
        raise LatentDatasetError(f"{where}: key '{INTEGRITY_KEY}' is {shown} but must be {{'digest': one of {sorted(DIGESTS)}, "
                                 f"'files': {{key: {{{', '.join(RECORD_KEYS)}}}}}}}. Delete the key (the data is then "
                                 f"scanned at every training start) or rewrite it with {RECORD}.")
    return record


def check_file(root: Path, key: str, name: str, record: Optional[dict]) -> FileCheck:
    """One file against its record (None: no record): trusted on size and mtime, else read once."""
    path = root / name
    entry = (record or {}).get("files", {}).get(key)
    stat = path.stat() if path.is_file() else None
    if entry is not None and stat is not None and (stat.st_size, stat.st_mtime_ns) == (entry["bytes"],
                                                                                      entry["mtime_ns"]):
        return FileCheck(key, path, "trusted", entry["nonfinite_samples"], entry["first_nonfinite"], stat.st_size)
    start = time.perf_counter()
    found = file_record(path, key, record["digest"] if entry is not None else DIGEST)
    how = "scanned" if entry is None else "verified" if found["digest"] == entry["digest"] else "changed"
    return FileCheck(key, path, how, found["nonfinite_samples"], found["first_nonfinite"], found["bytes"],
                     time.perf_counter() - start)


def check_integrity(root: PathLike, meta: Optional[Mapping[str, Any]] = None) -> list[FileCheck]:
    """Every file of the dataset at `root` (meta: its read meta.json) checked against the integrity record; files
    without one are scanned. Facts only: what to refuse or say is integrity_verdict's."""
    root = Path(root).expanduser().absolute()
    meta = read_meta(root) if meta is None else meta
    record = _checked_record(meta, str(root / "meta.json"))
    return [check_file(root, key, name, record) for key, name in meta["files"].items()]


def _mb(checks: list[FileCheck]) -> str:
    """How much was read, and in how long: "15.4 MB in 4 ms"."""
    secs = sum(c.secs for c in checks)
    took = f"{secs:.1f} s" if secs >= 1 else f"{secs * 1000:.0f} ms"
    return f"{sum(c.nbytes for c in checks) / 1e6:.3g} MB in {took}"


def nonfinite_message(bad: list[FileCheck], num_samples: int) -> str:
    """Which files hold NaN/inf: the first one's file, count and first index, then the others' names."""
    c = bad[0]
    changed = " (changed since the dataset was written: its digest differs from meta.json's record)" \
        if c.how == "changed" else ""
    others = f"; also {', '.join(repr(o.path.name) for o in bad[1:])}" if len(bad) > 1 else ""
    return (f"'{c.path}' holds NaN/inf in {c.nonfinite} of {num_samples} samples, the first at index {c.first}"
            f"{changed}{others}")


def integrity_verdict(root: PathLike, checks: list[FileCheck], num_samples: int,
                      allow_nonfinite: bool) -> tuple[list[str], list[str]]:
    """(notes, warnings) about check_integrity's findings; LatentDatasetError for non-finite data unless
    `allow_nonfinite` (data.allow_nonfinite), which turns it into a warning."""
    bad = [c for c in checks if c.nonfinite]
    if bad and not allow_nonfinite:
        raise LatentDatasetError(
            f"{nonfinite_message(bad, num_samples)}: refusing to train on it (a batch drawing such a sample gives a "
            f"non-finite loss). Re-encode those samples or rebuild the dataset, or set data.allow_nonfinite=true to "
            f"train anyway (train.nonfinite skips each step they spoil).")
    warnings = [f"data.allow_nonfinite=true: {nonfinite_message(bad, num_samples)}; training anyway: "
                f"train.nonfinite skips each step they spoil."] if bad else []
    root, notes = Path(root), []
    record = RECORD.format(root=root)
    for c in checks:
        if c.how == "changed" and not c.nonfinite:
            warnings.append(f"'{c.path}' changed since the dataset was written (its digest differs from meta.json's "
                            f"integrity record); read again: all finite. If the change was intended, record it with "
                            f"{record}; else rebuild the dataset.")
    verified = [c for c in checks if c.how == "verified"]
    if verified:
        notes.append(f"data at '{root}': {', '.join(c.path.name for c in verified)} read to verify their digests "
                     f"(modification times differ from the record: copied?), {_mb(verified)}: unchanged. {record} "
                     f"records the new times, so later starts skip the read.")
    scanned = [c for c in checks if c.how == "scanned"]
    if scanned:
        found = "" if any(c.nonfinite for c in scanned) else ": all finite"
        notes.append(f"data at '{root}' has no integrity record in meta.json (written before records were kept): "
                     f"scanned {', '.join(c.path.name for c in scanned)} for NaN/inf, {_mb(scanned)}{found}. "
                     f"{record} records it, so later starts skip the scan.")
    return notes, warnings


def check_dataset(dataset: Any, allow_nonfinite: bool) -> tuple[list[str], list[str]]:
    """(notes, warnings) of a dataset training opened: a latent directory's files checked against its integrity
    record (or scanned), its non-finite samples refused unless `allow_nonfinite`. WebDataset shards have no record
    (their reader warns per sample as batches meet NaN/inf): nothing to say. A bucketed dataset: each bucket's."""
    if dataset.buckets is not None:                        # tread/data/bucketed.py: one latent dataset per bucket
        found = [check_dataset(part, allow_nonfinite) for part in dataset.parts]
        return [n for notes, _ in found for n in notes], [w for _, warned in found for w in warned]
    if not isinstance(dataset, LatentDataset):
        return [], []
    checks = check_integrity(dataset.root, dataset.meta)
    return integrity_verdict(dataset.root, checks, len(dataset), allow_nonfinite)
