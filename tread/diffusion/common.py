"""Pieces shared by the EDM and rectified-flow objectives: per-seed RNG, the denoiser contract and the pass-through
of a backbone's auxiliary output."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

# What samplers call: denoise(x, noise_level, labels, **cond) -> prediction (EDM: D(x; sigma), RF: velocity).
# Guidance (CFG, inference routing, TREAD guidance) wraps a network into one of these: tread/sampling/guidance.py.
Denoiser = Callable[..., torch.Tensor]


def call_with_aux(fn: Callable[..., Any], *args: Any, return_aux: bool = False,
                  **kwargs: Any) -> tuple[torch.Tensor, Optional[dict]]:
    """(output, aux) of fn(*args, **kwargs): with return_aux, fn returns its auxiliary output too (e.g. REPA's
    tokens); without it, aux is None. Preconditioners and losses pass aux on untouched."""
    if not return_aux:
        return fn(*args, **kwargs), None
    return fn(*args, return_aux=True, **kwargs)


def with_aux(out: Any, aux: Optional[dict]) -> Any:
    """out, or (out, aux) when aux came back from call_with_aux(return_aux=True)."""
    return out if aux is None else (out, aux)


class StackedRandomGenerator:
    """One generator per sample seed (EDM's trick): sample i depends only on seed i,
    whatever the batch size or number of processes."""

    def __init__(self, device: torch.device | str, seeds: Sequence[int]):
        self.generators = [torch.Generator(device).manual_seed(int(s) % (1 << 32)) for s in seeds]

    def randn(self, size: Sequence[int], **kwargs) -> torch.Tensor:
        assert size[0] == len(self.generators)
        return torch.stack([torch.randn(size[1:], generator=g, **kwargs) for g in self.generators])

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.randn(x.shape, dtype=x.dtype, layout=x.layout, device=x.device)

    def randint(self, *args, size: Sequence[int], **kwargs) -> torch.Tensor:
        assert size[0] == len(self.generators)
        return torch.stack([torch.randint(*args, size=size[1:], generator=g, **kwargs) for g in self.generators])
