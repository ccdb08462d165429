"""Device choice: "auto" means CUDA when there is one, else the CPU; whether a named CUDA device exists here
(torch's CPU threads: tread/utils/threads.py)."""
from __future__ import annotations

from typing import Optional, Union

import torch

DeviceLike = Union[str, torch.device]


def resolve_device(device: DeviceLike) -> torch.device:
    """"auto" -> cuda if available, else cpu; anything else as torch.device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cuda_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def why_unavailable(device: DeviceLike) -> Optional[str]:
    """None when this machine has the device named ("cuda", "cuda:N"; other names pass), else what it has instead:
    "no CUDA device" or "CUDA devices 0..K-1"."""
    name = str(device)
    if not name.startswith("cuda"):
        return None
    count, index = cuda_count(), int(name.split(":", 1)[1]) if ":" in name else 0
    if index < count:
        return None
    return f"CUDA devices 0..{count - 1}" if count else "no CUDA device"
