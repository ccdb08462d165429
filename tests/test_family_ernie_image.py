"""ERNIE-Image (diffusers ErnieImageTransformer2DModel, ErnieImagePipeline) with TREAD routing: the proofs only
ERNIE-Image has (the pipeline's own input helpers _patchify_latents / _pad_text and the ids its forward builds, the kept
subsequence of diffusers' single-stream [image, text] sequence with true RoPE rows, the text never routed and masked,
prompts through ErnieImagePipeline.encode_prompt, the timestep and shift against the pipeline's own loop, the fresh
init of the zeroed layers, the released geometry); the shared checks (dense, ratio 0, set-aside, gradients,
force-keep, checkpointing, config errors, FLOPs) run for it in tests/test_families.py, its LoRA export through
ErnieImagePipeline.load_lora_weights in tests/test_adapter_export.py (NEW_PIPELINES), int8 in tests/test_quantize.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import family_checks as fc
from test_families import SPAN, route

FAMILY = "ernie_image"
REPO = Path(__file__).resolve().parents[1]
L = 9   # stored text length of the test conditioning

pytestmark = pytest.mark.usefixtures("one_thread")


def pipeline_text(lengths=(7, 4, 2), seed: int = 4):
    """Text as our data stores ErnieImagePipeline.encode_prompt's rows: each prompt's rows first, right-padded to L
    with a mask; the padded rows random (never read), so they cannot pass for the pipeline's zero padding."""
    def make(model) -> dict:
        g = torch.Generator().manual_seed(seed)
        mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
        return {"text": torch.randn(len(lengths), L, model.text_dim, generator=g), "text_mask": mask}
    return make


def rows_of(cond: dict) -> list[torch.Tensor]:
    """The per-prompt (T_i, D) row blocks encode_prompt gives, read back from the stored, masked text."""
    mask = cond.get("text_mask")
    return list(cond["text"]) if mask is None else [t[m] for t, m in zip(cond["text"], mask)]


def pipe_inputs(model, x, cond):
    """ErnieImagePipeline's own inputs: _patchify_latents(latents), _pad_text(rows) -> (text_bth, text_lens)."""
    from diffusers import ErnieImagePipeline

    text_bth, lens = ErnieImagePipeline._pad_text(rows_of(cond), x.device, x.dtype, model.text_dim)
    return ErnieImagePipeline._patchify_latents(x), text_bth, lens


def left_padded(cond: dict) -> dict:
    """The same prompts stored left-padded: each sample's real rows (in order) at the end, the padding in front."""
    text, mask = cond["text"].clone(), torch.zeros_like(cond["text_mask"])
    for b, m in enumerate(cond["text_mask"]):
        n = int(m.sum())
        text[b, L - n:], mask[b, L - n:] = cond["text"][b, m], True
        text[b, :L - n] = cond["text"][b, :L - n] - 5.0
    return {"text": text, "text_mask": mask}


def test_pipeline_helpers_give_our_packing_text_and_ids():
    """Our packing is the pipeline's _patchify_latents / _unpatchify_latents; our text layout is its _pad_text (real
    rows first, text_lens), also from left-padded storage; the RoPE ids our embed builds are those diffusers' forward
    builds (image rows (text_len of the sample, row, col), text rows (l, 0, 0)); dense = diffusers on these inputs."""
    from diffusers import ErnieImagePipeline

    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model, size=(8, 12))
    y = torch.zeros_like(y)   # no null label: the text as stored (label dropout zeroes it)
    cond = pipeline_text()(model)
    packed, text_bth, lens = pipe_inputs(model, x, cond)
    assert packed.shape == (3, 16, 4, 6) and text_bth.shape == (3, 7, 32) and lens.tolist() == [7, 4, 2]
    torch.testing.assert_close(model.pack(x), packed, rtol=0, atol=0)
    tokens = torch.randn(3, 24, 16)
    torch.testing.assert_close(model.unpack(tokens, (1, 4, 6)),
                               ErnieImagePipeline._unpatchify_latents(tokens.transpose(1, 2).reshape(3, 16, 4, 6)))
    left = left_padded(cond)
    for stored in (cond, left):
        text, valid, lengths = model.text_rows(stored)
        assert torch.equal(lengths, lens)
        torch.testing.assert_close(text[:, :7] * valid[:, :7, None], text_bth, rtol=0, atol=0)
    ref = model.pristine_transformer()
    seen = []
    hook = ref.pos_embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    with torch.no_grad():
        theirs = ref(hidden_states=packed, timestep=t, text_bth=text_bth, text_lens=lens, return_dict=False)[0]
    hook.remove()
    (ids,) = seen                                                                  # (B, N + Tmax, 3)
    torch.testing.assert_close(model.image_ids(lens, (1, 4, 6)), ids[:, :24], rtol=0, atol=0)
    torch.testing.assert_close(model.text_ids(7, torch.device("cpu")).expand(3, -1, -1), ids[:, 24:], rtol=0, atol=0)
    assert ids[:, :24, 0].tolist() == [[7.0] * 24, [4.0] * 24, [2.0] * 24]          # image rows: after the text
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        ours_left = model(x, t, y, cond=left)
    torch.testing.assert_close(ours, ErnieImagePipeline._unpatchify_latents(theirs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_left, ours, rtol=1e-6, atol=1e-6)


def block_args(ref, block, packed, text_bth, lens, t):
    """Run diffusers' forward on the pipeline's inputs; return the positional args `block` received:
    (x (S, B, D), rotary_pos_emb (B, S, 1, Dh), temb [6 x (S, B, D)], attention_mask (B, 1, 1, S))."""
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, args: seen.setdefault("args", args))
    with torch.no_grad():
        ref(hidden_states=packed, timestep=t, text_bth=text_bth, text_lens=lens, return_dict=False)
    hook.remove()
    return seen["args"]


