"""Krea 2 (diffusers Krea2Transformer2DModel, Krea2Pipeline) with TREAD routing: the proofs only Krea 2 has (the kept
subsequence of diffusers' own single-stream [text, image] sequence, the never-routed text fusion, the pipeline's
mid-sequence text padding, prompts through Krea2Pipeline.encode_prompt stored flattened, the timestep and sign against
the pipeline's own sampling step, the LoRA export through Krea2Pipeline.load_lora_weights); the shared checks run for
Krea 2 in tests/test_families.py."""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import family_checks as fc
from test_adapter_export import adapted, pipeline_applies_the_adapter
from test_families import SPAN, route
from tread.checkpoint.save import export_adapter
from tread.models.families import FamilyConfigError, build_family

FAMILY = "krea2"
L = 7   # text tokens of the test prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def pipeline_text(model, seed: int = 4) -> dict:
    """Text as Krea2Pipeline lays it out: [prompt | PAD | 2 suffix tokens] per sample (padding in the middle), the
    padded rows random (the pipeline's encoder states there are not zero)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    return {"text": torch.randn(3, L, model.text_dim, generator=g), "text_mask": mask}


def stacked(model, text: torch.Tensor) -> torch.Tensor:
    """(B, L, K * D) -> the pipeline's prompt_embeds (B, L, K, D): layer k at features [k D, (k + 1) D)."""
    c = model.transformer.config
    return text.reshape(*text.shape[:2], c.num_text_layers, c.text_hidden_dim)


def block_args(ref, block, x_packed, text4d, t, ids, mask):
    """Run diffusers' forward (pipeline inputs) and return the positional args `block` received."""
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, args: seen.setdefault("args", args))
    with torch.no_grad():
        ref(hidden_states=x_packed, encoder_hidden_states=text4d, timestep=t, position_ids=ids,
            encoder_attention_mask=mask, return_dict=False)
    hook.remove()
    return seen["args"]


def kept_reference(r, text4d, mask, *, true_rows: bool = True):
    """diffusers' blocks start..end on each sample's kept subsequence [all L text, kept image tokens]: diffusers' own
    sequence, RoPE rows (the pipeline's ids), key mask and modulation entering the route's first block, sliced
    to the text and the kept tokens' TRUE positions (true_rows=False: the first K image rows, for the teeth)."""
    from diffusers import Krea2Pipeline

    model, start, end = r.model, r.route.start_layer_idx, r.route.end_layer_idx
    _, _, ids, _ = r.scatter
    L = text4d.shape[1]   # the class table's text_len or the pipeline text's 7
    ref = model.pristine_transformer()
    _, h, w = model.grid_of(r.x)
    pos = Krea2Pipeline.prepare_position_ids(L, h, w, "cpu")
    seq, temb_mod, (cos, sin), keys = block_args(ref, ref.transformer_blocks[start], model.pack(r.x), text4d,
                                                 r.t / 1000, pos, mask)
    torch.testing.assert_close(r.dense[start][0], seq[:, L:], rtol=1e-5, atol=1e-5)   # our route-start tokens
    outs = []
    with torch.no_grad():
        for b in range(r.x.shape[0]):
            img = ids[b] if true_rows else torch.arange(ids.shape[1])
            rows = torch.cat([torch.arange(L), L + ids[b]])
            rope_rows = torch.cat([torch.arange(L), L + img])
            s = seq[b:b + 1, rows]
            k = None if keys is None else keys[b:b + 1, ..., rows]
            for blk in ref.transformer_blocks[start:end + 1]:
                s = blk(s, temb_mod[b:b + 1], (cos[rope_rows], sin[rope_rows]), k)
            outs.append(s)
    return outs


