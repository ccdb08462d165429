"""Chroma (diffusers ChromaTransformer2DModel) with TREAD routing: the proofs only Chroma has (the approximator's
per-block modulation slices, the kept subsequence with its true RoPE ids and its block's slice, the text attention
mask); the shared checks run for Chroma in tests/test_families.py."""
from __future__ import annotations

import inspect

import pytest
import torch

import family_checks as fc
from test_families import CROSS, route

FAMILY = "chroma"

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)


def masked_text(model, seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"text": torch.randn(3, 5, model.text_dim, generator=g), "text_mask": MASK.clone()}


def capture_tembs(transformer):
    """Record the `temb` each block gets and the modulation norm_out gets, in block order."""
    seen, hooks = [], []

    def block_hook(module, args, kwargs):
        seen.append(kwargs["temb"].detach().clone())

    def norm_hook(module, args, kwargs):
        seen.append((args[1] if len(args) > 1 else kwargs["emb"]).detach().clone())

    for blk in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        hooks.append(blk.register_forward_pre_hook(block_hook, with_kwargs=True))
    hooks.append(transformer.norm_out.register_forward_pre_hook(norm_hook, with_kwargs=True))
    return seen, hooks


def test_modulation_slices_equal_diffusers():
    """Every block (2 dual, 6 single) and the output norm get, per sample, exactly the approximator rows that
    diffusers' forward hands them; the slices partition the approximator's 3*6 + 12*2 + 2 = 44 rows."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    ref_tr = model.pristine_transformer()
    ours, h1 = capture_tembs(model.transformer)
    theirs, h2 = capture_tembs(ref_tr)
    with torch.no_grad():
        model(x, t, y)
        model.reference_forward(x, t, y, transformer=ref_tr)
    for h in h1 + h2:
        h.remove()
    assert len(ours) == len(theirs) == 9
    assert [tuple(a.shape[1:2]) for a in ours] == [(12,)] * 2 + [(3,)] * 6 + [(2,)]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"block {i}: modulation differs from diffusers'"
    assert not torch.equal(ours[0][0], ours[0][1])   # per sample (different timesteps)
    # Which rows: index tensors through modulation() cover every row once.
    M = ref_tr.time_text_embed.mod_proj.shape[0]
    assert M == 3 * 6 + 12 * 2 + 2
    rows = torch.arange(M, dtype=torch.float32).view(1, M, 1)
    used = [model.modulation(rows, i).flatten() for i in range(8)] + [rows[:, -2:].flatten()]
    assert torch.equal(torch.cat(used).sort().values, torch.arange(M, dtype=torch.float32))
    assert used[0].tolist() == [*range(18, 24), *range(30, 36)]   # dual 0: image rows 3S.., text rows 3S+6D..
    assert used[2].tolist() == [0, 1, 2]                          # single 0


ROUTES = {"double-to-single": CROSS, "single-only-to-end": [route(0.75, 3, -1)], "double-only": [route(0.5, 0, 1)]}


@pytest.mark.parametrize("with_mask", [True, False], ids=["text-mask", "class-table"])
@pytest.mark.parametrize("routes", list(ROUTES.values()), ids=list(ROUTES))
def test_kept_tokens_equal_blocks_on_subsequence(routes, with_mask):
    """3. Kept tokens after the route = diffusers' blocks (default processors) run on the kept subsequence, per
    sample, with the kept tokens' own position ids (RoPE from the sliced ids), the block's own approximator rows
    (sliced here as ChromaTransformer2DModel.forward slices them) and the [text mask, ones] attention mask."""
    r = fc.routed_run(FAMILY, routes, cond=masked_text if with_mask else None)
    model, x, t, y, seen, routed_in, route = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    dual, single = list(ref_tr.transformer_blocks), list(ref_tr.single_transformer_blocks)
    D, S = len(dual), len(single)
    img_ids = model.image_ids(x.device, model.grid_of(x))
    with torch.no_grad():
        pooled = ref_tr.distilled_guidance_layer(ref_tr.time_text_embed(t / 1000 * 1000))   # (B, 3S+12D+2, D)
        for b in range(x.shape[0]):
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]           # dense route-start tokens, kept subset
            c = seen[route.start_layer_idx][1][b:b + 1]                   # text stream at the route's start
            L, K = c.shape[1], h.shape[1]
            rope = ref_tr.pos_embed(torch.cat([torch.zeros(L, 3), img_ids[ids[b]]]))  # true positions
            mask = torch.cat([MASK[b:b + 1], torch.ones(1, K, dtype=torch.bool)], 1) if with_mask else None
            for k in range(route.start_layer_idx, route.end_layer_idx + 1):
                if k < D:
                    i, o = 3 * S + 6 * k, 3 * S + 6 * D + 6 * k
                    temb = torch.cat([pooled[b:b + 1, i:i + 6], pooled[b:b + 1, o:o + 6]], 1)
                    c, h = dual[k](hidden_states=h, encoder_hidden_states=c, temb=temb, image_rotary_emb=rope,
                                   attention_mask=mask)
                else:
                    j = 3 * (k - D)
                    out = single[k - D](hidden_states=torch.cat([c, h], 1), temb=pooled[b:b + 1, j:j + 3],
                                        image_rotary_emb=rope, attention_mask=mask)
                    c, h = out[:, :L], out[:, L:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < D + S:                            # the text stream after the route
                torch.testing.assert_close(routed_in[route.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)


def _perturb_padding(cond: dict, real: bool = False) -> dict:
    """The same conditioning with the text embeddings at masked positions (or, real=True, one real token) changed."""
    text, where = cond["text"].clone(), ~cond["text_mask"]
    if real:
        where = torch.zeros_like(where)
        where[:, 0] = True
    text[where] = torch.randn(int(where.sum()), text.shape[-1]) * 5
    return {**cond, "text": text}


@pytest.mark.parametrize("ckpt", [False, True], ids=["", "grad-checkpointing"])
def test_text_mask_is_honoured(ckpt):
    """Masked text positions change nothing, dense and routed (with gradient checkpointing too, where diffusers'
    own loop drops the single blocks' mask); a real token does; image tokens are never masked (an all-true text
    mask = no mask)."""
    model = fc.make(FAMILY, CROSS, gradient_checkpointing=ckpt)
    x, t, _ = fc.inputs(model)
    y = torch.zeros(3, dtype=torch.long)
    cond = masked_text(model)

    def run(c, train):
        model.train(train)
        model.routing.router.manual_seed(9)
        with torch.enable_grad() if train else torch.no_grad():
            return model(x, t, y, cond=c).detach()

    for train in (False, True):
        out = run(cond, train)
        torch.testing.assert_close(run(_perturb_padding(cond), train), out, rtol=0, atol=1e-6)
        assert not torch.allclose(run(_perturb_padding(cond, real=True), train), out, atol=1e-4)
        if train:
            assert model.last_route_stats
    full = {**cond, "text_mask": torch.ones_like(MASK)}
    torch.testing.assert_close(run(full, False), run({"text": cond["text"]}, False), rtol=0, atol=1e-6)


def test_pipeline_float_mask_is_a_bias_not_a_mask():
    """Why the mask is passed as booleans: ChromaPipeline 0.42.1 builds it in the text encoder's float dtype
    (0/1), which SDPA adds to the logits (diffusers #12116 / #13619): then padded text does leak in."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    tr = model.pristine_transformer()
    cond = masked_text(model)
    as_float = {**cond, "text_mask": cond["text_mask"].float()}
    with torch.no_grad():
        real = model.diffusers_forward(x, t / 1000, cond, tr)          # diffusers_forward makes it boolean
        mask = model.attention_mask(as_float["text_mask"], model.num_tokens).float()
        packed, L = model.pack(x), cond["text"].shape[1]
        img_ids = model.image_ids(x.device, model.grid_of(x))
        call = lambda text: tr(hidden_states=packed, encoder_hidden_states=text, timestep=t / 1000,
                               img_ids=img_ids, txt_ids=torch.zeros(L, 3), attention_mask=mask, return_dict=False)[0]
        bias = call(cond["text"])
        moved = call(_perturb_padding(cond)["text"])
    assert not torch.allclose(model.unpack(bias, model.grid_of(x)), real, atol=1e-4)
    assert not torch.allclose(bias, moved, atol=1e-4)


def test_released_geometry_is_diffusers_defaults():
    """The chroma1-hd preset is ChromaTransformer2DModel's defaults (Chroma1-HD): 19 dual + 38 single blocks,
    3*38 + 12*19 + 2 = 344 approximator rows, 8.9B parameters (meta device)."""
    from diffusers import ChromaTransformer2DModel

    from tread.models.families.chroma import PRESETS

    preset = PRESETS["chroma1-hd"]
    defaults = {k: p.default for k, p in inspect.signature(ChromaTransformer2DModel.__init__).parameters.items()
                if k in preset}
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()} == preset
    with torch.device("meta"):
        tr = ChromaTransformer2DModel(**preset)
    assert (len(tr.transformer_blocks), len(tr.single_transformer_blocks)) == (19, 38)
    assert tr.time_text_embed.mod_proj.shape[0] == 344
    assert abs(sum(p.numel() for p in tr.parameters()) / 1e9 - 8.9) < 0.01


def test_batched_rope_processor_with_fused_qkv():
    """Fused QKV projections honour per-sample RoPE (FLUX's processor, reused)."""
    fc.check_fused_projections(FAMILY, CROSS)
