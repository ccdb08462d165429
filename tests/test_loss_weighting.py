"""Timestep sampling and loss weighting: rectified flow's weighting schemes against diffusers' own training utilities
(compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3) on the same random streams, the weighted
loss, the default's bit-identical loss, EDM's Min-SNR-gamma weight, the config errors, and short training runs."""
from __future__ import annotations

import math

import pytest
import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from conftest import compose_cfg
from tread.diffusion import EDM
from tread.diffusion.rf import WEIGHTING_SCHEMES, RectifiedFlow, shift_t
from tread.schema import ConfigError, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics

DIFFUSERS_NAME = {"uniform": "none"}   # our "uniform" is diffusers' "none"


@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_schemes_draw_and_weigh_as_diffusers(scheme):
    """Same seed, same t as diffusers' density (logit-normal: torch.normal vs randn * std + mean, within one float32
    ulp); the weight at those t equals diffusers' (cosmap, sigma_sqrt), or is 1 where diffusers' is ones."""
    rf = RectifiedFlow(weighting_scheme=scheme, P_mean=0.2, P_std=1.3, mode_scale=1.29)
    name = DIFFUSERS_NAME.get(scheme, scheme)
    torch.manual_seed(7)
    ours = rf.draw_t(4096, "cpu")
    torch.manual_seed(7)
    theirs = compute_density_for_timestep_sampling(name, 4096, logit_mean=0.2, logit_std=1.3, mode_scale=1.29)
    if scheme == "logit_normal":
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-7)
    else:
        assert torch.equal(ours, theirs)
    assert 0 <= float(ours.min()) and float(ours.max()) <= 1
    weight, expected = rf.loss_weight(ours), compute_loss_weighting_for_sd3(name, sigmas=ours)
    if weight is None:
        assert torch.equal(expected, torch.ones_like(ours))
    else:
        assert torch.equal(weight, expected)


def test_mode_sampling_concentrates_in_the_middle():
    """The SD3 paper's mode sampling with scale 1.29 puts more t near 0.5 than uniform does (its point)."""
    torch.manual_seed(0)
    t = RectifiedFlow(weighting_scheme="mode").draw_t(20000, "cpu")
    middle = ((t > 0.25) & (t < 0.75)).float().mean()
    assert 0.6 < float(middle) < 0.8    # uniform: 0.5


class FixedVelocity(torch.nn.Module):
    """A 'network' whose output ignores its inputs: the loss differs between schemes only by t and its weight."""

    def forward(self, z, t, labels, **cond):
        return torch.full_like(z, 0.3)


@pytest.mark.parametrize("scheme", ["cosmap", "sigma_sqrt"])
def test_weighted_loss_is_the_weight_times_the_uniform_loss(scheme):
    """cosmap / sigma_sqrt draw t as uniform does (same stream), and multiply each sample's loss by the weight at its
    shifted t."""
    x, y = torch.randn(6, 3, 4, 4), torch.zeros(6, dtype=torch.long)
    weighted, plain = (RectifiedFlow(weighting_scheme=s, shift=3.0) for s in (scheme, "uniform"))
    torch.manual_seed(1)
    got = weighted.loss(FixedVelocity(), x, y)
    torch.manual_seed(1)
    base = plain.loss(FixedVelocity(), x, y)
    torch.manual_seed(1)
    t = shift_t(plain.draw_t(6, "cpu"), 3.0).reshape(-1, 1, 1, 1)
    torch.testing.assert_close(got, weighted.loss_weight(t) * base)


def test_default_loss_is_unchanged():
    """logit_normal (the default) draws t and noise exactly as before the schemes existed: the same loss, bit for
    bit, as the formula written out."""
    x, y = torch.randn(5, 3, 4, 4), torch.zeros(5, dtype=torch.long)
    rf = RectifiedFlow(P_mean=0.1, P_std=0.9, shift=2.0)
    torch.manual_seed(3)
    got = rf.loss(FixedVelocity(), x, y)
    torch.manual_seed(3)
    t = shift_t(torch.sigmoid(torch.randn([5]) * 0.9 + 0.1), 2.0).reshape(-1, 1, 1, 1)
    noise = torch.randn_like(x)
    assert torch.equal(got, (torch.full_like(x, 0.3) - (noise - x)) ** 2)


def test_min_snr_gamma_weight():
    """EDM's weight is (SNR + 1) / sd^2 (SNR = sd^2 / sigma^2); Min-SNR-gamma's is min(SNR, gamma) / sd^2: EDM's
    times min(SNR, gamma) / (SNR + 1), the factor diffusers' examples apply to a v-prediction loss."""
    sigma = torch.tensor([0.002, 0.05, 0.3, 0.5, 1.0, 10.0, 80.0])
    edm, snr5 = EDM(sigma_data=0.5), EDM(sigma_data=0.5, min_snr_gamma=5.0)
    snr = 0.25 / sigma ** 2
    torch.testing.assert_close(edm.loss_weight(sigma), (snr + 1) / 0.25)
    torch.testing.assert_close(snr5.loss_weight(sigma), edm.loss_weight(sigma) * torch.clamp(snr, max=5.0) / (snr + 1))
    assert torch.equal(snr5.loss_weight(sigma)[:2], torch.full((2,), 5.0 / 0.25))   # low noise: clamped at gamma
    torch.testing.assert_close(EDM(min_snr_gamma=1e12).loss_weight(sigma), 1 / sigma ** 2)


@pytest.mark.parametrize("overrides,message", [
    (["diffusion=rf", "diffusion.weighting_scheme=cosine"], "diffusion.weighting_scheme"),
    (["diffusion=rf", "diffusion.mode_scale=2.0"], "diffusion.mode_scale=2.0 is not allowed"),
    (["diffusion.min_snr_gamma=0"], "diffusion.min_snr_gamma"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=overrides))
    assert message in str(err.value) and "\n" not in str(err.value).strip()


@pytest.mark.parametrize("extra", [["diffusion=rf", "diffusion.weighting_scheme=cosmap"],
                                   ["diffusion=rf", "diffusion.weighting_scheme=mode"],
                                   ["diffusion.min_snr_gamma=5"]])
def test_a_run_trains_with_the_setting(tiny_cfg, tmp_path, extra):
    cfg = tiny_cfg(*extra, "train.max_steps=4", "train.log_every_steps=2", "eval.every_steps=0", "eval.at_end=false",
                   "checkpoint.every_steps=0")
    train(cfg, tmp_path / "run")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
