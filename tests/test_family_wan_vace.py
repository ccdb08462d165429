"""Wan VACE (diffusers WanVACETransformer3DModel, WanVACEPipeline) with TREAD routing: the proofs only WanVACE has.

Dense equals the transformer as WanVACEPipeline.__call__ calls it (no control video: its blank context) and on a context
built by the pipeline's own prepare_video_latents + prepare_masks; kept tokens equal diffusers' main blocks on the kept
subsequence with their true RoPE rows and the VACE hints of their own positions added after the vace_layers blocks;
the VACE blocks run on the full sequence and their hints are untouched by routing. The shared checks run in
tests/test_families.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import family_checks as fc
from conftest import compose_cfg
from test_families import SPAN, VIDEO
from tread.models.families import FamilyConfigError
from tread.schema import ConfigError, check_train
from tread.schema.builders import build_model

FAMILY = "wan_vace"
SCALES = [1.0, 0.5, 2.0, 1.5]          # a different conditioning_scale per VACE layer (tiny: vace_layers 0, 2, 4, 6)

pytestmark = pytest.mark.usefixtures("one_thread")


class _StubVAE:
    """What WanVACEPipeline reads of its VAE (AutoencoderKLWan): the compression (temperal_downsample: 4x in time, 8x
    in space), dtype, latent statistics, and encode: a fixed linear map (8x8 pixel cells averaged, causal 4-frame
    groups: the first frame alone, then 4 at a time), so the blank (zero) video encodes to exactly 0."""

    def __init__(self, z_dim: int):
        self.temperal_downsample = [False, True, True]
        self.dtype = torch.float32
        self.config = SimpleNamespace(z_dim=z_dim, latents_mean=[0.1] * z_dim, latents_std=[2.0] * z_dim)
        self.mix = torch.randn(z_dim, 3, generator=torch.Generator().manual_seed(9))

    def encode(self, video: torch.Tensor) -> SimpleNamespace:
        B, C, F, H, W = video.shape
        cells = video.reshape(B, C, F, H // 8, 8, W // 8, 8).mean((4, 6))
        frames = [cells[:, :, :1]] + [cells[:, :, i:i + 4].mean(2, keepdim=True) for i in range(1, F, 4)]
        z = torch.einsum("zc,bcthw->bzthw", self.mix, torch.cat(frames, 2))
        return SimpleNamespace(latents=z + 0.1)    # + the latents_mean: the blank video -> 0 after normalisation


def _pipeline(model):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

    return WanVACEPipeline(tokenizer=None, text_encoder=None, vae=_StubVAE(model.in_channels),
                           scheduler=FlowMatchEulerDiscreteScheduler(), transformer=model.pristine_transformer())


def _first_call(pipe):
    seen: dict = {}

    def pre(_, args, kwargs):
        seen.setdefault("kwargs", dict(kwargs))

    def post(_, args, kwargs, out):
        seen.setdefault("out", out[0])

    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    pipe.transformer.register_forward_hook(post, with_kwargs=True)
    return seen


@pytest.mark.parametrize("frames", [1, 3], ids=["T1", "T3"])
def test_dense_equals_the_transformer_as_the_pipeline_calls_it(frames):
    """WanVACEPipeline.__call__ without a control video (its text-to-video call: blank video, mask ones) feeds the
    transformer our blank_control context and the per-layer conditioning_scale; our forward equals that call."""
    model = fc.make(FAMILY, frames=frames, conditioning_scale=SCALES).eval()
    x, _, y = fc.inputs(model, batch=1, frames=frames)
    cond = fc.masked_text(model, batch=1)
    cond["text"] = cond["text"] * cond["text_mask"][..., None]          # encode_prompt's zero padding rows
    pipe = _pipeline(model)
    seen = _first_call(pipe)
    _, _, T, H, W = x.shape
    with torch.no_grad():
        pipe(prompt_embeds=cond["text"], latents=x, height=H * 8, width=W * 8, num_frames=(T - 1) * 4 + 1,
             num_inference_steps=2, guidance_scale=1.0, conditioning_scale=SCALES, output_type="latent")
        kw = seen["kwargs"]
        torch.testing.assert_close(kw["control_hidden_states"], model.blank_control(x), rtol=0, atol=0)
        torch.testing.assert_close(kw["control_hidden_states_scale"], torch.tensor(SCALES), rtol=0, atol=0)
        ours = model(x, kw["timestep"], y, cond=cond)
    torch.testing.assert_close(ours, seen["out"], rtol=1e-6, atol=1e-6)


def test_given_control_is_the_pipelines_prepare_video_latents_and_masks():
    """A control video + mask through the pipeline's own prepare_video_latents (inactive / reactive latents) and
    prepare_masks (the 8x8 pixel cells as 64 channels), concatenated as __call__ does, is cond['control']: our
    forward equals the transformer on it, differs from the blank context, and the context conditions both CFG
    branches (the null label zeroes the text only)."""
    model = fc.make(FAMILY, frames=3, num_classes=5).eval()
    x, t, _ = fc.inputs(model, batch=1, frames=3)
    pipe = _pipeline(model)
    _, _, T, H, W = x.shape
    g = torch.Generator().manual_seed(3)
    video = torch.rand(1, 3, (T - 1) * 4 + 1, H * 8, W * 8, generator=g) * 2 - 1
    mask = (torch.rand(1, 3, (T - 1) * 4 + 1, H * 8, W * 8, generator=g) > 0.5).float()
    refs = [[]]                                          # what preprocess_conditions gives without reference images
    ctrl = torch.cat([pipe.prepare_video_latents(video, mask, refs, None, "cpu"), pipe.prepare_masks(mask, refs)], 1)
    assert ctrl.shape == (1, model.transformer.config.vace_in_channels, T, H, W)
    y = torch.tensor([1, model.num_classes])            # a label and the null label (CFG's unconditional branch)
    x2, t2, c2 = x.expand(2, -1, -1, -1, -1), t.expand(2), ctrl.expand(2, -1, -1, -1, -1)
    cond = {"text": fc.masked_text(model, batch=2)["text"], "control": c2}
    with torch.no_grad():
        ours = model(x2, t2, y, cond=cond)
        given = model.conditioning(y, cond)
        ref = model.transformer(hidden_states=x2, timestep=t2, encoder_hidden_states=given["text"],
                                control_hidden_states=c2, return_dict=False)[0]
        blank = model(x2, t2, y, cond={"text": cond["text"]})
    assert not given["text"][1].any() and given["text"][0].any() and given["control"] is c2   # null: text only
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, blank, atol=1e-3)
    with pytest.raises(FamilyConfigError, match=r"cond\['control'\] has shape"):
        model(x2, t2, y, cond={"control": c2[:, :-1]})


def _hints(ref_tr, x5, text, t, ctrl):
    """diffusers' VACE blocks on the FULL sequence of one sample: the hints (1, N, D) in vace_layers order."""
    rope = ref_tr.rope(x5)
    hidden = ref_tr.patch_embedding(x5).flatten(2).transpose(1, 2)
    c = ref_tr.vace_patch_embedding(ctrl).flatten(2).transpose(1, 2)
    _, proj, ctx, _ = ref_tr.condition_embedder(t, text)
    proj = proj.unflatten(1, (6, -1))
    hints = []
    for blk in ref_tr.vace_blocks:
        hint, c = blk(hidden, ctx, c, proj, rope)
        hints.append(hint)
    return hints, proj, ctx


