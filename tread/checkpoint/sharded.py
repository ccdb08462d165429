"""Sharded checkpoint files (checkpoint.layout=sharded): a torch.distributed.checkpoint folder in a step dir. The
folder's format and checks are tread/checkpoint/dcp_io.py, imported on first use: torch.distributed.checkpoint
pulls in DTensor and FSDP, most of a second of every launch that never reads or writes shards."""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Optional

import torch

from tread.checkpoint.shard_names import INDEX, SHARDED_DIR, ShardedFileError, ShardedWriteError

__all__ = ["INDEX", "SHARDED_DIR", "ShardedFileError", "ShardedWriteError", "check_sharded", "full_tensors",
           "load_sharded", "save_sharded", "tensor_index"]


@functools.cache
def _io() -> ModuleType:
    import tread.checkpoint.dcp_io as dcp_io   # deferred: see the module docstring

    return dcp_io


def tensor_index(folder: Path) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """{path in the nested state dict: (full shape, dtype)} of every entry of a sharded folder; ShardedFileError
    when an entry is not a tensor, or the index claims bytes its files do not hold (dcp_check.py)."""
    return _io().tensor_index(folder)


def check_sharded(folder: Path) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """tensor_index, after checking that every stored chunk is a tensor archive of the shape and dtype the index
    gives it (its header and layout, not its data: what decides whether a checkpoint can be loaded before any of it
    is); ShardedFileError naming the file and the tensor."""
    return _io().check_sharded(folder)


def save_sharded(state: Mapping[str, Any], folder: Path) -> None:
    """Write a nested dict of tensors (DTensors: each process its shards) into `folder`; a collective when a
    process group is up (every process calls it). ShardedWriteError when a process failed."""
    _io().save_sharded(state, folder)


def load_sharded(template: Mapping[str, Any], folder: Path, index: Optional[dict] = None) -> None:
    """Fill `template` (a nested dict of tensors or DTensors) in place from `folder`, after checking the folder declares
    each as a tensor of the same full shape; dtypes are converted. Every process calls it."""
    _io().load_sharded(template, folder, index)


def full_tensors(folder: Path, top: tuple[str, ...]) -> dict[str, Any]:
    """The entries under the top-level keys `top` as full tensors on the CPU (one process reads every shard), after
    check_sharded."""
    return _io().full_tensors(folder, top)
