"""Device choice: "auto" means CUDA when there is one, else the CPU; whether a named CUDA device exists here;
the torch CPU thread count for a block of work."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

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
