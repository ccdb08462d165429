"""Qwen-Image (diffusers QwenImageTransformer2DModel) with TREAD routing: the proofs only Qwen-Image has (the
pipelines' 2x2 packing, the centred 3-axis RoPE and where the text positions start, RoPE and the text mask on the kept
subsequence, editing with never-routed conditioning-image tokens and zero_cond_t's per-token t = 0 modulation); the
shared checks run for qwen_image in tests/test_families.py."""
from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline

import family_checks as fc
from tread.models.families import FamilyConfigError
from test_families import SPAN

FAMILY = "qwen_image"
ZCT = {"config": {"zero_cond_t": True}}
TO_LAST = [{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}]
FIRST = [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_text(model, batch: int = 3, seed: int = 4) -> dict:
    """Text embeddings (batch, 5, D) and a keep-mask, one of them not contiguous (diffusers allows any pattern)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0]], dtype=torch.bool)[:batch]
    return {"text": torch.randn(batch, 5, model.text_dim, generator=g), "text_mask": mask}


def reference_for(model, batch: int = 3, seed: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, model.in_channels, model.input_size, model.input_size, generator=g)


def unpacked(pipe, tokens, H, W):
    """The pipeline's _unpack_latents (B, C, 1, H, W) for latents of H x W cells, as (B, C, H, W)."""
    return pipe._unpack_latents(tokens, H * 8, W * 8, 8).squeeze(2)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "text-mask"])
