"""How far a measured step is from what it could be: the FLOPs bound of a route and MFU against device peaks."""
from __future__ import annotations

import platform
from pathlib import Path
from typing import Optional

import torch

# bf16 dense tensor-core peaks (FLOP/s, no sparsity), matched by substring of the device name, first wins.
DEVICE_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 SXM", 989e12),
    ("H100 80GB HBM3", 989e12),   # how torch names the SXM part
    ("H100", 989e12),             # other H100 names (NVL, ...): SXM figure
    ("A100", 312e12),
)


def speedup_bound(dense_flops: float, routed_flops: float) -> float:
    """The most a route can speed a step up: dense FLOPs / routed FLOPs."""
    return dense_flops / routed_flops


def fraction_of_bound(speedup: float, dense_flops: float, routed_flops: float) -> float:
    """Measured speedup / the FLOPs-ratio speedup: 1.0 means the saving is fully realised."""
    return speedup / speedup_bound(dense_flops, routed_flops)


def device_peak_flops(device_name: Optional[str]) -> tuple[Optional[float], str]:
    """(bf16 dense peak FLOP/s, note) for a CUDA device name; (None, note) when unknown."""
    if not device_name:
        return None, "no CUDA device: MFU not defined"
    for key, peak in DEVICE_PEAK_BF16:
        if key.lower() in device_name.lower():
            return peak, f"bf16 dense peak {peak / 1e12:g} TFLOP/s ({key})"
    return None, f"unknown device {device_name!r}: no peak in the table, MFU is null"


def mfu(achieved_flops_per_s: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: achieved / peak (None without a known peak)."""
    return None if not peak else achieved_flops_per_s / peak


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
