"""Pieces shared by the EDM and rectified-flow objectives: per-seed RNG and guidance."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


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


Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def classifier_free_guidance(net: Denoiser, cfg_scale: float, null_label: int) -> Denoiser:
    """Wrap net(x, noise, labels, **cond) so it returns uncond + cfg_scale * (cond - uncond).

    cfg_scale == 1 is the plain conditional model (one evaluation per step). Per-sample conditioning
    tensors in `cond` (text embeddings, ...) are repeated for the unconditional half, whose null label
    tells the model to drop them.
    """
    if cfg_scale == 1.0:
        return net

    def guided(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond) -> torch.Tensor:
        """x (B, ...), noise (B,), labels (B,): one batched call for both branches."""
        null = torch.full_like(labels, null_label)
        both = {k: (torch.cat([v, v]) if isinstance(v, torch.Tensor) else
                    {kk: torch.cat([vv, vv]) for kk, vv in v.items()} if isinstance(v, dict) else v)
                for k, v in cond.items()}
        out = net(torch.cat([x, x]), torch.cat([noise, noise]), torch.cat([labels, null]), **both)
        cond_out, uncond = out.chunk(2)
        return uncond + cfg_scale * (cond_out - uncond)

    return guided
