"""Z-Image (diffusers ZImageTransformer2DModel) with TREAD routing: the proofs only Z-Image has (the kept subsequence
against diffusers' own joint sequence, the never-routed refiners, image / caption pad tokens and per-sample caption
padding, the reversed timestep and negated output of ZImagePipeline, the refused omni mode); the shared checks run
for Z-Image in tests/test_families.py."""
from __future__ import annotations

import inspect

import pytest
import torch

import family_checks as fc
from test_families import RGB16, SPAN, route
from tread.models.families import FamilyConfigError, build_family

FAMILY = "z_image"

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_text(model, seed: int = 4) -> dict:
    """Prompts of 40, 3 and 7 real tokens (L = 40): padded captions of 64, 32 and 32 tokens, so diffusers batches
    them with an attention mask; the third one is LEFT-padded (the pipeline selects the real tokens by the mask)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0], mask[1, :3], mask[2, -7:] = True, True, True
    return {"text": torch.randn(3, 40, model.text_dim, generator=g), "text_mask": mask}


def random_pad_tokens(model, seed: int = 9) -> None:
    """diffusers initialises x_pad_token / cap_pad_token to zeros: random values make the pads visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (model.transformer.x_pad_token, model.transformer.cap_pad_token):
            p.copy_(torch.randn(p.shape, generator=g))


def captions(model, y, cond):
    """What ZImagePipeline passes as cap_feats: each prompt's real tokens (prompt_embeds[i][prompt_masks[i]])."""
    if cond is None:
        return list(model.conditioning(y, None)["text"].unbind(0))
    return [cond["text"][i][cond["text_mask"][i]] for i in range(cond["text"].shape[0])]


def diffusers_inputs_of(transformer, module, x, sigma, caps):
    """Run diffusers' forward as the pipeline calls it; return the positional args `module` received."""
    seen = {}
    hook = module.register_forward_pre_hook(lambda m, args: seen.setdefault("args", args))
    with torch.no_grad():
        transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, caps, return_dict=False)
    hook.remove()
    return seen["args"]


