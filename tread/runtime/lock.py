"""A lock on a training run directory (`<run_dir>/.lock`, taken by rank 0): two runs never write the same run
dir. `with RunDirLock(run_dir) as lock: ...` raises RunDirLocked if another live run holds it; staleness
and take-over: docs/reliability.md, "One launch per run directory".
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

from tread.runtime.processes import boot_id, process_gone, process_start_ticks
from tread.utils.errors import UserError
from tread.utils.io import create_new, writing
from tread.utils.readers import FileFormatError, parse_json

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HELD: set[str] = set()          # lock files held by RunDirLock objects of this process
_HELD_MUTEX = threading.Lock()
_PARTIAL_RETRY_SEC = 0.5         # how long a lock that cannot be parsed is re-read (a writer without os.link)


class RunDirLocked(UserError):
    """The run dir is held by another training process (or by a lock file nobody can read)."""


# ---------------------------------------------------------------------------------------------------------
# This process.

def own_record() -> dict[str, Any]:
    """What this process writes into a lock."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "argv": list(sys.argv),
        "start_ticks": process_start_ticks(pid),
        "boot_id": boot_id(),
    }


def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("pid") == b.get("pid") and a.get("host") == b.get("host") \
        and a.get("start_ticks") == b.get("start_ticks")


# ---------------------------------------------------------------------------------------------------------
# Reading a lock.

def _parse(data: bytes) -> dict[str, Any]:
    """The record in a lock file; ValueError naming what is wrong."""
    try:
        record = parse_json(data, "its content", "a JSON object")
    except FileFormatError as err:
        raise ValueError(str(err).rstrip(".") if data.strip() else "empty") from err
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2 ** 31:
        raise ValueError(f"no valid pid ({pid!r})")
    if not isinstance(record.get("host"), str) or not record["host"]:
        raise ValueError("no host")
    return record


def read_lock(path: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """The record of the lock file `path`, None if there is none; ValueError if it cannot be read or parsed."""
    path = Path(path)
    deadline = time.monotonic() + _PARTIAL_RETRY_SEC
    while True:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise ValueError(f"cannot read it: {err.strerror or err}") from err
        try:
            return _parse(data)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)          # maybe a writer without hard links is still writing it


def _describe(record: dict[str, Any]) -> str:
    job = f", SLURM job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return f"pid {record['pid']} on host {record['host']}{job}"


# ---------------------------------------------------------------------------------------------------------
# The lock.

class RunDirLock:
    """A lock on `run_dir` (the file `<run_dir>/.lock`; when a lock is stale: docs/reliability.md). `note` is
    set by acquire() when it took over a stale lock."""

    def __init__(self, run_dir: Union[str, os.PathLike]):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.note: Optional[str] = None
        self._record: Optional[dict[str, Any]] = None

    @property
    def held(self) -> bool:
        return self._record is not None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- acquire ------------------------------------------------------------------------------------------

    def acquire(self) -> Optional[str]:
        """Take the lock (creating run_dir); returns a note if a stale lock was taken over, else None. RunDirLocked if a
        live process holds it or the file is unreadable, WriteError if it cannot be written."""
        if self.held:
            return self.note
        record = own_record()
        data = (json.dumps(record, indent=2) + "\n").encode()
        tmp = self.run_dir / f"{LOCK_NAME}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        with writing(self.path):       # a disk that is full or read-only: one WriteError naming the lock file
            self.run_dir.mkdir(parents=True, exist_ok=True)
            create_new(tmp, data)      # gone again if it could not be written whole
            try:
                note = self._acquire_loop(tmp, data, record)
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        self._record, self.note = record, note
        with _HELD_MUTEX:
            _HELD.add(str(self.path.resolve()))
        if note:
            log.warning("%s: %s", self.path, note)
        return note

    def _acquire_loop(self, tmp: Path, data: bytes, record: dict[str, Any]) -> Optional[str]:
        for _ in range(100):          # each round: the lock changed under us (another process won a race)
            if self._create(tmp, data):
                return None
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                continue
            try:
                holder = read_lock(self.path)
            except ValueError as err:
                raise RunDirLocked(
                    f"run dir {self.run_dir} has a lock file that cannot be read ({err}): {self.path}. A training "
                    f"process may still be using this dir: check that none is, then delete {self.path}, or use "
                    f"another hydra.run.dir") from None
            if holder is None:
                continue
            reason = self._stale_reason(holder, record)
            if reason is None:
                raise RunDirLocked(
                    f"run dir {self.run_dir} is in use by another training process: {_describe(holder)}, "
                    f"running since {holder.get('started', '?')}; wait for it to finish, use another "
                    f"hydra.run.dir, or delete {self.path} if that process is gone")
            if self._take_over(st, tmp):
                return f"took over a stale lock of {_describe(holder)} ({reason})"
        raise RunDirLocked(f"run dir {self.run_dir}: could not take the lock {self.path}: other processes keep "
                           f"changing it; use another hydra.run.dir")

    def _create(self, tmp: Path, data: bytes) -> bool:
        """Create the lock file with our record if there is none (atomically). False if one exists."""
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass                      # no hard links on this filesystem (or it cannot be written: said next)
        return create_new(self.path, data)

    def _stale_reason(self, holder: dict[str, Any], record: dict[str, Any]) -> Optional[str]:
        """Why `holder`'s lock may be taken over, or None if it must be respected."""
        if holder.get("host") == record["host"]:
            if holder.get("boot_id") and record["boot_id"] and holder["boot_id"] != record["boot_id"]:
                return "host rebooted since"
            if _same_process(holder, record):
                with _HELD_MUTEX:
                    if str(self.path.resolve()) in _HELD:
                        return None   # another RunDirLock of this very process holds it
                return "left by this same process"
            return process_gone(int(holder["pid"]), holder.get("start_ticks"))
        job = record.get("slurm_job_id")
        if job and str(holder.get("slurm_job_id")) == job:
            return f"same SLURM job {job}, requeued"
        return None

    def _take_over(self, judged: os.stat_result, tmp: Path) -> bool:
        """Replace the stale lock file `judged` (as stat'ed before judging it) by ours. False if the lock
        file changed meanwhile (someone else took it over or released it): the caller looks again."""
        aside = self.run_dir / f"{tmp.name}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            st = os.stat(aside)
            if (st.st_dev, st.st_ino) != (judged.st_dev, judged.st_ino):
                # not the file we judged: a fresh lock of a process that won the race; put it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    log.warning("%s: a lock created during a take-over race could not be restored", self.path)
                return False
            return self._create(tmp, tmp.read_bytes())
        finally:
            aside.unlink(missing_ok=True)

    # -- release ------------------------------------------------------------------------------------------

    def release(self) -> bool:
        """Remove the lock file if it is still ours (same pid, host and start time). Idempotent; True if a
        file was removed."""
        record, self._record = self._record, None
        if record is None:
            return False
        with _HELD_MUTEX:
            _HELD.discard(str(self.path.resolve()))
        if os.getpid() != record["pid"]:
            return False              # a forked child never removes its parent's lock
        try:
            holder = read_lock(self.path)
        except ValueError:
            return False
        if holder is None or not _same_process(holder, record):
            return False
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        except OSError as err:        # the run dir became read-only: the next launch takes the stale lock over
            log.warning("%s: could not remove the lock (%s); the next launch takes it over as stale", self.path,
                        err.strerror or err)
            return False
        return True
