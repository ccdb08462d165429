"""LTX-Video (diffusers LTXVideoTransformer3DModel) with TREAD routing: the proofs only LTX-Video has, for images
(T = 1) and video (T = 3), with per-sample and per-token (LTXImageToVideoPipeline) timesteps; the shared checks run
for it (image, video, per-token and frame-rate cases) in tests/test_families.py."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTXImageToVideoPipeline, LTXPipeline

import family_checks as fc
from test_families import SPAN
from tread.models.families import FamilyConfigError

FAMILY = "ltx_video"
PATCH1 = {"config": {"patch_size": 1}}      # the released models' packing (1x1x1 cells per token)
ALL_BLOCKS = [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_cond(model, batch: int = 3) -> dict:
    return fc.masked_text(model, batch=batch)


@pytest.mark.parametrize("patch,patch_t", [(1, 1), (2, 1), (2, 2)])
def test_pack_and_unpack_are_the_pipelines(patch, patch_t):
    model = fc.make(FAMILY, frames=4, config={"patch_size": patch, "patch_size_t": patch_t})
    x = torch.randn(2, 4, 4, 8, 8)
    tokens = model.pack(x)
    torch.testing.assert_close(tokens, LTXPipeline._pack_latents(x, patch, patch_t), rtol=0, atol=0)
    grid = model.grid_of(x)
    assert tokens.shape == (2, grid[0] * grid[1] * grid[2], 4 * patch_t * patch * patch)
    back = LTXPipeline._unpack_latents(tokens, *grid, patch, patch_t)
    torch.testing.assert_close(model.unpack(tokens, grid), back, rtol=0, atol=0)
    torch.testing.assert_close(back, x, rtol=0, atol=0)


def pipeline_call(cls, model, x, cond, *, frame_rate: int, steps: int = 2) -> dict:
    """Run diffusers' `cls` pipeline (the tiny transformer with our weights, LTX's scheduler config) on packed latents
    x and the text (no CFG, latents out), recording the transformer's first call: its kwargs and its output."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    pipe = cls(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
               transformer=model.pristine_transformer())
    seen: dict[str, Any] = {}

    def pre(_, args, kwargs):
        seen.setdefault("kwargs", {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    def post(_, args, kwargs, out):
        seen.setdefault("out", out[0].clone())

    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    pipe.transformer.register_forward_hook(post, with_kwargs=True)
    _, _, T, H, W = x.shape
    extra = {"image": None} if cls is LTXImageToVideoPipeline else {}
    with torch.no_grad():
        pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"], latents=model.pack(x),
             height=H * 32, width=W * 32, num_frames=(T - 1) * 8 + 1, frame_rate=frame_rate, guidance_scale=1.0,
             num_inference_steps=steps, output_type="latent", **extra)
    return seen


@pytest.mark.parametrize("frames", [1, 3], ids=["T1", "T3"])
@pytest.mark.parametrize("frame_rate", [25, 12])
def test_dense_equals_the_transformer_as_ltx_pipeline_calls_it(frames, frame_rate):
    """LTXPipeline.__call__ itself (packed latents, the T5 mask, sigma * 1000 timesteps, latent sizes and
    rope_interpolation_scale (8 / frame_rate, 32, 32)) feeds the transformer; our dense forward on the unpacked
    latents, that timestep and text equals what the transformer returned, unpacked."""
    model = fc.make(FAMILY, frames=frames, frame_rate=frame_rate, **PATCH1).eval()
    x, _, _ = fc.inputs(model, batch=2, frames=frames)
    y = torch.zeros(2, dtype=torch.long)        # no null label: the text stays as given
    cond = masked_cond(model, batch=2)
    seen = pipeline_call(LTXPipeline, model, x, cond, frame_rate=frame_rate)
    kw = seen["kwargs"]
    assert (kw["num_frames"], kw["height"], kw["width"]) == model.grid_of(x) == (frames, 8, 8)
    assert kw["rope_interpolation_scale"] == model.rope_interpolation_scale() == (8 / frame_rate, 32, 32)
    assert kw["timestep"].shape == (2,) and 0 < kw["timestep"][0] <= 1000
    torch.testing.assert_close(model.unpack(kw["hidden_states"], model.grid_of(x)), x, rtol=0, atol=0)
    with torch.no_grad():
        ours = model(x, kw["timestep"], y, cond={"text": kw["encoder_hidden_states"],
                                                 "text_mask": kw["encoder_attention_mask"]})
    torch.testing.assert_close(ours, model.unpack(seen["out"], model.grid_of(x)), rtol=1e-6, atol=1e-6)


def test_dense_equals_the_transformer_as_the_i2v_pipeline_calls_it():
    """LTXImageToVideoPipeline: per-token timesteps t * (1 - conditioning_mask), (B, N), the first latent frame's
    tokens at 0; our forward with that (B, N) noise level equals the transformer's output."""
    model = fc.make(FAMILY, frames=3, **PATCH1).eval()
    x, _, _ = fc.inputs(model, batch=2, frames=3)
    y = torch.zeros(2, dtype=torch.long)
    cond = masked_cond(model, batch=2)
    seen = pipeline_call(LTXImageToVideoPipeline, model, x, cond, frame_rate=25)
    t = seen["kwargs"]["timestep"]
    per_frame = model.num_tokens // 3
    assert t.shape == (2, model.num_tokens) and not t[:, :per_frame].any() and (t[:, per_frame:] > 0).all()
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        uniform = model(x, t.amax(1), y, cond=cond)
    torch.testing.assert_close(ours, model.unpack(seen["out"], model.grid_of(x)), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, uniform)    # the first frame's timestep 0 matters


def test_single_frame_image_latents_and_frame_rate():
    """Images (B, C, H, W) run as one frame (B, C, 1, H, W); one frame has the single temporal position 0, so the
    frame rate cannot change it, while at T = 3 it changes the temporal RoPE and the output."""
    x4 = torch.randn(2, 4, 8, 8)
    outs = {}
    for rate in (25, 12):
        model = fc.make(FAMILY, frame_rate=rate).eval()
        with torch.no_grad():
            image = model(x4, torch.tensor([300.0, 700.0]), torch.tensor([0, 1]))
            single = model(x4.unsqueeze(2), torch.tensor([300.0, 700.0]), torch.tensor([0, 1]))
        torch.testing.assert_close(image.unsqueeze(2), single, rtol=0, atol=0)
        assert torch.isfinite(image).all()
        video = fc.make(FAMILY, frames=3, frame_rate=rate).eval()
        x, t, y = fc.inputs(video, frames=3)
        with torch.no_grad():
            outs[rate] = (image, video(x, t, y))
    torch.testing.assert_close(outs[25][0], outs[12][0], rtol=0, atol=0)
    assert not torch.allclose(outs[25][1], outs[12][1])


def rope_of(tr, ids: torch.Tensor, grid, model) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' RoPE for the tokens `ids` (K,) alone, from their true (f, h, w) positions on the token grid, given
    to LTXVideoRotaryPosEmbed as video_coords (f * scale * patch_t, h * scale * patch, w * scale * patch)."""
    f, h, w = grid
    pt, p, _ = model.latent_patch()
    s = model.rope_interpolation_scale()
    pos = torch.stack([ids // (h * w), ids // w % h, ids % w]).float()                # (3, K)
    coords = torch.stack([pos[0] * s[0] * pt, pos[1] * s[1] * p, pos[2] * s[2] * p])[None]
    return tr.rope(torch.zeros(1, 1), video_coords=coords)                          # (1, K, D) each


@pytest.mark.parametrize("frames,per_token", [(1, False), (3, False), (1, True), (3, True)],
                         ids=["T1", "T3", "T1-per-token-t", "T3-per-token-t"])
@pytest.mark.parametrize("routes", [SPAN, ALL_BLOCKS], ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, frames, per_token):
    """3. Kept tokens after the route = diffusers' blocks (default LTXVideoAttnProcessor) run on the kept
    subsequence, per sample, with RoPE computed from the kept tokens' true (f, h, w) positions alone, the text
    projected with its mask and, for per-token timesteps, the modulation computed from their own timesteps."""
    r = fc.routed_run(FAMILY, routes, frames=frames, cond=masked_cond,
                      timesteps=fc.per_token_timesteps if per_token else None)
    model, t, seen, route, cond = r.model, r.t, r.dense, r.route, r.cond
    _, x_kept, ids, _ = r.scatter
    tr, grid = model.pristine_transformer(), model.token_grid
    start, end = route.start_layer_idx, route.end_layer_idx
    with torch.no_grad():
        for b in range(ids.shape[0]):
            if frames > 1:   # the kept set spans several frames, so the temporal positions are exercised
                assert len(set((ids[b] // (model.num_tokens // frames)).tolist())) > 1
            ctx = tr.caption_projection(cond["text"][b:b + 1])
            bias = (1 - cond["text_mask"][b:b + 1].float()) * -10000.0
            ts = t[b, ids[b]] if per_token else t[b:b + 1]
            temb = tr.time_embed(ts, batch_size=1, hidden_dtype=torch.float32)[0].view(1, -1, 6 * ctx.shape[-1])
            # projected for 1 sample here, for the whole batch in the model: other matmul shapes, float32 tolerance
            torch.testing.assert_close(seen[start][1][b:b + 1], ctx)
            rope = rope_of(tr, ids[b], grid, model)

            def blocks(h, temb=temb, rope=rope):
                for blk in tr.transformer_blocks[start:end + 1]:
                    h = blk(h, ctx, temb, rope, bias[:, None])
                return h

            h = seen[start][0][b:b + 1, ids[b]]                                 # dense route-start tokens, kept
            torch.testing.assert_close(x_kept[b:b + 1], blocks(h), rtol=1e-5, atol=1e-5)
            if b == 0:   # the check has teeth: the kept tokens at other positions (or timesteps) give other values
                assert not torch.allclose(x_kept[:1], blocks(h, rope=rope_of(tr, ids[b].flip(0), grid, model)),
                                          rtol=1e-3, atol=1e-3)
                if per_token:
                    flipped = tr.time_embed(ts.flip(0), batch_size=1, hidden_dtype=torch.float32)[0]
                    assert not torch.allclose(x_kept[:1], blocks(h, temb=flipped.view(1, -1, temb.shape[-1])),
                                              rtol=1e-3, atol=1e-3)


def test_ratio_zero_permuted_per_token_timesteps_equals_dense():
    """A permutation moves each token's own timestep modulation and RoPE rows with it."""
    model = fc.make(FAMILY, fc.RATIO_ZERO, frames=3)
    x, _, y = fc.inputs(model, frames=3)
    fc.check_ratio_zero_model(model, (x, fc.per_token_timesteps(model), y), cond=masked_cond(model))


def test_per_token_timesteps_of_the_wrong_length_are_refused():
    model = fc.make(FAMILY)
    x, _, y = fc.inputs(model, batch=2)
    with pytest.raises(FamilyConfigError, match="per-token timestep"):
        model(x, torch.zeros(2, model.num_tokens + 1), y)
