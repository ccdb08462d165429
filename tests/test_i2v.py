"""Image-to-video conditioning frames (model.i2v "frames" mode, tread/models/families/first_frame.py): Wan 2.2 TI2V's
and LTX-Video's inputs as their diffusers image-to-video pipelines build them, the conditioning tokens never routed,
left out of the loss, and put back after sampling. (HunyuanVideo 1.5 conditions through channels:
tests/test_family_hunyuan_video.py.)"""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from conftest import TINY, compose_cfg
from tread.schema import ConfigError
from tread.diffusion import RectifiedFlow
from tread.models.families import FamilyConfigError
from tread.models.families.first_frame import condition_inputs, frame_loss_weight, restore_frames
from tread.sampling.generate import generate
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.training.step import reduce_loss

pytestmark = pytest.mark.usefixtures("one_thread")
ROUTE = [{"selection_ratio": 0.75, "start_layer_idx": 1, "end_layer_idx": -2}]


def clip_inputs(model, batch: int = 2, frames: int = 3):
    x, level, labels = fc.inputs(model, batch=batch, frames=frames)
    first = torch.randn(batch, model.in_channels, 1, *x.shape[-2:], generator=torch.Generator().manual_seed(9))
    return x, level, labels, first


def pipeline_inputs(model, x, level, first):
    """What the image-to-video pipelines (diffusers 0.42.1) feed the transformer at one step, written from their
    source. WanImageToVideoPipeline (expand_timesteps): latent_model_input = (1 - first_frame_mask) * condition +
    first_frame_mask * latents, timestep first_frame_mask[0][0][:, ::2, ::2] * t flattened (the mask is 0 on the first
    latent frame); LTXImageToVideoPipeline: the same latents (its conditioning_mask is 1 on the first frame) and
    timestep t * (1 - conditioning_mask) per packed token (2x2 cells: one token per 2x2 cells of a frame)."""
    mask = torch.ones_like(x)
    mask[:, :, :1] = 0
    condition = torch.cat([first, torch.zeros_like(x[:, :, 1:])], dim=2)
    latent_in = (1 - mask) * condition + mask * x
    per_token = torch.stack([(mask[b, 0][:, ::2, ::2] * level[b]).flatten() for b in range(x.shape[0])])
    return latent_in, per_token


@pytest.mark.parametrize("family", ["wan", "ltx_video"])
def test_i2v_forward_equals_diffusers_on_the_pipeline_inputs(family):
    model = fc.make(family, frames=3, i2v=True).eval()
    x, level, labels, first = clip_inputs(model)
    latent_in, per_token = pipeline_inputs(model, x, level, first)
    with torch.no_grad():
        ours = model(x, level, labels, cond={"first_frame": first})
        ref = model.reference_forward(latent_in, per_token, labels)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, model(x, level, labels))     # the given frame matters


def test_i2v_mask_conditions_only_the_chosen_samples():
    model = fc.make("wan", frames=3, i2v=True).eval()
    x, level, labels, first = clip_inputs(model)
    use = torch.tensor([True, False])
    with torch.no_grad():
        mixed = model(x, level, labels, cond={"first_frame": first, "i2v": use})
        given = model(x, level, labels, cond={"first_frame": first})
        plain = model(x, level, labels)
    torch.testing.assert_close(mixed[0], given[0])
    torch.testing.assert_close(mixed[1], plain[1])


def test_routes_never_drop_the_conditioning_tokens():
    model = fc.make("wan", ROUTE, frames=3, i2v=True).train()
    x, level, labels, first = clip_inputs(model)
    per_frame = model.num_tokens // 3
    for seed in range(3):
        model.routing.router.manual_seed(seed)
        with fc.capture_routes() as log:
            model(x, level, labels, cond={"first_frame": first})
        [(_, _, ids, _)] = log["scatter"]
        assert ids.shape[1] < model.num_tokens
        assert all(set(range(per_frame)) <= set(row.tolist()) for row in ids)


def test_ratio_zero_with_given_frames_equals_dense():
    routed = fc.make("wan", [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}], frames=3,
                     i2v=True)
    x, level, labels, first = clip_inputs(routed)
    with torch.no_grad(), fc.fixed_selection(routed, fc.random_permutation(3)) as calls:
        with torch.enable_grad():
            out = routed.train()(x, level, labels, cond={"first_frame": first})
        dense = routed.eval()(x, level, labels, cond={"first_frame": first})
    assert calls
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_given_frames_are_left_out_of_the_loss():
    loss = torch.rand(2, 4, 3, 8, 8)
    cond = {"first_frame": torch.zeros(2, 4, 1, 8, 8), "i2v": torch.tensor([True, False])}
    got = reduce_loss(loss, None, frame_loss_weight(loss, cond))
    want = torch.cat([loss[0, :, 1:].flatten(), loss[1].flatten()]).mean()
    torch.testing.assert_close(got, want)


def test_sampling_puts_the_given_frames_back():
    model = fc.make("wan", frames=3, i2v=True).eval()
    diffusion = RectifiedFlow(num_steps=3)
    net = diffusion.precondition(model)
    first = torch.randn(2, model.in_channels, 1, 8, 8)
    [(_, _, x)] = list(generate(net, diffusion, [0, 1], (model.in_channels, 3, 8, 8), model.num_classes,
                                torch.device("cpu"), batch_size=2, cond_fn=lambda s: {"first_frame": first}))
    assert torch.equal(x[:, :, :1], first) and not torch.equal(x[:, :, 1:2], torch.zeros_like(x[:, :, 1:2]))
    torch.testing.assert_close(restore_frames(x, first, torch.tensor([True, True])), x)


def test_conditioning_frames_must_fit_the_latents():
    x = torch.zeros(1, 4, 3, 8, 8)
    with pytest.raises(ValueError, match="do not fit latents"):
        condition_inputs(x, torch.ones(1), torch.zeros(1, 4, 1, 4, 4), torch.tensor([True]), 16)


def test_i2v_needs_a_family_that_takes_first_frames():
    with pytest.raises(FamilyConfigError, match="model.i2v=true"):
        fc.make("flux", i2v=True)


def i2v_cfg(tmp_path, first_frame: bool, *extra: str):
    return compose_cfg("train", TINY + [
        f"paths.cache_dir={tmp_path / 'cache'}", "model=wan", "data=toy_clips", "data.builtin_args.frames=3",
        "data.builtin_args.num_per_class=2", f"data.builtin_args.first_frame={str(first_frame).lower()}",
        "model.i2v=true", "train.max_steps=2", "train.batch_size=4", "eval.every_steps=0", "eval.at_end=false",
        *extra])


@pytest.mark.slow
def test_training_on_clips_with_first_frames(tmp_path):
    """model.i2v with train.i2v_probability 0.5 trains on the built-in clips' first frames: finite losses."""
    train(i2v_cfg(tmp_path, True, "train.i2v_probability=0.5"), tmp_path / "run")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r.get("type") == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_i2v_without_first_frames_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="model.i2v=true but the data .* has no first-frame latents"):
        train(i2v_cfg(tmp_path, False), tmp_path / "run")
