"""Qwen-Image 2.1 (diffusers QwenImage21Transformer2DModel) with TREAD routing: the proofs only this family needs.

The joint sequence is [text, target] under diffusers' block-causal mask `(q >= kv) or same image block`. Routing drops
target tokens only; a kept token must equal diffusers' blocks run on the kept subsequence with the mask, segments
and modulation rows diffusers builds for THAT sequence and the token's true RoPE row (SDPA and flex processors).
Also: the mask restricted to the kept tokens is the kept sequence's mask (with a condition image in the prefix
too), the text stream never sees the image, RoPE rows, per-prompt positions, the pipeline's own sampling loop (with
its KV cache), the Qwen3-VL prompts, the LoRA export through the pipeline, the refusals. The shared checks run in
tests/test_families.py."""
from __future__ import annotations

import inspect

import pytest
import torch

import family_checks as fc
from test_families import SPAN, TO_LAST, route
from tread.models.families import FamilyConfigError, build_family

FAMILY = "qwen_image21"
pytestmark = pytest.mark.usefixtures("one_thread")


def qi21():
    from diffusers.models.transformers import transformer_qwenimage21 as module

    return module


def masked_text(model, lengths=(6, 3, 1), length: int = 6, seed: int = 2) -> dict:
    """Right-padded prompt embeddings with a keep-mask, as encode_prompt stores them: a length per sample."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return {"text": torch.randn(len(lengths), length, model.text_dim, generator=g), "text_mask": mask}


def dense_mask(block_mask, batch: int, length: int) -> torch.Tensor:
    """(B, S, S) bool: a flex BlockMask's mask_mod evaluated at every (query, key) of the unpadded sequence."""
    b, q, kv = torch.arange(batch)[:, None, None], torch.arange(length)[None, :, None], torch.arange(length)
    return block_mask.mask_mod(b, torch.zeros((), dtype=torch.long), q, kv[None, None, :]).expand(batch, -1, -1)


def kept_reference(r, b: int, *, flex: bool = False, positions: str = "true", image_block: bool = True,
                   frame_at_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample b's route, recomputed with diffusers alone: its prompt's n real tokens and its kept target tokens at
    the route start, RoPE rows from diffusers' QwenImage21Rope over the sample's own full sequence [n text, N target]
    at the kept tokens' TRUE positions, the kept sequence's image ids / target mask (build_token_metadata), prefix
    segments (SDPA processor) or BlockMask (build_qwenimage21_block_causal_mask, flex processor), the shared
    modulation of [t, 0]; diffusers' blocks start..end. Returns (kept target tokens, text) after the route.
    The knobs break one fact each (teeth): positions="first-k" (positions 0..K-1 of the grid), image_block=False
    (the kept target causal like text), frame_at_padding (the image's frame index at the padded text length)."""
    m = qi21()
    model, ref = r.model, r.model.pristine_transformer().eval()
    if flex:
        for blk in ref.transformer_blocks:
            blk.attn.set_processor(m.QwenImage21FlexAttnProcessor())
    _, x_kept, ids, _ = r.scatter
    text, lengths, _ = model.prompt(r.cond if r.cond else model.conditioning(r.y, None))
    n, L, N, K = int(lengths[b]), text.shape[1], model.num_tokens, ids.shape[1]
    _, h, w = model.token_grid
    frame = L if frame_at_padding else n
    full_pad = torch.cat([torch.zeros(frame), torch.ones(N)]).bool()
    rot = ref.pos_embed([(1, h, w)], full_pad, device="cpu")
    pick = ids[b] if positions == "true" else torch.arange(K)
    rope = torch.cat([rot[:n], rot[frame + pick]])
    kept_pad = torch.cat([torch.zeros(n), torch.ones(K)]).bool()
    image_ids, target = ref.build_token_metadata(kept_pad, [(1, K, 1)])
    if not image_block:
        image_ids = torch.full_like(image_ids, -1)
    segments = m._qwenimage21_prefix_segments(image_ids, n + K if not image_block else n)
    mask = m.build_qwenimage21_block_causal_mask(image_ids, None, 1, "cpu") if flex else None
    start, end = r.route.start_layer_idx, r.route.end_layer_idx
    with torch.no_grad():
        temb = ref.time_text_embed(torch.cat([r.t[b:b + 1] / 1000, torch.zeros(1)]), x_kept)
        mod = ref.modulation(temb)
        seq = torch.cat([r.dense[start][1][b:b + 1, :n], r.dense[start][0][b:b + 1, ids[b]]], dim=1)
        for blk in ref.transformer_blocks[start:end + 1]:
            seq = blk(seq, mod, rope, attention_mask=mask, target_token_mask=target,
                      segments=None if flex else segments)
    return seq[:, n:], seq[:, :n]


@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "masked-text"])
@pytest.mark.parametrize("routes", [SPAN, TO_LAST], ids=["inner", "to-last"])
def test_kept_tokens_equal_diffusers_blocks_on_the_kept_subsequence(routes, masked):
    """3. After the route, every sample's kept tokens and its text equal diffusers' blocks on the kept subsequence
    (diffusers' default SDPA processor, its segments for the kept sequence, true RoPE rows; 1e-5)."""
    r = fc.routed_run(FAMILY, routes, cond=masked_text if masked else None)
    _, x_kept, ids, _ = r.scatter
    end = r.route.end_layer_idx
    for b in range(r.x.shape[0]):
        kept, text = kept_reference(r, b)
        torch.testing.assert_close(x_kept[b:b + 1], kept, rtol=1e-5, atol=1e-5)
        if end + 1 < r.model.depth:
            torch.testing.assert_close(r.routed[end + 1][1][b:b + 1, :text.shape[1]], text, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ids[0], ids[1])   # per-sample kept sets: per-sample RoPE rows


