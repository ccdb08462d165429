"""FLUX.3 (diffusers Flux3Transformer2DModel; modular pipeline only) with TREAD routing: the proofs only FLUX.3 has.
The shared checks run for FLUX.3 in tests/test_families.py.

Against diffusers (tiny configs, fp32), every input built by the modular pipeline's own helpers
(Flux3VaeEncoderStep._patchify_latents + its token packing, before_denoise._prepare_image_ids with the image RoPE
scale 0.5, Flux3TextRoPEInputsStep._prepare_text_ids, Flux3UnpackLatentsStep's view + Flux3DecodeStep._unpatchify_
latents): dense with and without several references equals Flux3Transformer2DModel; the kept tokens after a route
equal diffusers' blocks (default processors, diffusers' per-token modulation rows) run per sample on the kept image
tokens with their true 4-axis ids, the text and references through their own mode blocks whole; text and references
are never routed; prompts through Flux3TextEncoderStep; the LoRA export loads with Flux3ModularPipeline's
load_lora_weights and the transformer's load_lora_adapter; the shift in configs/model/flux3.yaml.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.modular_pipelines.flux3.before_denoise import (Flux3SetTimestepsStep, Flux3TextRoPEInputsStep,
                                                              _prepare_image_ids)
from diffusers.modular_pipelines.flux3.decoders import Flux3DecodeStep
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep

import family_checks as fc
from test_families import CROSS

FAMILY = "flux3"
SCALE = 0.5   # Flux3PrepareLatentsStep / Flux3PrepareImageCondLatentsStep image_rope_scale

pytestmark = pytest.mark.usefixtures("one_thread")


def references(model, batch: int = 3, seed: int = 9) -> list:
    """Two reference images' latents: one of the target's size, one smaller and not square (multi-reference)."""
    g = torch.Generator().manual_seed(seed)
    C, S = model.in_channels, model.input_size
    return [torch.randn(batch, C, S, S, generator=g), torch.randn(batch, C, S // 2, S - 2, generator=g)]


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's tokens: VAE latents patchified 2x2, then `latents.flatten(2).transpose(1, 2)`."""
    return Flux3VaeEncoderStep._patchify_latents(latents).flatten(2).transpose(1, 2)


