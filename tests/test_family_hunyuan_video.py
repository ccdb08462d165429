"""HunyuanVideo 1.5 (diffusers HunyuanVideo15Transformer3DModel) with TREAD routing: the proofs only this family has,
for images (T = 1) and video (T = 3): the inputs HunyuanVideo15Pipeline itself builds, the kept subsequence, the I2V
condition channels and SigLIP stream, the ByT5 glyph stream, the LoRA export in the pipeline's transformer. The
shared checks run for it in tests/test_families.py."""
from __future__ import annotations

import inspect

import diffusers
import pytest
import torch

import family_checks as fc
from test_adapter_export import adapted
from test_families import SPAN
from tread.models.families import FamilyConfigError
from tread.checkpoint.save import DIFFUSERS_LORA_FILE, export_adapter

FAMILY = "hunyuan_video"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def glyph(model, batch: int = 3, seed: int = 6) -> dict:
    """ByT5 glyph embeddings with a keep-mask of a different length per sample (one sample without glyph text)."""
    g = torch.Generator().manual_seed(seed)
    width = model.transformer.config.text_embed_2_dim
    mask = torch.arange(5)[None, :] < torch.tensor([2, 0, 5][:batch])[:, None]
    return {"glyph": torch.randn(batch, 5, width, generator=g), "glyph_mask": mask}


def t2v_pipeline(model) -> diffusers.HunyuanVideo15Pipeline:
    """HunyuanVideo15Pipeline around a pristine copy of the model's transformer (tiny VAE, no text encoders: the
    prompts come as embeddings), scheduler shift 5.0 (the 480p pipelines'), no CFG."""
    vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=model.in_channels, block_out_channels=(8,) * 5,
                                                layers_per_block=1)
    cls = diffusers.HunyuanVideo15Pipeline
    parts = {k: None for k in inspect.signature(cls.__init__).parameters if k != "self"}
    pipe = cls(**{**parts, "vae": vae, "transformer": model.pristine_transformer(),
                  "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
                  "guider": diffusers.ClassifierFreeGuidance(guidance_scale=1.0)})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("with_glyph", [False, True], ids=["no-glyph", "glyph"])