def kept_reference(r, *, true_rows: bool = True):
    """diffusers' layers start..end run per sample on [kept image tokens, the sample's text] of diffusers' own
    sequence: the RoPE rows, modulation rows and key mask entering the route's first layer, sliced to the kept
    tokens' TRUE positions (true_rows=False: the first K image rows, for the teeth)."""
    model, start, end = r.model, r.route.start_layer_idx, r.route.end_layer_idx
    _, _, ids, _ = r.scatter
    ref = model.pristine_transformer()
    cond = model.conditioning(r.y, r.cond)   # the class table's text, or the data's (null labels: zeroed)
    packed, text_bth, lens = pipe_inputs(model, r.x, cond)
    seq, rope, temb, mask = block_args(ref, ref.layers[start], packed, text_bth, lens, r.t)
    N, T = model.tokens_in(r.x), text_bth.shape[1]
    torch.testing.assert_close(r.dense[start][0], seq[:N].transpose(0, 1), rtol=1e-5, atol=1e-5)   # route start
    outs = []
    with torch.no_grad():
        for b in range(r.x.shape[0]):
            img = ids[b] if true_rows else torch.arange(ids.shape[1])
            rows, rope_rows = torch.cat([ids[b], N + torch.arange(T)]), torch.cat([img, N + torch.arange(T)])
            s = seq[rows, b:b + 1]
            for layer in ref.layers[start:end + 1]:
                s = layer(s, rope[b:b + 1, rope_rows], [m[rows, b:b + 1] for m in temb], mask[b:b + 1, ..., rows])
            outs.append(s[:, 0])                                                   # (K + T, D)
    return outs, lens


@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "pipeline-mask"])
@pytest.mark.parametrize("routes", [SPAN, [route(0.75, 0, -1)]], ids=["inner", "all-blocks"])
def test_kept_tokens_equal_layers_on_the_kept_subsequence(routes, masked):
    """3. Kept tokens after the route = diffusers' ErnieImageSharedAdaLNBlock layers run, per sample, on [the kept
    image tokens, the full text] of diffusers' own sequence with their true RoPE rows (ids (text_len, row, col)), the
    shared modulation and the sample's key mask; the text rows after the route too. Teeth: the first K RoPE rows
    instead of the kept tokens' own give a different result."""
    r = fc.routed_run(FAMILY, routes, cond=pipeline_text() if masked else None, size=(8, 12))
    _, x_kept, ids, _ = r.scatter
    K, end = ids.shape[1], r.route.end_layer_idx
    outs, lens = kept_reference(r)
    for b, s in enumerate(outs):
        torch.testing.assert_close(x_kept[b], s[:K], rtol=1e-5, atol=1e-5)
        if end + 1 < r.model.depth:   # the text (context) entering the layer after the route: its real rows
            n = int(lens[b])
            torch.testing.assert_close(r.routed[end + 1][1][b, :n], s[K:K + n], rtol=1e-5, atol=1e-5)
    wrong, _ = kept_reference(r, true_rows=False)
    assert not torch.allclose(torch.stack([w[:K] for w in wrong]), x_kept, atol=1e-4)


