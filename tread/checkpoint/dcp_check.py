"""What a sharded folder's index (.metadata) and files must be before any tensor is allocated or read (dcp_io.py):
every entry a tensor whose chunks lie inside its shape and add up to it, each chunk stored in a file of the folder,
inside the file's size, in no fewer bytes than its elements take and in bytes no other chunk claims (so the
tensors an index declares never exceed the files that hold them), and each stored chunk a torch.save archive of
that chunk's shape and dtype (read on the meta device: its zip directory and pickled layout, with torch's
weights-only unpickler, not its data)."""
from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.utils import _create_file_view

from tread.checkpoint.shard_names import INDEX, ShardedFileError

ZIP_MAGIC = b"PK\x03\x04"       # how every torch.save archive (and so every chunk DCP writes) starts
# How torch.load fails on bytes that are not the archive it expects (a foreign, truncated or garbled item).
LOAD_ERRORS = (RuntimeError, OSError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
               RecursionError, pickle.UnpicklingError)


class Stored(NamedTuple):
    """One chunk of a tensor and where the index says its bytes are."""
    fqn: str
    dtype: torch.dtype
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


def check_metadata(folder: Path, metadata: dcp_metadata.Metadata) -> list[Stored]:
    """Every chunk the index declares, after the checks of the module doc that need only its records and the
    files' sizes; ShardedFileError naming the file and the tensor."""
    index = Path(folder) / INDEX
    try:
        storage = storage_map(index, metadata.storage_data)
        entries = metadata.state_dict_metadata
        if not isinstance(entries, dict):
            raise TypeError("its entries are not a mapping")
        chunks = [c for fqn, md in entries.items() for c in tensor_chunks(index, fqn, md, storage)]
    except ShardedFileError:
        raise
    except (AttributeError, TypeError, ValueError) as err:    # a record of DCP's without its fields, or not theirs
        raise ShardedFileError(f"'{index}' is not a checkpoint index ({str(err)[:200]})") from None
    check_files(Path(folder), chunks)
    return chunks


