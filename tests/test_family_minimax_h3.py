"""MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel, modular pipeline only) with TREAD routing: the proofs only
MiniMax-H3 has. One packed [text | video] sequence (no cross-attention); video rows are routed with their own RoPE ids
and (timestep, modality) modulation rows, the text rows never are; the audio stream is empty (video-only); each prompt
is laid out by the pipeline's own layout step; t = 1 - sigma and a data-ward velocity (the pipeline's scheduler);
prompts through the pipeline's text step; the LoRA export through the pipeline's load_lora_weights. The shared checks
run in tests/test_families.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep

import family_checks as fc
from test_families import SPAN, VIDEO, route
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders

FAMILY = "minimax_h3"

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_cond(model) -> dict:
    """Stored text: prompts of 6, 3 and 1 real rows, right-padded to 6 (how precompute stores them)."""
    return fc.masked_text(model, batch=3)


def block_inputs_alone(ref, model, x, t, cond, b: int, start: int):
    """The (hidden_states, temb, adaln_indices, rotary_emb) entering ref.transformer_blocks[start] when diffusers'
    forward runs sample b alone, on the pipeline's inputs (model.diffusers_forward)."""
    seen = {}
    hook = ref.transformer_blocks[start].register_forward_pre_hook(lambda m, args: seen.update(args=args))
    with torch.no_grad():
        model.diffusers_forward(model.to_model_layout(x[b:b + 1]), model.timestep(t[b:b + 1]),
                                {k: v[b:b + 1] for k, v in cond.items()}, ref)
    hook.remove()
    return seen["args"]


def run_reference(ref, rows, start: int, end: int, args):
    """diffusers' blocks start..end (pristine processors) on the packed rows `rows` of one sample alone: its hidden
    states, AdaLN table rows and RoPE rows sliced to them, its own temb."""
    hidden, temb, adaln, (cos, sin) = args
    h = hidden[:, rows]
    with torch.no_grad():
        for block in ref.transformer_blocks[start:end + 1]:
            h = block(h, temb, adaln[rows], (cos[rows], sin[rows]))
    return h


@pytest.mark.parametrize("routes", [SPAN, [route(0.75, 0, -1)]], ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes):
    """3. Kept video rows after the route = diffusers' blocks run on the kept subsequence of each sample alone: the
    pipeline's packed sequence of that prompt (its real text rows, no padding, no mask) entering the route's first
    block, sliced to [its text rows | its kept video rows] with their true RoPE ids and their own (timestep, video)
    AdaLN rows. Teeth: the same rows with the first K video rows' RoPE ids, or with the text modality's AdaLN rows,
    do not match."""
    r = fc.routed_run(FAMILY, routes, cond=masked_cond, **VIDEO)
    model, start, end = r.model, r.route.start_layer_idx, r.route.end_layer_idx
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    lengths = r.cond["text_mask"].sum(1).tolist()
    N = model.num_tokens
    for b, n in enumerate(lengths):
        args = block_inputs_alone(ref, model, r.x, r.t, r.cond, b, start)
        torch.testing.assert_close(r.dense[start][0][b:b + 1], args[0][:, n:], rtol=1e-5, atol=1e-5)
        rows = torch.cat([torch.arange(n), n + ids[b]])
        out = run_reference(ref, rows, start, end, args)
        torch.testing.assert_close(x_kept[b:b + 1], out[:, n:], rtol=1e-5, atol=1e-5)
        hidden, temb, adaln, (cos, sin) = args
        wrong_pos = torch.cat([torch.arange(n), n + torch.arange(ids.shape[1])])
        h = hidden[:, rows]
        with torch.no_grad():
            for name, a, rope in (("positions", adaln[rows], (cos[wrong_pos], sin[wrong_pos])),
                                  ("modality", adaln[rows] + (torch.arange(len(rows)) >= n), (cos[rows], sin[rows]))):
                g = h
                for block in ref.transformer_blocks[start:end + 1]:
                    g = block(g, temb, a, rope)
                assert not torch.allclose(g[:, n:], x_kept[b:b + 1], atol=1e-3), name
        assert ids.shape[1] < N or routes[0]["selection_ratio"] == 0


def test_text_rows_and_refiner_never_routed():
    """The text refiner is no routable block and runs on the full text before the blocks; its output and the text rows
    entering every block up to the route's start are bit-identical with and without a route from block 0, and every
    block sees every text row (the context keeps its length)."""
    model = fc.make(FAMILY, [route(0.5, 0, -1)], **VIDEO)
    tr = model.transformer
    assert not set(tr.token_refiner.refiner_blocks) & set(model.routable_blocks())
    x, t, y = fc.inputs(model, frames=3)
    cond = masked_cond(model)
    seen = {}
    hook = tr.token_refiner.register_forward_hook(lambda m, a, out: seen.setdefault(m.training, []).append(out))
    dense, _ = fc.block_inputs(model.eval(), x, t, y, cond=cond)
    with fc.capture_routes() as log, torch.no_grad(), torch.enable_grad():
        routed, _ = fc.block_inputs(model.train(), x, t, y, cond=cond)
    hook.remove()
    assert len(log["scatter"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))
    assert torch.equal(dense[0][1], routed[0][1])
    assert all(c.shape == dense[0][1].shape for _, c in routed)