def test_kept_tokens_equal_diffusers_flex_blocks_with_its_block_mask_for_the_kept_sequence():
    """The same with diffusers' QwenImage21FlexAttnProcessor (flex_attention, eager on the CPU) driven by
    build_qwenimage21_block_causal_mask built for the kept sequence (the paper route: blocks 2..4)."""
    r = fc.routed_run(FAMILY, [route(0.5, 2, 4)], cond=masked_text)
    _, x_kept, _, _ = r.scatter
    b = 1   # the prompt of 3 of the 6 stored tokens
    torch.testing.assert_close(x_kept[b:b + 1], kept_reference(r, b, flex=True)[0], rtol=1e-5, atol=1e-5)


def test_the_kept_subsequence_check_has_teeth():
    """Each fact the reference uses matters: grid positions 0..K-1 instead of the kept tokens' own, a causal
    (text-like) mask over the kept target instead of one bidirectional block, or the image's frame index at the
    padded text length instead of the prompt's own: each gives other kept tokens."""
    r = fc.routed_run(FAMILY, SPAN, cond=masked_text)
    _, x_kept, _, _ = r.scatter
    b = 1   # a prompt of 3 of the 6 stored tokens
    for wrong in ({"positions": "first-k"}, {"image_block": False}, {"frame_at_padding": True}):
        assert (x_kept[b:b + 1] - kept_reference(r, b, **wrong)[0]).abs().max() > 1e-3, wrong


def test_mask_on_the_kept_tokens_is_the_full_mask_restricted_even_with_a_condition_image():
    """diffusers' block-causal mask of [text, condition image, text, target] restricted to the prefix and any kept
    target tokens equals the mask diffusers builds for that shorter sequence: a kept target token still sees the
    whole prefix and the kept tokens of its own block, the prefix never sees the target. Target-only routing is
    well defined even with condition images (refused here for the data reason, see
    test_condition_images_and_kv_cache_are_refused)."""
    m = qi21()
    pad = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0] + [1] * 16).bool()            # 3 text, 4 cond, 2 text, 16 target
    shapes = [(1, 2, 2), (1, 4, 4)]
    ids_full, target = m.QwenImage21Transformer2DModel.build_token_metadata(pad, shapes)
    valid = torch.ones(2, 25, dtype=torch.bool)
    valid[1, 8] = False                                                              # a padded text key
    full = dense_mask(m.build_qwenimage21_block_causal_mask(ids_full, valid, 2, "cpu"), 2, 25)
    kept = torch.tensor([9, 12, 13, 20, 24])                                         # 5 of the 16 target tokens
    keep = torch.cat([torch.arange(9), kept])
    ids_kept, _ = m.QwenImage21Transformer2DModel.build_token_metadata(pad[keep], [(1, 2, 2), (1, 5, 1)])
    mine = dense_mask(m.build_qwenimage21_block_causal_mask(ids_kept, valid[:, keep], 2, "cpu"), 2, 14)
    assert torch.equal(full[:, keep][:, :, keep], mine)
    assert mine[:, 9:, :].sum(-1).tolist() == [[14] * 5, [13] * 5]               # all prefix keys + all kept
    assert not full[:, :9, 9:].any() and not full[:, :3, 3:9].any()              # prefix never sees what follows
    assert target.sum() == 16


