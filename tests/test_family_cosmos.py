"""Cosmos-Predict2 (diffusers CosmosTransformer3DModel) with TREAD routing: the proofs only Cosmos has (the shared
checks run for it, image, video and per-frame cases, in tests/test_families.py): the Predict2 pipelines' EDM
preconditioning is our velocity objective, per-frame timesteps, the kept-subsequence reference (check 3), fps RoPE,
the LoRA export in diffusers' Cosmos loaders, the T5 recipe of the pipelines."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from test_adapter_export import adapted
from test_families import SPAN
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.models.families import FamilyConfigError
from tread.checkpoint.save import DIFFUSERS_LORA_FILE, export_adapter

FAMILY = "cosmos"
VIDEO2WORLD = {"frames": 3, "frame_rate": 16, "expand_timesteps": True, "config": {"in_channels": 5}}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def per_frame(model, batch: int = 3, seed: int = 4) -> torch.Tensor:
    """(B, T) noise levels, a different one per latent frame."""
    return torch.rand(batch, model.frames, generator=torch.Generator().manual_seed(seed)) * 1000


def with_positions(model):
    """Give the learnable absolute embedding (zeros at init) values, so that it matters."""
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.transformer.learnable_pos_embed.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("frames", [1, 3])
def test_dense_per_frame_timesteps_equal_diffusers(frames):
    """A (B, T) noise level = diffusers' per-frame timestep (B, 1, T, 1, 1), as Cosmos2VideoToWorldPipeline feeds it."""
    model = fc.make(FAMILY, frames=frames).eval()
    x, _, y = fc.inputs(model, frames=frames)
    t = per_frame(model)
    with torch.no_grad():
        ours, ref = model(x, t, y), model.reference_forward(x, t, y)
        first = model(x, t[:, 0], y)             # every frame at the first frame's noise level, (B,)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours, first, rtol=0, atol=1e-6) is (frames == 1)   # the other frames' levels matter