def test_dense_equals_what_the_pipeline_feeds_its_transformer(frames, with_glyph):
    """Two steps of HunyuanVideo15Pipeline (prompt embeddings given): every transformer call it makes is recorded,
    and our model on the same latents, timestep and text gives the same prediction. Without glyph text the pipeline
    passes 256 zero ByT5 rows (mask 0) and 729 zero SigLIP rows, which our model leaves out."""
    model = fc.make(FAMILY, frames=frames).eval()
    x, _, y = fc.inputs(model, batch=3, frames=frames)
    text = fc.masked_text(model)
    gl = glyph(model) if with_glyph else {
        "glyph": torch.zeros(3, 256, model.transformer.config.text_embed_2_dim),
        "glyph_mask": torch.zeros(3, 256, dtype=torch.long)}
    pipe, calls = t2v_pipeline(model), []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True)
    with torch.no_grad():
        pipe(prompt_embeds=text["text"], prompt_embeds_mask=text["text_mask"], prompt_embeds_2=gl["glyph"],
             prompt_embeds_mask_2=gl["glyph_mask"], latents=x, num_inference_steps=2, output_type="latent")
        assert len(calls) == 2 and calls[1][0]["timestep"][0] < calls[0][0]["timestep"][0] <= 1000
        for kw, theirs in calls:
            latents, t = kw["hidden_states"][:, :model.in_channels], kw["timestep"]
            assert kw["hidden_states"].shape[1] == 2 * model.in_channels + 1     # [latents, zeros, zero mask]
            assert not kw["hidden_states"][:, model.in_channels:].any()
            assert kw["image_embeds"].shape == (3, 729, 32) and not kw["image_embeds"].any()
            cond = {**text, **gl} if with_glyph else text
            ours = model(latents, t, y, cond=cond)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(calls[0][1], calls[1][1])


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("routes", [SPAN, [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]],
                         ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, frames):
    """3. Kept tokens after the route = diffusers' blocks (default HunyuanVideo15AttnProcessor2_0) run per sample on
    the kept subsequence with the RoPE rows of their true (t, h, w) positions sliced from diffusers' full table, the
    per-sample temb, and the text keep-mask reordered valid-first as diffusers' forward does."""
    r = fc.routed_run(FAMILY, routes, frames=frames, cond=fc.masked_text)
    model, x, t, seen, route, cond = r.model, r.x, r.t, r.dense, r.route, r.cond
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    x5 = x if x.dim() == 5 else x.unsqueeze(2)
    pipe_in = torch.cat([x5, torch.zeros_like(x5), torch.zeros_like(x5[:, :1])], dim=1)
    with torch.no_grad():
        cos, sin = ref.rope(pipe_in)                                            # (N, Dh): every position
        assert cos.shape[0] == model.num_tokens
        refined = ref.context_embedder(cond["text"], t, cond["text_mask"]) + ref.cond_type_embed.weight[0]
        for b in range(x.shape[0]):
            m = cond["text_mask"][b]
            if frames > 1:   # the kept set spans several frames, so the temporal positions are exercised
                assert len(set((ids[b] // (model.num_tokens // frames)).tolist())) > 1
            ctx = seen[route.start_layer_idx][1][b:b + 1]
            if route.start_layer_idx == 0:   # the context diffusers builds: valid text rows first, then zeros
                torch.testing.assert_close(ctx[0, :int(m.sum())], refined[b, m], rtol=0, atol=0)
                assert not ctx[0, int(m.sum()):].any()
            mask = torch.cat([m[m], m[~m]])[None]                               # diffusers' reordered mask
            temb = ref.time_embed(t[b:b + 1])
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]                 # dense route-start tokens, kept
            for blk in ref.transformer_blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                h, ctx = blk(h, ctx, temb, mask, (cos[ids[b]], sin[ids[b]]))
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)


def i2v_cond(model, x, seed: int = 8) -> dict:
    """Text + glyph + the I2V inputs: the first frame's latents and SigLIP embeddings (as the data would bring)."""
    g = torch.Generator().manual_seed(seed)
    B, C, _, H, W = x.shape
    return {**fc.masked_text(model), **glyph(model), "first_frame": torch.randn(B, C, 1, H, W, generator=g),
            "image_embeds": torch.randn(B, 7, model.transformer.config.image_embed_dim, generator=g)}


def test_image_to_video_inputs_equal_diffusers_and_route():
    """cond["first_frame"] gives the I2V pipeline's [latents, image latents at frame 0, mask 1 at frame 0] and
    cond["image_embeds"] the SigLIP stream: dense == diffusers, both matter, cond["i2v"] (B,) picks the conditioned
    samples (the others as text-to-video), a permuted ratio-0 route == dense."""
    model = fc.make(FAMILY, frames=3).eval()
    x, t, y = fc.inputs(model, frames=3)
    cond = i2v_cond(model, x)
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond=cond), rtol=1e-5, atol=1e-5)
        for key in ("first_frame", "image_embeds", "glyph"):
            assert not torch.allclose(ours, model(x, t, y, cond={k: v for k, v in cond.items() if k != key}))
        zero_image = {**cond, "image_embeds": torch.zeros_like(cond["image_embeds"])}   # diffusers: T2V, masked
        no_image = {k: v for k, v in cond.items() if k != "image_embeds"}
        torch.testing.assert_close(model(x, t, y, cond=zero_image), model(x, t, y, cond=no_image), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(x, t, y, cond=zero_image), model.reference_forward(x, t, y, cond=zero_image),
                                   rtol=1e-5, atol=1e-5)
        some = {**cond, "i2v": torch.tensor([True, False, True])}         # sample 1 text-to-video
        text_only = {k: v for k, v in cond.items() if k not in ("first_frame", "image_embeds")}   # the T2V inputs
        mixed, t2v = model(x, t, y, cond=some), model(x, t, y, cond=text_only)
        torch.testing.assert_close(mixed[1], t2v[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mixed[::2], ours[::2], rtol=1e-6, atol=1e-6)
        # diffusers masks the image rows only when the whole batch's are zero, so its mixed batch still feeds sample
        # 1 the image: the conditioned samples against it, sample 1 against diffusers' text-to-video call alone
        torch.testing.assert_close(mixed[::2], model.reference_forward(x, t, y, cond=some)[::2], rtol=1e-5, atol=1e-5)
        alone = {k: v[1:2] for k, v in text_only.items()}
        torch.testing.assert_close(mixed[1:2], model.reference_forward(x[1:2], t[1:2], y[1:2], cond=alone),
                                   rtol=1e-5, atol=1e-5)
    routed = fc.make(FAMILY, fc.RATIO_ZERO, frames=3)
    fc.check_ratio_zero_model(routed, fc.inputs(routed, frames=3), cond=i2v_cond(routed, x))


def test_null_label_drops_the_glyph_stream():
    """The null label (CFG) zeroes the text and masks the glyph rows out, as the pipeline's glyph-less negative
    prompt gives them: the same as no glyph data at all; the I2V inputs stay."""
    model = fc.make(FAMILY).eval()
    x, t, _ = fc.inputs(model)
    y = torch.full((3,), model.num_classes)
    text = fc.masked_text(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond={**text, **glyph(model)}), model(x, t, y, cond=text),
                                   rtol=1e-6, atol=1e-6)


