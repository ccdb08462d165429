"""FLUX.2 (diffusers Flux2Transformer2DModel) with TREAD routing: the proofs only FLUX.2 has. The shared checks run
for FLUX.2 in tests/test_families.py.

Against diffusers (tiny configs, fp32), with every input built by Flux2Pipeline's own helpers (_patchify_latents,
_pack_latents, _prepare_latent_ids, _prepare_text_ids, _prepare_image_ids, _unpack_latents_with_ids,
_unpatchify_latents): the dense forward with guidance and several reference images of different sizes equals
Flux2Transformer2DModel on the pipeline's inputs; the kept tokens after a route equal diffusers' blocks (default
processors, shared modulation, diffusers' own concatenated single-block call) run per sample on [kept target tokens
+ all reference tokens] with their true 4-axis ids; reference tokens are never routed; ratio 0 equals dense with
references; fused QKV; the guidance key; the shift in configs/model/flux2.yaml.
"""
from __future__ import annotations

import pytest
import torch
from diffusers import Flux2Pipeline

import family_checks as fc
from test_families import CROSS

FAMILY = "flux2"
GUIDED = {"config": {"guidance_embeds": True}, "guidance": 4.0}
pipe = Flux2Pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def references(model, batch: int = 3, seed: int = 9) -> list:
    """Two reference images' latents: one of the target's size, one smaller and not square (multi-reference)."""
    g = torch.Generator().manual_seed(seed)
    C, S = model.in_channels, model.input_size
    return [torch.randn(batch, C, S, S, generator=g), torch.randn(batch, C, S // 2, S - 2, generator=g)]


def pipeline_ids(x: torch.Tensor, text: torch.Tensor, refs: list) -> tuple:
    """(text ids (L, 4), target ids (N, 4), reference ids (R, 4)) exactly as Flux2Pipeline builds them."""
    txt = pipe._prepare_text_ids(text)[0].float()
    lat = pipe._prepare_latent_ids(pipe._patchify_latents(x))[0].float()
    ref = pipe._prepare_image_ids([pipe._patchify_latents(r[:1]) for r in refs])[0].float() if refs else \
        torch.zeros(0, 4)
    return txt, lat, ref


@pytest.mark.parametrize("with_refs", [False, True], ids=["text-to-image", "two-references"])
def test_dense_equals_diffusers_on_the_pipelines_inputs(with_refs):
    """Guidance-distilled, dense: ours == Flux2Transformer2DModel on Flux2Pipeline's inputs (patchified and packed
    latents, [target, references] tokens and ids, text ids (0, 0, 0, l), t / 1000, guidance 4.0), the output's
    target part unpacked with the pipeline's helpers. Our packing equals the pipeline's patchify + pack."""
    model = fc.make(FAMILY, kontext=with_refs, **GUIDED).eval()
    x, t, y = fc.inputs(model)
    B = x.shape[0]
    refs = references(model) if with_refs else []
    text = model.conditioner(y)["text"]
    txt_ids, lat_ids, ref_ids = pipeline_ids(x, text, refs)
    latents = pipe._pack_latents(pipe._patchify_latents(x))
    assert torch.equal(model.pack(x), latents)
    assert torch.equal(model.text_ids(text.shape[1], x.device), txt_ids)
    assert torch.equal(model.image_ids(x.device, model.grid_of(x)[1:]), lat_ids)
    hidden, img_ids = latents, lat_ids
    if refs:
        assert torch.equal(model.reference_ids(refs, x.device), ref_ids)
        assert ref_ids[:, 0].unique().tolist() == [10, 20]
        hidden = torch.cat([latents, *(pipe._pack_latents(pipe._patchify_latents(r)) for r in refs)], dim=1)
        img_ids = torch.cat([lat_ids, ref_ids])
    tr = model.pristine_transformer()
    with torch.no_grad():
        pred = tr(hidden_states=hidden, timestep=t / 1000, guidance=torch.full([1], 4.0).expand(B),
                  encoder_hidden_states=text, txt_ids=txt_ids.expand(B, -1, -1), img_ids=img_ids.expand(B, -1, -1),
                  return_dict=False)[0][:, :latents.shape[1]]
        want = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(pred, lat_ids.expand(B, -1, -1)))
        ours = model(x, t, y, cond={"reference": refs} if refs else None)
        unguided = fc.make(FAMILY, kontext=with_refs, **{**GUIDED, "guidance": 1.0}).eval()(
            x, t, y, cond={"reference": refs} if refs else None)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, unguided)   # the guidance value reaches the model


