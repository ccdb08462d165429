"""RMS norms that follow their input's dtype. diffusers' FLUX, FLUX.2, Chroma, HiDream, Wan and LTX-Video attention
norms are torch.nn.RMSNorm with fp32 weights; under bf16 autocast their input is the bf16 output of a projection,
and torch.rms_norm with a bf16 input and an fp32 weight warns ("Mismatch dtype between input and weight ...
Cannot dispatch to fused implementation") and runs its composite path, which returns fp32. Casting the weight to
the input's dtype, as autocast casts a linear layer's weight, keeps the fused kernel and a bf16 output (the
gradient still reaches the fp32 weight); in fp32 nothing changes."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)


class InputDtypeRMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm with its weight cast to a half-precision input's dtype (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and x.dtype in LOW_PRECISION and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def norms_follow_input(module: nn.Module) -> nn.Module:
    """Every torch.nn.RMSNorm in `module` becomes an InputDtypeRMSNorm, in place (its class only: parameters,
    hooks and state dict stay); returns `module`."""
    for sub in module.modules():
        if type(sub) is nn.RMSNorm:
            sub.__class__ = InputDtypeRMSNorm
    return module
