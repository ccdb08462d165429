"""torch.distributed.checkpoint underneath tread/checkpoint/sharded.py: the folder written and read by every process
(or read by one into full tensors). Its pickled index is read by MetadataUnpickler, which builds only DCP's own
records, and only tensors the index declares are loaded (docs/design.md)."""
from __future__ import annotations

import collections
import contextlib
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from torch.distributed.checkpoint.api import CheckpointException

from tread.checkpoint.shard_names import INDEX, ShardedFileError, ShardedWriteError


def _allowed(module: str, name: str) -> Any:
    """The object a pickled DCP index may name, or None."""
    if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
        return getattr(dcp_metadata, name)
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


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only what a DCP index holds (see _allowed)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint index may not")
        return found


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / INDEX
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ShardedFileError(f"'{path}' is missing: the sharded checkpoint is incomplete") from None
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                RecursionError) as err:
            raise ShardedFileError(f"'{path}' cannot be read: {err}") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ShardedFileError(f"'{path}' is not a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def tensor_index(folder: Path) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """sharded.tensor_index."""
    metadata = SafeReader(folder).read_metadata()
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            raise ShardedFileError(f"'{Path(folder) / INDEX}': entry '{fqn}' is not a tensor; sharded checkpoints "
                                   f"hold tensors only")
        out[tuple(metadata.planner_data.get(fqn, (fqn,)))] = (md.size, md.properties.dtype)
    return out


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
    try:
        with _quiet():
            dcp.load(dict(template), storage_reader=SafeReader(folder), no_dist=not _distributed())
    except ShardedFileError:
        raise
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
        raise ShardedFileError(f"'{folder}' cannot be read: {str(err).splitlines()[0][:300]}") from None


def full_tensors(folder: Path, top: tuple[str, ...]) -> dict[str, Any]:
    """sharded.full_tensors."""
    index = tensor_index(folder)
    template: dict[str, Any] = {}
    for path, (shape, dtype) in index.items():
        if path[0] in top:
            node = template
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = torch.empty(shape, dtype=dtype)
    for key in top:
        template.setdefault(key, {})
    if any(True for _ in leaves(template)):
        with _quiet():
            dcp.load(template, storage_reader=SafeReader(folder), no_dist=True)
    return template