@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "pipeline-mask"])
@pytest.mark.parametrize("routes", [SPAN, [route(0.75, 0, -1)]], ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, masked):
    """3. Kept tokens after the route = diffusers' transformer blocks run, per sample, on [the full text, the kept
    image tokens] of diffusers' own sequence with their true RoPE rows (ids (0, row, col); text rows (0, 0, 0)), the
    sample's key mask and modulation; the text stream after the route too. Teeth: the first K RoPE rows instead of
    the kept tokens' own give a different result."""
    r = fc.routed_run(FAMILY, routes, cond=pipeline_text if masked else None)
    model = r.model
    text = r.cond["text"] if masked else model.conditioning(r.y, None)["text"]
    mask = r.cond["text_mask"] if masked else None
    _, x_kept, ids, _ = r.scatter
    end, L = r.route.end_layer_idx, text.shape[1]
    for b, s in enumerate(kept_reference(r, stacked(model, text), mask)):
        torch.testing.assert_close(x_kept[b:b + 1], s[:, L:], rtol=1e-5, atol=1e-5)
        if end + 1 < model.depth:   # the text (context) entering the block after the route
            torch.testing.assert_close(r.routed[end + 1][1][b:b + 1], s[:, :L], rtol=1e-5, atol=1e-5)
    wrong = kept_reference(r, stacked(model, text), mask, true_rows=False)
    assert not torch.allclose(torch.cat(wrong)[:, L:], x_kept, atol=1e-4)


def test_text_fusion_never_routed_and_identical_with_routing():
    """Krea2TextFusion (layer-wise blocks across the 12 taps, projector, refiner blocks) and txt_in are not routable
    blocks; they run on the text alone before the blocks, bit-identical with and without a route from block 0, and
    equal diffusers' own modules called on the pipeline's prompt_embeds and key mask."""
    model = fc.make(FAMILY, [route(0.5, 0, -1)])
    tr = model.transformer
    assert model.routable_blocks() == list(tr.transformer_blocks) and model.depth == 8
    assert not set(tr.text_fusion.modules()) & {m for b in model.routable_blocks() for m in b.modules()}
    x, t, y = fc.inputs(model)
    cond = pipeline_text(model)
    seen: dict = {}
    hook = tr.txt_in.register_forward_hook(lambda m, a, out: seen.setdefault(len(seen), out.detach()))
    with torch.no_grad():
        model.eval()(x, t, y, cond=cond)
    with fc.capture_routes() as log:
        model.train()(x, t, y, cond=cond)
    hook.remove()
    assert len(log["scatter"]) == 1 and log["scatter"][0][2].shape == (3, 8)     # the route ran: 8 of 16 kept
    assert torch.equal(seen[0], seen[1]) and seen[0].shape == (3, L, 64)
    ref = model.pristine_transformer()
    with torch.no_grad():
        fused = ref.txt_in(ref.text_fusion(stacked(model, cond["text"]), cond["text_mask"][:, None, None, :]))
    torch.testing.assert_close(seen[0], fused, rtol=1e-6, atol=1e-6)