def test_routed_block_with_a_condition_image_in_the_prefix_equals_diffusers_per_sample():
    """Our processor on a batch with per-sample kept target tokens behind a condition-image block equals diffusers'
    default block run per sample on its kept sequence (its own segments, shared RoPE rows of the true positions)."""
    m = qi21()
    model = fc.make(FAMILY).eval()
    ours, ref = model.transformer.transformer_blocks[0], model.pristine_transformer().transformer_blocks[0]
    pad = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0] + [1] * 16).bool()
    rot = model.transformer.pos_embed([(1, 2, 2), (1, 4, 4)], pad, device="cpu")
    g = torch.Generator().manual_seed(0)
    kept = torch.stack([torch.randperm(16, generator=g)[:6] + 9 for _ in range(2)])
    keep = torch.cat([torch.arange(9).expand(2, -1), kept], dim=1)                 # (2, 15)
    ids_kept, target = m.QwenImage21Transformer2DModel.build_token_metadata(pad[keep[0]], [(1, 2, 2), (1, 6, 1)])
    segments = m._qwenimage21_prefix_segments(ids_kept, 9)
    assert [s[2] for s in segments] == [True, False, True]                         # text, image block, text
    seq = torch.randn(2, 15, 64, generator=g)
    mod = torch.randn(3, 256, generator=g)
    with torch.no_grad():
        batched = ours(seq, mod, rot[keep], target_token_mask=target, segments=segments)
        for b in range(2):
            alone = ref(seq[b:b + 1], mod[[b, 2]], rot[keep[b]], target_token_mask=target, segments=segments)
            torch.testing.assert_close(batched[b:b + 1], alone, rtol=1e-5, atol=1e-5)


def test_text_stream_is_never_routed_and_never_sees_the_image():
    """Text queries attend to earlier text only (causal, before the target block): the text entering every block is
    the same with and without routing and whatever the image latents are."""
    r = fc.routed_run(FAMILY, SPAN, cond=masked_text)
    for (_, c_dense), (_, c_routed) in zip(r.dense, r.routed):
        torch.testing.assert_close(c_routed, c_dense, rtol=0, atol=1e-6)
    other, _ = fc.block_inputs(r.model.eval(), torch.randn_like(r.x), r.t, r.y, cond=r.cond)
    for (_, c_dense), (_, c_other) in zip(r.dense, other):
        torch.testing.assert_close(c_other, c_dense, rtol=0, atol=1e-6)


@pytest.mark.parametrize("grid", [(4, 4), (4, 6), (6, 2)])
def test_rope_rows_are_diffusers_qwenimage21rope(grid):
    """Our rows (computed without host reads) equal QwenImage21Rope.forward over each sample's [n text, target]:
    text i at (i, i, i), the target at frame n with rows and columns centred on zero."""
    model = fc.make(FAMILY).eval()
    lengths = torch.tensor([5, 3])
    text, image = model.rope_rows(lengths, 5, (1, *grid))
    N = grid[0] * grid[1]
    for b, n in enumerate(lengths.tolist()):
        pad = torch.cat([torch.zeros(n), torch.ones(N)]).bool()
        theirs = model.transformer.pos_embed([(1, *grid)], pad, device="cpu")
        assert torch.equal(text[:n], theirs[:n]) and torch.equal(image[b], theirs[n:])