def test_dense_equals_diffusers_on_the_pipelines_inputs(with_mask):
    """No routes: our forward = QwenImageTransformer2DModel on QwenImagePipeline's own packing (_pack_latents),
    img_shapes [[(1, H/2, W/2)]] * B, timestep / 1000 and prompt mask, unpacked with its _unpack_latents."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    B, C, H, W = x.shape
    text = masked_text(model) if with_mask else model.conditioner(y)
    tr = model.pristine_transformer()
    with torch.no_grad():
        pred = tr(hidden_states=QwenImagePipeline._pack_latents(x, B, C, H, W), timestep=t / 1000,
                  encoder_hidden_states=text["text"], encoder_hidden_states_mask=text.get("text_mask"),
                  img_shapes=[[(1, H // 2, W // 2)]] * B, return_dict=False)[0]
        ours = model(x, t, y, cond=text if with_mask else None)
    torch.testing.assert_close(ours, unpacked(QwenImagePipeline, pred, H, W), rtol=1e-6, atol=1e-6)
    assert tr.config.patch_size == 2 and tr.config.in_channels == 4 * C and tr.config.out_channels == C


def test_rope_is_centred_on_the_grid_and_text_follows_it():
    """diffusers' QwenEmbedRope (scale_rope) against explicit integer positions: image idx has frame position idx,
    rows -(h - h//2) .. h//2 - 1 and columns -(w - w//2) .. w//2 - 1; the L text tokens take position
    m .. m + L - 1 on all three axes, m = max(h//2, w//2) over the images. Our per-token rows are the target's."""
    model = fc.make(FAMILY, input_size=8)
    tr = model.transformer
    axes = list(tr.config.axes_dims_rope)

    def table(frame, rows, cols):   # complex rows exp(i p theta_k) per axis, concatenated
        out = []
        for p, d in zip((frame, rows, cols), axes):
            inv = 1.0 / torch.pow(10000, torch.arange(0, d, 2).float() / d)
            out.append(torch.polar(torch.ones(len(p), d // 2), torch.outer(torch.tensor(p).float(), inv)))
        return torch.cat(out, dim=1)

    def grid(idx, h, w):
        rows = [r - (h - h // 2) for r in range(h) for _ in range(w)]
        cols = [c - (w - w // 2) for _ in range(h) for c in range(w)]
        return table([idx] * (h * w), rows, cols)

    for shapes in ([(1, 4, 4)], [(1, 3, 5), (1, 4, 2)]):
        L = 6
        vid, txt = tr.pos_embed([shapes], max_txt_seq_len=L, device=torch.device("cpu"))
        want = torch.cat([grid(i, h, w) for i, (_, h, w) in enumerate(shapes)])
        m = max(max(h // 2, w // 2) for _, h, w in shapes)
        torch.testing.assert_close(vid, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(txt, table(*[list(range(m, m + L))] * 3), rtol=1e-5, atol=1e-5)
    x, t, y = fc.inputs(model, batch=2)
    emb = model.embed(x, model.timestep(t), model.conditioning(y, None))
    rope = torch.view_as_complex(emb.per_token["rope"].contiguous())
    assert rope.shape == (2, 16, sum(axes) // 2)
    torch.testing.assert_close(rope[1], grid(0, 4, 4), rtol=1e-5, atol=1e-5)
    assert set(emb.per_token) == {"rope"} and emb.extra["txt_freqs"].shape[0] == model.text_len


@pytest.mark.parametrize("routes,with_mask", [(SPAN, True), (TO_LAST, False), (FIRST, True)],
                         ids=["span-text-mask", "to-last", "first-blocks-text-mask"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, with_mask):
    check_kept_tokens(routes, with_mask)


def check_kept_tokens(routes, with_mask: bool, size=None, **kw) -> None:
    """3. Kept tokens after the route = diffusers' blocks (default processors) run per sample on the kept
    subsequence with the kept tokens' own RoPE rows (diffusers' table for img_shapes (1, H/2, W/2), indexed by their
    grid positions), the shared text rows, and the sample's text mask; latents of the default size or size = (H, W)."""
    r = fc.routed_run(FAMILY, routes, cond=masked_text if with_mask else None, size=size, **kw)
    model, route = r.model, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    blocks = list(ref_tr.transformer_blocks)
    h_, w_ = r.x.shape[-2] // 2, r.x.shape[-1] // 2                          # QwenImagePipeline's img_shapes
    mask = r.cond["text_mask"] if with_mask else None
    with torch.no_grad():
        temb = ref_tr.time_text_embed(r.t / 1000, x_kept)
        for b in range(x_kept.shape[0]):
            h = r.dense[route.start_layer_idx][0][b:b + 1, ids[b]]           # dense route-start tokens, kept subset
            c = r.dense[route.start_layer_idx][1][b:b + 1]                   # text stream at the route's start
            vid, txt = ref_tr.pos_embed([[(1, h_, w_)]], max_txt_seq_len=c.shape[1], device=h.device)
            m = None if mask is None else mask[b:b + 1]
            for blk in blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                c, h = blk(hidden_states=h, encoder_hidden_states=c, encoder_hidden_states_mask=m,
                           temb=temb[b:b + 1], image_rotary_emb=(vid[ids[b]], txt))
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                         # the text stream after the route
                torch.testing.assert_close(r.routed[route.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)


def test_text_mask_hides_padded_positions_under_routing():
    """The mask is honoured on the kept subsequence: the text embeddings at masked positions do not change the
    routed output; the mask itself does."""
    model = fc.make(FAMILY, SPAN).train()
    x, t, y = fc.inputs(model)
    cond = masked_text(model)
    other = {**cond, "text": torch.where(cond["text_mask"][..., None], cond["text"], torch.randn_like(cond["text"]))}
    with torch.no_grad(), torch.enable_grad():
        outs = []
        for c in (cond, other, {"text": cond["text"]}):
            model.routing.router.manual_seed(2)
            outs.append(model(x, t, y, cond=c))
    assert model.last_route_stats
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[0], outs[2], atol=1e-4)


# -- editing: never-routed conditioning-image tokens, zero_cond_t ------------------------------------------------

def edit(routes=None, zct: bool = True):
    return fc.make(FAMILY, routes, kontext=True, **(ZCT if zct else {}))


@pytest.mark.parametrize("zct", [False, True], ids=["edit", "edit-zero_cond_t"])
def test_edit_dense_equals_diffusers_on_the_edit_pipelines_inputs(zct):
    """(a) No routes, edit: our forward = diffusers on QwenImageEditPlusPipeline's inputs: hidden states [target,
    reference] (its _pack_latents), img_shapes [[(1, h, w), (1, h, w)]] * B, the output's target part unpacked."""
    model = edit(zct=zct).eval()
    assert model.zero_cond_t == zct
    x, t, y = fc.inputs(model)
    ref = reference_for(model)
    B, C, H, W = x.shape
    pipe = QwenImageEditPlusPipeline
    text = model.conditioner(y)
    tr = model.pristine_transformer()
    with torch.no_grad():
        pred = tr(hidden_states=torch.cat([pipe._pack_latents(x, B, C, H, W), pipe._pack_latents(ref, B, C, H, W)], 1),
                  timestep=t / 1000, encoder_hidden_states=text["text"], encoder_hidden_states_mask=None,
                  img_shapes=[[(1, H // 2, W // 2), (1, H // 2, W // 2)]] * B, return_dict=False)[0]
        ours = model(x, t, y, cond={"reference": ref})
        plain = fc.make(FAMILY, **(ZCT if zct else {})).eval()(x, t, y)   # same seed: same weights, no reference
    torch.testing.assert_close(ours, unpacked(pipe, pred[:, :H * W // 4], H, W), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, plain, atol=1e-4)   # the reference conditions the prediction


@pytest.mark.parametrize("zct,routes", [(True, SPAN), (True, FIRST), (False, SPAN)],
                         ids=["zero_cond_t-span", "zero_cond_t-first-blocks", "edit-span"])
def test_edit_kept_tokens_equal_blocks_on_subsequence_plus_reference(zct, routes):
    """(b) Kept target tokens after the route = diffusers' blocks (default processors) run per sample on [kept target
    tokens, all reference tokens] with their true RoPE rows (target grid at frame 0, reference grid at frame 1) and,
    with zero_cond_t, PER-TOKEN modulation: temb rows [temb(t), temb(0)] and modulate_index [0] * K + [1] * N, i.e.
    the kept target tokens take the timestep's modulation and the reference tokens the t = 0 one."""
    ref = None

    def cond(model):
        nonlocal ref
        ref = reference_for(model)
        return {"reference": ref}

    r = fc.routed_run(FAMILY, routes, cond=cond, kontext=True, **(ZCT if zct else {}))
    model, route = r.model, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    blocks = list(ref_tr.transformer_blocks)
    _, h_, w_ = model.token_grid
    N = h_ * w_
    with torch.no_grad():
        temb_t = ref_tr.time_text_embed(r.t / 1000, x_kept)
        temb_0 = ref_tr.time_text_embed(torch.zeros_like(r.t), x_kept)
        for b in range(x_kept.shape[0]):
            h = r.dense[route.start_layer_idx][0][b:b + 1, ids[b]]            # dense route-start tokens, kept
            c, z = (v[b:b + 1] for v in r.dense[route.start_layer_idx][1])    # text and reference streams
            K = h.shape[1]
            vid, txt = ref_tr.pos_embed([[(1, h_, w_), (1, h_, w_)]], max_txt_seq_len=c.shape[1], device=h.device)
            rope = (torch.cat([vid[:N][ids[b]], vid[N:]]), txt)
            if zct:
                temb = torch.cat([temb_t[b:b + 1], temb_0[b:b + 1]])
                index = torch.tensor([[0] * K + [1] * N], dtype=torch.int)
            else:
                temb, index = temb_t[b:b + 1], None
            for blk in blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                c, hz = blk(hidden_states=torch.cat([h, z], dim=1), encoder_hidden_states=c,
                            encoder_hidden_states_mask=None, temb=temb, image_rotary_emb=rope, modulate_index=index)
                h, z = hz[:, :K], hz[:, K:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            after = r.routed[route.end_layer_idx + 1][1]                       # both streams after the route
            torch.testing.assert_close(after[0][b:b + 1], c, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(after[1][b:b + 1], z, rtol=1e-5, atol=1e-5)


def test_reference_tokens_are_never_routed_and_modulate_index_follows_the_kept_tokens():
    """(c) Every block sees the kept target tokens + all N reference tokens and the whole text; its modulate_index
    is the gathered per-token index of the kept target tokens (0) followed by N ones (t = 0 modulation)."""
    model = edit(SPAN).train()
    x, t, y = fc.inputs(model)
    N, seen = model.num_tokens, []
    hooks = [b.register_forward_pre_hook(lambda m, a, kw: seen.append(
        (kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1], kw["modulate_index"].clone())),
        with_kwargs=True) for b in model.routable_blocks()]
    try:
        model(x, t, y, cond={"reference": reference_for(model)})
    finally:
        for h in hooks:
            h.remove()
    route = model.routing.routes[0]
    kept = [route.num_keep(N) if route.start_layer_idx <= i <= route.end_layer_idx else N for i in range(8)]
    assert [(s, L) for s, L, _ in seen] == [(k + N, model.text_len) for k in kept] and min(kept) < N
    for (_, _, index), k in zip(seen, kept):
        assert index.shape == (x.shape[0], k + N)
        assert (index[:, :k] == 0).all() and (index[:, k:] == 1).all()


def test_edit_ratio_zero_permuted_equals_dense_and_gradients_reach_the_parameters():
    """(d) selection_ratio 0 with a random permutation of the target tokens equals dense (1e-5); under a route every
    parameter the dense edit model trains gets a gradient."""
    model = edit(fc.RATIO_ZERO)
    x, t, y = fc.inputs(model)
    cond = {"reference": reference_for(model)}
    fc.check_ratio_zero_model(model, (x, t, y), cond)

    def grads(routes):
        m = edit(routes).train()
        m(x, t, y, cond=cond).square().mean().backward()
        return {n: p.grad for n, p in m.named_parameters()}

    dense_g, routed_g = grads(None), grads(SPAN)
    trained = [n for n, g in dense_g.items() if g is not None and g.abs().sum() > 0]
    assert trained and all(routed_g[n] is not None and routed_g[n].abs().sum() > 0 for n in trained)


def test_edit_needs_reference_latents_and_data_must_match():
    """model.kontext=true without cond['reference'] is refused; the data must have reference latents exactly when edit
    is on (references with edit off would be dropped silently)."""
    model = edit()
    x, t, y = fc.inputs(model)
    with pytest.raises(FamilyConfigError, match=r"model.kontext=true needs .*cond\['reference'\]"):
        model(x, t, y)
    text = {"text": (8, model.text_dim), "pooled": None}
    with pytest.raises(FamilyConfigError, match="no reference latents"):
        model.check_text_data(text, "/data/x")
    model.check_text_data({**text, "reference": (4, 8, 8)}, "/data/x")
    with pytest.raises(FamilyConfigError, match="model.kontext=false would ignore them"):
        fc.make(FAMILY).check_text_data({**text, "reference": (4, 8, 8)}, "/data/x")


def test_edit_trains_with_the_references(tiny_cfg, tmp_path, monkeypatch):
    """(e) train.py model=qwen_image model.kontext=true (zero_cond_t): the data's references reach the model in every
    training step, null labels (label dropout) included; data without references is one clear error. (Sampling with
    the references is the generic path tests/test_family_flux_kontext.py covers.)"""
    import numpy as np

    from tread.data import write_latent_dataset
    from tread.models.families.qwen_image import QwenImageFamily
    from tread.training.loop import train

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    data = write_latent_dataset(tmp_path / "edit", -ref, np.arange(16) % 2, num_classes=2, dtype="float32",
                                extras={"reference": ref})
    seen = []
    real = QwenImageFamily.conditioning
    monkeypatch.setattr(QwenImageFamily, "conditioning", lambda self, labels, cond: seen.append(
        (labels.clone(), (cond or {}).get("reference"))) or real(self, labels, cond))
    cfg = tiny_cfg("model=qwen_image", "model.kontext=true", "model.config={zero_cond_t: true}", f"data.path={data}",
                   "data.builtin=null", "data.resolution=8", "data.channels=3", "data.num_classes=2",
                   "train.batch_size=8", "train.max_steps=2", "eval.every_steps=0", "eval.at_end=false",
                   "train.label_dropout=0.5")
    train(cfg, tmp_path / "run")
    assert seen and all(r is not None and r.shape[1:] == (3, 8, 8) for _, r in seen)
    assert any((y == 2).any() for y, _ in seen)                    # null labels (dropout, CFG) kept the reference
    with pytest.raises(FamilyConfigError, match=r"model.kontext=true but the data at data.path=.*no reference"):
        train(tiny_cfg("model=qwen_image", "model.kontext=true", "train.max_steps=1", "eval.every_steps=0",
                       "eval.at_end=false"), tmp_path / "nope")
