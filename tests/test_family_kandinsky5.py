"""Kandinsky 5.0 (diffusers Kandinsky5Transformer3DModel) with TREAD routing: the proofs only this family has, for
images (T = 1) and video (T = 3): the inputs Kandinsky5T2VPipeline / Kandinsky5T2IPipeline themselves feed, the kept
subsequence with true 3-D RoPE rows, the never-routed text stream (encoder blocks + mask), dense attention for NABLA
configs, the prompts through the pipeline's encode_prompt, the LoRA export in the pipeline, a quantized base, the clip
path. The shared checks run for it in tests/test_families.py."""
from __future__ import annotations

import inspect

import diffusers
import pytest
import torch

import family_checks as fc
from test_families import SPAN, TWO_ROUTES
from tread.models.families import FamilyConfigError

FAMILY = "kandinsky5"
BUILD = fc.make   # diffusers' own init (the autouse fixture below makes fc.make's models lively)
# LoRA targets: attention and the visual modulations (at diffusers' zero init the gates alone make a block count)
TARGETS = ["to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer",
           "visual_modulation.out_layer"]

pytestmark = pytest.mark.usefixtures("one_thread")
MODULATION = ("text_modulation", "visual_modulation", "out_layer.modulation")


def lively(model, seed: int = 0, std: float = 0.3):
    """diffusers zero-initialises every Kandinsky5Modulation (adaLN-zero: each block starts as the identity, its
    gates 0), which would make these proofs blind to attention and RoPE: give the modulations random weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if any(m in name for m in MODULATION):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@pytest.fixture(autouse=True)
def live_gates(monkeypatch):
    """Every model this file builds (fc.make, also inside fc.routed_run and the fc.check_* helpers) is lively."""
    real = fc.make
    monkeypatch.setattr(fc, "make", lambda *a, **kw: lively(real(*a, **kw)))


def pooled_text(model, batch: int = 3, seed: int = 3) -> dict:
    """The data's text: Qwen rows with a keep-mask of a different length per sample, and CLIP pooled embeddings."""
    g = torch.Generator().manual_seed(seed)
    return {**fc.masked_text(model, batch=batch), "pooled": torch.randn(batch, model.pooled_dim, generator=g)}