def test_mid_sequence_padding_equals_diffusers_and_is_never_read():
    """The pipeline's mask has its padding between the prompt and the suffix: our dense forward equals diffusers'
    with it; the padded text rows are never read (changing them changes nothing), the mask matters (without it the
    padded samples change), and a sample does not depend on the rest of the batch."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = pipeline_text(model)
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond=cond), rtol=1e-6, atol=1e-6)
        noisy = {**cond, "text": torch.where(cond["text_mask"][..., None], cond["text"], cond["text"] + 3.0)}
        torch.testing.assert_close(model(x, t, y, cond=noisy), ours, rtol=1e-6, atol=1e-6)
        unmasked = model(x, t, y, cond={"text": cond["text"]})
        torch.testing.assert_close(unmasked[0], ours[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(unmasked[1:], ours[1:], atol=1e-4)
        alone = model(x[2:], t[2:], y[2:], cond={k: v[2:] for k, v in cond.items()})
    torch.testing.assert_close(alone, ours[2:], rtol=1e-5, atol=1e-6)


def test_one_pipeline_sampling_step_equals_our_velocity():
    """Krea2Pipeline itself (its scheduler config as the docstring states it, one step from sigma 1, no guidance)
    moves the packed latents by -1 x its transformer's output on timestep 1000 / 1000: our model at noise level 1000
    gives that same velocity (the timestep fed, no sign change, the pipeline's packing)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    model = fc.make(FAMILY).eval()
    x, _, y = fc.inputs(model)
    cond = pipeline_text(model)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    pipe = Krea2Pipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                         transformer=model.pristine_transformer())
    size = model.input_size * pipe.vae_scale_factor
    with torch.no_grad():
        out = pipe(prompt_embeds=stacked(model, cond["text"]), prompt_embeds_mask=cond["text_mask"],
                   latents=model.pack(x), height=size, width=size, num_inference_steps=1, sigmas=[1.0],
                   guidance_scale=0.0, output_type="latent").images
        v = model(x, torch.full((3,), 1000.0), y, cond=cond)
    torch.testing.assert_close(out, model.pack(x - v), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_encoders(tmp_path_factory):
    from tread.encoders.text import load_text_encoders
    from tread.encoders.tiny_text import save_tiny_text_encoders

    return load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path_factory.mktemp("krea2_text")))


