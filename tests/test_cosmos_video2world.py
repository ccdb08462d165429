"""Cosmos-Predict2 Video2World conditioning frames (model.i2v on the Video2World geometry, tread/models/families/cosmos.py):
our forward equals diffusers' transformer on exactly the inputs Cosmos2VideoToWorldPipeline builds at one step (clean
first-frame latents in place, per-frame timesteps with t_conditioning on the given frame, the condition-mask channel
1 there); the given tokens are force-kept and never routed; ratio 0 equals dense; the T2I geometry refuses model.i2v;
a two-step run on clips with first frames."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from conftest import TINY, compose_cfg
from tread.data import Bucket, LatentDataset
from tread.data.builtin.toy_clips import write_clip_files
from tread.cli.precompute import main as precompute
from tread.models.families import FamilyConfigError
from tread.models.families.cosmos import SIGMA_CONDITIONING
from tread.training.loop import train
from test_video_vae import tiny_wan

pytestmark = pytest.mark.usefixtures("one_thread")
V2W = {"frames": 3, "i2v": True, "config": {"in_channels": 5}}      # 4 latent channels + the condition mask
ROUTE = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]


def pipeline_step(model, x, level, first, use):
    """Cosmos2VideoToWorldPipeline (diffusers 0.42.1) at one step, written from its source: cond_indicator 1 on the
    first latent frame; hidden_states = cond_indicator * conditioning_latents + (1 - cond_indicator) * latents * c_in
    (our x_t is latents * c_in); timestep (B, 1, T, 1, 1) = cond_indicator * t_conditioning + (1 - cond_indicator) *
    t, t_conditioning = sigma_conditioning / (sigma_conditioning + 1); condition_mask = cond_indicator; a zero
    padding mask. Samples with use=False get the text-to-world inputs (no indicator)."""
    B, C, T, H, W = x.shape
    ind = torch.zeros(B, 1, T, 1, 1)
    ind[:, :, :1] = use.float().view(B, 1, 1, 1, 1)
    cond_latents = torch.cat([first, torch.zeros_like(x[:, :, 1:])], dim=2)
    hidden = ind * cond_latents + (1 - ind) * x
    t = (level / 1000).view(B, 1, 1, 1, 1).expand(B, 1, T, 1, 1)
    t_cond = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1)
    timestep = ind * t_cond + (1 - ind) * t
    text = model.conditioning(torch.zeros(B, dtype=torch.long), None)["text"]
    with torch.no_grad():
        return model.pristine_transformer()(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                                            fps=None, condition_mask=ind.expand(B, 1, T, H, W),
                                            padding_mask=torch.zeros(1, 1, H * 8, W * 8), return_dict=False)[0]


def test_forward_equals_diffusers_on_the_video2world_pipeline_inputs():
    model = fc.make("cosmos", **V2W).eval()
    x, level, _ = fc.inputs(model, batch=2, frames=3)
    first = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(9))
    labels = torch.zeros(2, dtype=torch.long)
    for use in (torch.tensor([True, True]), torch.tensor([True, False])):
        with torch.no_grad():
            ours = model(x, level, labels, cond={"first_frame": first, "i2v": use})
        torch.testing.assert_close(ours, pipeline_step(model, x, level, first, use), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = model(x, level, labels)
    torch.testing.assert_close(plain, pipeline_step(model, x, level, first, torch.tensor([False, False])),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours[0], plain[0], atol=1e-4)          # the given frame and its mask matter


def test_given_tokens_are_force_kept_and_ratio_zero_equals_dense():
    model = fc.make("cosmos", ROUTE, **V2W).train()
    x, level, _ = fc.inputs(model, batch=2, frames=3)
    first = torch.randn(2, 4, 1, 8, 8)
    cond = {"first_frame": first}
    per_frame = model.num_tokens // 3
    with fc.capture_routes() as log:
        model(x, level, torch.zeros(2, dtype=torch.long), cond=cond)
    (_, _, ids, _), = log["scatter"]
    assert all(set(range(per_frame)) <= set(ids[b].tolist()) for b in range(2))   # frame 0's tokens all kept
    zero = fc.make("cosmos", fc.RATIO_ZERO, **V2W)
    fc.check_ratio_zero_model(zero, (x, level, torch.zeros(2, dtype=torch.long)), cond=cond)


def test_text2image_geometry_refuses_i2v():
    with pytest.raises(FamilyConfigError, match=r"model.i2v=true needs the Video2World geometry.*allowed: 5"):
        fc.make("cosmos", frames=3, i2v=True)


@pytest.mark.slow
def test_clips_with_first_frames_train(tmp_path, cache_dir):
    write_clip_files(tmp_path / "clips", [Bucket(32, 32, 9)], num_per_class=1, captions=False)
    tiny_wan().save_pretrained(tmp_path / "vae")
    precompute(["--videos", str(tmp_path / "clips"), "--out", str(tmp_path / "data"), "--vae", str(tmp_path / "vae"),
                "--frames", "9", "--resolution", "32", "--device", "cpu", "--workers", "0", "--first-frame"])
    ds = LatentDataset(tmp_path / "data")
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={cache_dir}", "model=cosmos", "data=latents", f"data.path={ds.root}",
        f"data.channels={ds.shape[0]}", "data.resolution=8", f"data.frames={ds.shape[1]}", "data.num_classes=10",
        f"model.config={{in_channels: {ds.shape[0] + 1}}}", "model.i2v=true", "train.i2v_probability=0.5",
        "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 5}]", "train.max_steps=2",
        "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, tmp_path / "run")
