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
    """Wrap net(x, noise, labels, **cond) so it returns uncond + cfg_scale * (cond - uncond), both branches in
    one batched call. cfg_scale == 1 is the plain conditional model (one evaluation per step). Per-sample
    conditioning tensors in `cond` (text embeddings, ...) are repeated for the unconditional half, whose null
    label tells the model to drop them. (diffusion.guidance.guided_denoiser with CFG only.)"""
    if cfg_scale == 1.0:
        return net
    from diffusion.guidance import Guidance, guided_denoiser
    return guided_denoiser(net, Guidance(cfg_scale=cfg_scale), null_label)


def sampling_denoiser(net: Denoiser, null_label: int, cfg_scale: float, guidance, stats) -> Denoiser:
    """The samplers' denoiser: `guidance` (a diffusion.guidance.Guidance) if given, else plain CFG."""
    from diffusion.guidance import Guidance, guided_denoiser
    if guidance is None:
        guidance = Guidance(cfg_scale=cfg_scale)
    elif cfg_scale != 1.0 and cfg_scale != guidance.cfg_scale:
        raise ValueError(f"cfg_scale={cfg_scale} disagrees with guidance.cfg_scale={guidance.cfg_scale}.")
    if stats is None and guidance.is_plain:
        return net
    return guided_denoiser(net, guidance, null_label, stats)
