"""EDM (Karras et al. 2022): preconditioning, training loss and the Heun sampler."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn

from tread.diffusion.common import Denoiser, call_with_aux, with_aux


class EDMPrecond(nn.Module):
    """D(x; sigma) = c_skip x + c_out F(c_in x, c_noise): wraps a backbone F(x, noise_level, labels)."""

    def __init__(self, model: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        self.model = model
        self.sigma_data = sigma_data

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sd = self.sigma_data
        c_skip = sd ** 2 / (sigma ** 2 + sd ** 2)
        c_out = sigma * sd / (sigma ** 2 + sd ** 2).sqrt()
        c_in = 1 / (sd ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        return c_skip, c_out, c_in, c_noise

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, *, return_aux: bool = False,
                **cond: Any) -> Any:
        """D(x; sigma); with return_aux, (D, the backbone's auxiliary output) (tread/diffusion/common.py)."""
        sigma = sigma.to(torch.float32).reshape(-1, 1, 1, 1).expand(x.shape[0], 1, 1, 1)
        c_skip, c_out, c_in, c_noise = self.coefficients(sigma)
        F_x, aux = call_with_aux(self.model, (c_in * x).to(torch.float32), c_noise.flatten(), labels,
                                 return_aux=return_aux, **cond)
        return with_aux(c_skip * x + c_out * F_x.to(torch.float32), aux)


class EDM:
    """EDM objective: sigma ~ logN(P_mean, P_std^2), loss weight (s^2+sd^2)/(s*sd)^2 (or Min-SNR-gamma's),
    Heun sampling."""

    def __init__(
        self,
        sigma_data: float = 0.5,     # std of the data (latents scaled accordingly)
        P_mean: float = -1.2,        # mean of ln(sigma) during training
        P_std: float = 1.2,          # std of ln(sigma) during training
        num_steps: int = 40,         # Heun steps (2*num_steps - 1 network evaluations)
        sigma_min: float = 0.002,    # lowest noise level of the schedule
        sigma_max: float = 80.0,     # highest noise level of the schedule
        rho: float = 7.0,            # Karras schedule curvature
        S_churn: float = 0.0,        # stochasticity (0 = deterministic ODE)
        S_min: float = 0.0,          # churn only for sigma in [S_min, S_max]
        S_max: float = math.inf,
        S_noise: float = 1.0,        # noise inflation for churn
        min_snr_gamma: Optional[float] = None,   # None: EDM's weight; gamma: Min-SNR-gamma (loss_weight)
    ):
        self.sigma_data, self.P_mean, self.P_std = sigma_data, P_mean, P_std
        self.min_snr_gamma = None if min_snr_gamma is None else float(min_snr_gamma)
        self.num_steps, self.sigma_min, self.sigma_max, self.rho = num_steps, sigma_min, sigma_max, rho
        self.S_churn, self.S_min, self.S_max, self.S_noise = S_churn, S_min, float(S_max), S_noise

    def precondition(self, model: nn.Module) -> EDMPrecond:
        return EDMPrecond(model, self.sigma_data)

    def loss(self, net: nn.Module, x: torch.Tensor, labels: torch.Tensor, *, return_aux: bool = False,
             **cond: Any) -> Any:
        """Unreduced weighted denoising loss (B, C, H, W); draws from the global RNG. With return_aux, (loss, the
        backbone's auxiliary output)."""
        rnd_normal = torch.randn([x.shape[0], 1, 1, 1], device=x.device)
        sigma = (rnd_normal * self.P_std + self.P_mean).exp()
        weight = self.loss_weight(sigma)
        noise = torch.randn_like(x) * sigma
        D_yn, aux = call_with_aux(net, x + noise, sigma.flatten(), labels, return_aux=return_aux, **cond)
        return with_aux(weight * (D_yn - x) ** 2, aux)

    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """The weight of ||D(x + n; sigma) - x||^2: EDM's (SNR + 1) / sd^2 with SNR = sd^2 / sigma^2, or with
        Min-SNR-gamma (Hang et al. 2023) min(SNR, gamma) / sd^2, clamping the low-noise levels at gamma."""
        if self.min_snr_gamma is None:
            return (sigma ** 2 + self.sigma_data ** 2) / (sigma * self.sigma_data) ** 2
        sd2 = self.sigma_data ** 2
        return torch.clamp(sd2 / sigma ** 2, max=self.min_snr_gamma) / sd2

    def sigma_steps(self, num_steps: Optional[int] = None, device: Any = None) -> torch.Tensor:
        """Karras schedule t_0 > ... > t_{N-1}, then t_N = 0 (float64)."""
        n = num_steps or self.num_steps
        i = torch.arange(n, dtype=torch.float64, device=device)
        inv = 1.0 / self.rho
        step = (n - 1) if n > 1 else 1
        t = (self.sigma_max ** inv + i / step * (self.sigma_min ** inv - self.sigma_max ** inv)) ** self.rho
        return torch.cat([t, torch.zeros_like(t[:1])])

    @torch.no_grad()
    def sample(self, denoise: Denoiser, noise: torch.Tensor, labels: torch.Tensor, *, num_steps: Optional[int] = None,
               randn_like=torch.randn_like, cond: Optional[dict] = None) -> torch.Tensor:
        """Heun (EDM Algorithm 2) from unit-variance `noise`; denoise(x, sigma, labels, **cond) -> D(x; sigma)."""
        extra = {"cond": cond} if cond else {}
        t_steps = self.sigma_steps(num_steps, noise.device)
        n = len(t_steps) - 1
        x_next = noise.to(torch.float64) * t_steps[0]
        for i, (t_cur, t_next) in enumerate(zip(t_steps[:-1], t_steps[1:])):
            x_cur = x_next
            gamma = min(self.S_churn / n, math.sqrt(2) - 1) if self.S_min <= t_cur <= self.S_max else 0.0
            t_hat = t_cur + gamma * t_cur
            if gamma > 0:
                x_cur = x_cur + (t_hat ** 2 - t_cur ** 2).sqrt() * self.S_noise * randn_like(x_cur)
            d_cur = (x_cur - self._denoise(denoise, x_cur, t_hat, labels, extra)) / t_hat
            x_next = x_cur + (t_next - t_hat) * d_cur
            if i < n - 1:  # 2nd-order correction, except for the last step to sigma=0
                d_prime = (x_next - self._denoise(denoise, x_next, t_next, labels, extra)) / t_next
                x_next = x_cur + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_prime)
        return x_next.to(torch.float32)

    @staticmethod
    def _denoise(denoise, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, extra: dict) -> torch.Tensor:
        sigmas = sigma.to(torch.float32).expand(x.shape[0])
        return denoise(x.to(torch.float32), sigmas, labels, **extra).to(torch.float64)

    def sampling_nfe(self, num_steps: Optional[int] = None) -> int:
        return 2 * (num_steps or self.num_steps) - 1
