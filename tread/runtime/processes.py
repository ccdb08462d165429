"""Processes of this host, as the run-dir lock and the collective monitor judge them: alive, stopped or gone, and
whether a pid still names the recorded process on the same boot (why os.kill and clock ticks, not psutil alone:
docs/reliability.md).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import psutil

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)        # exited, maybe not yet reaped by its parent


def process_state(pid: int) -> Optional[str]:
    """psutil's status of process `pid` ("running", "sleeping", "stopped", "zombie", ...), or None when
    there is no such process or it cannot be seen."""
    try:
        return psutil.Process(pid).status()
    except psutil.ZombieProcess:
        return psutil.STATUS_ZOMBIE
    except psutil.Error:
        return None


def process_start_ticks(pid: int) -> Optional[int]:
    """The start time of process `pid` in clock ticks after boot (field 22 of /proc/<pid>/stat), or None; read again
    when the boot time moved meanwhile (a clock adjustment)."""
    for _ in range(3):
        try:
            boot = psutil.boot_time()
            created = psutil.Process(pid).create_time()
            if psutil.boot_time() == boot:
                return round((created - boot) * _CLOCK_TICKS)
        except (psutil.Error, OSError, RuntimeError):
            return None
    return None


def boot_id() -> Optional[str]:
    """The kernel's id of this boot: unlike psutil.boot_time(), it does not move with the clock."""
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
    if process_state(pid) in GONE:
        return "process gone"
    now_ticks = process_start_ticks(pid)
    if start_ticks is not None and now_ticks is not None and now_ticks != start_ticks:
        return "process gone, its pid now belongs to another process"
    return None


def describe_process(pid: int, host: str, start_ticks: Optional[int]) -> str:
    """'stopped', 'process gone', 'alive but not answering' for a process of this host; 'stopped or lost'
    for one elsewhere (nothing here can see it)."""
    if host != socket.gethostname():
        return "stopped or lost"
    gone = process_gone(pid, start_ticks)
    if gone:
        return gone
    return "stopped" if process_state(pid) in STOPPED else "alive but not answering"
