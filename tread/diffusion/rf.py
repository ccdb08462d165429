"""Rectified flow / flow matching: z_t = (1-t) x + t n, the network predicts n - x.

The timestep shift t -> s t / (1 + (s - 1) t) applies to training and sampling alike; s is static (`shift`) or
FLUX's resolution-dependent one (`dynamic_shift`), read from the latents' shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from tread.diffusion.common import Denoiser, call_with_aux, with_aux
from tread.utils.errors import UserError


class ShiftConfigError(UserError):
    """A diffusion.shift / diffusion.dynamic_shift / diffusion.weighting_scheme setting that cannot work."""


# diffusers' --weighting_scheme of its SD3 / FLUX training scripts (training_utils.py): which density t is drawn from
# (compute_density_for_timestep_sampling) and which weight the loss gets at the shifted t
# (compute_loss_weighting_for_sd3). "uniform" is diffusers' "none": uniform t, weight 1.
WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "sigma_sqrt", "uniform")
MODE_SCALE_MAX = 2 / (math.pi - 2)   # SD3 paper: mode sampling keeps t in [0, 1] for -1 <= scale <= 2 / (pi - 2)


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3-style timestep shift: shift > 1 spends more time at high noise."""
    return shift * t / (1 + (shift - 1) * t)


@dataclass(frozen=True)
class DynamicShift:
    """FLUX's resolution-dependent shift (diffusers' calculate_shift): mu linear in the image sequence length
    T (H / patch_size) (W / patch_size), base_shift at base_seq_len, max_shift at max_seq_len (extrapolated
    beyond, as the pipeline); the shift is exp(mu)."""
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096
    patch_size: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.base_seq_len < self.max_seq_len:
            raise ShiftConfigError(
                f"diffusion.dynamic_shift.base_seq_len={self.base_seq_len} and max_seq_len={self.max_seq_len} are "
                f"not allowed; allowed: 1 <= base_seq_len < max_seq_len (FLUX.1: 256 and 4096).")
        if self.patch_size < 1:
            raise ShiftConfigError(f"diffusion.dynamic_shift.patch_size={self.patch_size} is not allowed; allowed: "
                                   f"an integer >= 1 (latent cells per token side; FLUX: 2).")

    def seq_len(self, latent_shape: Sequence[int]) -> int:
        """Image tokens per sample of latents shaped (B, C, H, W) or (B, C, T, H, W)."""
        *frames, h, w = latent_shape[2:]
        return math.prod(frames) * (h // self.patch_size) * (w // self.patch_size)

    def mu(self, seq_len: int) -> float:
        """diffusers' calculate_shift(seq_len, base_seq_len, max_seq_len, base_shift, max_shift)."""
        m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return seq_len * m + (self.base_shift - m * self.base_seq_len)

    def shift(self, latent_shape: Sequence[int]) -> float:
        return math.exp(self.mu(self.seq_len(latent_shape)))


class RFModel(nn.Module):
    """Velocity model v(z_t, t): wraps a backbone F(x, noise_level, labels) with noise_level = t * t_scale."""

    def __init__(self, model: nn.Module, t_scale: float = 1000.0):
        super().__init__()
        self.model = model
        self.t_scale = t_scale

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, *, return_aux: bool = False,
                **cond: Any) -> Any:
        """v(x, t); with return_aux, (v, the backbone's auxiliary output) (tread/diffusion/common.py)."""
        t = t.to(torch.float32).reshape(-1).expand(x.shape[0])
        v, aux = call_with_aux(self.model, x.to(torch.float32), t * self.t_scale, labels, return_aux=return_aux,
                               **cond)
        return with_aux(v.to(torch.float32), aux)


