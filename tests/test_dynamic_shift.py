"""FLUX's resolution-dependent timestep shift (diffusion.dynamic_shift): the sampler's t grid against diffusers'
FlowMatchEulerDiscreteScheduler as FluxPipeline drives it, the training t shifted the same way, and config errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from conftest import TINY, compose_cfg
from tread.schema.builders import build_diffusion, build_model
from tread.diffusion.rf import DynamicShift, RectifiedFlow, ShiftConfigError, shift_t
from tread.schema import ConfigError, check_train

FLUX1 = dict(base_shift=0.5, max_shift=1.15, base_seq_len=256, max_seq_len=4096, patch_size=2)


def flux_scheduler_sigmas(seq_len: int, num_steps: int) -> torch.Tensor:
    """FluxPipeline.__call__'s schedule: FLUX.1-dev's scheduler config, sigmas np.linspace(1, 1/N, N) and mu from
    calculate_shift on the packed latents' length, with the scheduler's terminal 0 appended."""
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)
    mu = calculate_shift(seq_len, sched.config.base_image_seq_len, sched.config.max_image_seq_len,
                         sched.config.base_shift, sched.config.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sched.sigmas


@pytest.mark.parametrize("side", [16, 32, 64, 128, 96])        # 64 .. 4096 tokens, and 2304 (768 px)
@pytest.mark.parametrize("num_steps", [1, 4, 28, 50])
def test_sampler_grid_equals_flux_pipeline_schedule(side, num_steps):
    """Same nodes and shift: within one float32 ulp (diffusers computes in float32, we in float64), with the
    endpoints 1 and 0 exact."""
    rf = RectifiedFlow(dynamic_shift=FLUX1)
    seq = (side // 2) ** 2
    assert rf.dynamic_shift.seq_len((2, 16, side, side)) == seq
    assert rf.dynamic_shift.mu(seq) == calculate_shift(seq, 256, 4096, 0.5, 1.15)
    ours = rf.t_steps(num_steps, latent_shape=(2, 16, side, side))
    theirs = flux_scheduler_sigmas(seq, num_steps)
    assert ours.shape == theirs.shape == (num_steps + 1,)
    torch.testing.assert_close(ours.float(), theirs, atol=1.2e-7, rtol=0)
    assert ours[0] == theirs[0] == 1 and ours[-1] == theirs[-1] == 0


def test_exponential_time_shift_is_the_static_shift_by_exp_mu():
    t = torch.linspace(0.01, 1, 100, dtype=torch.float64)
    mu = 0.83
    exponential = math.exp(mu) / (math.exp(mu) + (1 / t - 1))      # diffusers' time_shift, sigma = 1
    torch.testing.assert_close(shift_t(t, math.exp(mu)), exponential, atol=1e-15, rtol=1e-14)


def test_sampler_evaluates_the_shifted_grid_of_the_noise_shape():
    rf = RectifiedFlow(dynamic_shift=FLUX1, num_steps=6)
    seen = []

    def velocity(x, t, labels):
        seen.append(float(t[0]))
        return torch.zeros_like(x)

    for side in (16, 64):
        seen.clear()
        rf.sample(velocity, torch.randn(2, 4, side, side), torch.zeros(2, dtype=torch.long))
        assert seen == rf.t_steps(6, latent_shape=(2, 4, side, side))[:-1].float().tolist()
    assert rf.shift_for((1, 4, 16, 16)) < rf.shift_for((1, 4, 64, 64))       # more tokens: more shift


class RecordT(torch.nn.Module):
    def forward(self, z, t, labels):
        self.t = t.clone()
        return torch.zeros_like(z)


@pytest.mark.parametrize("side", [16, 64])
def test_training_t_is_shifted_like_the_static_shift_exp_mu(side):
    """The dynamic objective draws the same t as a static one with shift exp(mu(seq)), bit for bit, and that t
    is the shifted logit-normal draw."""
    x = torch.randn(64, 4, side, side)
    dynamic = RectifiedFlow(P_mean=-0.2, P_std=1.1, dynamic_shift=FLUX1)
    static = RectifiedFlow(P_mean=-0.2, P_std=1.1, shift=math.exp(dynamic.dynamic_shift.mu((side // 2) ** 2)))
    nets, losses = [RecordT(), RecordT()], []
    for net, obj in zip(nets, (dynamic, static)):
        torch.manual_seed(3)
        losses.append(obj.loss(net, x, torch.zeros(64, dtype=torch.long)))
    assert torch.equal(nets[0].t, nets[1].t) and torch.equal(losses[0], losses[1])
    torch.manual_seed(3)
    drawn = torch.sigmoid(torch.randn(64) * 1.1 - 0.2)
    assert torch.equal(nets[0].t, shift_t(drawn, static.shift))
    assert nets[0].t.median() > drawn.median()                        # shift > 1: toward high noise


def test_flux_config_uses_flux1_dynamic_shift_and_dit_default_is_unchanged():
    flux = build_diffusion(compose_cfg("train", TINY + ["model=flux"]).diffusion)
    assert flux.dynamic_shift == DynamicShift(**FLUX1) and flux.shift == 1.0
    assert flux.shift_for((1, 16, 16, 16)) == pytest.approx(math.exp(0.5 - 192 * 0.65 / 3840))     # tiny: 1.60
    assert flux.shift_for((1, 16, 128, 128)) == pytest.approx(math.exp(1.15))                      # 1024 px
    assert build_diffusion(compose_cfg("train", TINY + ["model=sd3"]).diffusion).dynamic_shift is None
    default = compose_cfg("train", [])
    assert default.diffusion._target_ == "tread.diffusion.EDM" and "dynamic_shift" not in default.diffusion
    static = compose_cfg("train", TINY + ["model=flux", "diffusion.dynamic_shift=null", "diffusion.shift=3"])
    check_train(static)
    assert build_diffusion(static.diffusion).shift_for((1, 16, 16, 16)) == 3.0


def test_flux_model_token_count_matches_the_shift_sequence_length():
    cfg = compose_cfg("train", TINY + ["model=flux"])
    model, diffusion = build_model(cfg.model), build_diffusion(cfg.diffusion)
    diffusion.precondition(model)                                    # no error: 2x2 cells per token
    assert diffusion.dynamic_shift.seq_len((1, 4, model.input_size, model.input_size)) == model.num_tokens


@pytest.mark.parametrize("overrides, match", [
    (["diffusion.shift=3"], r"^diffusion.shift=3.0 cannot be combined with diffusion.dynamic_shift .*allowed: "
                            r"diffusion.shift=1 with dynamic_shift, or diffusion.dynamic_shift=null"),
    (["diffusion.dynamic_shift.max_seq_len=256"], r"^diffusion.dynamic_shift.base_seq_len=256 and max_seq_len=256 "
                                                  r"are not allowed; allowed: 1 <= base_seq_len < max_seq_len"),
    (["diffusion.dynamic_shift.patch_size=0"], r"^diffusion.dynamic_shift.patch_size=0 is not allowed; allowed: an "
                                               r"integer >= 1"),
    (["diffusion.dynamic_shift=2"], r"^diffusion.dynamic_shift=2 is not allowed; allowed: null .* or \{base_shift"),
    (["diffusion.dynamic_shift.base_shift=high"], r"^diffusion.dynamic_shift.base_shift='high' is not allowed"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_train(compose_cfg("train", TINY + ["model=flux"] + overrides))
    assert "\n" not in str(err.value)


def test_patch_size_that_miscounts_the_model_tokens_is_an_error():
    cfg = compose_cfg("train", TINY + ["model=flux", "diffusion.dynamic_shift.patch_size=1"])
    check_train(cfg)                                 # a valid value on its own: only the model says it is wrong
    model, diffusion = build_model(cfg.model), build_diffusion(cfg.diffusion)
    with pytest.raises(ShiftConfigError, match=r"diffusion.dynamic_shift.patch_size=1 counts 256 image tokens for "
                                               r"the model's 16x16 latents, but the model has 64; allowed: "):
        diffusion.precondition(model)


def test_direct_construction_errors_and_the_grid_needs_a_shape():
    with pytest.raises(ShiftConfigError, match="base_seq_len=4096 and max_seq_len=256"):
        RectifiedFlow(dynamic_shift={**FLUX1, "base_seq_len": 4096, "max_seq_len": 256})
    with pytest.raises(ShiftConfigError, match="diffusion.shift=2.0 cannot be combined"):
        RectifiedFlow(shift=2.0, dynamic_shift=FLUX1)
    with pytest.raises(ShiftConfigError, match="pass latent_shape"):
        RectifiedFlow(dynamic_shift=FLUX1).t_steps(4)
    torch.testing.assert_close(RectifiedFlow(shift=3.0).t_steps(4), shift_t(torch.linspace(1, 0, 5).double(), 3.0))


LTX = dict(base_shift=0.95, max_shift=2.05, base_seq_len=1024, max_seq_len=4096, patch_size=1)


@pytest.mark.parametrize("cells", [1024, 2048, 6144])
@pytest.mark.parametrize("num_steps", [2, 8, 50])
def test_shift_terminal_grid_equals_the_ltx_pipeline_schedule(cells, num_steps):
    """diffusion.shift_terminal (LTX-Video's scheduler: 0.1): the grid LTXPipeline drives the scheduler with
    (sigmas np.linspace(1, 1/N, N), mu from the video's latent cells), shifted and stretched so its last non-zero t
    is 0.1, within one float32 ulp; the endpoints 1 and 0 exact."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift as ltx_shift

    rf = RectifiedFlow(dynamic_shift=LTX, shift_terminal=0.1)
    shape = (1, 128, cells // 256, 16, 16)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                            base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
                        mu=ltx_shift(cells, 1024, 4096, 0.95, 2.05))
    ours = rf.t_steps(num_steps, latent_shape=shape)
    torch.testing.assert_close(ours.float(), sched.sigmas, atol=2.4e-7, rtol=0)
    assert ours[0] == 1 and ours[-1] == 0 and ours[-2] == pytest.approx(0.1, abs=1e-12)
    plain = RectifiedFlow(dynamic_shift=LTX).t_steps(num_steps, latent_shape=shape)
    ratio = (1 - ours[:-1]) / (1 - plain[:-1])                             # one scale of 1 - t fixes t = 1
    torch.testing.assert_close(ratio[1:], torch.full_like(ratio[1:], float(ratio[-1])), atol=1e-12, rtol=0)
    assert (ours[1:] < ours[:-1]).all()


def test_shift_terminal_leaves_training_t_and_is_checked(tiny_cfg):
    x = torch.randn(16, 4, 8, 8)
    nets = [RecordT(), RecordT()]
    for net, obj in zip(nets, (RectifiedFlow(shift=3.0), RectifiedFlow(shift=3.0, shift_terminal=0.1))):
        torch.manual_seed(0)
        obj.loss(net, x, torch.zeros(16, dtype=torch.long))
    assert torch.equal(nets[0].t, nets[1].t)
    with pytest.raises(ShiftConfigError, match=r"diffusion.shift_terminal=1.5 is not allowed; allowed: null .* \(0, 1\)"):
        RectifiedFlow(shift_terminal=1.5)
    with pytest.raises(ConfigError, match="diffusion.shift_terminal"):
        check_train(tiny_cfg("diffusion=rf", "diffusion.shift_terminal=0"))
    assert check_train(compose_cfg("train", TINY + ["model=ltx_video"])).diffusion.shift_terminal == 0.1
    assert build_diffusion(compose_cfg("train", TINY + ["model=ltx_video"])["diffusion"]).shift_terminal == 0.1
    assert check_train(compose_cfg("train", TINY + ["model=qwen_image"])).diffusion.shift_terminal == 0.02
    assert check_train(compose_cfg("train", TINY + ["model=flux"])).diffusion.shift_terminal is None


def test_exported_scheduler_carries_the_shift_terminal():
    """scripts/export_pipeline's scheduler (tread/cli/diffusers_pipeline.py) is the run's: driven as LTXPipeline
    drives it, it gives our sampling grid."""
    from types import SimpleNamespace

    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift as ltx_shift

    from tread.cli.diffusers_pipeline import scheduler

    diffusion = check_train(compose_cfg("train", TINY + ["model=ltx_video"])).diffusion
    sched = scheduler(SimpleNamespace(diffusion=diffusion))
    assert sched.config.shift_terminal == 0.1
    dyn = diffusion.dynamic_shift
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=ltx_shift(64, dyn.base_seq_len, dyn.max_seq_len,
                                                                       dyn.base_shift, dyn.max_shift))
    ours = build_diffusion(diffusion.plain()).t_steps(8, latent_shape=(1, 128, 1, 16, 16))
    torch.testing.assert_close(ours.float(), sched.sigmas, atol=2.4e-7, rtol=0)