def test_single_frame_positions_are_the_first_frame_of_a_video():
    """T = 1 (images, (B, C, H, W) or (B, C, 1, H, W)): RoPE rows are the frame-0 rows of a video's table and the
    model runs in both layouts alike."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    tr = model.transformer
    one, three = tr.rope(x.unsqueeze(2)), tr.rope(x.unsqueeze(2).expand(-1, -1, 3, -1, -1))
    n = one[0].shape[0]
    assert torch.equal(one[0], three[0][:n]) and torch.equal(one[1], three[1][:n])
    assert not torch.equal(three[0][:n], three[0][n:2 * n])          # frame 1 has other temporal rows
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), model(x.unsqueeze(2), t, y).squeeze(2), rtol=0, atol=0)


def test_bad_inputs_are_refused():
    model = fc.make(FAMILY, frames=3)
    x, t, y = fc.inputs(model, batch=2, frames=3)
    with pytest.raises(FamilyConfigError, match="per sample: the timestep must be"):
        model(x, torch.zeros(2, model.num_tokens), y)
    with pytest.raises(FamilyConfigError, match=r"cond\['first_frame'\] has shape \[2, 4, 1, 4, 4\]"):
        model(x, t, y, cond={**fc.masked_text(model, batch=2), "first_frame": torch.zeros(2, 4, 1, 4, 4)})


def test_lora_export_loads_in_the_pipeline_transformer(tmp_path):
    """HunyuanVideo15Pipeline has no load_lora_weights (no LoRA loader mixin in diffusers 0.42.1): its transformer's
    own load_lora_adapter reads our exported file, and the pipeline's transformer then computes what our model with
    the adapter computes."""
    model = adapted(FAMILY, "lora", targets=LORA_TARGETS)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    pipe = t2v_pipeline(base)
    x, t, y = fc.inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, t, y, transformer=pipe.transformer)
        pipe.transformer.load_lora_adapter(tmp_path / DIFFUSERS_LORA_FILE, prefix="transformer")
        ours = model(x, t, y)
        theirs = base.reference_forward(x, t, y, transformer=pipe.transformer)
    assert (ours - plain).abs().max() > 0.02            # the adapter matters ...
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)   # ... and the pipeline's transformer applies it


def test_tiny_text_encoders_give_both_text_streams(tmp_path):
    """save_tiny_text_encoders + HunyuanVideo15Pipeline.encode_prompt (via encode_via_pipeline): the 108-token
    template prefix is dropped exactly (a prompt's mask counts its words + the 5-token assistant suffix), quoted text
    gives ByT5 glyph rows (none without quotes), and the model takes both streams (== diffusers)."""
    from tread.encoders.text import load_text_encoders
    from tread.encoders.text_families import FAMILIES
    from tread.encoders.text_pipelines import encode_via_pipeline
    from tread.encoders.tiny_text import save_tiny_text_encoders

    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path))
    out = encode_via_pipeline(FAMILY, FAMILIES[FAMILY], enc.models, enc.tokenizers,
                              ["a cat", 'a sign "hi"', "a red disc on a tree"], 12, torch.device("cpu"))
    assert out["text"].shape == (3, 12, 32) and out["glyph"].shape == (3, 256, 32)
    assert out["text_mask"].sum(1).tolist()[::2] == [2 + 5, 6 + 5]
    assert out["glyph_mask"].sum(1).tolist()[0] == 0 < out["glyph_mask"].sum(1).tolist()[1]
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = {k: v.float() if k in ("text", "glyph") else v for k, v in out.items()}
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-5, atol=1e-5)
