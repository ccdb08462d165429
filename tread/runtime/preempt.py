"""Preemption and Ctrl-C: SIGTERM, SIGUSR1, SIGUSR2 and SIGINT end a run at the next step boundary with a
checkpoint; the ranks agree on the stop step, a second Ctrl-C kills at once, and with train.slurm_requeue a
time-limit warning requeues the job (docs/reliability.md, "Preemption").
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from tread.utils.distributed import is_distributed

EXIT_PREEMPTED = 75          # EX_TEMPFAIL: "try again later"; train.py's exit status after a preemption
EXIT_INTERRUPTED = 130       # 128 + SIGINT, as a shell reports Ctrl-C; train.py's exit status after one
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
TIME_LIMIT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
INTERRUPTED_NOTE = (b"\nSIGINT: stopping after this step with a checkpoint (resume=auto continues); "
                    b"Ctrl-C again stops at once, without one\n")


def stop_status(signal_name: str) -> str:
    """summary.json's status after the stop signal `signal_name`: "interrupted" for Ctrl-C, else "preempted"."""
    return "interrupted" if signal_name == signal.SIGINT.name else "preempted"


def stop_exit_status(status: str) -> int:
    """train.py's exit status for summary.json's `status` (0 when the run was not stopped by a signal)."""
    return {"preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}.get(status, 0)


class StopRequest:
    """The first stop signal this process received (None: none yet); `agreed()` all-reduces the flag over a CPU gloo
    group, so a CUDA run gets no device sync per step from it."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.pid = os.getpid()   # a forked child (a DataLoader worker) inherits the handler: it does nothing there
        self.group = None
        if is_distributed():
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def handle(self, signum: int, _frame) -> None:
        if os.getpid() != self.pid:
            return
        if self.signum is None:
            self.signum = signum
        if signum == signal.SIGINT:   # the next Ctrl-C: the default action, which the kernel carries out
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.write(2, INTERRUPTED_NOTE)   # not print(): the handler may run inside a print of the loop

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def agreed(self) -> bool:
        """Whether to stop after this step: this process got a signal, or (with several) any process did."""
        if self.group is None:
            return self.signum is not None
        flag = torch.tensor([int(self.signum is not None)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())


@contextlib.contextmanager
def handling(signals: tuple[int, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` for `signals` inside the block, the previous handlers after it (only the main thread can install
    handlers; elsewhere the signals keep theirs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """A StopRequest recording SIGNALS for the block."""
    request = StopRequest()
    with handling(SIGNALS, request.handle):
        yield request


def slurm_job_id(env: Mapping[str, str] = os.environ) -> Optional[str]:
    return env.get("SLURM_JOB_ID") or None


def requeued(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this is a SLURM job that was requeued (it must continue its run, not start over)."""
    return bool(slurm_job_id(env)) and int(env.get("SLURM_RESTART_COUNT") or 0) > 0


def requeue_after(signum: Optional[int], enabled: bool, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """`scontrol requeue` this SLURM job after a time-limit warning signal; returns what happened (None: nothing
    to do)."""
    job = slurm_job_id(env)
    if not (enabled and job and signum in TIME_LIMIT_SIGNALS):
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"requeue of SLURM job {job} failed: {err}"
    if done.returncode:
        return f"requeue of SLURM job {job} failed: {done.stderr.strip() or done.returncode}"
    return f"requeued SLURM job {job}"
