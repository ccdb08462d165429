"""torch.distributed.checkpoint underneath tread/checkpoint/sharded.py: the folder written and read by every process
(or read by one into full tensors). Its pickled index is read by MetadataUnpickler, which builds only DCP's own
records, and only tensors the index declares are loaded (docs/design.md); what the index claims is checked against
the files first (dcp_check.py), and a process's failure inside DCP is a ShardedFileError naming the folder."""
from __future__ import annotations

import collections
import contextlib
import io
import pathlib
import pickle
import pickletools
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tread.checkpoint.dcp_check import cause, check_items, check_metadata
from tread.checkpoint.shard_names import INDEX, ShardedFileError, ShardedWriteError


def _allowed(module: str, name: str) -> Any:
    """The object a pickled DCP index may name, or None."""
    value = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
    if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:     # its records, not its imports
        return value
    if (module, name) == (_StorageInfo.__module__, "_StorageInfo"):
        return _StorageInfo
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout          # maps a name such as "torch.strided" to the layout
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) \
            else None
    if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    return None


# How unpickling a garbled index fails: the opcodes' own errors, and those of the records' constructors it may call.
INDEX_ERRORS = (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, RecursionError,
                RuntimeError, KeyError, IndexError, OverflowError, MemoryError, SystemError)


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only what a DCP index holds (see _allowed). Give it bytes that passed
    prescan: it allocates what an opcode claims (a length, a memo slot) before it reads."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint index may not")
        return found


def prescan(data: bytes) -> None:
    """Walk the pickle's opcodes without building anything: each is known, each length it claims is in the data,
    and each memo slot it fills is the next one (so MetadataUnpickler allocates no more than the file holds);
    ValueError otherwise."""
    memo = 0
    for op, arg, pos in pickletools.genops(data):
        if op.name == "MEMOIZE":
            memo += 1
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            if not isinstance(arg, int) or arg > memo:
                raise ValueError(f"at byte {pos}, memo slot {arg!r} after {memo} objects")
            memo = max(memo, arg + 1)


def unpickle_index(data: bytes) -> Any:
    prescan(data)
    return MetadataUnpickler(io.BytesIO(data)).load()


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / INDEX
        try:
            metadata = unpickle_index(path.read_bytes())
        except FileNotFoundError:
            raise ShardedFileError(f"'{path}' is missing: the sharded checkpoint is incomplete") from None
        except INDEX_ERRORS as err:
            raise ShardedFileError(f"'{path}' cannot be read: {cause(err)}") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ShardedFileError(f"'{path}' is not a checkpoint index")
        if not isinstance(metadata.storage_meta, dcp_metadata.StorageMeta):     # None in indexes of older versions
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def read_index(folder: Path, items: bool = False) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """{path in the nested state dict: (full shape, dtype)} of a folder whose index passes dcp_check's checks (with
    `items`, also each stored chunk's archive)."""
    metadata = SafeReader(folder).read_metadata()
    chunks = check_metadata(Path(folder), metadata)
    if items:
        check_items(Path(folder), chunks)
    return {path: (md.size, md.properties.dtype) for path, md in key_paths(folder, metadata).items()}


def key_paths(folder: Path, metadata: dcp_metadata.Metadata) -> dict[tuple, Any]:
    """{path in the nested state dict: entry}: each entry's name is its path joined by dots (as DCP names what it
    loads), and no path lies inside another's tensor."""
    planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = planner.get(fqn, (fqn,))
        if not isinstance(path, (tuple, list)) or not path or not all(isinstance(k, str) for k in path) \
                or ".".join(path) != fqn:
            raise ShardedFileError(f"'{Path(folder) / INDEX}': entry '{fqn}' has the key path {path!r}, not its "
                                   f"name's; the index is corrupt")
        out[tuple(path)] = md
    for path in out:
        inside = [path[:i] for i in range(1, len(path)) if path[:i] in out]
        if inside:
            raise ShardedFileError(f"'{Path(folder) / INDEX}': entry '{'.'.join(path)}' lies inside the tensor "
                                   f"'{'.'.join(inside[0])}'; the index is corrupt")
    return out


def tensor_index(folder: Path) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """sharded.tensor_index."""
    return read_index(folder)


def check_sharded(folder: Path) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """sharded.check_sharded."""
    return read_index(folder, items=True)


def leaves(tree: Mapping, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that a process group is missing: one process is a case we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(state: Mapping[str, Any], folder: Path) -> None:
    """sharded.save_sharded."""
    try:
        with _quiet():
            dcp.save(dict(state), storage_writer=FileSystemWriter(folder), no_dist=not _distributed())
    except CheckpointException as err:      # DCP gathers every process's failure: the first one's, with its rank
        rank, (cause, _) = next(iter(err.failures.items()))
        raise ShardedWriteError(f"rank {rank}: {type(cause).__name__}: {str(cause)[:300]}") from None


def load_sharded(template: Mapping[str, Any], folder: Path, index: Optional[dict] = None) -> None:
    """sharded.load_sharded."""
    index = tensor_index(folder) if index is None else index
    for path, tensor in leaves(template):
        name = ".".join(map(str, path))
        if path not in index:
            raise ShardedFileError(f"'{folder}' holds no tensor '{name}' (has {len(index)} tensors); it is not a "
                                   f"checkpoint of this model")
        if tuple(index[path][0]) != tuple(tensor.shape):      # a DTensor's shape is its full shape
            raise ShardedFileError(f"'{folder}': tensor '{name}' has shape {tuple(index[path][0])}, the model's is "
                                   f"{tuple(tensor.shape)}")
    dcp_load(dict(template), folder, not _distributed())


def dcp_load(template: dict, folder: Path, no_dist: bool) -> None:
    """dcp.load into `template`; what fails (on any process: DCP gathers them) is a ShardedFileError naming the
    folder and the first failure."""
    try:
        with _quiet():
            dcp.load(template, storage_reader=SafeReader(folder), no_dist=no_dist)
    except ShardedFileError:
        raise
    except CheckpointException as err:          # a BaseException: it carries each process's failure
        rank, (failure, _) = next(iter(err.failures.items()))
        if isinstance(failure, ShardedFileError):
            raise failure from None
        raise ShardedFileError(f"'{folder}' cannot be read (rank {rank}): {type(failure).__name__}: "
                               f"{cause(failure)}") from None
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
        raise ShardedFileError(f"'{folder}' cannot be read: {type(err).__name__}: {cause(err)}") from None


def full_tensors(folder: Path, top: tuple[str, ...]) -> dict[str, Any]:
    """sharded.full_tensors."""
    index = check_sharded(folder)
    template: dict[str, Any] = {}
    for path, (shape, dtype) in index.items():
        if path[0] in top:
            node = template
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = torch.zeros(shape, dtype=dtype)
    for key in top:
        template.setdefault(key, {})
    if any(True for _ in leaves(template)):
        dcp_load(template, folder, True)
    return template
