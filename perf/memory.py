"""Memory of a training step: the static bytes a run keeps (weights, optimizer state, EMA) and the transient
peak of a code region.

Transient peak = the peak above what was resident when the region began: CUDA max_memory_allocated (reset
per region); on the CPU the process peak RSS (VmHWM in /proc/self/status, reset through /proc/self/clear_refs;
where that cannot be reset, the ru_maxrss growth, which only sees new peaks). CPU figures are approximate
(allocator caching)."""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Iterable, Optional

import torch

from training.setup import TrainingParts


def proc_status_kb(key: str) -> Optional[int]:
    """A kB figure of /proc/self/status (VmRSS, VmHWM), None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """start() ... stop() -> transient peak bytes of the region (see the module docstring); `method` names how."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0
        if device.type == "cuda":
            self.method = "cuda_max_memory_allocated"
        elif _reset_hwm() and proc_status_kb("VmHWM") is not None:
            self.method = "cpu_vmhwm_clear_refs"
        else:
            self.method = "cpu_ru_maxrss_delta"

    def start(self) -> None:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            _reset_hwm()
            self.base = proc_status_kb("VmRSS") * 1024
        else:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def stop(self) -> int:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            peak = proc_status_kb("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, int(peak - self.base))


def tensor_bytes(tensors: Iterable) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def static_bytes(parts: TrainingParts) -> int:
    """What a run holds between steps: the backbone's parameters, the optimizer state and the EMA copy."""
    state = [t for s in parts.optimizer.state.values() for t in s.values()]
    return (tensor_bytes(parts.model.parameters()) + tensor_bytes(state)
            + tensor_bytes(parts.ema.parameters()) + tensor_bytes(parts.ema.buffers()))
