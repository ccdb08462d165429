"""Nested state (optimizer state, data position, random streams) as one safetensors file: tensors in the file,
the structure (dicts, lists, tuples, numbers, strings) in its JSON metadata, so loading makes no pickle.
A truncated or foreign file raises StateFileError naming it.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tread.utils.errors import UserError
from tread.utils.readers import parse_json

PathLike = Union[str, Path]
TREE_KEY = "tree"


class StateFileError(UserError):
    """A state or weights file that cannot be read (truncated, corrupt, or not written by this project)."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor], seen: dict[Any, str]) -> Any:
    """obj as JSON-able data, its tensors moved into `tensors` under t0, t1, ... keys."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _put(obj.detach().cpu(), tensors, seen)}
    if isinstance(obj, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy())
        return {"__ndarray__": _put(raw, tensors, seen), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), tensors, seen)
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, seen) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, seen) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, seen) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, seen), _encode(v, tensors, seen)] for k, v in obj.items()]}
    raise TypeError(f"cannot store a {type(obj).__name__} in a state file (tensors, arrays and plain data only)")


def _put(t: torch.Tensor, tensors: dict[str, torch.Tensor], seen: dict[Any, str]) -> str:
    """Store t once: the same storage view twice (tied weights) is one entry; other views of a storage already
    stored are copied (safetensors refuses tensors that share memory)."""
    if not t.numel():
        key = f"t{len(tensors)}"
        tensors[key] = t
        return key
    storage = t.untyped_storage().data_ptr()
    ident = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    if ident in seen:
        return seen[ident]
    key = f"t{len(tensors)}"
    tensors[key] = t.clone() if storage in seen or not t.is_contiguous() else t
    seen[ident] = seen[storage] = key
    return key


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        raw = tensors[obj["__ndarray__"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(obj: Any, path: PathLike) -> Path:
    """Write obj (nested dicts/lists/tuples of tensors, numpy arrays and plain data) to `path` atomically."""
    tensors: dict[str, torch.Tensor] = {}
    tree = json.dumps(_encode(obj, tensors, {}))
    return save_tensors(tensors, path, {TREE_KEY: tree})


def save_tensors(tensors: dict[str, torch.Tensor], path: PathLike, metadata: dict[str, str] | None = None) -> Path:
    """A flat {name: tensor} dict (model weights) as a safetensors file, written atomically (a temp file renamed;
    safetensors writes straight from the tensors' memory, no second copy in RAM)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except SafetensorError as err:   # its I/O errors (disk full, ...) as the OSError they are, naming the file
        tmp.unlink(missing_ok=True)
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_state(path: PathLike) -> Any:
    """What save_state wrote; StateFileError if the file is missing pieces or is not a state file."""
    tensors, metadata = load_tensors(path, with_metadata=True)
    if TREE_KEY not in metadata:
        raise StateFileError(f"'{path}' is a safetensors file without this project's state layout.")
    tree = parse_json(metadata[TREE_KEY], f"'{path}' state layout", "the JSON tree save_state writes", StateFileError)
    try:
        return _decode(tree, tensors)
    except (KeyError, ValueError, TypeError) as err:
        raise StateFileError(f"'{path}' has a damaged state layout ({err}).") from None


def load_tensors(path: PathLike, with_metadata: bool = False) -> Any:
    """{name: tensor} of a safetensors file on the CPU (and its metadata); StateFileError if unreadable."""
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"'{path}' is missing.")
    try:
        tensors = load_file(str(path))
        if not with_metadata:
            return tensors
        with safe_open(str(path), "pt") as f:
            return tensors, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as err:
        raise StateFileError(f"'{path}' cannot be read ({err}); it is truncated or corrupt.") from None