def test_each_prompt_is_positioned_as_the_pipeline_encodes_it_alone():
    """A sample's output does not depend on the other prompts of its batch: it equals the model on that sample
    alone and diffusers on the prompt's real tokens alone (pipe(prompt)); diffusers' own batched call, where a
    batch shares one padded layout (the image's frame index at the longest prompt), gives the shorter prompts
    something else. Real tokens are taken in order wherever the mask has them."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = masked_text(model, lengths=(6, 3, 2))
    with torch.no_grad():
        out = model(x, t, y, cond=cond)
        alone = model(x[1:2], t[1:2], y[1:2], cond={k: v[1:2] for k, v in cond.items()})
        tr = model.pristine_transformer()
        img_mask = torch.cat([torch.zeros(3, 6), torch.ones(3, 4)], 1).bool()
        padded = tr(model.pack(x), cond["text"], t / 1000, [[(1, 4, 4)]] * 3, img_mask, cond["text_mask"],
                    return_dict=False)[0][:, -16:]
        gap = torch.tensor([[1, 0, 1, 1, 0, 0]]).bool()
        holes = model(x[:1], t[:1], y[:1], cond={"text": cond["text"][:1], "text_mask": gap})
        packed = model(x[:1], t[:1], y[:1], cond={"text": cond["text"][:1, [0, 2, 3]]})
    torch.testing.assert_close(out[1:2], alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.pack(out[:1]), padded[:1], rtol=1e-5, atol=1e-5)     # the longest: the same
    assert (model.pack(out[1:]) - padded[1:]).abs().max() > 1e-3
    torch.testing.assert_close(holes, packed, rtol=1e-6, atol=1e-6)


def test_pipeline_loop_with_its_kv_cache_equals_our_velocity_euler():
    """Timestep and sign against QwenImage21Pipeline itself (prompt_embeds, output_type='latent', its default KV
    cache: the text keys/values from the first step, reused): the transformer gets sigma, and Euler steps
    dz = (sigma' - sigma) v with our v (no cache: the whole sequence every step) land on the same latents. Patch
    size 1, as the pipeline packs (a row-major flatten)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    from tread.encoders.tiny_text import TINY_WORDS, _tiny_qwen3_vl

    model = fc.make(FAMILY, config={"patch_size": 1}, num_classes=0).eval()
    _, processor = _tiny_qwen3_vl(TINY_WORDS)
    tr = model.pristine_transformer()
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                               processor=processor, transformer=tr)
    g = torch.Generator().manual_seed(3)
    noise, text = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, model.text_dim, generator=g)
    fed = []
    hook = tr.register_forward_pre_hook(lambda mod, args, kw: fed.append(kw["timestep"].clone()), with_kwargs=True)
    with torch.no_grad():
        theirs = pipe(prompt_embeds=text, height=128, width=128, num_inference_steps=3, output_type="latent",
                      latents=model.pack(noise), return_dict=False)[0]
    hook.remove()
    sigmas = pipe.scheduler.sigmas
    assert len(fed) == 3 and sigmas[-1] == 0.0
    z = noise.clone()
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(fed[i], model.timestep(sigmas[i:i + 1] * 1000))
            v = model(z, sigmas[i:i + 1] * 1000, torch.zeros(1, dtype=torch.long), cond={"text": text})
            z = z + (sigmas[i + 1] - sigmas[i]) * v
    torch.testing.assert_close(model.pack(z), theirs, rtol=1e-5, atol=1e-5)


def test_condition_images_and_kv_cache_are_refused():
    """Condition images (reference latents) are refused in one line with the reason; our processor refuses the KV
    cache; a sample without any text token and an odd token grid are refused."""
    model = fc.make(FAMILY)
    x, t, y = fc.inputs(model, batch=2)
    with pytest.raises(FamilyConfigError, match="Qwen3-VL encoder's image slots"):
        model(x, t, y, cond={"text": torch.randn(2, 5, model.text_dim), "reference": torch.randn_like(x)})
    with pytest.raises(FamilyConfigError, match="reference_latents.npy"):
        model.check_text_data({"text": (5, model.text_dim), "reference": (4, 8, 8)}, "/data")
    with pytest.raises(FamilyConfigError, match="no text token"):
        model(x, t, y, cond={"text": torch.randn(2, 3, model.text_dim),
                             "text_mask": torch.tensor([[1, 1, 0], [0, 0, 0]]).bool()})
    with pytest.raises(FamilyConfigError, match="a 4x3 token grid"):
        model.check_size(8, 6)
    blk = model.transformer.transformer_blocks[0]
    with pytest.raises(ValueError, match="KV cache"):
        blk.attn(torch.randn(1, 4, 64), kv_cache_mode="cached")


