"""torch's CPU threads: a fixed count for a block of work (`cpu_threads`), and the count a training run keeps
(train.cpu_threads=auto, `ThreadGovernor`): the cores this process may use (affinity, cgroup quota, the run's
other processes on this machine), less the cores other processes hold now, at most what the step's size can use;
re-checked at step boundaries, so a run keeps its pace when the machine gets busy or quiet while it runs.

Why follow the other processes: a parallel region waits for its slowest thread, and a thread that shares its core
with another busy process runs at a fraction of its speed. The default run on 2 cores beside two CPU-busy processes
ran at 0.14-0.82 steps/s on torch's default two threads and at 0.93-1.23 on one; alone, two threads were 1.6x
faster than one (docs/benchmarks.md, "CPU threads"). Neither fixed count serves both machines."""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

MAX_CPU_THREADS = 4096
# At most one thread per this many floating-point operations of a step, so that a tiny step on a many-core machine
# does not pay for a parallel region of idle threads: the smallest step measured, 0.13 GFLOP (DiT-T/2, 16 tokens,
# batch 1), still ran 5-10% faster on 2 threads than on 1 (docs/benchmarks.md, "CPU threads").
FLOPS_PER_THREAD = 1e8
RECHECK_SEC = 10.0              # how often (at a step boundary) auto looks at the other processes' load again
PROBE_SEC = 0.25                # the start-up look, before the first step
CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
PROC_STAT = Path("/proc/stat")
clock = time.monotonic          # the wall clock of the samples (a test feeds its own)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (guest time is inside user already)
_IDLE_FIELDS = (3, 4)               # idle iowait


@contextlib.contextmanager
def cpu_threads(threads: Optional[int]) -> Iterator[None]:
    """torch runs on `threads` CPU threads inside the block (None or 0: unchanged); the caller's count comes back
    after it (in-process callers, e.g. tests, keep theirs)."""
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)


def cgroup_cores() -> Optional[int]:
    """The cores a cgroup CPU quota allows (cpu.max "150000 100000" -> 2), None without a quota."""
    try:
        if CGROUP_V2.is_file():
            quota, period = CGROUP_V2.read_text().split()[:2]
        else:
            quota, period = (p.read_text().strip() for p in CGROUP_V1)
        if quota in ("max", "-1"):
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def affinity_cores() -> frozenset[int]:
    """The CPUs this process may run on (all of os.cpu_count's where there is no affinity mask)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return frozenset(affinity(0)) if affinity is not None else frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may use: its affinity mask, capped by a cgroup quota, shared with the other processes
    of the run on this machine (LOCAL_WORLD_SIZE, as accelerate and torchrun set it)."""
    cores = len(affinity_cores())
    quota = cgroup_cores()
    cores = min(cores, quota) if quota else cores
    try:
        local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_processes = 1
    return max(1, cores // local_processes)


@dataclass(frozen=True)
class CpuSample:
    """Busy and total CPU seconds of `cores` cores (/proc/stat) and this process's own CPU seconds, at `wall`."""
    busy: float
    total: float
    own: float
    wall: float
    cores: int


def sample_cpu(cores: frozenset[int]) -> Optional[CpuSample]:
    """Now's CpuSample over `cores`, None where /proc/stat is not there or not readable (not Linux)."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    busy = total = seen = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        ticks = [int(f) for f in fields[:8]] + [0] * (8 - len(fields[:8]))
        busy += sum(ticks[i] for i in _BUSY_FIELDS)
        total += sum(ticks[i] for i in _BUSY_FIELDS + _IDLE_FIELDS)
        seen += 1
    if not total:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    own = os.times()
    return CpuSample(busy / hz, total / hz, own.user + own.system, clock(), seen)


def others_hold(before: CpuSample, after: CpuSample) -> Optional[float]:
    """The cores other processes (and this one's children: loader workers) kept busy between two samples, within
    [0, the cores sampled]: the busy share of the cores' time, less this process's own CPU time per second (both
    counted in clock ticks, so a short span is coarse: the start-up look spans PROBE_SEC)."""
    span, wall = after.total - before.total, after.wall - before.wall
    if span <= 0 or wall <= 0:
        return None
    busy = (after.busy - before.busy) / span * after.cores
    own = (after.own - before.own) / wall
    return min(float(after.cores), max(0.0, busy - own))


def work_cap(step_flops: float) -> int:
    """The threads a step of `step_flops` can use: one per FLOPS_PER_THREAD, at least one."""
    return max(1, min(MAX_CPU_THREADS, int(step_flops // FLOPS_PER_THREAD)))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str            # the start-up line's reason, e.g. "auto: 2 usable cores, others hold 0.1, 0.036 TFLOP/step"


class ThreadGovernor:
    """train.cpu_threads=auto on a CPU run: `start()` picks the count, `recheck()` (at a step boundary) moves it
    when the other processes' load has changed, at most every RECHECK_SEC; a fixed count, or OMP_NUM_THREADS, stays
    as it is."""

    def __init__(self, setting: Union[str, int], step_flops: float):
        self.fixed = setting != "auto" or bool(os.environ.get("OMP_NUM_THREADS"))
        self.setting, self.step_flops = setting, step_flops
        self.cores, self.affinity = usable_cores(), affinity_cores()
        self.threads, self.last = 0, None

    def start(self) -> ThreadChoice:
        """The count for the first steps, and why; sets it in torch."""
        if self.setting != "auto":
            self.threads = int(self.setting)
            why = "train.cpu_threads"
        elif self.fixed:
            self.threads = torch.get_num_threads()
            why = "auto: OMP_NUM_THREADS is set"
        else:
            self.last = sample_cpu(self.affinity)
            if self.last is not None:
                time.sleep(PROBE_SEC)
            others = self.look()
            self.threads = self.pick(others)
            held = "" if others is None else f", other processes hold {others:.1f}"
            why = (f"auto: {self.cores} usable core{'s' if self.cores > 1 else ''}{held}, "
                   f"{self.step_flops / 1e12:.2g} TFLOP per step; re-checked every {RECHECK_SEC:g} s; "
                   f"train.cpu_threads=N fixes it")
        torch.set_num_threads(self.threads)
        return ThreadChoice(self.threads, why)

    def look(self) -> Optional[float]:
        """The cores other processes held since the last sample (None without /proc/stat); starts the next span."""
        now = sample_cpu(self.affinity)
        others = others_hold(self.last, now) if self.last is not None and now is not None else None
        self.last = now
        return others

    def pick(self, others: Optional[float]) -> int:
        """The usable cores less those the others hold (rounded to the nearest), within [1, the work's cap]."""
        free = self.cores if others is None else len(self.affinity) - others
        return max(1, min(self.cores, work_cap(self.step_flops), int(free + 0.5)))

    def recheck(self) -> Optional[ThreadChoice]:
        """At a step boundary: the new count and why when it changed (set in torch), else None."""
        if self.fixed or self.last is None or clock() - self.last.wall < RECHECK_SEC:
            return None
        others = self.look()
        threads = self.pick(others)
        if threads == self.threads or others is None:
            return None
        self.threads = threads
        torch.set_num_threads(threads)
        return ThreadChoice(threads, f"other processes now hold {others:.1f} of {len(self.affinity)} cores")