class RectifiedFlow:
    """Flow-matching objective (t drawn by `weighting_scheme`, logit-normal by default) and an Euler sampler from
    t=1 to t=0."""

    def __init__(
        self,
        P_mean: float = 0.0,       # mean of logit(t) during training (logit-normal)
        P_std: float = 1.0,        # std of logit(t)
        shift: float = 1.0,        # static timestep shift applied to training and sampling t
        t_scale: float = 1000.0,   # noise_level fed to the backbone = t * t_scale
        num_steps: int = 50,       # Euler steps (network evaluations)
        dynamic_shift: Optional[Mapping[str, Any]] = None,   # DynamicShift's keys: FLUX's shift instead of `shift`
        weighting_scheme: str = "logit_normal",   # WEIGHTING_SCHEMES: t's density and the loss weight
        mode_scale: float = 1.29,  # "mode" sampling's scale (SD3 paper, diffusers' default)
        shift_terminal: Optional[float] = None,   # the sampling grid's last non-zero t (LTX-Video's scheduler: 0.1)
    ):
        self.P_mean, self.P_std, self.shift, self.t_scale, self.num_steps = P_mean, P_std, shift, t_scale, num_steps
        if shift_terminal is not None and not 0 < shift_terminal < 1:
            raise ShiftConfigError(f"diffusion.shift_terminal={shift_terminal} is not allowed; allowed: null (no "
                                   f"stretch) or a number in (0, 1), the last non-zero t of the sampling grid "
                                   f"(LTX-Video: 0.1).")
        self.shift_terminal = shift_terminal
        if weighting_scheme not in WEIGHTING_SCHEMES or not -1 <= mode_scale <= MODE_SCALE_MAX:
            raise ShiftConfigError(
                f"diffusion.weighting_scheme={weighting_scheme!r} with diffusion.mode_scale={mode_scale} is not allowed; "
                f"allowed: weighting_scheme one of {', '.join(WEIGHTING_SCHEMES)}, mode_scale in [-1, "
                f"{MODE_SCALE_MAX:.4f}] (2 / (pi - 2): beyond it mode sampling leaves [0, 1]).")
        self.weighting_scheme, self.mode_scale = weighting_scheme, float(mode_scale)
        self.dynamic_shift = None if dynamic_shift is None else DynamicShift(**dynamic_shift)
        if self.dynamic_shift is not None and shift != 1:
            raise ShiftConfigError(
                f"diffusion.shift={shift} cannot be combined with diffusion.dynamic_shift (it replaces the static "
                f"shift); allowed: diffusion.shift=1 with dynamic_shift, or diffusion.dynamic_shift=null.")

    def shift_for(self, latent_shape: Sequence[int]) -> float:
        """The shift for latents of this shape (B, C, H, W) / (B, C, T, H, W): dynamic or static."""
        return self.shift if self.dynamic_shift is None else self.dynamic_shift.shift(latent_shape)

    def precondition(self, model: nn.Module) -> RFModel:
        """The velocity wrapper; with a dynamic shift, its patch_size must count the backbone's own tokens."""
        self.check_tokens(model)
        return RFModel(model, self.t_scale)

    def check_tokens(self, model: nn.Module) -> None:
        """dynamic_shift.patch_size against the backbone: the sequence length computed from its training latents
        (input_size, frames) must be its token count (num_tokens), or mu would follow a wrong length."""
        dyn = self.dynamic_shift
        if dyn is None:
            return
        size, tokens, frames = model.input_size, model.num_tokens, int(model.frames)
        counted = dyn.seq_len((1, 1, frames, size, size))
        if counted != tokens:
            raise ShiftConfigError(
                f"diffusion.dynamic_shift.patch_size={dyn.patch_size} counts {counted} image tokens for the model's "
                f"{size}x{size} latents, but the model has {tokens}; allowed: the model's latent cells per token "
                f"side (FLUX: 2, a DiT or SD3: its patch_size).")

    def loss(self, net: nn.Module, x: torch.Tensor, labels: torch.Tensor, *, return_aux: bool = False,
             **cond: Any) -> Any:
        """Unreduced velocity loss (B, C, H, W); draws from the global RNG. With return_aux, (loss, the backbone's
        auxiliary output)."""
        t = shift_t(self.draw_t(x.shape[0], x.device), self.shift_for(x.shape)).reshape(-1, *[1] * (x.dim() - 1))
        noise = torch.randn_like(x)
        z = (1 - t) * x + t * noise
        v, aux = call_with_aux(net, z, t.flatten(), labels, return_aux=return_aux, **cond)
        loss = (v - (noise - x)) ** 2
        weight = self.loss_weight(t)
        return with_aux(loss if weight is None else weight * loss, aux)

    def draw_t(self, batch: int, device: Any) -> torch.Tensor:
        """t before the shift, from the global RNG: diffusers' compute_density_for_timestep_sampling for this
        weighting_scheme (logit_normal: sigmoid(N(P_mean, P_std)); mode: SD3's mode sampling; otherwise uniform)."""
        if self.weighting_scheme == "logit_normal":
            return torch.sigmoid(torch.randn([batch], device=device) * self.P_std + self.P_mean)
        u = torch.rand([batch], device=device)
        if self.weighting_scheme == "mode":
            u = 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        return u

    def loss_weight(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The loss weight at the shifted t (diffusers' sigma): compute_loss_weighting_for_sd3's cosmap
        2 / (pi (1 - 2t + 2t^2)) or sigma_sqrt t^-2; None (weight 1) for the other schemes."""
        if self.weighting_scheme == "cosmap":
            return 2 / (math.pi * (1 - 2 * t + 2 * t ** 2))
        if self.weighting_scheme == "sigma_sqrt":
            return t ** -2.0
        return None

    def t_steps(self, num_steps: Optional[int] = None, device: Any = None,
                latent_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The sampler's t grid: num_steps + 1 points from 1 to 0, uniform then shifted (a dynamic shift needs
        the latents' shape); with shift_terminal, the points before the final 0 stretched so that the last of them
        is shift_terminal (diffusers' FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal; one step has none
        to stretch). Training t is never stretched, as in diffusers."""
        if self.dynamic_shift is not None and latent_shape is None:
            raise ShiftConfigError("diffusion.dynamic_shift: the sampling t grid depends on the latents' shape; "
                                   "pass latent_shape.")
        t = torch.linspace(1.0, 0.0, (num_steps or self.num_steps) + 1, dtype=torch.float64, device=device)
        t = shift_t(t, self.shift if latent_shape is None else self.shift_for(latent_shape))
        if self.shift_terminal is not None and len(t) > 2:
            one_minus = 1 - t[:-1]
            t = torch.cat([1 - one_minus * (1 - self.shift_terminal) / one_minus[-1], t[-1:]])
        return t

    @torch.no_grad()
    def sample(self, velocity: Denoiser, noise: torch.Tensor, labels: torch.Tensor, *, num_steps: Optional[int] = None,
               randn_like=None, cond: Optional[dict] = None) -> torch.Tensor:
        """Euler integration of dz/dt = v from z_1 = noise to z_0; velocity(z, t, labels, **cond) -> v, `cond`
        (e.g. text) going to the model. randn_like is unused (the sampler is deterministic)."""
        extra = {"cond": cond} if cond else {}
        ts = self.t_steps(num_steps, noise.device, noise.shape)
        x = noise.to(torch.float64)
        for t_cur, t_next in zip(ts[:-1], ts[1:]):
            v = velocity(x.to(torch.float32), t_cur.to(torch.float32).expand(x.shape[0]), labels, **extra)
            x = x + (t_next - t_cur) * v.to(torch.float64)
        return x.to(torch.float32)

    def sampling_nfe(self, num_steps: Optional[int] = None) -> int:
        return num_steps or self.num_steps