def test_references_are_never_routed():
    """Every block sees the kept target tokens + ALL reference tokens (image weights) and the whole text; the
    router only ever sees the N target tokens, and the reference stream has its full length in every block."""
    model = fc.make(FAMILY, CROSS, kontext=True).train()
    x, t, y = fc.inputs(model)
    refs = references(model)
    N, R = model.num_tokens, sum(r.shape[2] * r.shape[3] // 4 for r in refs)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a, kw: seen.append(
        (kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1])), with_kwargs=True)
        for b in model.routable_blocks()]
    try:
        with fc.capture_routes() as log, fc.fixed_selection(model, fc.random_permutation(3)) as calls:
            model(x, t, y, cond={"reference": refs})
        block_in, _ = fc.block_inputs(model, x, t, y, cond={"reference": refs})
    finally:
        for h in hooks:
            h.remove()
    route = model.routing.routes[0]
    kept = [route.num_keep(N) if route.start_layer_idx <= i <= route.end_layer_idx else N for i in range(8)]
    assert seen[:8] == [(k + R, model.text_len) for k in kept] and min(kept) < N
    assert calls and all(c.shape[1] == route.num_keep(N) and int(c.max()) < N for c in calls)
    (x_full, _, ids, out), = log["scatter"]
    assert x_full.shape[1] == N and out.shape[1] == N and int(ids.max()) < N
    assert all(isinstance(ctx, tuple) and ctx[1].shape[1] == R for _, ctx in block_in)