@pytest.mark.parametrize("pipeline,kw", [("text2image", {"frames": 1}), ("video2world", VIDEO2WORLD)])
def test_pipeline_preconditioning_is_our_velocity(pipeline, kw):
    """The pipeline's step, written out from Cosmos2TextToImagePipeline / Cosmos2VideoToWorldPipeline.__call__ on EDM
    latents x_sigma = x0 + sigma eps: t = sigma / (sigma + 1), transformer(x_sigma * (1 - t), t, padding_mask zeros,
    [fps, condition_mask zeros, t per frame]), x0_hat = (1 - t) x_sigma - t F. Our model on the rectified-flow
    x_t = (1 - t) x0 + t eps at noise_level 1000 t returns F itself, and x_t - t F is the pipeline's x0_hat."""
    model = fc.make(FAMILY, **kw).eval()
    x0, _, y = fc.inputs(model, frames=kw.get("frames"))
    g = torch.Generator().manual_seed(3)
    eps, sigma = torch.randn(x0.shape, generator=g), torch.tensor([0.05, 1.7, 60.0])
    B, C, H, W = x0.shape[0], x0.shape[1], x0.shape[-2], x0.shape[-1]
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    x_sigma, t = x0 + s * eps, sigma / (sigma + 1)
    tr, text = model.pristine_transformer(), model.conditioning(y, None)["text"]
    call = dict(encoder_hidden_states=text, padding_mask=torch.zeros(1, 1, 8 * H, 8 * W), return_dict=False)
    if pipeline == "video2world":
        T = x0.shape[2]
        call.update(timestep=t.view(B, 1, 1, 1, 1).expand(-1, -1, T, -1, -1), fps=16,
                    condition_mask=torch.zeros(B, 1, T, H, W))
    else:
        call.update(timestep=t)
    tt = t.view_as(s)
    with torch.no_grad():
        F = tr(hidden_states=x_sigma * (1 - tt), **call)[0]
        x0_hat = (1 - tt) * x_sigma + (-tt) * F                      # c_skip * latents + c_out * F
        ours = model((1 - tt) * x0 + tt * eps, t * 1000, y)
    assert C == model.in_channels and tr.config.in_channels == C + (pipeline == "video2world")
    torch.testing.assert_close(ours, F, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((1 - tt) * x0 + tt * eps - tt * ours, x0_hat, rtol=1e-5, atol=1e-5)


def routed(model, timesteps=None, seed: int = 5) -> fc.RoutedRun:
    """fc.routed_run on a model built here (so its weights can be changed first)."""
    x, t, y = fc.inputs(model, frames=model.frames)
    t = timesteps(model) if timesteps is not None else t
    dense, _ = fc.block_inputs(model.eval(), x, t, y)
    with fc.capture_routes() as log, torch.no_grad(), fc.fixed_selection(model, fc.random_permutation(seed)):
        with torch.enable_grad():
            seen, _ = fc.block_inputs(model.train(), x, t, y)
    return fc.RoutedRun(model, x, t, y, None, dense, seen, log)


@pytest.mark.parametrize("frames,per_frame_t,learnable", [(1, False, False), (3, False, False), (3, True, False),
                                                          (1, True, True), (3, True, True)],
                         ids=["T1", "T3", "T3-per-frame-t", "T1-per-frame-t-pos", "T3-per-frame-t-pos"])
@pytest.mark.parametrize("routes", [SPAN, [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]],
                         ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, frames, per_frame_t, learnable):
    """3. Kept tokens after the route = diffusers' blocks (default CosmosAttnProcessor2_0) run on the kept subsequence,
    per sample, with the RoPE rows of their true (t, h, w) positions sliced from diffusers' (N, Dh) table, the
    modulation of their own frame's timestep and (learnable) their rows of the absolute embedding."""
    config = {"extra_pos_embed_type": "learnable"} if learnable else None
    model = fc.make(FAMILY, routes, frames=frames, frame_rate=16 if frames > 1 else None, config=config)
    r = routed(with_positions(model) if learnable else model, per_frame if per_frame_t else None)
    x, t, y, seen, route = r.x, r.t, r.y, r.dense, r.route
    _, x_kept, ids, _ = r.scatter
    tr = model.pristine_transformer()
    text = model.conditioning(y, None)["text"]
    x5 = x if x.dim() == 5 else x.unsqueeze(2)
    hw = model.num_tokens // frames
    blocks = tr.transformer_blocks[route.start_layer_idx:route.end_layer_idx + 1]
    with torch.no_grad():
        cos, sin = tr.rope(x5, fps=model.frame_rate)                            # (N, Dh): all positions
        pos = tr.learnable_pos_embed(x5)[:1] if learnable else None              # (1, N, D)
        for b in range(x.shape[0]):
            frame = ids[b] // hw                                                 # each kept token's latent frame
            if frames > 1:
                assert len(set(frame.tolist())) > 1
            if per_frame_t:
                temb, emb = tr.time_embed(x, t[b] / 1000)                        # (T, 3D), (T, D)
                temb, emb = temb[frame][None], emb[frame][None]                  # (1, K, .)
            else:
                temb, emb = tr.time_embed(x, t[b:b + 1] / 1000)                  # (1, 3D), (1, D)
            ctx = text[b:b + 1]
            torch.testing.assert_close(seen[route.start_layer_idx][1][b:b + 1], ctx, rtol=0, atol=0)
            rows = (cos[ids[b]], sin[ids[b]])
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]                  # dense route-start tokens, kept
            kept_pos = None if pos is None else pos[:, ids[b]]
            for blk in blocks:
                h = blk(h, ctx, emb, temb, rows, kept_pos)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if b == 0 and frames > 1:   # teeth: the first K positions' rows give other values
                h2 = seen[route.start_layer_idx][0][b:b + 1, ids[b]]
                for blk in blocks:
                    h2 = blk(h2, ctx, emb, temb, (cos[:len(ids[b])], sin[:len(ids[b])]), kept_pos)
                assert not torch.allclose(x_kept[b:b + 1], h2, rtol=1e-3, atol=1e-3)


def test_frame_rate_scales_temporal_rope_only_for_video():
    """model.frame_rate (the Video2World pipeline's fps) scales the temporal positions (t / fps * 24): a different
    output for T = 3, none for a single frame (T = 1: position 0), which runs like the Text2Image pipeline."""
    for frames, differs in ((3, True), (1, False)):
        plain, fps = (fc.make(FAMILY, frames=frames, frame_rate=rate).eval() for rate in (None, 16))
        x, t, y = fc.inputs(plain, frames=frames)
        with torch.no_grad():
            assert torch.allclose(plain(x, t, y), fps(x, t, y), rtol=0, atol=1e-6) is not differs
    with pytest.raises(FamilyConfigError, match="model.frame_rate=-2"):
        fc.make(FAMILY, frame_rate=-2)


