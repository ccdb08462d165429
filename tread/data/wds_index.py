"""The index of WebDataset latent shards (see tread/data/wds.py for the layout): one scan of the tar headers gives
every sample's shard, latent member offset and size, and label; the index is cached per set of shards. Also
the decoding of latent members (np.save bytes or a pickled ndarray, unpickled safely), which reads share."""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Sequence, Union

import numpy as np

from tread.utils.io import atomic_write
from tread.utils.readers import FileFormatError, parse_npy, read_npz

from .meta import LatentDatasetError

INDEX_VERSION = 1
LATENT_EXTS = ("latent.npy", "latent")  # np.save bytes | pickled ndarray (MaskDiT lmdb2wds.py)
LABEL_EXTS = ("cls",)                    # decimal text
NPY_HEADER_PROBE = 4096                  # bytes read to parse a .npy header during indexing


def default_index_dir() -> Path:
    """`$TREAD_CACHE_DIR/wds_index` (or `.cache/wds_index`), as paths.cache_dir would give."""
    return Path(os.environ.get("TREAD_CACHE_DIR") or ".cache") / "wds_index"


# ----------------------------------------------------------------------------- member decoding

class _NumpyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays only: any other global in the pickle is refused (no code from a shard runs)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle '{module}.{name}' (only numpy arrays are allowed)")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):  # numpy 1.x pickles under numpy 2.x
            module = "numpy._core." + module[len("numpy.core."):]
        return super().find_class(module, name)


def decode_latent(raw: bytes, ext: str) -> np.ndarray:
    """Bytes of a `.latent.npy` (np.save) or `.latent` (pickled ndarray) member -> array."""
    if ext == "latent.npy":
        return parse_npy(raw, "the .latent.npy member")
    arr = _NumpyUnpickler(io.BytesIO(raw)).load()
    if not isinstance(arr, np.ndarray):
        raise pickle.UnpicklingError(f"the pickle holds a {type(arr).__name__}, not a numpy array")
    return arr


def _npy_header(raw: bytes) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header length) from the start of np.save bytes."""
    bio = io.BytesIO(raw)
    version = np.lib.format.read_magic(bio)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(bio)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(bio)
    else:
        raise ValueError(f".npy format version {version} is not supported")
    return tuple(shape), np.dtype(dtype), bio.tell()


def _split_name(name: str) -> Optional[tuple[str, str]]:
    """Member name -> (key, extension) as webdataset splits it (first '.' of the base name), or None."""
    head, sep, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None
    return head + sep + stem, ext


def pread(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes of file `fd` at `offset`."""
    if hasattr(os, "pread"):  # positional: no shared file offset, safe across forked workers and threads
        return os.pread(fd, size, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, size)


# ----------------------------------------------------------------------------- indexing