def test_video_only_audio_stream_is_empty_and_untouched():
    """Video-only: the transformer takes zero audio rows (diffusers' forward returns an empty audio sample on the
    family's inputs); dropping the audio rows moves no video id (the pipeline's layout with and without audio); the
    audio projections get no gradient under routing and stay as built after an optimizer step."""
    model = fc.make(FAMILY, SPAN, **VIDEO).train()
    tr, grid = model.transformer, model.token_grid
    layout = model.layout(5, grid)
    with_audio = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(5, dtype=torch.long), 3, 8, 8, 7, (1, 2, 2), 2, 2, 0)
    assert torch.equal(with_audio[0][with_audio[2]], layout[0][layout[2]])   # video ids, audio or not
    assert len(layout[3]) == 0 and len(with_audio[3]) == 14
    x, t, y = fc.inputs(model, frames=3)
    seen = {}
    hook = tr.register_forward_hook(lambda m, a, k, out: seen.update(audio=out[1]), with_kwargs=True)
    model.reference_forward(x[:1], t[:1], y[:1], transformer=tr)
    hook.remove()
    assert seen["audio"].shape == (1, 0, tr.config.audio_in_channels)
    audio = {n: p.detach().clone() for n, p in tr.named_parameters() if n.startswith("audio_")}
    assert set(audio) == {"audio_proj_in.weight", "audio_proj_in.bias", "audio_proj_out.weight", "audio_proj_out.bias"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, t, y).square().mean().backward()
    assert all(p.grad is None for n, p in tr.named_parameters() if n in audio)
    opt.step()
    assert all(torch.equal(p, audio[n]) for n, p in tr.named_parameters() if n in audio)


def per_token_sigma(model, batch: int = 3) -> torch.Tensor:
    t = fc.per_token_timesteps(model, batch=batch)
    t[0] = 400.0      # one sample with one value (a (B,)-like row)
    return t


def test_per_token_timesteps_equal_diffusers_and_text_takes_the_noisiest():
    """(B, N) timesteps: each row gets its own (timestep, modality) row; the text rows take the sample's noisiest
    video row (the pipeline's text rows inherit the generated rows' timestep, its conditioning rows are at least as
    clean); dense equals diffusers' forward; routed at ratio 0 equals dense."""
    model = fc.make(FAMILY, **VIDEO).eval()
    x, _, y = fc.inputs(model, frames=3)
    t = per_token_sigma(model)
    cond = masked_cond(model)
    values, video, text = model.row_timesteps(model.timestep(t), model.num_tokens)
    torch.testing.assert_close(values[text], 1 - t.amax(1) / 1000)
    torch.testing.assert_close(values[video], 1 - t / 1000)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-6, atol=1e-6)
    fc.check_ratio_zero_model(fc.make(FAMILY, fc.RATIO_ZERO, **VIDEO), (x, t, y), cond)


def test_row_timesteps_are_the_pipelines():
    """Per sample: the pipeline's build_row_timesteps for a t2va prompt (no conditioning, no audio rows) gives one
    value, every row at index 0: what the family's (B,) path feeds (its B values, row b -> index b)."""
    model = fc.make(FAMILY, **VIDEO)
    layout = model.layout(4, model.token_grid)
    values, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(layout[2], layout[3], 0, 0, 4, 0.3, 0.9, 0.999,
                                                                    1.0)
    assert values.tolist() == [pytest.approx(0.3)] and not indices.any()
    ours, video, text = model.row_timesteps(torch.tensor([0.7, 0.2]), model.num_tokens)
    torch.testing.assert_close(ours, torch.tensor([0.3, 0.8]))
    assert torch.equal(video, torch.tensor([[0], [1]]).expand(-1, model.num_tokens)) and text.tolist() == [0, 1]


def test_each_prompt_laid_out_alone_batch_padding_masked():
    """A prompt's real length shifts its video rows' rotary time (the layout's text rows sit at their row index), so
    a sample's output depends on its own length, not on the batch's padding: alone (unpadded) = in the batch."""
    model = fc.make(FAMILY, **VIDEO).eval()
    x, t, y = fc.inputs(model, frames=3)
    cond = masked_cond(model)
    positions = model.video_positions([6, 3, 1], model.token_grid, torch.device("cpu"))
    assert positions[0, 0, 0] == 6 and positions[1, 0, 0] == 3 and positions[2, 0, 0] == 1
    with torch.no_grad():
        out = model(x, t, y, cond=cond)
        for b, n in enumerate((6, 3, 1)):
            alone = model(x[b:b + 1], t[b:b + 1], y[b:b + 1], cond={"text": cond["text"][b:b + 1, :n]})
            torch.testing.assert_close(out[b:b + 1], alone, rtol=1e-5, atol=1e-5)