def pipeline_ids(x: torch.Tensor, text: torch.Tensor, refs: list) -> tuple:
    """(text ids (L, 4), target ids (N, 4), reference ids (R, 4)) as the modular pipeline's steps build them."""
    txt = Flux3TextRoPEInputsStep._prepare_text_ids(text)
    lat = _prepare_image_ids(x.shape[-2] // 2, x.shape[-1] // 2, SCALE)
    ref = [_prepare_image_ids(r.shape[-2] // 2, r.shape[-1] // 2, SCALE, l_coord=-(1 + i)) for i, r in enumerate(refs)]
    return txt, lat, torch.cat(ref) if refs else torch.zeros(0, 4)


@pytest.mark.parametrize("with_refs", [False, True], ids=["text-to-image", "two-references"])
def test_dense_equals_diffusers_on_the_pipelines_inputs(with_refs):
    """Dense: ours == Flux3Transformer2DModel on the modular pipeline's inputs (packed tokens, ids (0, h/2, w/2, l),
    text ids (0, 0, 0, l), references with l = -1, -2, t / 1000), unpacked with the pipeline's own steps."""
    model = fc.make(FAMILY, kontext=with_refs).eval()
    x, t, y = fc.inputs(model)
    B, (h, w) = x.shape[0], (x.shape[-2] // 2, x.shape[-1] // 2)
    refs = references(model) if with_refs else []
    text = model.conditioner(y)["text"]
    txt_ids, lat_ids, ref_ids = pipeline_ids(x, text, refs)
    assert torch.equal(model.pack(x), tokens(x))
    assert torch.equal(model.text_ids(text.shape[1], x.device), txt_ids)
    assert torch.equal(model.image_ids(x.device, (h, w)), lat_ids) and lat_ids[:, 1:3].max() == (h - 1) * SCALE
    kw = {}
    if refs:
        assert torch.equal(model.reference_ids(refs, x.device), ref_ids)
        assert ref_ids[:, 3].unique().tolist() == [-2, -1]
        kw = {"image_cond_hidden_states": torch.cat([tokens(r) for r in refs], dim=1), "image_cond_ids": ref_ids}
    tr = model.pristine_transformer()
    with torch.no_grad():
        pred = tr(hidden_states=tokens(x), encoder_hidden_states=text, timestep=t / 1000, img_ids=lat_ids,
                  txt_ids=txt_ids, return_dict=False, **kw)[0]
        want = Flux3DecodeStep._unpatchify_latents(pred.view(B, h, w, -1).permute(0, 3, 1, 2))
        ours = model(x, t, y, cond={"reference": refs} if refs else None)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def _diffusers_mods(tr, t: torch.Tensor, b: int, K: int, L: int, R: int) -> dict:
    """Sample b's per-token modulation rows exactly as diffusers' forward makes them: image rows at t, text and
    reference rows at 0, each an expanded (1, S, D) embedding through SiLU and the mode's Flux3Modulation."""
    temb = tr.timestep_embedder(tr.time_proj(t[b:b + 1] * 1000))[:, None]
    zero = tr.timestep_embedder(tr.time_proj(torch.zeros(1)))[:, None]
    img, txt, ref = F.silu(temb.expand(1, K, -1)), F.silu(zero.expand(1, L, -1)), F.silu(zero.expand(1, R, -1))
    early, single = tr.early_stream_modulations, tr.single_stream_modulations
    return {"img": (early["image"](img), single["image"](img)), "txt": (early["txt"](txt), single["txt"](txt)),
            "ref": (early["image_cond"](ref), single["image_cond"](ref))}


def _reference_blocks(tr, r, b: int, kept: torch.Tensor, refs: list, with_refs: bool, pos=None):
    """Diffusers' blocks from the route's start to its end on sample b: the dense route-start image tokens at `kept`
    with the ids of positions `pos` (default: theirs), the text and references whole. Returns (image, text,
    references) after the route."""
    route, modes = r.route, len(tr.mode_blocks["image"])
    h = r.dense[route.start_layer_idx][0][b:b + 1, kept]
    ctx = r.dense[route.start_layer_idx][1]
    c, z = (ctx[0][b:b + 1], ctx[1][b:b + 1]) if with_refs else (ctx[b:b + 1], h[:, :0])
    text = r.model.conditioning(r.y, r.cond)["text"]
    txt_ids, lat_ids, ref_ids = pipeline_ids(r.x, text, refs)
    img_rope, txt_rope, ref_rope = tr.pos_embed(lat_ids[kept if pos is None else pos]), tr.pos_embed(txt_ids), tr.pos_embed(ref_ids)
    K, L, R = h.shape[1], c.shape[1], z.shape[1]
    mods = _diffusers_mods(tr, r.t / 1000, b, K, L, R)
    joint = tuple(torch.cat([txt_rope[j], img_rope[j], ref_rope[j]]) for j in range(2))
    for i in range(route.start_layer_idx, route.end_layer_idx + 1):
        if i < modes:
            h = tr.mode_blocks["image"][i](h, mods["img"][0], img_rope)
            c = tr.txt_mode_blocks[i](c, mods["txt"][0], txt_rope)
            z = tr.mode_blocks["image_cond"][i](z, mods["ref"][0], ref_rope) if with_refs else z
        else:
            c, hz = tr.single_transformer_blocks[i - modes](
                hidden_states=torch.cat([h, z], dim=1), encoder_hidden_states=c,
                temb_mod=torch.cat([mods["img"][1], mods["ref"][1]], dim=1), temb_mod_context=mods["txt"][1],
                image_rotary_emb=joint)
            h, z = hz[:, :K], hz[:, K:]
    return h, c, z


@pytest.mark.parametrize("routes,with_refs", [
    (CROSS, False), ([{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}], False),
    ([{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}], False), (CROSS, True)],
    ids=["mode-to-single", "single-to-end", "mode-only", "mode-to-single-refs"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, with_refs):
    """3. Kept tokens after the route = diffusers' blocks (default processors) run per sample on the kept image
    tokens with the RoPE rows of their TRUE ids (0, row/2, col/2, 0) and diffusers' per-token modulation rows; the
    text (0, 0, 0, l) and references (l = -1, -2) through their own mode blocks whole, then jointly. The text and
    reference streams after the route match too. Teeth: the first K positions' ids instead give another result."""
    refs = []

    def cond(model):
        refs.extend(references(model))
        return {"reference": refs}

    r = fc.routed_run(FAMILY, routes, cond=cond if with_refs else None, kontext=with_refs)
    _, x_kept, ids, _ = r.scatter
    tr, end = r.model.pristine_transformer(), r.route.end_layer_idx
    with torch.no_grad():
        for b in range(x_kept.shape[0]):
            h, c, z = _reference_blocks(tr, r, b, ids[b], refs, with_refs)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if end + 1 < len(r.routed):                                          # the streams after the route
                after = r.routed[end + 1][1]
                torch.testing.assert_close((after[0] if with_refs else after)[b:b + 1], c, rtol=1e-5, atol=1e-5)
                if with_refs:
                    torch.testing.assert_close(after[1][b:b + 1], z, rtol=1e-5, atol=1e-5)
        moved = _reference_blocks(tr, r, 0, ids[0], refs, with_refs, pos=torch.arange(ids.shape[1]))[0]
    assert not torch.allclose(moved, x_kept[:1], atol=1e-3)   # the true positions matter


def test_text_and_references_are_never_routed():
    """Every image mode block and single block sees the kept image tokens (+ ALL reference tokens in the single
    blocks); the text and reference mode blocks always see their whole streams; the router only ever sees the N
    image tokens."""
    model = fc.make(FAMILY, CROSS, kontext=True).train()
    x, t, y = fc.inputs(model)
    refs = references(model)
    N, R, L = model.num_tokens, sum(r.shape[2] * r.shape[3] // 4 for r in refs), model.text_len
    tr, seen = model.transformer, {}

    def spy(name):
        return lambda m, a, kw: seen.setdefault(name, []).append((a[0] if a else kw["hidden_states"]).shape[1])
    groups = {"image": tr.mode_blocks["image"], "ref": tr.mode_blocks["image_cond"], "txt": tr.txt_mode_blocks,
              "single": tr.single_transformer_blocks}
    hooks = [b.register_forward_pre_hook(spy(name), with_kwargs=True) for name, g in groups.items() for b in g]
    try:
        with fc.capture_routes(), fc.fixed_selection(model, fc.random_permutation(3)) as calls:
            model(x, t, y, cond={"reference": refs})
    finally:
        for hook in hooks:
            hook.remove()
    K = model.routing.routes[0].num_keep(N)
    assert seen == {"image": [N, K], "txt": [L, L], "ref": [R, R], "single": [K + R] * 4 + [N + R] * 2}
    assert calls and all(c.shape[1] == K and int(c.max()) < N for c in calls)


def test_ratio_zero_permuted_equals_dense_with_references():
    model = fc.make(FAMILY, fc.RATIO_ZERO, kontext=True)
    xty = fc.inputs(model)
    fc.check_ratio_zero_model(model, xty, cond={"reference": references(model)})


def test_fused_qkv_projections_keep_the_routed_output():
    fc.check_fused_projections(FAMILY, CROSS)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from tread.encoders.text import load_text_encoders
    from tread.encoders.tiny_text import save_tiny_text_encoders

    return load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path_factory.mktemp("flux3_text")))


def _step(enc, pad_multiple: int = 80):
    """Flux3TextEncoderStep run as the modular pipeline runs a block: its own pipeline with the loaded parts."""
    pipe = Flux3TextEncoderStep(pad_multiple=pad_multiple).init_pipeline()
    pipe.update_components(text_encoder=enc.models["text_encoder"], tokenizer=enc.tokenizers["tokenizer"])
    return pipe


def test_prompts_equal_the_modular_text_encoder_step(encoders):
    """Our stored arrays == Flux3TextEncoderStep (default: pad multiple 80) per prompt at max lengths <= 80, where
    the step's window is the length for every prompt; 8 stacked Qwen3-VL layers (4, 8, ..., 32), pad rows kept, no
    mask; a longer length is one fixed window (the step with that pad multiple), not the step's 80-token window."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from tread.encoders.text import encode_prompts

    assert isinstance(encoders.models["text_encoder"], Qwen3VLForConditionalGeneration)
    assert isinstance(encoders.tokenizers["tokenizer"], Qwen3VLProcessor)
    prompts, step = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"], _step(encoders)
    for length in (24, 80):
        ours = encode_prompts(FAMILY, encoders, prompts, max_length=length)
        assert list(ours) == ["text"] and ours["text"].shape == (3, length, 8 * 32)
        for row, prompt in zip(ours["text"], prompts):
            want = step(prompt=prompt, max_sequence_length=length, output="prompt_embeds")[0]
            torch.testing.assert_close(torch.from_numpy(row), want, rtol=1e-5, atol=1e-5)
    long = encode_prompts(FAMILY, encoders, prompts[:1], max_length=96)["text"][0]
    assert step(prompt=prompts[0], max_sequence_length=96, output="prompt_embeds").shape[1] == 80
    torch.testing.assert_close(torch.from_numpy(long), _step(encoders, 96)(
        prompt=prompts[0], max_sequence_length=96, output="prompt_embeds")[0], rtol=1e-5, atol=1e-5)
    assert encode_prompts(FAMILY, encoders, "a cat")["text"].shape == (1, 80, 256)   # FamilySpec default 80


@pytest.mark.parametrize("adapter", ["lora", "lokr"])
def test_lora_export_loads_in_the_modular_pipeline(adapter, tmp_path):
    """Flux3ModularPipeline (with Flux3LoraLoaderMixin) loads the exported adapter with load_lora_weights, and the
    transformer's own load_lora_adapter reads the file too: both give what our adapted model gives."""
    from diffusers import Flux3ModularPipeline

    from test_adapter_export import adapted
    from tread.checkpoint.save import DIFFUSERS_LORA_FILE, export_adapter

    targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.linear_in", "ff.linear_out", "proj_out"]
    model = adapted(FAMILY, adapter, targets=targets)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    pipe = Flux3ModularPipeline()
    pipe.update_components(transformer=base.pristine_transformer())
    alone = base.pristine_transformer()
    x, noise, labels = fc.inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
        pipe.load_lora_weights(tmp_path)
        alone.load_lora_adapter(tmp_path / DIFFUSERS_LORA_FILE)
        ours = model(x, noise, labels)
        for transformer in (pipe.transformer, alone):
            theirs = base.reference_forward(x, noise, labels, transformer=transformer)
            torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)
    assert (ours - plain).abs().max() > 0.02


def test_schema_takes_kontext_and_the_shift_is_the_pipelines():
    """model=flux3 composes and passes the schema with model.kontext; its static shift is Flux3SetTimestepsStep's
    scheduler shift; the released preset builds on the meta device with the docstring's geometry."""
    from conftest import compose_cfg
    from tread.models.families import build_family
    from tread.schema import check_train

    cfg = compose_cfg("train", ["model=flux3", "model.kontext=true"])
    assert cfg.model.family == FAMILY and cfg.model.arch == "flux3-tiny"
    check_train(cfg)
    assert cfg.diffusion.shift == Flux3SetTimestepsStep().shift == 6.93 and cfg.diffusion.get("dynamic_shift") is None
    with torch.device("meta"):
        released = build_family(FAMILY, preset="flux3", input_size=64, in_channels=32, num_classes=0)
    assert released.depth == 5 + 28 and released.text_dim == 20480
    assert released.transformer.inner_dim == 3072 and released.in_channels * 4 == 128
