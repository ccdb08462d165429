"""`python tests/write_fault_train.py FAULT[,FAULT...] train.py-args...`: train.py with failing writes injected,
for tests/test_write_faults.py. Like tests/fault_train.py (whose faults, e.g. hold:N:PATH, are accepted here too),
the faults patch the running code from outside; they act where every write of a run ends up, the os calls:

    full:NAME[:N]     the Nth write (default: the first) into a file whose path contains NAME fails with ENOSPC
                      after half its bytes went out (a disk that fills up mid-write)
    rofs:NAME[:N]     the Nth creation of such a file fails with EROFS (a read-only file system)
    denied:NAME[:N]   the same with EACCES (permissions)
    sigterm_in_write:N  this process gets SIGTERM inside the checkpoint write of step N (the write goes on)

NAME is matched against the path of the file as it is opened, so a temp file next to the target counts:
"summary.json" matches ".summary.json.x1y2.tmp", ".lock" the lock's temp file, "/samples/" every image.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fault_train  # noqa: E402  (tests/ is this script's own directory)
from tread.checkpoint import save as checkpoint  # noqa: E402

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT
REAL = {"open": os.open, "write": os.write, "fdopen": os.fdopen}


class Fault:
    """One injected failure: the `nth` matching call fails with `code`."""

    def __init__(self, code: int, name: str, nth: int):
        self.code, self.name, self.nth, self.seen = code, name, nth, 0

    def hits(self, path: str) -> bool:
        if self.name not in path:
            return False
        self.seen += 1
        return self.seen == self.nth

    def error(self, path: Optional[str] = None) -> OSError:
        return OSError(self.code, os.strerror(self.code), *([path] if path else []))


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class HalfWrittenFile:
    """A file object whose first write puts out half the bytes and then fails, as on a disk that fills up."""

    def __init__(self, f, fault: Fault):
        self._f, self._fault = f, fault

    def write(self, data) -> int:
        data = bytes(data)
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise self._fault.error()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def patch_writes(at_write: list[Fault], at_open: list[Fault]) -> None:
    def fdopen(fd, *args, **kwargs):
        f = REAL["fdopen"](fd, *args, **kwargs)
        hit = next((x for x in at_write if x.hits(fd_path(fd))), None) if "w" in str(f.mode) else None
        return HalfWrittenFile(f, hit) if hit else f

    def write(fd, data):
        hit = next((x for x in at_write if x.hits(fd_path(fd))), None)
        if hit:
            REAL["write"](fd, bytes(data)[:len(data) // 2])
            raise hit.error()
        return REAL["write"](fd, data)

    def open_(path, flags, *args, **kwargs):
        hit = next((x for x in at_open if x.hits(os.fspath(path))), None) if flags & WRITE_FLAGS else None
        if hit:
            raise hit.error(os.fspath(path))
        return REAL["open"](path, flags, *args, **kwargs)
    os.fdopen, os.write, os.open = fdopen, write, open_


def sigterm_in_write(step: int) -> None:
    write = checkpoint._write_main

    def write_with_signal(tmp, state, *a, **k):
        if state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return write(tmp, state, *a, **k)
    checkpoint._write_main = write_with_signal


def inject(faults: str) -> None:
    at_write, at_open = [], []
    codes = {"full": errno.ENOSPC, "rofs": errno.EROFS, "denied": errno.EACCES}
    for fault in faults.split(","):
        kind, _, arg = fault.partition(":")
        if kind in codes:
            name, _, nth = arg.partition(":")
            (at_write if kind == "full" else at_open).append(Fault(codes[kind], name, int(nth or 1)))
        elif kind == "sigterm_in_write":
            sigterm_in_write(int(arg))
        else:
            fault_train.inject(fault)
    patch_writes(at_write, at_open)


if __name__ == "__main__":
    inject(sys.argv[1])
    sys.argv = ["train.py", *sys.argv[2:]]
    import runpy

    os.chdir(Path(__file__).resolve().parents[1])
    runpy.run_path("train.py", run_name="__main__")