@pytest.mark.parametrize("case", ["class-text-4x4-pads", "masked-text-4x4-pads", "class-text-8x8-rgb"])
@pytest.mark.parametrize("routes", [SPAN, [route(0.75, 0, -1)]], ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, case):
    """3. Kept tokens after the route = diffusers' main blocks run on the kept subsequence, per sample: diffusers' own
    joint sequence and RoPE rows entering the route's first block (captured from its forward) are sliced to the
    kept image tokens + the image pad tokens + the sample's padded caption (no batch padding, no mask), with the
    sample's timestep embedding. Pad tokens are random, so a wrong pad value or pad position would show."""
    masked = case.startswith("masked")
    kw = RGB16 if case.endswith("rgb") else {}

    def prepare(model):   # routed_run calls it on the built model before both runs
        random_pad_tokens(model)
        return masked_text(model) if masked else None

    r = fc.routed_run(FAMILY, routes, cond=prepare, **kw)
    model, start, end = r.model, r.route.start_layer_idx, r.route.end_layer_idx
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    N, sigma = model.num_tokens, r.t / 1000
    P = (-N) % 32
    assert P == (0 if kw else 16)
    assert model.transformer.x_pad_token.abs().sum() > 0
    caps = captions(model, r.y, r.cond)
    args = diffusers_inputs_of(ref, ref.layers[start], r.x, sigma, caps)
    unified, mask, freqs, adaln = args[:4]
    assert (mask is not None) == masked
    # the dense tokens entering the route's first block are diffusers' image rows there
    torch.testing.assert_close(r.dense[start][0], unified[:, :N], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for b in range(r.x.shape[0]):
            c = 32 * ((len(caps[b]) + 31) // 32)                  # the sample's padded caption
            rows = torch.cat([ids[b], torch.arange(N, N + P + c)])
            h, f = unified[b:b + 1, rows], freqs[b:b + 1, rows]
            for blk in ref.layers[start:end + 1]:
                h = blk(h, None, f, adaln[b:b + 1])
            torch.testing.assert_close(x_kept[b:b + 1], h[:, :ids.shape[1]], rtol=1e-5, atol=1e-5)


def test_refiners_never_routed_and_identical_with_routing():
    """The noise refiner (image + image pad tokens) and the context refiner (caption tokens) are not routable blocks;
    they run on the full sequences before the main blocks, and their outputs are bit-identical with and without a
    route that starts at block 0 (and equal diffusers' own refiner outputs)."""
    model = fc.make(FAMILY, [route(0.5, 0, -1)])
    tr = model.transformer
    assert model.routable_blocks() == list(tr.layers) and model.depth == 8
    refiners = {*tr.noise_refiner, *tr.context_refiner}
    assert not refiners & set(model.routable_blocks())
    random_pad_tokens(model)
    x, t, y = fc.inputs(model)
    cond = masked_text(model)

    def outputs(run):
        seen, hooks = {}, []
        for name, mod in (("noise", tr.noise_refiner[-1]), ("context", tr.context_refiner[-1])):
            hooks.append(mod.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, out.detach())))
        run()
        for h in hooks:
            h.remove()
        return seen

    with torch.no_grad():
        dense = outputs(lambda: model.eval()(x, t, y, cond=cond))
    with fc.capture_routes() as log:
        routed = outputs(lambda: model.train()(x, t, y, cond=cond))
    assert len(log["scatter"]) == 1 and log["scatter"][0][2].shape == (3, 8)     # the route ran: 8 of 16 kept
    assert dense["noise"].shape == (3, 16 + 16, 64) and dense["context"].shape == (3, 64, 64)
    for name in ("noise", "context"):
        assert torch.equal(dense[name], routed[name]), name
    ref = model.pristine_transformer()
    caps = captions(model, y, cond)
    noise_ref = diffusers_inputs_of(ref, ref.layers[0], x, t / 1000, caps)[0]
    torch.testing.assert_close(dense["noise"], noise_ref[:, :32], rtol=1e-6, atol=1e-6)
    for b, cap in enumerate(caps):   # diffusers' unified: [image (+pads), caption (+pads)], caption after 32 rows
        c = 32 * ((len(cap) + 31) // 32)
        torch.testing.assert_close(dense["context"][b, :c], noise_ref[b, 32:32 + c], rtol=1e-6, atol=1e-6)


def test_dense_with_pad_tokens_and_per_sample_caption_padding_equals_diffusers():
    """Random x_pad_token / cap_pad_token, a 4x4 token grid (16 image pad tokens with RoPE id (0, 0, 0)) and captions
    of 40 / 3 / 7 real tokens (padded to 64 / 32 / 32: image ids start at 65 / 33 / 33, batch attention mask): our
    dense forward equals diffusers'; the pads matter (changing a pad token changes the output)."""
    model = fc.make(FAMILY).eval()
    random_pad_tokens(model)
    x, t, y = fc.inputs(model)
    cond = masked_text(model)
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond=cond), rtol=1e-6, atol=1e-6)
        for p in (model.transformer.x_pad_token, model.transformer.cap_pad_token):
            p.add_(1.0)
            moved = model(x, t, y, cond=cond)
            assert not torch.allclose(moved, ours, atol=1e-4)
            torch.testing.assert_close(moved, model.reference_forward(x, t, y, cond=cond), rtol=1e-6, atol=1e-6)
            ours = moved
        # a sample's output does not depend on the other samples' caption lengths (batch padding is masked)
        alone = model(x[1:2], t[1:2], y[1:2], cond={k: v[1:2] for k, v in cond.items()})
        torch.testing.assert_close(ours[1:2], alone, rtol=1e-5, atol=1e-5)


def test_image_pad_tokens_are_context_not_routable():
    """4x4 grid: the router sees the 16 image tokens only (K = 8 of 16); the 16 image pad tokens travel with the
    caption as never-routed context (full length in every block) and get gradients."""
    model = fc.make(FAMILY, SPAN).train()
    random_pad_tokens(model)
    x, t, y = fc.inputs(model)
    seen, out = fc.block_inputs(model, x, t, y)
    assert model.last_route_stats == [(1, 6, 8, 16)]
    for i, (h, (pad, cap)) in enumerate(seen):
        assert h.shape[1] == (8 if 1 <= i <= 6 else 16)
        assert pad.shape == (3, 16, 64) and cap.shape == (3, 32, 64)
    out.square().mean().backward()
    assert model.transformer.x_pad_token.grad.abs().sum() > 0