class _ShardScan:
    """scan_shard's running index of one shard: per latent sample its key, the offset and size of its latent
    member and its label, and the latent layout every sample must share."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self.keys: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.labels: list[int] = []
        self.layout: dict[str, Any] = {}  # ext, shape, dtype and the member they were first seen in

    def member(self, key: str, ext: str) -> str:
        return f"'{key}.{ext}' in shard '{self.path}'"

    def add(self, key: str, group: dict[str, tarfile.TarInfo]) -> None:
        """Index one sample (the members sharing `key`); a group with neither a latent nor a label is skipped."""
        lat = [e for e in LATENT_EXTS if e in group]
        lab = [e for e in LABEL_EXTS if e in group]
        if not lat and not lab:
            return  # not a latent sample (an extra file): skipped
        present, path = sorted(group), self.path
        if not lat:
            raise LatentDatasetError(f"sample '{key}' in shard '{path}' has no latent member (has {present}; "
                                     f"needs one of {[f'{key}.{e}' for e in LATENT_EXTS]})")
        if not lab:
            raise LatentDatasetError(f"sample '{key}' in shard '{path}' has no class label member (has "
                                     f"{present}; needs one of {[f'{key}.{e}' for e in LABEL_EXTS]})")
        if len(lat) > 1 or len(lab) > 1:
            raise LatentDatasetError(f"sample '{key}' in shard '{path}' has several latent or label members "
                                     f"({present}); keep one latent and one label per sample")
        lat_info = group[lat[0]]
        label = self.label(key, lab[0], group[lab[0]])
        self.check_layout(key, lat[0], *self.latent_layout(key, lat[0], lat_info))
        self.keys.append(key)
        self.offsets.append(lat_info.offset_data)
        self.sizes.append(lat_info.size)
        self.labels.append(label)

    def label(self, key: str, ext: str, info: tarfile.TarInfo) -> int:
        """The class index a label member holds as decimal text."""
        raw = pread(self.fd, min(info.size, 256), info.offset_data)
        try:
            if info.size > 256:
                raise ValueError("too long for a label")
            return int(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise LatentDatasetError(f"label member {self.member(key, ext)} holds {raw[:20]!r}, not an integer "
                                     f"class index written as decimal text (e.g. b'207')") from None

    def latent_layout(self, key: str, ext: str, info: tarfile.TarInfo) -> tuple[Any, Any]:
        """(shape, dtype) of a latent member: from its .npy header (checked against the member size), by
        unpickling the shard's first pickled sample (the whole member must be read), else (None, None)."""
        fd = self.fd
        if ext == "latent.npy":
            head = pread(fd, min(info.size, NPY_HEADER_PROBE), info.offset_data)
            try:
                try:
                    shape, dtype, hlen = _npy_header(head)
                except (ValueError, EOFError):  # a header longer than the probe
                    shape, dtype, hlen = _npy_header(pread(fd, info.size, info.offset_data))
            except (ValueError, EOFError) as err:
                raise LatentDatasetError(f"latent member {self.member(key, ext)} is not a valid .npy array "
                                         f"({err})") from None
            want = hlen + math.prod(shape) * dtype.itemsize
            if info.size != want:
                raise LatentDatasetError(f"latent member {self.member(key, ext)} is {info.size} bytes but its "
                                         f".npy header ({dtype} {list(shape)}) needs {want}: truncated or corrupt")
            return shape, dtype
        if self.layout:
            return None, None
        try:
            arr = decode_latent(pread(fd, info.size, info.offset_data), ext)
        except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad member
            raise LatentDatasetError(f"latent member {self.member(key, ext)} is not a pickled numpy array "
                                     f"({type(err).__name__}: {err})") from None
        return arr.shape, arr.dtype

    def check_layout(self, key: str, ext: str, shape: Any, dtype: Any) -> None:
        """The first sample fixes the encoding, shape and dtype; every later one must match them."""
        layout = self.layout
        if not layout:
            layout.update(ext=ext, shape=shape, dtype=dtype, first=self.member(key, ext))
        elif ext != layout["ext"]:
            raise LatentDatasetError(f"latent member {self.member(key, ext)} is a '.{ext}' member but earlier "
                                     f"samples use '.{layout['ext']}' (first: {layout['first']}); one encoding per "
                                     f"dataset")
        elif shape is not None and (shape != layout["shape"] or dtype != layout["dtype"]):
            raise LatentDatasetError(f"latent member {self.member(key, ext)} is {dtype} of shape {list(shape)} but "
                                     f"{layout['first']} is {layout['dtype']} of shape {list(layout['shape'])}: "
                                     f"all latents must have one shape and dtype")


def _each_sample(f: BinaryIO, path: Path, add: Callable[[str, dict[str, tarfile.TarInfo]], None]) -> None:
    """Call add(key, {extension: TarInfo}) for every run of consecutive tar members sharing a key, in order;
    a compressed, cut or corrupt archive raises."""
    fd = f.fileno()
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.ReadError as err:
        raise LatentDatasetError(f"shard '{path}' is not an uncompressed tar file ({err}); compressed shards "
                                 f"cannot be read randomly: decompress them to .tar") from None
    cur_key: Optional[str] = None
    group: dict[str, tarfile.TarInfo] = {}
    try:
        for info in tar:
            if not info.isfile():
                continue
            parts = _split_name(info.name)
            if parts is None:
                continue
            key, ext = parts
            if key != cur_key:
                if cur_key is not None:
                    add(cur_key, group)
                cur_key, group = key, {}
            if ext in group:
                raise LatentDatasetError(f"shard '{path}' has member '{info.name}' twice in one sample")
            group[ext] = info
    except (tarfile.TarError, EOFError, OSError) as err:
        raise LatentDatasetError(f"shard '{path}' is truncated or corrupt ({type(err).__name__}: {err})") from None
    # tarfile stops quietly at a cut or unreadable header: a complete archive ends with two zero blocks there.
    if pread(fd, 2 * tarfile.BLOCKSIZE, tar.offset) != bytes(2 * tarfile.BLOCKSIZE):
        raise LatentDatasetError(f"shard '{path}' is truncated or corrupt: no readable tar header or "
                                 f"end-of-archive marker at byte {tar.offset} (of {os.fstat(fd).st_size}); "
                                 f"was it written completely?")
    if cur_key is not None:
        add(cur_key, group)