def pipeline(model, cls=diffusers.Kandinsky5T2VPipeline):
    """The pipeline around a pristine copy of the model's transformer (no VAE, no text encoders: prompts come as
    embeddings)."""
    parts = {k: None for k in inspect.signature(cls.__init__).parameters if k != "self"}
    pipe = cls(**{**parts, "transformer": model.pristine_transformer(),
                  "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)})
    pipe.set_progress_bar_config(disable=True)
    pipe.resolutions = [(64, 64)]   # the T2I pipeline snaps other sizes to its 1024-px list; the tiny data is 64 px
    return pipe


@pytest.mark.parametrize("frames, cls, config", [
    (1, diffusers.Kandinsky5T2VPipeline, {}), (3, diffusers.Kandinsky5T2VPipeline, {}),
    (1, diffusers.Kandinsky5T2IPipeline, {"visual_cond": False})], ids=["t2v-T1", "t2v-T3", "t2i"])
def test_dense_equals_what_the_pipeline_feeds_its_transformer(frames, cls, config):
    """Two steps of the pipeline (prompt embeddings given, no CFG): every transformer call is recorded, and our model
    on the same latents, timestep (sigma * 1000), Qwen rows and CLIP pooled gives the same prediction. The T2V
    pipeline feeds [latents, zero condition, zero mask] channels (visual_cond) and its RoPE scale (1, 3.16, 3.16)
    at 64 px; the T2I one plain latents and (1, 1, 1)."""
    model = fc.make(FAMILY, frames=frames, config=config).eval()
    x, _, _ = fc.inputs(model, batch=2, frames=frames)
    y = torch.zeros(2, dtype=torch.long)                      # not the null label: that would drop the text (CFG)
    text = pooled_text(model, batch=2)
    rows = text["text"][:, :4]                                # unpadded prompts of one length (cu_seqlens 0, 4, 8)
    pipe, calls = pipeline(model, cls), []
    keep = lambda kw: {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}   # the pipeline steps in place
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((keep(kw), out.sample)), with_kwargs=True)
    latents = model._channels_last(x.unsqueeze(2) if x.dim() == 4 else x)
    video = {"num_frames": 4 * (frames - 1) + 1} if cls is diffusers.Kandinsky5T2VPipeline else {}
    with torch.no_grad():
        pipe(prompt_embeds_qwen=rows, prompt_embeds_clip=text["pooled"], prompt_cu_seqlens=torch.tensor([0, 4, 8]),
             latents=latents, height=8 * x.shape[-2], width=8 * x.shape[-1], num_inference_steps=2,
             guidance_scale=1.0, output_type="latent", **video)
        assert len(calls) == 2 and calls[1][0]["timestep"][0] < calls[0][0]["timestep"][0] <= 1000
        for kw, theirs in calls:
            assert tuple(kw["scale_factor"]) == model.rope_scale(model.grid_of(x)) and kw["sparse_params"] is None
            xt = kw["hidden_states"][..., :model.in_channels].permute(0, 4, 1, 2, 3)
            ours = model(xt if x.dim() == 5 else xt.squeeze(2), kw["timestep"], y, cond={"text": rows,
                                                                                      "pooled": text["pooled"]})
            torch.testing.assert_close(ours, model.from_model_layout(theirs.permute(0, 4, 1, 2, 3), x),
                                       rtol=1e-5, atol=1e-5)
    assert not torch.allclose(calls[0][1], calls[1][1])


def reference_context(ref, text: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
    """diffusers' text stream for one unpadded prompt (1, L, D_text): text_embeddings, then the encoder blocks with
    the 1-D text RoPE rows 0..L-1 (the pipeline's text_rope_pos)."""
    rope = ref.text_rope_embeddings(torch.arange(text.shape[1])).unsqueeze(0)
    ctx = ref.text_embeddings(text)
    for block in ref.text_transformer_blocks:
        ctx = block(ctx, time, rope)
    return ctx


@pytest.mark.parametrize("frames", [1, 3])
def test_kept_tokens_equal_blocks_on_subsequence(frames, no_bf16_rounding):
    """3. Kept tokens after the route = diffusers' visual blocks (default Kandinsky5AttnProcessor) run per sample on
    the kept subsequence with the 3-D RoPE rows of their true (t, h, w) positions taken from diffusers' full table
    (raster order, as its dense forward flattens), the per-sample time + pooled embedding, and the text stream of
    the unpadded prompt; with the rows of positions 0..K-1 instead it differs (the check has teeth)."""
    r = fc.routed_run(FAMILY, SPAN, frames=frames, cond=pooled_text)
    model, x, t, seen, route, cond = r.model, r.x, r.t, r.dense, r.route, r.cond
    _, x_kept, ids, _ = r.scatter
    ref, grid = model.pristine_transformer(), model.grid_of(x)
    with torch.no_grad():
        time = ref.time_embeddings(t) + ref.pooled_text_embeddings(cond["pooled"])
        rope = ref.visual_rope_embeddings((x.shape[0], *grid), [torch.arange(n) for n in grid],
                                          model.rope_scale(grid)).flatten(1, 3)            # (B, N, 1, Dh/2, 2, 2)
        for b in range(x.shape[0]):
            if frames > 1:   # the kept set spans several frames, so the temporal positions are exercised
                assert len(set((ids[b] // (grid[1] * grid[2])).tolist())) > 1
            ctx = reference_context(ref, cond["text"][b:b + 1, cond["text_mask"][b]], time[b:b + 1])
            blocks = ref.visual_transformer_blocks[route.start_layer_idx:route.end_layer_idx + 1]

            def run(rows):
                h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]                        # route-start, kept
                for blk in blocks:
                    h = blk(h, ctx, time[b:b + 1], rows, None)
                return h

            torch.testing.assert_close(x_kept[b:b + 1], run(rope[b:b + 1, ids[b]]), rtol=1e-5, atol=1e-5)
            wrong = rope[b:b + 1, :ids.shape[1]]
            assert not torch.allclose(x_kept[b:b + 1], run(wrong), rtol=1e-3, atol=1e-3)


def test_text_stream_is_never_routed_and_masked():
    """The text runs through its own encoder blocks before the visual ones and is never routed: the context
    entering every visual block is the same tensor in the dense and the routed forward; padded rows do not matter
    (any values there give the same output), and the mask does (without it the padding is attended)."""
    r = fc.routed_run(FAMILY, TWO_ROUTES, frames=3, cond=pooled_text)
    for (_, c_dense), (_, c_routed) in zip(r.dense, r.routed):
        assert torch.equal(c_dense, c_routed) and torch.equal(c_dense, r.dense[0][1])
    model, x, t, y, cond = r.model.eval(), r.x, r.t, r.y, r.cond
    noisy = {**cond, "text": torch.where(cond["text_mask"][..., None], cond["text"], torch.randn_like(cond["text"]))}
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(model(x, t, y, cond=noisy), ours, rtol=1e-6, atol=1e-6)
        unmasked = {k: v for k, v in cond.items() if k != "text_mask"}
        assert not torch.allclose(model(x, t, y, cond=unmasked), ours, rtol=1e-3, atol=1e-3)


def test_nabla_config_runs_dense_attention():
    """A NABLA checkpoint's config (attention_type 'nabla', the 10 s / Pro models) builds and runs dense attention,
    as diffusers does with sparse_params=None: NABLA's block mask is computed over 64-token blocks of the full grid
    in 8x8 fractal order (fractal_flatten), which a routed subset of tokens does not form."""
    nabla = dict(attention_type="nabla", attention_P=0.9, attention_wT=11, attention_wW=3, attention_wH=3,
                 attention_add_sta=True, attention_method="topcdf")
    model = fc.make(FAMILY, frames=3, config=nabla).eval()
    x, t, y = fc.inputs(model, frames=3)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), model.reference_forward(x, t, y), rtol=1e-6, atol=1e-6)


def test_rope_scale_follows_the_pipelines():
    """T2I geometry (visual_cond false): (1, 1, 1); T2V / I2V geometry: (1, 2, 2) when both pixel sides are in
    480..854 (latents x 8), else (1, 3.16, 3.16) (Kandinsky5T2VPipeline._get_scale_factor)."""
    video, image = fc.make(FAMILY), fc.make(FAMILY, config={"visual_cond": False})
    pipe = pipeline(video)
    for grid in ((1, 4, 4), (3, 32, 52), (1, 32, 60), (1, 64, 64)):
        px = (grid[1] * 16, grid[2] * 16)
        assert video.rope_scale(grid) == tuple(float(s) for s in pipe._get_scale_factor(*px))
        assert image.rope_scale(grid) == (1.0, 1.0, 1.0)


def test_bad_inputs_are_refused():
    model = fc.make(FAMILY, frames=3)
    x, t, y = fc.inputs(model, batch=2, frames=3)
    with pytest.raises(FamilyConfigError, match="modulates per sample"):
        model(x, torch.zeros(2, model.num_tokens), y)
    with pytest.raises(FamilyConfigError, match="token grid sides"):
        fc.make(FAMILY, input_size=258)
    with pytest.raises(FamilyConfigError, match="model.i2v=true"):
        fc.make(FAMILY, frames=3, i2v=True)
    with pytest.raises(FamilyConfigError, match="out_visual_dim"):
        fc.make(FAMILY, config={"out_channels": 4})
    assert fc.make(FAMILY, config={"attention_type": "nabla"}).transformer.config.attention_type == "nabla"


@pytest.mark.parametrize("frames", [1, 3])
def test_shared_checks_with_live_gates(frames, no_bf16_rounding):
    """tests/test_families.py runs the shared checks on diffusers' fresh init, whose zero modulations make every block
    the identity; here they run again with live gates (and no bf16 rounding of q, k): dense == diffusers, ratio 0 ==
    dense, set-aside tokens and text, gradients reach every parameter, checkpointing, force-keep, padded text data +
    mask + pooled == diffusers on each unpadded prompt."""
    kw = {"frames": frames}
    fc.check_dense_equals_diffusers(FAMILY, **kw)
    fc.check_ratio_zero_permuted_equals_dense(FAMILY, **kw)
    fc.check_set_aside_and_text(FAMILY, SPAN, **kw)
    fc.check_gradients_reach_all(FAMILY, SPAN, **kw)
    fc.check_checkpointing_same_grads(FAMILY, SPAN, **kw)
    fc.check_force_keep(FAMILY, TWO_ROUTES, **kw)
    fc.check_text_conditioning(FAMILY, SPAN, with_mask=True, **kw)
    model = fc.make(FAMILY, fc.RATIO_ZERO, **kw)
    fc.check_ratio_zero_model(model, fc.inputs(model, frames=frames), cond=pooled_text(model))


def test_tiny_text_encoders_through_the_pipelines_encode_prompt(tmp_path, no_bf16_rounding):
    """save_tiny_text_encoders + Kandinsky5T2VPipeline.encode_prompt (via encode_via_pipeline) give exactly the
    pipeline's own outputs per prompt (its unpadded Qwen rows, the mask from cu_seqlens, CLIP's pooler_output); the
    128-token template prefix is dropped exactly (a prompt's rows: its words + <|im_end|>); the model takes them."""
    from tread.encoders.text import load_text_encoders
    from tread.encoders.text_families import FAMILIES
    from tread.encoders.text_pipelines import build_pipeline, encode_via_pipeline
    from tread.encoders.tiny_text import save_tiny_text_encoders

    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path))
    prompts = ["a cat", "a red disc on a tree"]
    out = encode_via_pipeline(FAMILY, FAMILIES[FAMILY], enc.models, enc.tokenizers, prompts, 12, torch.device("cpu"))
    assert out["text"].shape == (2, 12, 32) and out["pooled"].shape == (2, 32)
    assert out["text_mask"].sum(1).tolist() == [2 + 1, 6 + 1]
    pipe = build_pipeline("Kandinsky5T2VPipeline", enc.models, enc.tokenizers)
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            rows, pooled, cu = pipe.encode_prompt(prompt, max_sequence_length=12, device=torch.device("cpu"))
            assert cu.tolist() == [0, int(out["text_mask"][b].sum())]
            torch.testing.assert_close(out["text"][b, out["text_mask"][b]], rows[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out["pooled"][b], pooled[0], rtol=1e-6, atol=1e-6)
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model, batch=2)
    cond = {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-5, atol=1e-5)


def test_adapters_learn_over_a_frozen_quantized_base_with_routing():
    """model.quantize=int8 (diffusers' init) with LoRA on TARGETS and a route: the adapters learn, the int8 base and
    every other base weight stay frozen (tests/test_quantize.py's check; its TARGETS name no Kandinsky module)."""
    from test_quantize import quantized_tensors
    from tread.models.lora import is_adapter_param
    from tread.models.quantize import quantize_mode

    model = BUILD(FAMILY, SPAN, frames=3, quantize="int8", lora={"rank": 4, "alpha": 4, "target_modules": TARGETS})
    base = quantized_tensors(model.train())
    assert quantize_mode(model) == "int8" and len(base) >= 2 * len(model.routable_blocks())
    x, t, y = fc.inputs(model, batch=4, frames=3)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(8):
        loss = model(x, t, y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(not p.requires_grad for n, p in model.named_parameters()
               if not is_adapter_param(n) and not n.startswith("conditioner."))
    after = quantized_tensors(model)
    assert after.keys() == base.keys() and all(torch.equal(after[k], v) for k, v in base.items())
