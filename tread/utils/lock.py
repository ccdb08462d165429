"""A lock on a training run directory: two runs never write the same run dir at once.

    with RunDirLock(run_dir) as lock:       # raises RunDirLocked (a UserError) if another live run holds it
        if lock.note:                       # "took over a stale lock of pid 123 on host h (process gone)"
            print(lock.note)
        ...                                 # train; the lock file goes away on leaving the block

or explicitly: `note = lock.acquire()` ... `lock.release()` (idempotent; removes the file only while it is
still ours). The API knows nothing of ranks: in a multi-process run exactly one process (the caller picks
rank 0) takes the lock; the others never touch it.

The lock is the file `<run_dir>/.lock`, JSON: {pid, host, started (ISO time), slurm_job_id (or null), argv,
start_ticks, boot_id}. `start_ticks` (field 22 of /proc/<pid>/stat: the process's start time) and `boot_id`
(/proc/sys/kernel/random/boot_id) tell a live holder from a dead one whose pid was reused, or one from
before a reboot. Both are null where /proc does not have them.

Acquiring: the full record is written to a private temp file and hard-linked to `.lock` (os.link fails if
`.lock` exists, atomically, also on NFS), so of processes starting at the same moment exactly one wins and
nobody ever reads a half-written lock. Filesystems without hard links fall back to O_CREAT|O_EXCL (a
reader then retries a lock that is still being written for up to half a second).

An existing lock is taken over (a note says why; it is also logged) when
  * its holder ran on this host and is gone: no such pid (os.kill(pid, 0)), a zombie, a pid whose
    start_ticks differ from the recorded ones (reused), or a different boot_id (rebooted);
  * its holder ran on another host and its slurm_job_id equals this process's SLURM_JOB_ID (a requeued
    SLURM job restarting, possibly on another node; the old processes of a requeued job are gone);
  * this process left it (its holder is this very process and no RunDirLock of this process holds it).
Otherwise `RunDirLocked` is raised, one line: the run dir, holder pid, host, since when, and what to do.
A lock file that cannot be read or parsed is treated as held by an unknown holder (RunDirLocked naming it).

Taking over is atomic too: the stale file is renamed to a private name and checked to be the very file
(same inode) that was judged stale before our record is linked in; if another process won the race in
between, the file it created is put back and we look again. Two processes racing for a stale lock: one
wins. (With three or more racing for the same stale lock at the same microsecond, the restore can meet a
third process's fresh lock; that window is not closed.)

Limits: a holder on the same host but in another pid namespace (another container with the same hostname)
looks dead. A holder on another host is never judged dead (nothing here can see its processes), except by
the SLURM rule: delete the file by hand, as the error says, when such a process is known to be gone.
"""
from __future__ import annotations

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

from tread.utils.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HELD: set[str] = set()          # lock files held by RunDirLock objects of this process
_HELD_MUTEX = threading.Lock()
_PARTIAL_RETRY_SEC = 0.5         # how long a lock that cannot be parsed is re-read (a writer without os.link)


class RunDirLocked(UserError):
    """The run dir is held by another training process (or by a lock file nobody can read)."""


# ---------------------------------------------------------------------------------------------------------
# This process and others on this host.

def _proc_stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (field 3 = state is [0]), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    end = data.rfind(")")            # the command name may hold spaces and parentheses
    return data[end + 2:].split() if end >= 0 else None


def process_state(pid: int) -> Optional[str]:
    """The state letter of process `pid` (R, S, D, T = stopped, Z = zombie, ...) from /proc, or None."""
    fields = _proc_stat_fields(pid)
    return fields[0] if fields else None


def process_start_ticks(pid: int) -> Optional[int]:
    """The start time of process `pid` in clock ticks after boot (/proc/<pid>/stat field 22), or None."""
    fields = _proc_stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def process_gone(pid: int, start_ticks: Optional[int]) -> Optional[str]:
    """Why process `pid` of this host (started at `start_ticks`, if known) is gone, or None if it is alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "process gone"
    except PermissionError:
        pass                          # another user's live process
    if process_state(pid) in ("Z", "X"):
        return "process gone"         # exited, not yet reaped by its parent
    now_ticks = process_start_ticks(pid)
    if start_ticks is not None and now_ticks is not None and now_ticks != start_ticks:
        return "process gone, its pid now belongs to another process"
    return None


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
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError("not JSON" if data.strip() else "empty") from err
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
    """A lock on `run_dir` (the file `<run_dir>/.lock`); see the module docstring. `note` is set by acquire()
    when it took over a stale lock."""

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
        """Take the lock (creating run_dir if needed). Returns a note if a stale lock was taken over (also
        logged), else None. Raises RunDirLocked if another live process holds it or the file is unreadable."""
        if self.held:
            return self.note
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = own_record()
        data = (json.dumps(record, indent=2) + "\n").encode()
        tmp = self.run_dir / f"{LOCK_NAME}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        tmp.write_bytes(data)
        try:
            note = self._acquire_loop(tmp, data, record)
        finally:
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
            pass                      # no hard links on this filesystem
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

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
        return True
