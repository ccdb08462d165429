"""Random access to WebDataset latent shards (the TREAD / MaskDiT ImageNet latents) as a map-style dataset, through
`tarfile` and a cached index of member offsets (tread/data/wds_index.py), so loading stays deterministic and resume
exact. The shard layouts, data.latent_draw and the checks: docs/data.md, "The paper repo's WebDataset shards"."""
from __future__ import annotations

import collections
import glob
import json
import math
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .meta import DTYPES, FORMAT, LATENT_KINDS, VERSION, LatentDatasetError, draw_latents, model_shape, validate_meta
from .reader import LatentMeta, warn_non_finite
from .wds_index import build_index, decode_latent, pread

LATENT_DRAWS = ("sample", "mean", "stored")   # data.latent_draw (docs/data.md)
MAX_OPEN_SHARDS = 256                    # file descriptors kept open per process (least recently used closed)
PathSpec = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


# ----------------------------------------------------------------------------- shard lists

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Expand `{000..127}` (zero-padded to the wider bound) and `{a,b,c}` groups, left to right.

    Nested or unbalanced braces and descending or non-numeric ranges raise LatentDatasetError.
    """
    def bad(why: str) -> LatentDatasetError:
        return LatentDatasetError(
            f"bad brace pattern {pattern!r}: {why}. Allowed: numeric ranges like "
            f"'/data/shards/imagenet-{{000000..000127}}.tar' and lists like '{{a,b}}' (no nesting)")

    match = _BRACE.search(pattern)
    if match is None:
        if "{" in pattern or "}" in pattern:
            raise bad("unbalanced or nested braces")
        return [pattern]
    body = match.group(1)
    rng = _RANGE.match(body)
    if rng:
        lo, hi = rng.groups()
        if int(lo) > int(hi):
            raise bad(f"range {{{body}}} is descending")
        width = max(len(lo), len(hi)) if (lo.startswith("0") or hi.startswith("0")) else 0
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    elif "," in body:
        options = body.split(",")
    else:
        raise bad(f"{{{body}}} is neither a range 'A..B' of non-negative integers nor a comma list")
    head, tail = pattern[:match.start()], pattern[match.end():]
    if "{" in head or "}" in head:
        raise bad("unbalanced or nested braces")
    rest = expand_braces(tail)
    return [head + opt + r for opt in options for r in rest]


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def resolve_shards(path: PathSpec) -> list[Path]:
    """Shard spec -> sorted absolute .tar paths.

    `path` is a directory (its *.tar files), a .tar file, a brace pattern ('x-{000..127}.tar'), a glob
    ('x-*.tar'), or a list of any of these. Missing shards, duplicates and empty results raise
    LatentDatasetError.
    """
    specs = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not specs:
        raise LatentDatasetError("no WebDataset shards given: data.path is an empty list")
    found: list[Path] = []
    for spec in specs:
        spec = os.path.expanduser(os.fspath(spec))
        p = Path(spec)
        if "{" in spec or "}" in spec or _is_glob(spec):
            names = expand_braces(spec)
            files: list[Path] = []
            missing = []
            for name in names:
                if _is_glob(name):
                    files += [Path(m) for m in sorted(glob.glob(name)) if os.path.isfile(m)]
                elif Path(name).is_file():
                    files.append(Path(name))
                else:
                    missing.append(name)
            if missing:
                shown = ", ".join(repr(m) for m in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                                                   else "")
                raise LatentDatasetError(f"WebDataset pattern {spec!r}: {len(missing)} of its {len(names)} shard(s) "
                                         f"do not exist: {shown}. Fix data.path (the pattern or the range).")
            if not files:
                raise LatentDatasetError(f"no WebDataset shards match {spec!r}. Set data.path to a directory of .tar "
                                         f"shards, a .tar file or a pattern like "
                                         f"'/data/imagenet-{{000000..000127}}.tar'.")
            found += files
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix == ".tar" and f.is_file())
            if not files:
                others = sorted({f.suffix for f in p.iterdir() if f.is_file()} - {""})
                hint = (f" (it has {', '.join(others)} files; compressed shards cannot be read randomly: "
                        f"decompress them to .tar)" if any(s in (".gz", ".tgz", ".zst", ".xz", ".bz2") for s in others)
                        else "")
                raise LatentDatasetError(f"no WebDataset shards (*.tar) in directory '{p.absolute()}'{hint}. Set "
                                         f"data.path to a directory of .tar shards, a .tar file or a brace pattern.")
            found += files
        elif p.is_file():
            found.append(p)
        else:
            raise LatentDatasetError(f"WebDataset shards not found: '{p.absolute()}' does not exist. Set data.path "
                                     f"to a directory of .tar shards, a .tar file or a pattern like "
                                     f"'/data/imagenet-{{000000..000127}}.tar'.")
    shards = sorted(Path(os.path.abspath(f)) for f in found)
    dupes = sorted(str(s) for s, n in collections.Counter(shards).items() if n > 1)
    if dupes:
        raise LatentDatasetError(f"WebDataset shard(s) listed more than once by data.path: {dupes[:3]}")
    return shards


# ----------------------------------------------------------------------------- dataset

def _check_layout(first: str, shape: list[int], kind: str, draw: str, channels: Optional[int]) -> None:
    """The stored shape against data.latent_kind / latent_draw and the model's channels (None: unknown): moments
    read with sample or mean hold 2C channels (mean, logvar), stored arrays C. One LatentDatasetError otherwise."""
    c = shape[0]
    moments = kind == "moments" and draw != "stored"
    if moments and not c % 2 and channels in (None, c // 2) or not moments and channels in (None, c):
        return
    if channels is None:
        raise LatentDatasetError(f"latent member {first} has shape {shape}: {c} channels, but latent_kind 'moments' "
                                 f"needs an even count (mean and logvar stacked) with data.latent_draw={draw}; allowed: "
                                 f"even channels, or data.latent_draw=stored for plain latents")
    if c not in (channels, 2 * channels):         # one of the two: _check_expected says which draw fits
        raise LatentDatasetError(f"latent member {first} has shape {shape}, which fits neither layout for a model of "
                                 f"data.channels={channels}; allowed: {2 * channels} channels (moments: "
                                 f"data.latent_draw=sample or mean, data.latent_kind=moments) or {channels} (latents "
                                 f"fed as stored: data.latent_draw=stored)")


class WebDatasetLatents(LatentMeta, torch.utils.data.Dataset):
    """WebDataset tar shards of latents, random access; the same interface as `data.LatentDataset`.

    Items are (float32 (C, H, W), int64 label) as data.latent_draw says (moments left for the training step's
    draw_latents under "sample"). `meta` describes the items in the tread-latents format (validate_meta); its
    files hold the member-name patterns ("*.latent.npy", "*.cls").
    """

    def __init__(self, path: PathSpec, *, num_classes: int = 1000, latent_scale: float = 0.18215,
                 latent_kind: str = "moments", latent_draw: str = "sample", vae: str = "stabilityai/sd-vae-ft-ema",
                 index_dir: Optional[Union[str, os.PathLike]] = None, expected_channels: Optional[int] = None,
                 expected_resolution: Optional[int] = None, expected_num_classes: Optional[int] = None):
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard -> open file descriptor (this process's)
        self._reported: set[int] = set()                   # samples already warned about (warn_non_finite)
        self._pid: Optional[int] = None                    # the process that opened them
        if latent_kind not in LATENT_KINDS:
            raise LatentDatasetError(f"data.latent_kind={latent_kind!r}; allowed: {list(LATENT_KINDS)} ('moments': "
                                     f"the shards hold VAE (mean, logvar); 'sample': plain latents)")
        if latent_draw not in LATENT_DRAWS:
            raise LatentDatasetError(f"data.latent_draw={latent_draw!r}; allowed: {list(LATENT_DRAWS)} ('sample': a "
                                     f"posterior draw per read, 'mean': the posterior mean, 'stored': as stored)")
        if latent_draw == "mean" and latent_kind != "moments":
            raise LatentDatasetError("data.latent_draw='mean' needs moments data (data.latent_kind=moments); "
                                     "allowed with data.latent_kind=sample: data.latent_draw=sample or stored")
        self.latent_draw, self._kind = latent_draw, latent_kind
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise LatentDatasetError(f"data.num_classes={num_classes!r} must be a positive integer (labels lie in "
                                     f"[0, num_classes))")
        if isinstance(latent_scale, bool) or not isinstance(latent_scale, (int, float)) or \
                not (math.isfinite(latent_scale) and latent_scale > 0):
            raise LatentDatasetError(f"data.latent_scale={latent_scale!r} must be a finite number > 0 (0.18215 for "
                                     f"the SD VAE)")
        if not isinstance(vae, str) or not vae:
            raise LatentDatasetError(f"data.vae={vae!r} must name the VAE that decodes these latents (a hub id or a "
                                     f"path, e.g. 'stabilityai/sd-vae-ft-ema')")
        self.shards = resolve_shards(path)
        path_spec = (os.fspath(path) if isinstance(path, (str, os.PathLike))
                     else json.dumps([os.fspath(p) for p in path]))
        if isinstance(path, (str, os.PathLike)) and Path(os.path.expanduser(path_spec)).exists():
            self.root = Path(os.path.abspath(os.path.expanduser(path_spec)))  # the directory or the .tar
        else:
            self.root = Path(os.path.commonpath([str(s.parent) for s in self.shards]))
        index, self.index_file = build_index(self.shards, index_dir)
        self._counts = index["counts"]
        self._shard = np.repeat(np.arange(len(self.shards), dtype=np.int32), self._counts)
        self._keys, self._offsets, self._sizes = index["keys"], index["offsets"], index["sizes"]
        self._labels = index["labels"]
        self._ext = str(index["ext"])
        shape, dtype = [int(s) for s in index["shape"]], str(index["dtype"])
        first = f"'{self._key(0)}.{self._ext}' in shard '{self.shards[0]}'"
        if len(shape) != 3 or min(shape) < 1:
            raise LatentDatasetError(f"latent member {first} has shape {shape}; expected (C, H, W) with C, H, W > 0")
        if dtype not in DTYPES:
            raise LatentDatasetError(f"latent member {first} is {dtype}; allowed dtypes: {list(DTYPES)}")
        _check_layout(first, shape, latent_kind, latent_draw, expected_channels)
        self._dtype, self._stored_shape = np.dtype(dtype), shape
        moments = latent_kind == "moments" and latent_draw != "stored"
        item_shape = [shape[0] // 2, *shape[1:]] if latent_draw == "mean" else shape
        self._meta = validate_meta({
            "format": FORMAT, "version": VERSION, "shape": item_shape, "dtype": dtype,
            "num_samples": int(len(self._labels)), "num_classes": int(num_classes), "latent_scale": float(latent_scale),
            "decode": {"type": "vae", "vae": vae, "scaling_factor": float(latent_scale)},
            "source": path_spec, "class_names": None, "latent_kind": "moments" if moments and latent_draw == "sample"
            else "sample", "latent_draw": latent_draw,
            "files": {"latents": f"*.{self._ext}", "labels": "*.cls"},
        }, f"WebDataset shards {path_spec!r}", "Fix the data.* settings.")
        self._check_labels()
        self._check_expected(expected_channels, expected_resolution, expected_num_classes)

    # -- validation

    def _key(self, i: int) -> str:
        return self._keys[i].decode("utf-8", "surrogateescape")

    def _member(self, i: int, ext: Optional[str] = None) -> str:
        return f"'{self._key(i)}.{ext or self._ext}' in shard '{self.shards[self._shard[i]]}'"

    def _check_labels(self) -> None:
        k = self._meta["num_classes"]
        bad = np.flatnonzero((self._labels < 0) | (self._labels >= k))
        if bad.size:
            i = int(bad[0])
            raise LatentDatasetError(
                f"label member {self._member(i, 'cls')} is {int(self._labels[i])} but data.num_classes={k} allows "
                f"only [0, {k - 1}] ({bad.size} sample(s) out of range; labels range over "
                f"[{int(self._labels.min())}, {int(self._labels.max())}]). Set data.num_classes or fix the shards.")

    _FIX = ("Point data.path at matching shards, set data.latent_draw (stored: latents fed as they are, e.g. the "
            "paper's 4-channel shards; sample or mean: 2C-channel moments), or change the data/model config.")

    def _shape_source(self) -> str:
        shape = list(model_shape(self._meta))
        held = "moments" if self.latent_draw != "stored" and self._kind == "moments" else "latents"
        return f"shards hold {self._stored_shape} {held} -> model shape {shape}"

    # -- reading

    def _fd(self, shard: int) -> int:
        """The shard's file descriptor, opened on first use in each process (forked workers reopen)."""
        pid = os.getpid()
        if self._pid != pid:
            if self._pid is not None:  # inherited through fork: close our copies, the parent keeps its own
                for fd in self._fds.values():
                    os.close(fd)
            self._fds.clear()
            self._pid = pid
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SHARDS:
                os.close(self._fds.popitem(last=False)[1])
            try:
                fd = os.open(self.shards[shard], os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as err:
                raise LatentDatasetError(f"cannot open shard '{self.shards[shard]}' ({err})") from None
            self._fds[shard] = fd
        else:
            self._fds.move_to_end(shard)
        return fd

    def _read(self, i: int) -> np.ndarray:
        off, size = int(self._offsets[i]), int(self._sizes[i])
        raw = pread(self._fd(int(self._shard[i])), size, off)
        cache = f" (index {self.index_file})" if self.index_file else ""
        if len(raw) != size:
            raise LatentDatasetError(f"latent member {self._member(i)}: read {len(raw)} of {size} bytes at offset "
                                     f"{off}; the shard was truncated or changed after it was indexed{cache}. "
                                     f"Restart to re-index it.")
        try:
            arr = decode_latent(raw, self._ext)
        except Exception as err:  # noqa: BLE001 - any decoding failure is a bad member
            raise LatentDatasetError(f"latent member {self._member(i)} cannot be decoded ({type(err).__name__}: "
                                     f"{err}); the shard is corrupt or changed after it was indexed{cache}") from None
        if list(arr.shape) != self._stored_shape or arr.dtype != self._dtype:
            raise LatentDatasetError(f"latent member {self._member(i)} is {arr.dtype} of shape {list(arr.shape)} but "
                                     f"the dataset is {self._dtype} of shape {self._stored_shape} (from its first "
                                     f"sample): all latents must have one shape and dtype")
        return arr

    def _items(self, x: np.ndarray) -> torch.Tensor:
        """Stored arrays (B, *stored shape) -> the items data.latent_draw gives."""
        xt = torch.from_numpy(x)
        if self.latent_draw == "mean":
            return draw_latents(xt, {"latent_kind": "moments", "latent_scale": self.latent_scale}, mode="mean")
        if self.latent_draw == "stored" or self.latent_kind == "moments":
            return xt                                    # sample from moments: the training step draws
        return xt * self.latent_scale

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched fetch, (x (B, C, H, W) float32, y (B,) int64); reads in shard/offset order."""
        n = len(self)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"index out of range for a dataset of {n} samples: {indices}")
        idx = np.where(idx < 0, idx + n, idx)
        x = np.empty((len(idx), *self._stored_shape), np.float32)
        for j in np.lexsort((self._offsets[idx], self._shard[idx])):  # sequential within each shard
            x[j] = self._read(int(idx[j]))
        warn_non_finite(x, idx, self._reported, lambda i: f"sample {i} (latent member {self._member(i)})")
        return self._items(x), torch.from_numpy(self._labels[idx].astype(np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([int(index)])
        return x[0], y[0]

    def label(self, index: int) -> int:
        """Class label of sample `index` (from the index: no shard read)."""
        return int(self._labels[index])

    def close(self) -> None:
        """Close this process's open shard files (reopened on the next read)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds.clear()

    def __getstate__(self) -> dict:
        # File descriptors stay with their process: an unpickled copy (a DataLoader worker) opens its own.
        return {**self.__dict__, "_fds": OrderedDict(), "_pid": None}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"WebDatasetLatents({len(self)} samples in {len(self.shards)} shard(s) at '{self.root}', "
                f"{self._meta['dtype']} {self._meta['shape']} {self.latent_kind})")