def test_per_frame_noise_of_the_wrong_shape_is_refused():
    model = fc.make(FAMILY, frames=3)
    x, _, y = fc.inputs(model, batch=2, frames=3)
    with pytest.raises(FamilyConfigError, match=r"per-frame noise level must be \(B, T\) = \(2, 3\)"):
        model(x, torch.zeros(2, 4), y)


def test_masked_text_rows_are_zeroed():
    """Masked text rows are zeroed (the pipelines' _get_t5_prompt_embeds), on top of the shared text check."""
    model, x, t, y, cond, out = fc.check_text_conditioning(FAMILY, with_mask=True, frames=3)
    padded = {"text": cond["text"][:1] * cond["text_mask"][:1, :, None]}
    with torch.no_grad():
        torch.testing.assert_close(out[:1], model(x[:1], t[:1], y[:1], cond=padded), rtol=1e-6, atol=1e-6)


def tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
                            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


@pytest.mark.parametrize("adapter", ["lora", "lokr"])
def test_lora_export_loads_in_diffusers_cosmos_loaders(adapter, tmp_path):
    """The Predict2 pipelines have no load_lora_weights; the export loads (a) with diffusers' Cosmos LoRA loader
    (CosmosLoraLoaderMixin.load_lora_weights, on Cosmos2_5_PredictBasePipeline, the same transformer class) and
    (b) with load_lora_adapter on a Cosmos2TextToImagePipeline's transformer; both give our adapted model's output."""
    from diffusers import Cosmos2TextToImagePipeline, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline

    model = adapted(FAMILY, adapter, targets=LORA_TARGETS)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    parts = dict(text_encoder=None, tokenizer=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                 safety_checker=lambda *a, **k: None)
    t2i = Cosmos2TextToImagePipeline(**parts, transformer=base.pristine_transformer(), vae=None)
    v25 = Cosmos2_5_PredictBasePipeline(**parts, transformer=base.pristine_transformer(), vae=tiny_wan_vae())
    assert not hasattr(t2i, "load_lora_weights")
    x, noise, labels = fc.inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, noise, labels, transformer=t2i.transformer)
        t2i.transformer.load_lora_adapter(str(tmp_path / DIFFUSERS_LORA_FILE), prefix="transformer")
        v25.load_lora_weights(tmp_path)
        ours = model(x, noise, labels)
        theirs = [base.reference_forward(x, noise, labels, transformer=p.transformer) for p in (t2i, v25)]
    assert (ours - plain).abs().max() > 0.02            # the adapter matters ...
    for out in theirs:                                   # ... and diffusers applies it exactly
        torch.testing.assert_close(out, ours, atol=2e-5, rtol=1e-5)


def test_prompts_encode_as_the_pipelines_t5(tmp_path):
    """encode_prompts('cosmos') = Cosmos2TextToImagePipeline._get_t5_prompt_embeds (T5 with the attention mask,
    padding rows zeroed) on the same tiny T5, plus the tokenizer's mask."""
    from diffusers import Cosmos2TextToImagePipeline

    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path / "te"))
    prompts = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
    out = encode_prompts(FAMILY, enc, prompts, max_length=12)
    pipe = Cosmos2TextToImagePipeline(text_encoder=enc.models["text_encoder"], tokenizer=enc.tokenizers["tokenizer"],
                                      transformer=None, vae=None, scheduler=None, safety_checker=lambda *a, **k: None)
    with torch.no_grad():
        ref = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=12, device=torch.device("cpu"))
    torch.testing.assert_close(torch.from_numpy(out["text"]), ref.float(), rtol=1e-6, atol=1e-6)
    mask = torch.from_numpy(out["text_mask"])
    assert mask.dtype == torch.bool and mask.sum(1).tolist()[1] < mask.sum(1).tolist()[2] < 12
    assert (ref[~mask] == 0).all() and (ref[mask] != 0).any()
