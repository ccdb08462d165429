"""Writes that cannot half-happen: atomic files and whole-line appends (readers and a crash never see half a
file or half a line), a failed write as one WriteError naming the file and the cause, and whether a directory
can be written at all, or made."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, Union

from tread.utils.errors import UserError

PathLike = Union[str, os.PathLike]


class WriteError(OSError, UserError):
    """A file that could not be written: one line naming the file and the cause. Both an OSError (errno, strerror,
    filename) and a UserError; the writes of this module leave the file as it was."""

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno, "") if self.errno else ""
        cause = f"{self.strerror or 'write failed'}{f' ({name})' if name else ''}"
        return f"cannot write '{self.filename}': {cause}"


@contextlib.contextmanager
def writing(path: PathLike) -> Iterator[None]:
    """An OSError raised inside the block becomes a WriteError naming `path` (which the OSError may not name); an inner
    block's WriteError is named for the outer block's file too."""
    try:
        yield
    except OSError as err:
        if isinstance(err, WriteError) and err.filename == str(path):
            raise
        raise WriteError(err.errno, err.strerror or str(err), str(path)) from err


def file_in_the_way(path: PathLike) -> Optional[Path]:
    """The file (anything but a directory) at `path` or above it that keeps a directory from being made there:
    the nearest existing one of path and its parents, when it is not a directory; None if there is none."""
    path = Path(path)
    for part in (path, *path.parents):
        try:
            if part.exists():
                return None if part.is_dir() else part
        except OSError:           # not allowed to look (permissions): the directory above decides
            continue
    return None


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any], fsync: bool = False) -> Path:
    """Call write(binary file) on a temp file next to `path`, then rename it over `path` (`fsync`: force the bytes to
    disk first). On failure the temp file is removed and `path` keeps what it held."""
    path = Path(path)
    with writing(path):
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
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    return path


def atomic_write_text(path: PathLike, text: str, fsync: bool = False) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()), fsync=fsync)


def atomic_write_json(path: PathLike, obj: Any, fsync: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2) + "\n", fsync=fsync)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]   # a short write (disk nearly full) goes on; the next one raises


def append_whole(path: PathLike, data: bytes) -> None:
    """Append `data` (one record: a line) to `path` whole or not at all: a failed write or an interruption cuts the
    file back (a kill -9 may still tear one; readers drop a torn last line)."""
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)


def create_new(path: PathLike, data: bytes) -> bool:
    """Create `path` holding `data` if no file is there (O_EXCL: atomic against another creator); False if one
    is. A failed write removes the half-written file again (WriteError)."""
    with writing(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            _write_all(fd, data)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)
            raise
        finally:
            os.close(fd)
    return True


def unwritable_dir(path: PathLike) -> Optional[tuple[Path, OSError]]:
    """None if files can be made in directory `path` (or the nearest existing directory above it), else (that
    directory, the error). Tried for real with an unnamed temporary file, so permissions, ACLs and root squash show."""
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is None or file_in_the_way(existing) is not None:
        return None
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        return existing, err
    return None