def test_timestep_convention_is_the_pipelines_scheduler():
    """sigma = noise_level / 1000; the transformer gets t = 1 - sigma; our output v satisfies x0 = x_t - sigma v where
    MiniMaxH3Scheduler.step (x0 = x_t + sigma * output, the data-ward velocity) gives the same x0."""
    model = fc.make(FAMILY, **VIDEO).eval()
    x, t, y = fc.inputs(model, batch=1, frames=3)
    seen = {}
    hook = model.transformer.time_proj.register_forward_hook(lambda m, a, out: seen.update(t=a[0]))
    with torch.no_grad():
        ours = model(x, t, y)
    hook.remove()
    sigma = t / 1000
    torch.testing.assert_close(seen["t"], 1 - sigma)
    scheduler = MiniMaxH3Scheduler()
    scheduler.set_timesteps(sigmas=[float(sigma), 0.0])
    raw = -ours                                            # the transformer's own output (diffusers_forward negates)
    x0 = scheduler.step(raw, scheduler.timesteps[0], x, return_dict=False)[0]   # sigma_next 0: the step is x0
    torch.testing.assert_close(x0, x - sigma * ours, rtol=1e-5, atol=1e-5)


def test_prompts_through_the_modular_pipelines_text_step(tmp_path):
    """encode_prompts = MiniMaxH3ModularPipeline's text_encoder block (t2va: MiniMaxH3TextEncoderStep) run per prompt
    on the tiny Qwen3-VL (51 layers: it reads hidden_states[50]), stored right-padded with the mask."""
    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path / "enc"))
    prompts = ["a red disc", "a photo of a blue square on a green ring"]
    out = encode_prompts(FAMILY, enc, prompts, max_length=12)
    pipe = MiniMaxH3ModularPipeline()
    processor = enc.tokenizers["processor"]
    pipe.update_components(text_encoder=enc.models["text_encoder"], processor=processor, tokenizer=processor.tokenizer)
    for i, prompt in enumerate(prompts):
        state = PipelineState()
        state.set("prompt", prompt)
        _, state = pipe.blocks.sub_blocks["text_encoder"](pipe, state)
        rows = state.get("prompt_embeds")[0]
        n = rows.shape[0]
        assert n == len(prompt.split()) and out["text_mask"][i].sum() == n and out["text_mask"][i, :n].all()
        np.testing.assert_allclose(out["text"][i, :n], rows.numpy(), rtol=1e-6, atol=1e-6)
        assert not out["text"][i, n:].any()
    assert enc.models["text_encoder"].config.text_config.num_hidden_layers == 51


def test_lora_export_loads_with_the_modular_pipelines_load_lora_weights(tmp_path):
    """The exported LoRA loads with MiniMaxH3ModularPipeline.load_lora_weights (MiniMaxH3LoraLoaderMixin; the pipeline
    has no DiffusionPipeline half) into its transformer, which then computes what our adapted model computes."""
    from test_adapter_export import adapted
    from tread.checkpoint.save import export_adapter

    targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2", "context_embedder"]
    model = adapted(FAMILY, "lora", targets=targets)
    export_adapter(model, tmp_path)
    base = fc.make(FAMILY)
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=base.pristine_transformer())
    x, noise, labels = fc.inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
        pipe.load_lora_weights(tmp_path)
        ours = model(x, noise, labels)
        theirs = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
    assert (ours - plain).abs().max() > 0.02
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)


def test_released_geometry_on_the_meta_device():
    """The minimax-h3 preset builds on the meta device at the class defaults (50 blocks, width 5376, 56 x 128 heads,
    Qwen3-VL 5120-wide text, 24 latent channels) and runs a routed forward there; mid is ~0.38B parameters."""
    with torch.device("meta"):
        model = fc.make(FAMILY, fc.ROUTES, preset="minimax-h3", input_size=8, in_channels=24, frames=3)
        mid = fc.make(FAMILY, preset="mid", input_size=8, in_channels=24)
    c = model.transformer.config
    assert (model.depth, c.hidden_size, c.num_attention_heads, c.text_dim) == (50, 5376, 56, 5120)
    assert 0.3e9 < sum(p.numel() for p in mid.parameters()) < 0.45e9
    x = torch.empty(2, 24, 3, 8, 8, device="meta")
    out = model.train()(x, torch.empty(2, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"))
    assert out.shape == x.shape