def test_prompts_equal_the_pipelines_encode_prompt_and_feed_the_transformer(tiny_encoders):
    """encode_prompts('krea2') = Krea2Pipeline.encode_prompt on the tiny Qwen3VLModel (36 text layers: the
    pipeline's own taps 2, 5, ..., 35) with its layers side by side; the mask is the pipeline's [prompt | PAD |
    suffix]; the template prefix is the 34 tokens the pipeline drops. Those arrays in our model give diffusers'
    forward on the pipeline's own 4-D prompt_embeds."""
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    from tread.encoders.text import encode_prompts

    enc, prompts = tiny_encoders, ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
    te, tok = enc.models["text_encoder"], enc.tokenizers["tokenizer"]
    assert type(te) is transformers.Qwen3VLModel and te.config.text_config.num_hidden_layers == 36
    folder = Path(enc.paths["text_encoder"]).parent
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "Krea2Pipeline"
    assert isinstance(te, inspect.signature(Krea2Pipeline.__init__).parameters["text_encoder"].annotation)
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=te, tokenizer=tok,
                         transformer=None)
    assert pipe.text_encoder_select_layers == tuple(range(2, 36, 3))
    assert len(tok(pipe.prompt_template_encode_prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 34
    ours = encode_prompts(FAMILY, enc, prompts, max_length=L + 9)
    with torch.no_grad():
        text, mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=L + 9)
    assert list(ours) == ["text", "text_mask"] and ours["text"].shape == (3, L + 9, 12 * 32)
    np.testing.assert_allclose(ours["text"], text.flatten(2).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours["text_mask"], mask.numpy())
    assert ours["text_mask"][:, -5:].all() and not ours["text_mask"][1, :-5].any()   # "" keeps the suffix only
    alone = encode_prompts(FAMILY, enc, prompts[2:], max_length=L + 9)   # fixed length: independent of the batch
    for key in ours:
        np.testing.assert_allclose(alone[key][0], ours[key][2], rtol=1e-5, atol=1e-5)
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = {"text": torch.from_numpy(ours["text"]), "text_mask": torch.from_numpy(ours["text_mask"])}
    _, h, w = model.grid_of(x)
    with torch.no_grad():
        theirs = model.pristine_transformer()(
            hidden_states=model.pack(x), encoder_hidden_states=text, timestep=t / 1000, encoder_attention_mask=mask,
            position_ids=Krea2Pipeline.prepare_position_ids(text.shape[1], h, w, "cpu"), return_dict=False)[0]
        torch.testing.assert_close(model.pack(model(x, t, y, cond=cond)), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapter", ["lora", "lokr"])
def test_lora_export_loads_with_the_pipelines_load_lora_weights(adapter, tmp_path):
    """The exported adapter (LoKr as an exact plain LoRA) loads with Krea2Pipeline.load_lora_weights (its
    __init__ needs patch_size, so the shared NEW_PIPELINES check, which passes None for every argument, cannot build
    it) and gives what our adapted model gives."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    targets = ["to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.down"]
    model = adapted(FAMILY, adapter, targets=targets)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                         transformer=base.pristine_transformer())
    pipeline_applies_the_adapter(model, base, pipe, tmp_path)


def test_text_width_error_names_the_layers():
    model = fc.make(FAMILY)
    with pytest.raises(FamilyConfigError, match=r"num_text_layers x text_hidden_dim = 12 x 32 = 384"):
        model.check_text_data({"text": (8, 32)}, "/data/x")
    model.check_text_data({"text": (8, 384)}, "/data/x")


def test_released_preset_is_the_constructors_defaults_on_the_meta_device():
    """model.preset=krea2 is Krea2Transformer2DModel's own defaults (the Krea 2 geometry, which the pipeline's
    Qwen3-VL-4B taps fit: 12 x 2560); built on the meta device: 28 routable blocks, 12.8B parameters (0.34B of them
    the never-routed text fusion), 4096 image tokens at 1024 px (128 x 128 latents of the 16-channel Qwen-Image VAE).
    The mid preset (GPU benchmarks) keeps the real text width."""
    from diffusers import Krea2Transformer2DModel

    from tread.models.families.krea2 import PRESETS

    preset = PRESETS["krea2"]
    defaults = {k: p.default for k, p in inspect.signature(Krea2Transformer2DModel.__init__).parameters.items()
                if k in preset}
    assert defaults == preset
    with torch.device("meta"):
        released = build_family(FAMILY, preset="krea2", input_size=128, in_channels=16, num_classes=0)
        mid = build_family(FAMILY, preset="mid", input_size=64, in_channels=16, num_classes=0)
    tr = released.transformer
    params, fusion = (sum(p.numel() for p in m.parameters()) for m in (tr, tr.text_fusion))
    assert released.depth == 28 and released.num_tokens == 4096 and released.text_dim == 12 * 2560
    assert 12.7e9 < params < 12.9e9 and 0.3e9 < fusion < 0.4e9, (params, fusion)
    assert mid.depth == 12 and mid.text_dim == 12 * 2560
    assert 0.45e9 < sum(p.numel() for p in mid.transformer.parameters()) < 0.55e9


@pytest.mark.parametrize("side", [16, 128])   # the tiny toy latents (64 tokens), 1024 px (4096 tokens)
def test_config_schedule_equals_the_pipelines(side):
    """configs/model/krea2.yaml's dynamic shift gives Krea2Pipeline's own sampling schedule: its calculate_shift
    (256 / 6400 tokens, 0.5 / 1.15) on the packed latents, the scheduler as its docstring configures it (dynamic,
    exponential), sigmas linspace(1, 1/N, N); the Turbo's fixed mu = 1.15 is the static shift exp(1.15) the config
    comment names (3.158)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    from conftest import compose_cfg
    from tread.schema import check_train
    from tread.schema.builders import build_diffusion

    cfg = compose_cfg("train", ["model=krea2"])
    check_train(cfg)
    rf = build_diffusion(cfg.diffusion)
    seq, steps = (side // 2) ** 2, 28
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=6400)
    mu = calculate_shift(seq, 256, 6400, 0.5, 1.15)
    assert rf.dynamic_shift.mu(seq) == pytest.approx(mu, abs=1e-12)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(rf.t_steps(steps, latent_shape=(1, 16, side, side)).float(), sched.sigmas,
                               atol=2e-7, rtol=0)
    assert round(math.exp(1.15), 3) == 3.158