@pytest.mark.parametrize("frames", [1, 3], ids=["T1", "T3"])
@pytest.mark.parametrize("routes", [SPAN, [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]],
                         ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence_with_hints_at_kept_positions(routes, frames):
    """3. Kept tokens after the route = diffusers' main blocks (default WanAttnProcessor) run on the kept subsequence,
    per sample, with the RoPE rows of their true (t, h, w) positions and, after each block of vace_layers, the VACE
    hint rows of the kept positions (from diffusers' VACE blocks on the full sequence) times that layer's scale.
    Teeth: the hints of other positions give other values."""
    r = fc.routed_run(FAMILY, routes, frames=frames, conditioning_scale=SCALES)
    model, x, t, y, seen, route = r.model, r.x, r.t, r.y, r.dense, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    layers = list(ref_tr.config.vace_layers)
    span = range(route.start_layer_idx, route.end_layer_idx + 1)
    assert any(i in layers for i in span)
    text = model.conditioning(y, None)["text"]
    x5 = x if x.dim() == 5 else x.unsqueeze(2)
    with torch.no_grad():
        cos, sin = ref_tr.rope(x5)
        for b in range(x.shape[0]):
            if frames > 1:
                assert len(set((ids[b] // (model.num_tokens // frames)).tolist())) > 1
            hints, proj, ctx = _hints(ref_tr, x5[b:b + 1], text[b:b + 1], t[b:b + 1], model.blank_control(x5[b:b + 1]))
            torch.testing.assert_close(seen[route.start_layer_idx][1][b:b + 1], ctx)

            def run(pos):
                h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]              # dense route-start tokens, kept
                for i in span:
                    h = ref_tr.blocks[i](h, ctx, proj, (cos[:, ids[b]], sin[:, ids[b]]))
                    if i in layers:
                        k = layers.index(i)
                        h = h + hints[k][:, pos] * SCALES[k]
                return h

            torch.testing.assert_close(x_kept[b:b + 1], run(ids[b]), rtol=1e-5, atol=1e-5)
            if b == 0:
                assert not torch.allclose(x_kept[b:b + 1], run(ids[b].flip(0)), rtol=1e-3, atol=1e-3)


def test_vace_hints_are_untouched_by_routing():
    """The VACE blocks see the full sequence in a routed step too: the hints of the routed forward are bit-identical
    to the dense forward's and equal diffusers' VACE blocks on the full sequence (all N tokens, not K)."""
    model = fc.make(FAMILY, SPAN, frames=3)
    x, t, y = fc.inputs(model, frames=3)
    got = []
    real = model.embed

    def spy(*args):
        emb = real(*args)
        got.append({k: v.detach().clone() for k, v in emb.per_token.items() if k.startswith("vace_hint")})
        return emb

    model.embed = spy
    with torch.no_grad():
        model.eval()(x, t, y)
    model.train()
    model(x, t, y)
    assert model.last_route_stats and len(got) == 2
    dense, routed = got
    assert list(dense) == [f"vace_hint{k}" for k in range(4)]
    for key in dense:
        assert routed[key].shape[1] == model.num_tokens and torch.equal(dense[key], routed[key])
    ref_tr = model.pristine_transformer()
    text = model.conditioning(y, None)["text"]
    with torch.no_grad():
        hints, _, _ = _hints(ref_tr, x, text, t, model.blank_control(x))
    for k, hint in enumerate(hints):
        torch.testing.assert_close(dense[f"vace_hint{k}"], hint, rtol=1e-6, atol=1e-6)


def test_hints_matter_and_scale_zero_is_wan():
    """conditioning_scale 0 drops every hint: the main path is then exactly diffusers' WanTransformer3DModel with the
    same weights (VACE = Wan + hints); scale 1 differs."""
    from diffusers import WanTransformer3DModel

    model = fc.make(FAMILY, frames=3, conditioning_scale=0.0).eval()
    x, t, y = fc.inputs(model, frames=3)
    cfg = {k: v for k, v in model.transformer.config.items() if not k.startswith("_")
           and k not in ("vace_layers", "vace_in_channels")}
    wan = WanTransformer3DModel(**cfg)
    missing, _ = wan.load_state_dict(model.transformer.state_dict(), strict=False)
    assert not missing
    with torch.no_grad():
        zero = model(x, t, y)
        text = model.conditioning(y, None)["text"]
        torch.testing.assert_close(zero, wan(x, t, text, return_dict=False)[0], rtol=1e-6, atol=1e-6)
        model.conditioning_scale = [1.0] * 4
        assert not torch.allclose(model(x, t, y), zero, atol=1e-3)


def test_per_sample_timesteps_only_and_config_errors():
    model = fc.make(FAMILY, frames=3)
    x, t, y = fc.inputs(model, frames=3)
    with pytest.raises(FamilyConfigError, match="per-sample"):
        model(x, t[:, None].expand(-1, model.num_tokens), y)
    for bad in ("x", [1.0] * 3, True):
        with pytest.raises(FamilyConfigError, match="conditioning_scale"):
            fc.make(FAMILY, conditioning_scale=bad)
    with pytest.raises(FamilyConfigError, match="model.i2v"):
        fc.make(FAMILY, frames=3, i2v=True)


def test_conditioning_scale_is_a_config_key():
    """model.conditioning_scale (configs/model/wan_vace.yaml: 1.0, the pipeline's default) reaches the family: a
    number for every VACE layer or one per layer; a wrong count, a string or the key on another family is one
    error naming it."""
    def built(*overrides):
        config = check_train(compose_cfg(overrides=["model=wan_vace", "debug=tiny", *overrides]))
        return build_model(config.model.plain())

    assert built().conditioning_scale == [1.0] * 4
    assert built("model.conditioning_scale=[0.5,1,1.5,2]").conditioning_scale == [0.5, 1.0, 1.5, 2.0]
    with pytest.raises(FamilyConfigError, match=r"conditioning_scale=\[0.5, 1.0\]: allowed: a number or a list of 4"):
        built("model.conditioning_scale=[0.5,1]")
    with pytest.raises(ConfigError, match="model.conditioning_scale"):
        check_train(compose_cfg(overrides=["model=wan_vace", "model.conditioning_scale=strong"]))
    with pytest.raises(ConfigError, match="model.conditioning_scale is a key of model.family=wan_vace"):
        check_train(compose_cfg(overrides=["model=wan", "+model.conditioning_scale=0.5"]))


def test_released_geometries_on_meta():
    """The released Wan2.1-VACE configs (diffusers' converter): 30 blocks + 15 VACE blocks (every 2nd), 40 + 8
    (every 5th); context 96 = 2 x 16 + 64 with the Wan 2.1 VAE's 16 channels."""
    for preset, depth, layers, width in (("wan2.1-vace-1.3b", 30, list(range(0, 30, 2)), 1536),
                                         ("wan2.1-vace-14b", 40, list(range(0, 40, 5)), 5120)):
        with torch.device("meta"):
            model = fc.build_family(FAMILY, input_size=60, in_channels=16, num_classes=0, preset=preset, frames=21)
        c = model.transformer.config
        assert model.depth == depth and model.vace_layers == layers and len(model.transformer.vace_blocks) == len(layers)
        assert c.vace_in_channels == 96 and c.num_attention_heads * c.attention_head_dim == width
        assert model.token_grid == (21, 30, 30)
    with pytest.raises(FamilyConfigError, match="vace_in_channels=96"):
        fc.build_family(FAMILY, input_size=8, in_channels=4, num_classes=0, preset="tiny",
                        config={"vace_in_channels": 96})


def test_prompts_are_the_pipelines_encode_prompt(tmp_path, monkeypatch):
    """Our stored text (tiny UMT5EncoderModel) equals WanVACEPipeline.encode_prompt's rows, with the mask of the real
    tokens; it equals Wan's own encoding (the same UMT5 path) and feeds the tiny preset."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline
    from tread.encoders.text import encode_prompts, load_text_encoders
    from tread.encoders.tiny_text import save_tiny_text_encoders

    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path / "enc"))
    prompts = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
    ours = encode_prompts(FAMILY, enc, prompts, max_length=16)
    pipe = WanVACEPipeline(tokenizer=enc.tokenizers["tokenizer"], text_encoder=enc.models["text_encoder"], vae=None,
                           scheduler=FlowMatchEulerDiscreteScheduler())
    from diffusers.pipelines.wan import pipeline_wan_vace
    if not hasattr(pipeline_wan_vace, "ftfy"):   # the pipeline uses ftfy unimported when it is missing (a NameError)
        monkeypatch.setattr(pipeline_wan_vace, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)
    with torch.inference_mode():
        text, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu")
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel" and text.shape == (3, 16, 32)
    np.testing.assert_allclose(ours["text"], text.float().numpy(), rtol=1e-5, atol=1e-6)
    n = ours["text_mask"].sum(1)
    assert n[1] < n[0] < n[2] < 16 and not ours["text"][~ours["text_mask"]].any()
    wan = encode_prompts("wan", {"text_encoder": enc.models["text_encoder"], "tokenizer": enc.tokenizers["tokenizer"]},
                         prompts, max_length=16)
    for key in ("text", "text_mask"):
        np.testing.assert_allclose(ours[key], wan[key], rtol=1e-6, atol=1e-6)
    model = fc.make(FAMILY, frames=3).eval()
    x, t, y = fc.inputs(model, frames=3)
    cond = {k: torch.from_numpy(v) for k, v in ours.items()}
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-6, atol=1e-6)