@pytest.mark.parametrize("routes,with_refs", [
    (CROSS, False), ([{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}], False),
    ([{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}], False), (CROSS, True),
    ([{"selection_ratio": 0.75, "start_layer_idx": 4, "end_layer_idx": -1}], True)],
    ids=["dual-to-single", "single-to-end", "dual-only", "dual-to-single-refs", "single-to-end-refs"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, with_refs):
    """3. Kept tokens after the route = diffusers' blocks (default processors) run per sample on [kept target
    tokens + all reference tokens], with the shared modulation computed by diffusers' Flux2Modulation layers and the
    RoPE from the TRUE 4-axis ids (Flux2Pipeline's target ids sliced to the kept tokens, its reference ids (10 + 10 i,
    row, col, 0), text ids (0, 0, 0, l)); single blocks are called as diffusers' forward calls them, on the
    concatenated [text, image] sequence. The text and reference streams after the route match too."""
    refs = None

    def cond(model):
        nonlocal refs
        refs = references(model)
        return {"reference": refs}

    r = fc.routed_run(FAMILY, routes, cond=cond if with_refs else None, kontext=with_refs)
    model, route = r.model, r.route
    _, x_kept, ids, _ = r.scatter
    tr = model.pristine_transformer()
    text = model.conditioning(r.y, r.cond)["text"]
    txt_ids, lat_ids, ref_ids = pipeline_ids(r.x, text, refs or [])
    blocks, dual = [*tr.transformer_blocks, *tr.single_transformer_blocks], len(tr.transformer_blocks)
    with torch.no_grad():
        temb = tr.time_guidance_embed(r.t / 1000 * 1000, None)
        mod_img, mod_txt = tr.double_stream_modulation_img(temb), tr.double_stream_modulation_txt(temb)
        mod_single = tr.single_stream_modulation(temb)
        for b in range(x_kept.shape[0]):
            h = r.dense[route.start_layer_idx][0][b:b + 1, ids[b]]              # dense route-start tokens, kept
            ctx = r.dense[route.start_layer_idx][1]
            c, z = (ctx[0][b:b + 1], ctx[1][b:b + 1]) if with_refs else (ctx[b:b + 1], h[:, :0])
            K, L = h.shape[1], c.shape[1]
            img_rope = tr.pos_embed(torch.cat([lat_ids[ids[b]], ref_ids]))    # true positions, as diffusers
            txt_rope = tr.pos_embed(txt_ids)
            rope = (torch.cat([txt_rope[0], img_rope[0]]), torch.cat([txt_rope[1], img_rope[1]]))
            for i in range(route.start_layer_idx, route.end_layer_idx + 1):
                if i < dual:
                    c, hz = blocks[i](hidden_states=torch.cat([h, z], dim=1), encoder_hidden_states=c,
                                      temb_mod_img=mod_img[b:b + 1], temb_mod_txt=mod_txt[b:b + 1],
                                      image_rotary_emb=rope)
                else:
                    hz = blocks[i](hidden_states=torch.cat([c, h, z], dim=1), encoder_hidden_states=None,
                                   temb_mod=mod_single[b:b + 1], image_rotary_emb=rope)
                    c, hz = hz[:, :L], hz[:, L:]
                h, z = hz[:, :K], hz[:, K:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                            # the streams after the route
                after = r.routed[route.end_layer_idx + 1][1]
                torch.testing.assert_close((after[0] if with_refs else after)[b:b + 1], c, rtol=1e-5, atol=1e-5)
                if with_refs:
                    torch.testing.assert_close(after[1][b:b + 1], z, rtol=1e-5, atol=1e-5)


def test_ratio_zero_permuted_equals_dense_with_references():
    """selection_ratio 0 with a random permutation of the target tokens equals dense (1e-5), references on."""
    model = fc.make(FAMILY, [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}], kontext=True)
    x, t, y = fc.inputs(model)
    cond = {"reference": references(model)}
    with torch.no_grad(), fc.fixed_selection(model, fc.random_permutation(7)) as calls:
        with torch.enable_grad():
            routed = model.train()(x, t, y, cond=cond)
        dense = model.eval()(x, t, y, cond=cond)
    assert calls and not torch.equal(calls[0], torch.arange(calls[0].shape[1]).expand_as(calls[0]))
    torch.testing.assert_close(routed, dense, rtol=1e-5, atol=1e-5)


def test_fused_qkv_projections_keep_the_routed_output():
    """diffusers' fuse_qkv_projections fuses the dual-stream attentions (the single-stream ones are always fused);
    our processors honour it with per-sample RoPE: the routed output (same router seed) is unchanged."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Attention

    model = fc.make(FAMILY, CROSS).train()
    x, t, y = fc.inputs(model)
    model.routing.router.manual_seed(3)
    ref = model(x, t, y)
    model.transformer.fuse_qkv_projections()
    dual = [m for m in model.transformer.modules() if isinstance(m, Flux2Attention)]
    assert len(dual) == 2 and all(m.fused_projections for m in dual)
    model.routing.router.manual_seed(3)
    torch.testing.assert_close(model(x, t, y), ref, rtol=1e-5, atol=1e-5)


def test_reference_and_guidance_errors_name_the_key():
    from tread.models.families import FamilyConfigError

    model = fc.make(FAMILY, kontext=True).eval()
    x, t, y = fc.inputs(model)
    with pytest.raises(FamilyConfigError, match=r"model.kontext=true needs .*cond\['reference'\].*got none"):
        model(x, t, y)
    with pytest.raises(FamilyConfigError, match=r"got shape \[3, 4, 5, 4\]"):
        model(x, t, y, cond={"reference": [torch.zeros(3, 4, 8, 8), torch.zeros(3, 4, 5, 4)]})
    with pytest.raises(FamilyConfigError, match=r"data.path='/d' has no reference latents"):
        model.check_text_data({"text": None, "reference": None}, "'/d'")
    with pytest.raises(FamilyConfigError, match=r"model.kontext=false would ignore them"):
        fc.make(FAMILY).check_text_data({"text": None, "reference": (4, 8, 8)}, "'/d'")


def test_schema_takes_guidance_and_kontext_and_the_shift_is_the_pipelines():
    """model=flux2 composes and passes the schema with model.guidance and model.kontext; its dynamic shift is
    Flux2Pipeline's compute_empirical_mu on its step-independent line (200 steps)."""
    from conftest import compose_cfg
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    from tread.diffusion.rf import DynamicShift
    from tread.schema import check_train

    cfg = compose_cfg("train", ["model=flux2", "model.guidance=4.0", "model.kontext=true"])
    assert cfg.model.family == "flux2" and cfg.model.arch == "flux2-tiny"
    check_train(cfg)
    shift = DynamicShift(**cfg.diffusion.dynamic_shift)
    for seq in (64, 256, 1024, 4096, 8192):
        assert shift.mu(seq) == pytest.approx(compute_empirical_mu(seq, 200), abs=1e-5)
