"""Rectified flow / flow matching: z_t = (1-t) x + t n, the network predicts n - x."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from diffusion.common import Denoiser


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3-style timestep shift: shift > 1 spends more time at high noise."""
    return shift * t / (1 + (shift - 1) * t)


class RFModel(nn.Module):
    """Velocity model v(z_t, t): wraps a backbone F(x, noise_level, labels) with noise_level = t * t_scale."""

    def __init__(self, model: nn.Module, t_scale: float = 1000.0):
        super().__init__()
        self.model = model
        self.t_scale = t_scale

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        t = t.to(torch.float32).reshape(-1).expand(x.shape[0])
        return self.model(x.to(torch.float32), t * self.t_scale, labels, **cond).to(torch.float32)


class RectifiedFlow:
    """Flow-matching objective with logit-normal t and an Euler sampler from t=1 to t=0."""

    def __init__(
        self,
        P_mean: float = 0.0,       # mean of logit(t) during training (logit-normal)
        P_std: float = 1.0,        # std of logit(t)
        shift: float = 1.0,        # timestep shift applied to training and sampling t
        t_scale: float = 1000.0,   # noise_level fed to the backbone = t * t_scale
        num_steps: int = 50,       # Euler steps (network evaluations)
    ):
        self.P_mean, self.P_std, self.shift, self.t_scale, self.num_steps = P_mean, P_std, shift, t_scale, num_steps

    def precondition(self, model: nn.Module) -> RFModel:
        return RFModel(model, self.t_scale)

    def loss(self, net: nn.Module, x: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        """Unreduced velocity loss (B, C, H, W); draws from the global RNG."""
        t = torch.sigmoid(torch.randn([x.shape[0]], device=x.device) * self.P_std + self.P_mean)
        t = shift_t(t, self.shift).reshape(-1, 1, 1, 1)
        noise = torch.randn_like(x)
        z = (1 - t) * x + t * noise
        return (net(z, t.flatten(), labels, **cond) - (noise - x)) ** 2

    def t_steps(self, num_steps: Optional[int] = None, device: Any = None) -> torch.Tensor:
        t = torch.linspace(1.0, 0.0, (num_steps or self.num_steps) + 1, dtype=torch.float64, device=device)
        return shift_t(t, self.shift)

    @torch.no_grad()
    def sample(self, velocity: Denoiser, noise: torch.Tensor, labels: torch.Tensor, *, num_steps: Optional[int] = None,
               randn_like=None, cond: Optional[dict] = None) -> torch.Tensor:
        """Euler integration of dz/dt = v from z_1 = noise to z_0; velocity(z, t, labels, **cond) -> v, `cond`
        (e.g. text) going to the model. randn_like is unused (the sampler is deterministic)."""
        extra = {"cond": cond} if cond else {}
        ts = self.t_steps(num_steps, noise.device)
        x = noise.to(torch.float64)
        for t_cur, t_next in zip(ts[:-1], ts[1:]):
            v = velocity(x.to(torch.float32), t_cur.to(torch.float32).expand(x.shape[0]), labels, **extra)
            x = x + (t_next - t_cur) * v.to(torch.float64)
        return x.to(torch.float32)

    def sampling_nfe(self, num_steps: Optional[int] = None) -> int:
        return num_steps or self.num_steps