def test_released_geometry_is_diffusers_defaults():
    """The qwen-image-2.1 preset is QwenImage21Transformer2DModel's defaults: 32 blocks, width 4096 (32 heads x 128),
    Qwen3-VL width 4096, 64 latent channels unpatched; about 7B parameters (meta device); 1024 px = 64x64 latents
    = 4096 tokens."""
    from diffusers import QwenImage21Transformer2DModel

    from tread.models.families.qwen_image21 import PRESETS

    preset = PRESETS["qwen-image-2.1"]
    defaults = {k: p.default for k, p in inspect.signature(QwenImage21Transformer2DModel.__init__).parameters.items()
                if k in preset}
    assert defaults == preset
    with torch.device("meta"):
        model = build_family(FAMILY, preset="qwen-image-2.1", input_size=64, in_channels=64, num_classes=0)
    params = sum(p.numel() for p in model.transformer.parameters())
    assert model.depth == 32 and model.num_tokens == 4096 and 6.9e9 < params < 7.2e9, params


@pytest.fixture(scope="module")
def tiny_encoders(tmp_path_factory):
    from tread.encoders.text import load_text_encoders
    from tread.encoders.tiny_text import save_tiny_text_encoders

    return load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path_factory.mktemp("qi21_text")))


def test_prompts_equal_the_pipelines_encode_prompt_on_tiny_qwen3_vl(tiny_encoders):
    """encode_prompts (the stored arrays: text right-padded to max_length, mask) equal QwenImage21Pipeline's own
    encode_prompt on tiny Qwen3VLForConditionalGeneration + Qwen3VLProcessor (its chat template, the system message
    dropped, hidden_states[-1] before the final norm); an empty prompt is the pipeline's ' '; batch-independent."""
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    from tread.encoders.text import encode_prompts

    enc = tiny_encoders
    assert type(enc.models["text_encoder"]) is transformers.Qwen3VLForConditionalGeneration
    assert isinstance(enc.tokenizers["processor"], transformers.Qwen3VLProcessor)
    prompts = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
    ours = encode_prompts(FAMILY, enc, prompts, max_length=24)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, transformer=None,
                               text_encoder=enc.models["text_encoder"], processor=enc.tokenizers["processor"])
    with torch.no_grad():
        text, mask, image_pad = pipe.encode_prompt(prompts, device="cpu")
    n = mask.sum(1)
    assert pipe._drop_idx == 12 and not image_pad.any() and len(set(n.tolist())) == 3
    assert torch.equal(torch.from_numpy(ours["text_mask"])[:, :text.shape[1]], mask.bool())
    assert not ours["text_mask"][:, text.shape[1]:].any() and not ours["text"][~ours["text_mask"]].any()
    torch.testing.assert_close(torch.from_numpy(ours["text"])[:, :text.shape[1]] * mask[..., None], text * mask[..., None])
    alone = encode_prompts(FAMILY, enc, prompts[1:2], max_length=24)
    torch.testing.assert_close(torch.from_numpy(alone["text"][0]), torch.from_numpy(ours["text"][1]), rtol=1e-5,
                               atol=1e-5)


def test_lora_export_loads_with_the_pipelines_load_lora_weights(tmp_path, tiny_encoders):
    """The exported LoRA loads with QwenImage21Pipeline.load_lora_weights (QwenImageLoraLoaderMixin) and gives what
    our adapted model gives. (Not in test_adapter_export's NEW_PIPELINES: this pipeline's __init__ needs a
    processor, whose chat template it reads.)"""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from test_adapter_export import adapted, pipeline_applies_the_adapter

    from tread.checkpoint.save import export_adapter

    targets = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.out"]
    model = adapted(FAMILY, "lora", targets=targets)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                               processor=tiny_encoders.tokenizers["processor"], transformer=base.pristine_transformer())
    pipeline_applies_the_adapter(model, base, pipe, tmp_path)
