"""Atomic file writes: readers (and a crash) never see half a file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Union

PathLike = Union[str, os.PathLike]


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any], fsync: bool = False) -> Path:
    """Call write(binary file) on a temp file next to `path`, then rename it over `path`. `fsync` also
    forces the bytes to disk before the rename (resumable work whose parts must survive a power loss)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def atomic_write_text(path: PathLike, text: str, fsync: bool = False) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()), fsync=fsync)


def atomic_write_json(path: PathLike, obj: Any, fsync: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2) + "\n", fsync=fsync)
