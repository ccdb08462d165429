"""Lumina-Image 2.0 (diffusers Lumina2Transformer2DModel) with TREAD routing: the proofs only Lumina2 needs (the
joint [padded caption, image] sequence with a key mask equals diffusers' per-sample packing, the never-routed
refiners, per-sample RoPE rows on the kept subsequence, the reversed timestep and the sign of the prediction
against Lumina2Pipeline's own sampling loop); the shared checks run for Lumina2 in tests/test_families.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import family_checks as fc
from test_families import SPAN, route
from tread.models.families import FamilyConfigError

FAMILY = "lumina2"
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_text(model, lengths=(6, 3, 1), length: int = 6, seed: int = 2, mask=None) -> dict:
    """Gemma-style text: right-padded embeddings and a keep-mask, a different effective length per sample."""
    g = torch.Generator().manual_seed(seed)
    if mask is None:
        mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return {"text": torch.randn(mask.shape[0], mask.shape[1], model.text_dim, generator=g), "text_mask": mask}


def record_layer_inputs(layer):
    """Forward pre-hook on a Lumina2TransformerBlock: records (sequence length, attention_mask) of every call."""
    seen = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        seen.append((hidden.shape[1], None if mask is None else mask.clone()))
    return seen, layer.register_forward_pre_hook(hook, with_kwargs=True)


MASKS = {  # caption keep-masks over 6 text tokens, 3 samples
    "different-lengths": (6, 3, 1),      # diffusers: per-sample packing + padding mask
    "no-padding": (6, 6, 6),             # diffusers: mask None
    "equal-padding": (4, 4, 4),          # diffusers: mask None, a shorter joint sequence (4 + N)
    "empty-prompt": (0, 3, 6),           # a sample with no caption token at all
    "not-a-prefix": torch.tensor([[1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 1, 0]], dtype=torch.bool),
    "no-mask": None,                     # class text (no text_mask): diffusers gets all ones, mask None
}


@pytest.mark.parametrize("case", list(MASKS))
def test_joint_sequence_with_key_mask_equals_diffusers_per_sample_packing(case):
    """Our joint layers see [the full padded caption (L), all image tokens] with the key mask [arange(L) < cap_len,
    ones]; diffusers packs [caption[:cap_len], image, padding] per sample, masked only when the lengths differ.
    Attention is permutation-equivariant given per-token RoPE and the mask, so the outputs agree (1e-6)."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    N, L = model.num_tokens, 6
    spec = MASKS[case]
    cond = masked_text(model, mask=spec) if isinstance(spec, torch.Tensor) else masked_text(model, spec or (L,) * 3)
    if spec is None:
        del cond["text_mask"]
    ref = model.pristine_transformer()
    theirs_seen, h1 = record_layer_inputs(ref.layers[0])
    ours_seen, h2 = record_layer_inputs(model.transformer.layers[0])
    try:
        with torch.no_grad():
            ours, theirs = model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond, transformer=ref)
    finally:
        h1.remove(), h2.remove()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    (S_theirs, mask_theirs), = theirs_seen
    (S_ours, mask_ours), = ours_seen
    lengths = torch.full((3,), L) if spec is None else cond["text_mask"].sum(1)
    assert S_ours == L + N and S_theirs == int(lengths.max()) + N
    assert (mask_theirs is None) == (len(set(lengths.tolist())) == 1)      # diffusers' use_mask
    if spec is None:
        assert mask_ours is None   # no text mask: no mask in the joint layers (flash attention on GPU)
    else:
        want = torch.cat([torch.arange(L)[None] < lengths[:, None], torch.ones(3, N, dtype=torch.bool)], dim=1)
        assert torch.equal(mask_ours, want)
    if case == "different-lengths":   # the mask is honoured: without it the padded samples change
        with torch.no_grad():
            unmasked = model(x, t, y, cond={"text": cond["text"]})
        torch.testing.assert_close(unmasked[0], ours[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(unmasked[1:], ours[1:], atol=1e-4)


@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "masked-text"])
@pytest.mark.parametrize("routes", [SPAN, [route(0.75, 0, -1)]], ids=["inner", "all-layers"])
def test_kept_tokens_equal_layers_on_subsequence(routes, masked):
    """3. Kept tokens after the route = diffusers' joint layers run, per sample, on diffusers' own packing of the
    kept subsequence: [the sample's effective caption (cap_len tokens), the kept image tokens] without a mask, with
    RoPE rows taken from diffusers' rope_embedder at the TRUE positions (caption (i, 0, 0), image (cap_len, row,
    col): the image rows differ per sample), the sample's own temb."""
    r = fc.routed_run(FAMILY, routes, cond=masked_text if masked else None)
    model, x, t, y, seen, routed_in, route_ = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    text = r.cond["text"] if masked else model.conditioning(y, None)["text"]
    mask = r.cond["text_mask"] if masked else torch.ones(text.shape[:2], dtype=torch.long)
    start, end = route_.start_layer_idx, route_.end_layer_idx
    with torch.no_grad():
        for b in range(x.shape[0]):
            temb, _ = ref.time_caption_embed(x[b:b + 1], 1 - t[b:b + 1] / 1000, text[b:b + 1])
            _, _, _, rot, (cap,), _ = ref.rope_embedder(x[b:b + 1], mask[b:b + 1])   # (1, cap + N, Dh/2)
            rope = torch.cat([rot[:, :cap], rot[:, cap + ids[b]]], dim=1)            # true positions of kept tokens
            c = seen[start][1][b:b + 1, :cap]                                         # effective caption at start
            h = seen[start][0][b:b + 1, ids[b]]                                       # dense route-start, kept subset
            for blk in ref.layers[start:end + 1]:
                out = blk(torch.cat([c, h], dim=1), None, rope, temb)
                c, h = out[:, :cap], out[:, cap:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if end + 1 < model.depth:   # the caption stream (context) after the route
                torch.testing.assert_close(routed_in[end + 1][1][b:b + 1, :cap], c, rtol=1e-5, atol=1e-5)
    if masked:   # per-sample image RoPE rows: samples with different caption lengths get different rows
        assert len(set(r.cond["text_mask"].sum(1).tolist())) > 1


def test_refiners_run_on_all_tokens_before_the_routes_and_are_never_routed():
    """The context refiner (caption only) and the noise refiner (image only) are not routable blocks; they run in
    embed on every token, and their outputs are bit-identical with and without routing (a route from layer 0),
    and equal diffusers' refiners run by hand."""
    model = fc.make(FAMILY, [route(0.5, 0, -1)])
    tr = model.transformer
    assert model.routable_blocks() == list(tr.layers) and model.depth == len(tr.layers) == 8
    refiners = [*tr.context_refiner, *tr.noise_refiner]
    assert len(refiners) == 4 and not any(r is b for r in refiners for b in model.routable_blocks())
    x, t, y = fc.inputs(model)
    cond = masked_text(model)
    L, N = cond["text"].shape[1], model.num_tokens

    embedded, real_embed = [], model.embed

    def spy(*args, **kwargs):
        emb = real_embed(*args, **kwargs)
        embedded.append((emb.x.detach().clone(), emb.context.detach().clone(), emb.per_token["rope"].clone()))
        return emb
    model.embed = spy
    calls = [record_layer_inputs(layer) for layer in refiners]
    try:
        with torch.no_grad():
            model.eval()(x, t, y, cond=cond)
            with fc.fixed_selection(model, fc.random_permutation(4)), torch.enable_grad():
                model.train()(x, t, y, cond=cond)
    finally:
        del model.embed
        for _, handle in calls:
            handle.remove()
    assert model.last_route_stats == [(0, 7, N // 2, N)]                    # the routed run routed
    (dense, routed) = embedded
    for a, b in zip(dense, routed):
        assert torch.equal(a, b)
    for (seen, _), want in zip(calls, [L, L, N, N]):
        assert [s for s, _ in seen] == [want, want]                           # all tokens, dense and routed
    # ... and they are diffusers' refiners: run them by hand as Lumina2Transformer2DModel.forward does
    ref = model.pristine_transformer()
    mask = cond["text_mask"]
    with torch.no_grad():
        temb, cap = ref.time_caption_embed(x, 1 - t / 1000, cond["text"])
        patches, cap_rope, img_rope, _, lengths, _ = ref.rope_embedder(x, mask)
        img = ref.x_embedder(patches)
        for layer in ref.context_refiner:
            cap = layer(cap, mask, cap_rope)
        for layer in ref.noise_refiner:
            img = layer(img, None, img_rope, temb)
    ours_x, ours_ctx, _ = dense
    torch.testing.assert_close(ours_x, img, rtol=1e-6, atol=1e-6)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(ours_ctx[b, :n], cap[b, :n], rtol=1e-6, atol=1e-6)
        assert not ours_ctx[b, n:].any()                                      # padding rows zeroed


def test_timestep_sign_and_shift_follow_lumina2_pipeline():
    """Lumina2Pipeline's own loop (FlowMatchEulerDiscreteScheduler with configs/model/lumina2.yaml's shift,
    timestep = 1 - t / 1000 fed to the transformer, scheduler stepped with -noise_pred) gives the latents our
    rectified-flow Euler sampler gives with our model: the reversed timestep, the sign and the shift agree."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    from tread.diffusion import RectifiedFlow

    shift = OmegaConf.load(REPO / "configs" / "model" / "lumina2.yaml").diffusion.shift
    assert shift == 6.0
    model = fc.make(FAMILY).eval()
    tr = model.pristine_transformer()
    pipe = Lumina2Pipeline(transformer=tr, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), vae=None,
                           text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    cond = masked_text(model, (6, 3))
    noise = torch.randn(2, model.in_channels, model.input_size, model.input_size,
                        generator=torch.Generator().manual_seed(0))
    fed, handle = [], tr.register_forward_pre_hook(lambda m, a, k: fed.append(k["timestep"].clone()),
                                                   with_kwargs=True)
    try:
        with torch.no_grad():
            theirs = pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"], guidance_scale=1.0,
                          num_inference_steps=3, latents=noise.clone(), output_type="latent",
                          height=model.input_size * 8, width=model.input_size * 8, return_dict=False)[0]
    finally:
        handle.remove()
    sigmas = pipe.scheduler.sigmas[:-1]
    torch.testing.assert_close(torch.stack([f[0] for f in fed]), 1 - sigmas)    # t = 1 is the image
    rf = RectifiedFlow(shift=shift, num_steps=3)
    ours = rf.sample(rf.precondition(model), noise, torch.zeros(2, dtype=torch.long), cond=cond)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # our forward feeds the transformer 1 - sigma as well (timestep() itself is sigma: the shared convention)
    x, t, y = fc.inputs(model)
    got, handle = [], model.transformer.time_caption_embed.register_forward_pre_hook(
        lambda m, a: got.append(a[1].clone()))
    try:
        with torch.no_grad():
            model(x, t, y)
    finally:
        handle.remove()
    torch.testing.assert_close(model.timestep(t), t / 1000)
    torch.testing.assert_close(got[0], 1 - t / 1000)


def test_text_longer_than_the_caption_rope_table_is_refused():
    """The image's first RoPE id is the caption length: text of L tokens needs axes_lens[0] > L."""
    model = fc.make(FAMILY, config={"axes_lens": [8, 512, 512]}).eval()    # the class table's text: 8 tokens
    x, t, y = fc.inputs(model)
    with pytest.raises(FamilyConfigError, match=r"axes_lens\[0\] > 8"):
        model(x, t, y)
    with torch.no_grad():
        model(x, t, y, cond=masked_text(model, length=7, lengths=(7, 3, 1)))