def scan_shard(path: Path) -> dict[str, Any]:
    """Index one uncompressed tar shard from its headers.

    Returns {"keys": [...], "offsets": [...], "sizes": [...] (of each sample's latent member),
    "labels": [...], "ext": latent extension, "shape": (C, H, W), "dtype": str}. Reads the tar headers,
    the label members and (for .latent.npy) the .npy headers, not the latent data.
    """
    with open(path, "rb", buffering=0) as f:  # unbuffered: skipping a member never reads its data
        scan = _ShardScan(path, f.fileno())
        _each_sample(f, path, scan.add)
    if not scan.keys:
        raise LatentDatasetError(f"shard '{path}' holds no latent samples (no '<key>.latent.npy' or '<key>.latent' "
                                 f"members with a '<key>.cls' label)")
    layout = scan.layout
    return {"keys": scan.keys, "offsets": scan.offsets, "sizes": scan.sizes, "labels": scan.labels,
            "ext": layout["ext"], "shape": tuple(int(s) for s in layout["shape"]), "dtype": str(layout["dtype"]),
            "first": layout["first"]}


def _fingerprint(shards: Sequence[Path]) -> list[list]:
    out = []
    for s in shards:
        st = s.stat()
        out.append([str(s), int(st.st_size), int(st.st_mtime_ns)])
    return out


def index_path(shards: Sequence[Path], index_dir: Union[str, os.PathLike]) -> Path:
    """Cache file for these shards: a hash of every shard's path, size and mtime (a changed shard -> a new file)."""
    blob = json.dumps({"version": INDEX_VERSION, "shards": _fingerprint(shards)}).encode()
    return Path(index_dir).expanduser() / f"{hashlib.sha256(blob).hexdigest()[:32]}.npz"


def _load_index(file: Path, fingerprint: list[list]) -> Optional[dict[str, np.ndarray]]:
    try:
        index = read_npz(file, "shard index")
    except (FileFormatError, FileNotFoundError):
        return None  # missing, partial or foreign: rebuilt
    try:
        same = (int(index["version"]) == INDEX_VERSION and index["shard_paths"].tolist() == [f[0] for f in fingerprint]
                and index["shard_sizes"].tolist() == [f[1] for f in fingerprint]
                and index["shard_mtimes"].tolist() == [f[2] for f in fingerprint])
    except KeyError:
        return None
    return index if same else None


def build_index(shards: Sequence[Path], index_dir: Optional[Union[str, os.PathLike]]) -> tuple[dict, Optional[Path]]:
    """Load the cached index of `shards` or scan them (scan_shard) and cache it. -> (index, cache file)."""
    fingerprint = _fingerprint(shards)
    file = index_path(shards, index_dir if index_dir is not None else default_index_dir())
    cached = _load_index(file, fingerprint)
    if cached is not None:
        return cached, file
    print(f"Indexing {len(shards)} WebDataset shard(s) (once; cached in {file}) ...", file=sys.stderr, flush=True)
    start = time.time()
    parts = []
    for shard in shards:
        part = scan_shard(shard)
        if parts and (part["ext"], part["shape"], part["dtype"]) != (parts[0]["ext"], parts[0]["shape"],
                                                                    parts[0]["dtype"]):
            raise LatentDatasetError(
                f"shard '{shard}' holds '.{part['ext']}' latents, {part['dtype']} of shape {list(part['shape'])} "
                f"(first: {part['first']}) but {parts[0]['first']} is '.{parts[0]['ext']}', {parts[0]['dtype']} of "
                f"shape {list(parts[0]['shape'])}: all shards must hold one latent shape, dtype and encoding")
        parts.append(part)
    keys = [k.encode("utf-8", "surrogateescape") for p in parts for k in p["keys"]]
    index = {
        "version": np.array(INDEX_VERSION),
        "shard_paths": np.array([f[0] for f in fingerprint]),
        "shard_sizes": np.array([f[1] for f in fingerprint], np.int64),
        "shard_mtimes": np.array([f[2] for f in fingerprint], np.int64),
        "counts": np.array([len(p["keys"]) for p in parts], np.int64),
        "keys": np.array(keys, dtype=f"S{max(len(k) for k in keys)}"),
        "offsets": np.array([o for p in parts for o in p["offsets"]], np.int64),
        "sizes": np.array([s for p in parts for s in p["sizes"]], np.int64),
        "labels": np.array([y for p in parts for y in p["labels"]], np.int64),
        "ext": np.array(parts[0]["ext"]), "shape": np.array(parts[0]["shape"], np.int64),
        "dtype": np.array(parts[0]["dtype"]),
    }
    print(f"Indexed {len(keys)} samples in {time.time() - start:.1f} s.", file=sys.stderr, flush=True)
    try:  # atomic: a concurrent reader (another rank) sees the old file or the whole new one
        atomic_write(file, lambda out: np.savez(out, **index))
    except OSError as err:
        warnings.warn(f"could not cache the WebDataset index in '{file}' ({err}); the shards will be rescanned next "
                      f"time (set data.index_dir to a writable directory)", stacklevel=2)
        file = None
    return index, file