def storage_map(index: Path, storage_data: Any) -> dict[tuple[str, tuple[int, ...]], _StorageInfo]:
    """{(tensor name, chunk offsets): where its bytes are} of an index."""
    if not isinstance(storage_data, dict):
        raise TypeError("its storage records are not a mapping")
    out = {}
    for key, info in storage_data.items():
        if not isinstance(key, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise TypeError(f"storage record {key!r} is not DCP's")
        if key.offset is None:        # a non-tensor's record: its entry is refused as such
            continue
        out[(key.fqn, shape_of(key.offset, f"storage record {key.fqn!r} offset"))] = info
    return out


def shape_of(value: Any, what: str) -> tuple[int, ...]:
    """A shape or offset: a tuple of ints >= 0."""
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise TypeError(f"{what} {value!r} is not a tuple of integers >= 0")
    return tuple(value)


def tensor_chunks(index: Path, fqn: str, md: Any, storage: dict) -> list[Stored]:
    """The chunks of one entry, which lie inside its shape, add up to it and are each stored somewhere."""
    if not isinstance(md, dcp_metadata.TensorStorageMetadata):
        raise ShardedFileError(f"'{index}': entry '{fqn}' is not a tensor; sharded checkpoints hold tensors only")
    shape, dtype = shape_of(md.size, f"tensor {fqn!r} shape"), md.properties.dtype
    if not isinstance(dtype, torch.dtype) or not isinstance(md.chunks, list):
        raise TypeError(f"tensor {fqn!r} has no dtype and chunk list")
    out, total = [], 0
    for chunk in md.chunks:
        offsets, sizes = (shape_of(getattr(chunk, k), f"tensor {fqn!r} chunk {k}") for k in ("offsets", "sizes"))
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise ShardedFileError(f"'{index}': tensor '{fqn}' of shape {list(shape)} has a chunk {list(sizes)} at "
                                   f"{list(offsets)} outside it; the index is corrupt")
        info = storage.get((fqn, offsets))
        if info is None:
            raise ShardedFileError(f"'{index}': tensor '{fqn}' has a chunk at {list(offsets)} stored in no file; "
                                   f"the index is corrupt")
        out.append(stored(index, fqn, dtype, sizes, info))
        total += math.prod(sizes)
    if total != math.prod(shape):
        raise ShardedFileError(f"'{index}': the chunks of tensor '{fqn}' hold {total} elements, its shape "
                               f"{list(shape)} needs {math.prod(shape)}; the index is corrupt")
    return out


def stored(index: Path, fqn: str, dtype: torch.dtype, sizes: tuple[int, ...], info: _StorageInfo) -> Stored:
    """A chunk's storage record: a file of the folder (a plain name), a byte range at least as long as the chunk's
    elements take, no transforms (this project writes none)."""
    name, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or not all(
            type(v) is int and v >= 0 for v in (offset, length)):
        raise ShardedFileError(f"'{index}': tensor '{fqn}' is stored at {name!r} bytes {offset!r}+{length!r}, "
                               f"which is not a byte range of a file in its folder; the index is corrupt")
    if info.transform_descriptors:
        raise ShardedFileError(f"'{index}': tensor '{fqn}' is stored with transforms {info.transform_descriptors!r}; "
                               f"this project writes none")
    need = math.prod(sizes) * dtype.itemsize
    if need > length:
        raise ShardedFileError(f"'{index}': tensor '{fqn}' claims a {list(sizes)} {dtype} chunk ({need} bytes) in "
                               f"{length} bytes of '{name}'; the index is corrupt")
    return Stored(fqn, dtype, sizes, name, offset, length)


def by_file(chunks: list[Stored]) -> list[tuple[str, list[Stored]]]:
    """The chunks by the file that stores them, files by name."""
    out: dict[str, list[Stored]] = {}
    for chunk in chunks:
        out.setdefault(chunk.file, []).append(chunk)
    return sorted(out.items())


def check_files(folder: Path, chunks: list[Stored]) -> None:
    """Each file the chunks name is there, holds their byte ranges, and no two ranges overlap."""
    for name, items in by_file(chunks):
        path = folder / name
        if not path.is_file():
            raise ShardedFileError(f"'{path}' is missing: the index '{folder / INDEX}' stores tensor "
                                   f"'{items[0].fqn}' in it; the sharded checkpoint is incomplete")
        size, end, last = path.stat().st_size, 0, None
        for item in sorted(items, key=lambda c: c.offset):
            if item.offset + item.length > size:
                raise ShardedFileError(f"'{path}' holds {size} bytes, but the index stores tensor '{item.fqn}' at "
                                       f"bytes {item.offset}..{item.offset + item.length}; the file is truncated")
            if item.offset < end:
                raise ShardedFileError(f"'{folder / INDEX}': tensors '{last}' and '{item.fqn}' are stored in the same "
                                       f"bytes of '{path}'; the index is corrupt")
            end, last = item.offset + item.length, item.fqn


def check_items(folder: Path, chunks: list[Stored]) -> None:
    """Each stored chunk is a torch.save archive of its shape and dtype, its storage inside its byte range."""
    for name, items in by_file(chunks):
        with open(Path(folder) / name, "rb") as f:
            for item in items:
                check_item(Path(folder) / name, f, item)


def check_item(path: Path, f: Any, item: Stored) -> None:
    where = f"'{path}': tensor '{item.fqn}' (bytes {item.offset}..{item.offset + item.length})"
    try:
        tensor = meta_load(_create_file_view(f, item.offset, item.length))
    except pickle.UnpicklingError:              # torch's weights-only unpickler: its message is about torch.load
        raise ShardedFileError(f"{where} cannot be read (its pickled layout is not a tensor's); the file is corrupt "
                               f"or not this checkpoint's") from None
    except LOAD_ERRORS as err:
        raise ShardedFileError(f"{where} cannot be read ({cause(err)}); the file is corrupt or not this "
                               f"checkpoint's") from None
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != item.sizes or tensor.dtype != item.dtype \
            or tensor.untyped_storage().nbytes() > item.length:
        found = f"{list(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ShardedFileError(f"{where} holds {found}, the index says {list(item.sizes)} {item.dtype}; the file is "
                               f"not this checkpoint's")


def cause(err: BaseException) -> str:
    """An error's first sentence (torch's go on about where to report them), or its type."""
    text = " ".join(str(err).split())
    return (text.split(". ")[0][:200] or type(err).__name__).rstrip(".")


def meta_load(view: Any) -> Any:
    """What a torch.save archive holds, on the meta device (its zip directory and pickled layout read, not its
    data); ValueError for bytes that are not a zip archive (torch.load would try them as an old-format pickle)."""
    if view.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        raise ValueError("not a torch.save archive")
    view.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch's notes on what the unpickler was given
        return torch.load(view, map_location="meta", weights_only=True)