def test_text_is_never_routed_and_its_padding_never_read():
    """Routes count over transformer.layers and gather image tokens only: the text enters every layer whole (L
    rows), routed or not, identical before the route; the padded rows are never read (random values change
    nothing, dense or routed), the mask matters (without it the padded samples change), and a sample does not
    depend on the rest of the batch."""
    model = fc.make(FAMILY, SPAN)
    tr = model.transformer
    assert model.routable_blocks() == list(tr.layers) and model.depth == 8
    x, t, y = fc.inputs(model)
    cond = pipeline_text(lengths=(9, 4, 2))(model)
    noisy = {**cond, "text": torch.where(cond["text_mask"][..., None], cond["text"], cond["text"] + 3.0)}
    dense, ours = fc.block_inputs(model.eval(), x, t, y, cond=cond)
    outs, seen = [], []
    for c in (cond, noisy):
        with fc.capture_routes() as log, torch.no_grad(), fc.fixed_selection(model, fc.random_permutation(3)):
            with torch.enable_grad():
                routed, out = fc.block_inputs(model.train(), x, t, y, cond=c)
        outs.append(out)
        seen.append(routed)
    routed = seen[0]
    assert len(log["scatter"]) == 1 and log["scatter"][0][2].shape == (3, 8)          # 8 of 16 image tokens kept
    assert all(ctx.shape == (3, L, 64) for _, ctx in routed) and all(h.shape[1] in (16, 8) for h, _ in routed)
    assert torch.equal(routed[0][1], dense[0][1]) and torch.equal(routed[1][1], dense[1][1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=noisy), ours, rtol=1e-6, atol=1e-6)
        unmasked = model(x, t, y, cond={"text": cond["text"]})
        torch.testing.assert_close(unmasked[0], ours[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(unmasked[1:], ours[1:], atol=1e-4)
        alone = model(x[2:], t[2:], y[2:], cond={k: v[2:] for k, v in cond.items()})
    torch.testing.assert_close(alone, ours[2:], rtol=1e-5, atol=1e-6)


def test_timestep_sign_and_shift_follow_the_pipelines_loop():
    """ErnieImagePipeline's own loop (FlowMatchEulerDiscreteScheduler with configs/model/ernie_image.yaml's shift 4,
    the published scheduler's; sigmas linspace(1, 0) shifted, the transformer fed sigma * 1000, stepped with its
    output as it is) gives the latents our rectified-flow Euler sampler gives with our model: the timestep (not
    reversed), the sign (velocity noise - x0) and the shift agree."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    from tread.diffusion import RectifiedFlow

    cfg = OmegaConf.load(REPO / "configs" / "model" / "ernie_image.yaml").diffusion
    assert cfg.shift == 4.0 and cfg.dynamic_shift is None
    model = fc.make(FAMILY).eval()
    tr = model.pristine_transformer()
    pipe = ErnieImagePipeline(transformer=tr, vae=None, text_encoder=None, tokenizer=None,
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=cfg.shift))
    pipe.set_progress_bar_config(disable=True)
    cond = pipeline_text(lengths=(6, 3))(model)
    noise = torch.randn(2, model.in_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    fed, handle = [], tr.register_forward_pre_hook(lambda m, a, k: fed.append(k["timestep"].clone()),
                                                   with_kwargs=True)
    try:
        with torch.no_grad():
            theirs = pipe(prompt_embeds=rows_of(cond), guidance_scale=1.0, num_inference_steps=3,
                          latents=ErnieImagePipeline._patchify_latents(noise), height=4 * pipe.vae_scale_factor,
                          width=4 * pipe.vae_scale_factor, output_type="latent", return_dict=False)[0]
    finally:
        handle.remove()
    sigmas = pipe.scheduler.sigmas[:-1]
    torch.testing.assert_close(sigmas[1:], torch.tensor([8 / 9, 2 / 3]))          # 4s / (1 + 3s) at 2/3, 1/3
    torch.testing.assert_close(torch.stack([f[0] for f in fed]), sigmas * 1000)   # sigma * 1000, not reversed
    rf = RectifiedFlow(shift=cfg.shift, num_steps=3)
    ours = rf.sample(rf.precondition(model), noise, torch.zeros(2, dtype=torch.long), cond=cond)
    torch.testing.assert_close(ours, ErnieImagePipeline._unpatchify_latents(theirs), rtol=1e-5, atol=1e-5)
    x, t, _ = fc.inputs(model)
    assert model.timestep(t) is t                                                  # noise_level = t * 1000 as fed


@pytest.fixture(scope="module")
def tiny_encoders(tmp_path_factory):
    from tread.encoders.text import load_text_encoders
    from tread.encoders.tiny_text import save_tiny_text_encoders

    return load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path_factory.mktemp("ernie_text")))


def test_prompts_equal_the_pipelines_encode_prompt_and_feed_the_transformer(tiny_encoders):
    """encode_prompts('ernie_image') = ErnieImagePipeline.encode_prompt on the tiny Mistral3Model (its
    hidden_states[-2] on the bare prompt with bos): each prompt's rows first, zero rows after them, the mask its
    length; a prompt longer than the stored length is cut there (the tokenizer's truncation at model_max_length,
    restored afterwards). Those arrays in our model give diffusers' forward on the pipeline's _pad_text of them."""
    import transformers
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    from tread.encoders.text import encode_prompts

    enc, length = tiny_encoders, 10
    prompts = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes and a red disc and a blue square"]
    te, tok = enc.models["text_encoder"], enc.tokenizers["tokenizer"]
    assert type(te) is transformers.Mistral3Model and te.config.text_config.num_hidden_layers == 3
    pipe = ErnieImagePipeline(transformer=None, vae=None, text_encoder=te, tokenizer=tok, pe=None, pe_tokenizer=None,
                              scheduler=FlowMatchEulerDiscreteScheduler())
    saved = tok.model_max_length
    ours = encode_prompts(FAMILY, enc, prompts, max_length=length)
    assert tok.model_max_length == saved and saved > 30
    with torch.no_grad():
        full = pipe.encode_prompt(prompts, device="cpu")
        tok.model_max_length = length
        rows = pipe.encode_prompt(prompts, device="cpu")
        tok.model_max_length = saved
    lens = [len(r) for r in rows]
    assert lens[1] == 1 and lens[2] == length < len(full[2]) and lens[0] == len(full[0])   # "": the bos alone
    torch.testing.assert_close(rows[2], full[2][:length], rtol=1e-5, atol=1e-6)              # causal: a prefix
    assert list(ours) == ["text", "text_mask"] and ours["text"].shape == (3, length, 32)
    np.testing.assert_array_equal(ours["text_mask"], np.arange(length)[None, :] < np.array(lens)[:, None])
    for b, row in enumerate(rows):
        np.testing.assert_allclose(ours["text"][b, :lens[b]], row.numpy(), rtol=1e-5, atol=1e-6)
        assert not ours["text"][b, lens[b]:].any()
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    y = torch.zeros_like(y)
    cond = {"text": torch.from_numpy(ours["text"]), "text_mask": torch.from_numpy(ours["text_mask"])}
    text_bth, text_lens = ErnieImagePipeline._pad_text(rows, "cpu", torch.float32, 32)
    with torch.no_grad():
        theirs = model.pristine_transformer()(hidden_states=model.pack(x), timestep=t, text_bth=text_bth,
                                              text_lens=text_lens, return_dict=False)[0]
        torch.testing.assert_close(model.pack(model(x, t, y, cond=cond)), theirs, rtol=1e-5, atol=1e-5)


def test_fresh_weights_redraw_the_zeroed_layers_and_the_released_geometry():
    """diffusers' constructor zeroes the shared adaLN projection and the output layer (every block the identity,
    output 0); a preset build redraws them (nn.Linear's init), so routing has something to change. The released
    preset (transformer/config.json of baidu/ERNIE-Image) builds on the meta device: 36 layers, width 4096, text
    3072, 128 = 4 x 32 FLUX.2 latent channels; model=ernie_image composes and passes the schema."""
    from conftest import compose_cfg
    from tread.models.families import build_family
    from tread.schema import check_train

    model = fc.make(FAMILY)
    fresh = model.pristine_transformer().from_config(model.transformer.config)
    for name in ("adaLN_modulation.1", "final_linear"):
        assert not fresh.get_submodule(name).weight.any()
        assert model.transformer.get_submodule(name).weight.abs().min() > 0
    with torch.device("meta"):
        released = build_family(FAMILY, preset="ernie-image", input_size=64, in_channels=32, num_classes=0)
    c = released.transformer.config
    assert released.depth == 36 and released.text_dim == 3072 and c.hidden_size == 4096 and c.in_channels == 128
    assert released.token_grid == (1, 32, 32) and list(c.rope_axes_dim) == [32, 48, 48] and c.rope_theta == 256
    cfg = compose_cfg("train", ["model=ernie_image"])
    assert cfg.model.family == FAMILY and cfg.model.arch == "ernie_image-tiny"
    check_train(cfg)