def test_pipeline_step_equals_our_velocity_euler():
    """Timestep convention and sign, against ZImagePipeline itself (no text encoder / VAE: prompt_embeds and
    output_type='latent'): the pipeline feeds the transformer 1 - sigma and steps with minus its output; Euler
    steps dz = (sigma' - sigma) v with our model's v at noise_level = sigma * 1000 land on the same latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    model = fc.make(FAMILY, num_classes=0).eval()
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(2, 4, 8, 8, generator=g)
    cond = {"text": torch.randn(2, 6, model.text_dim, generator=g),
            "text_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)}
    tr = model.pristine_transformer()
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None, text_encoder=None,
                          tokenizer=None, transformer=tr)
    fed = []
    hook = tr.register_forward_pre_hook(lambda m, args: fed.append(args[1].clone()))
    with torch.no_grad():
        theirs = pipe(prompt_embeds=captions(model, None, cond), height=64, width=64, num_inference_steps=3,
                      guidance_scale=0.0, latents=noise.clone(), output_type="latent", return_dict=False)[0]
    hook.remove()
    sigmas = pipe.scheduler.sigmas
    assert len(fed) == 3 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    for i, tt in enumerate(fed):       # reversed: the transformer sees 1 - sigma (1 = clean)
        torch.testing.assert_close(tt, (1 - sigmas[i]).expand(2), rtol=0, atol=1e-6)
    z = noise.clone()
    with torch.no_grad():
        for i in range(3):
            v = model(z, (sigmas[i] * 1000).expand(2), torch.zeros(2, dtype=torch.long), cond=cond)
            z = z + (sigmas[i + 1] - sigmas[i]) * v
    torch.testing.assert_close(z, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.timestep(torch.tensor([250.0])), torch.tensor([0.25]))


def test_omni_mode_is_refused():
    """Reference images (ZImageOmniPipeline's clean-image / SigLIP mode) are refused with FamilyConfigError."""
    model = fc.make(FAMILY)
    x, t, y = fc.inputs(model, batch=2)
    cond = {"text": torch.randn(2, 5, model.text_dim), "reference": torch.randn_like(x)}
    with pytest.raises(FamilyConfigError, match="omni"):
        model(x, t, y, cond=cond)
    with pytest.raises(FamilyConfigError, match="reference_latents.npy"):
        model.check_text_data({"text": (5, model.text_dim), "reference": (4, 8, 8)}, "/data")
    with pytest.raises(FamilyConfigError, match="siglip_feat_dim=32"):
        build_family(FAMILY, input_size=8, in_channels=4, num_classes=3, config={"siglip_feat_dim": 32})


def test_released_geometry_is_diffusers_defaults():
    """The z-image-turbo preset is ZImageTransformer2DModel's defaults (Z-Image-Turbo): 30 main blocks, 2 + 2
    refiners, width 3840, 30 heads of 128 (RoPE 32/48/48), Qwen3-4B width 2560; 6.15B parameters (meta device)."""
    from diffusers import ZImageTransformer2DModel

    from tread.models.families.z_image import PRESETS

    preset = PRESETS["z-image-turbo"]
    defaults = {k: p.default for k, p in inspect.signature(ZImageTransformer2DModel.__init__).parameters.items()
                if k in preset}
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()} == preset
    with torch.device("meta"):
        model = build_family(FAMILY, preset="z-image-turbo", input_size=128, in_channels=16, num_classes=0)
    tr = model.transformer
    assert (len(tr.layers), len(tr.noise_refiner), len(tr.context_refiner), model.depth) == (30, 2, 2, 30)
    assert model.num_tokens == 64 * 64
    assert abs(sum(p.numel() for p in tr.parameters()) / 1e9 - 6.15) < 0.01
