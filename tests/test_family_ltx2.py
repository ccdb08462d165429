"""LTX-2 (diffusers LTX2VideoTransformer3DModel, audio-visual) with TREAD routing: the proofs only LTX-2 has. Video
tokens are routed; the audio stream never is. Dense equals the transformer as LTX2Pipeline.__call__ calls it (video
and audio outputs); kept video tokens equal diffusers' blocks on the kept subsequence with their own RoPE rows
(self-attention and a2v/v2a) while the audio keeps all its tokens and rows; the audio stream is bit-identical to dense
where routing cannot reach it and equals diffusers' where all video tokens are kept. The shared checks run in
tests/test_families.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

import family_checks as fc
from test_families import SPAN
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.models.families import FamilyConfigError

FAMILY = "ltx2"
JOINT = {"audio_sigma": None}          # the audio at the video's sigma: LTX2Pipeline's joint schedule
REGISTERS = {"connectors": {"video_connector_num_learnable_registers": 4, "audio_connector_num_learnable_registers": 4}}

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_cond(model, batch: int = 3) -> dict:
    """encode_prompt-like text: left-padded (Gemma's padding side), prompts of 6, 3 and 1 tokens."""
    cond = fc.masked_text(model, batch=batch)
    cond["text_mask"] = cond["text_mask"].flip(1)
    return cond


class _Stub:
    """What LTX2Pipeline.__call__ reads of a VAE when it returns latents: sizes and identity latent statistics."""

    def __init__(self, **config: Any):
        self.config = SimpleNamespace(**config)
        self.latents_mean, self.latents_std = torch.zeros(1), torch.ones(1)
        self.spatial_compression_ratio, self.temporal_compression_ratio = 32, config.get("temporal", 8)
        self.mel_compression_ratio = 4


def pipeline_call(model, x, cond, audio, *, frame_rate: float) -> dict:
    """LTX2Pipeline.__call__ (our transformer's weights and connectors, no guidance, sigmas 0.7 then 0.3) on packed
    latents x and audio latents, recording the transformer's first call: its kwargs and its (video, audio) output."""
    c = model.transformer.config
    vae = _Stub(scaling_factor=1.0)
    audio_vae = _Stub(mel_bins=16, latent_channels=c.audio_in_channels // 4, sample_rate=16000, mel_hop_length=160,
                      temporal=4)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None,
                        tokenizer=None, connectors=model.connectors, transformer=model.pristine_transformer(),
                        vocoder=None)
    seen: dict[str, Any] = {}

    def pre(_, args, kwargs):
        seen.setdefault("kwargs", dict(kwargs))

    def post(_, args, kwargs, out):
        seen.setdefault("out", out)

    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    pipe.transformer.register_forward_hook(post, with_kwargs=True)
    _, _, T, H, W = x.shape
    with torch.no_grad():
        pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"], latents=model.pack(x),
             audio_latents=audio, height=H * 32, width=W * 32, num_frames=(T - 1) * 8 + 1, frame_rate=frame_rate,
             sigmas=[0.7, 0.3], guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
             modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
             spatio_temporal_guidance_blocks=None, use_cross_timestep=model.use_cross_timestep, output_type="latent")
    return seen


@pytest.mark.parametrize("frames,frame_rate", [(3, 24.0), (3, 12.0), (1, 24.0)], ids=["T3", "T3-12fps", "T1"])
def test_dense_equals_the_transformer_as_ltx2_pipeline_calls_it(frames, frame_rate):
    """LTX2Pipeline.__call__ itself (its connectors on encode_prompt's output, packed latents, precomputed video and
    audio coords at the frame rate, sigma * 1000 timesteps, the audio length from the clip's duration) feeds the
    transformer; with the audio at the video's sigma (JOINT), our dense forward on the same latents, timestep and
    text equals the transformer's video output, and its audio stream equals the transformer's audio output."""
    model = fc.make(FAMILY, frames=frames, frame_rate=frame_rate, **JOINT).eval()
    x, _, _ = fc.inputs(model, batch=2, frames=frames)
    y, cond = torch.zeros(2, dtype=torch.long), masked_cond(model, batch=2)
    audio = model.audio_latents(2, frames, x)
    seen = pipeline_call(model, x, cond, audio, frame_rate=frame_rate)
    kw, (video_out, audio_out) = seen["kwargs"], seen["out"]
    assert kw["timestep"].shape == (2,) and torch.allclose(kw["timestep"], torch.tensor(700.0))
    assert kw["audio_num_frames"] == model.audio_frames(frames) == audio.shape[1]
    torch.testing.assert_close(kw["audio_hidden_states"], audio, rtol=0, atol=0)
    ours_kw = model.pipeline_inputs(x, kw["timestep"], cond)
    for key in ("video_coords", "audio_coords", "encoder_hidden_states", "audio_encoder_hidden_states",
                "encoder_attention_mask", "hidden_states"):
        torch.testing.assert_close(ours_kw[key], kw[key], rtol=0, atol=0, msg=key)
    with torch.no_grad():
        ours = model(x, kw["timestep"], y, cond=cond)
    torch.testing.assert_close(ours, model.unpack(video_out, model.grid_of(x)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.last_audio, audio_out, rtol=1e-6, atol=1e-6)


def test_video_only_audio_is_noise_at_sigma_one():
    """Training default: the audio stream is the same fixed noise for every sample at timestep 1000 (sigma 1),
    whatever the video's timestep; at the pipeline's joint sigma the video output differs (the audio matters)."""
    model = fc.make(FAMILY, frames=3).eval()
    x, t, y = fc.inputs(model, frames=3)
    kw = model.pipeline_inputs(x, t, {"text": torch.randn(3, 4, model.text_dim)})
    assert torch.equal(kw["audio_timestep"], torch.full((3,), 1000.0)) and torch.equal(kw["sigma"], t)
    assert torch.equal(kw["audio_hidden_states"][0], kw["audio_hidden_states"][2])
    joint = fc.make(FAMILY, frames=3, **JOINT).eval()
    with torch.no_grad():
        assert not torch.allclose(model(x, t, y), joint(x, t, y))
        torch.testing.assert_close(model(x, t, y), model.reference_forward(x, t, y), rtol=1e-6, atol=1e-6)


def test_connector_registers_and_text_length():
    """With learnable registers (the released connectors: 128) the padding is replaced by registers and the mask
    becomes all ones, as in the pipeline; a text length that is not a multiple of the registers is one error."""
    model = fc.make(FAMILY, frames=3, **REGISTERS).eval()
    x, t, y = fc.inputs(model, batch=2, frames=3)
    cond = {"text": torch.randn(2, 8, model.text_dim), "text_mask": torch.arange(8).flip(0)[None] < torch.tensor([[3], [8]])}
    _, _, mask = model.connect(cond)
    assert mask.all()
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(FamilyConfigError, match="multiple of 4"):
        model(x, t, y, cond={"text": torch.randn(2, 6, model.text_dim)})


def _coords_rope(tr, model, ids: torch.Tensor, F: int, H: int, W: int):
    """diffusers' video RoPE rows (self-attention and a2v/v2a) of the tokens `ids` alone, from their own coords."""
    coords = tr.rope.prepare_video_coords(1, F, H, W, torch.device("cpu"), fps=model.frame_rate)[:, :, ids]
    return tr.rope(coords), tr.cross_attn_rope(coords[:, 0:1])


def _embed(layer, values: torch.Tensor, n: int, scale: float = 1.0) -> torch.Tensor:
    return layer(values.flatten() * scale, batch_size=1, hidden_dtype=torch.float32)[0].view(1, n, -1)


@pytest.mark.parametrize("per_token", [False, True], ids=["T3", "T3-per-token-t"])
def test_kept_tokens_and_audio_equal_blocks_on_subsequence(per_token):
    """Kept video tokens after the route, and the audio stream leaving the route's last block, equal diffusers' own
    blocks run per sample on the kept video subsequence with its RoPE rows from the kept tokens' true (f, h, w)
    coords (self-attention and the a2v/v2a rows), the whole audio stream with its own rows, the connectors' text
    and (per-token timesteps) the kept tokens' own modulation. Teeth: other rows (or timesteps) give other values."""
    r = fc.routed_run(FAMILY, SPAN, frames=3, cond=masked_cond, timesteps=fc.per_token_timesteps if per_token else None)
    model, t, seen, routed, cond = r.model, r.t, r.dense, r.routed, r.cond
    _, x_kept, ids, _ = r.scatter
    tr, (F, H, W) = model.pristine_transformer(), (3, 8, 8)
    start, end = r.route.start_layer_idx, r.route.end_layer_idx
    with torch.no_grad():
        video_text, audio_text, mask = model.connect(cond)
        for b in range(ids.shape[0]):
            assert len(set((ids[b] // (model.num_tokens // 3)).tolist())) > 1      # kept tokens span frames
            ts = t[b, ids[b]] if per_token else t[b:b + 1]
            n, audio_t = (len(ts) if per_token else 1), torch.tensor([1000.0])
            kw = dict(encoder_hidden_states=tr.caption_projection(video_text[b:b + 1]),
                      audio_encoder_hidden_states=tr.audio_caption_projection(audio_text[b:b + 1]),
                      temb_audio=_embed(tr.audio_time_embed, audio_t, 1),
                      temb_ca_audio_scale_shift=_embed(tr.av_cross_attn_audio_scale_shift, audio_t, 1),
                      temb_ca_audio_gate=_embed(tr.av_cross_attn_audio_v2a_gate, audio_t, 1),
                      audio_rotary_emb=tr.audio_rope(tr.audio_rope.prepare_audio_coords(1, 18, torch.device("cpu"))),
                      ca_audio_rotary_emb=tr.cross_attn_audio_rope(
                          tr.audio_rope.prepare_audio_coords(1, 18, torch.device("cpu"))[:, 0:1]),
                      encoder_attention_mask=(1 - mask[b:b + 1].float()).unsqueeze(1) * -10000.0)
            kw["audio_encoder_attention_mask"] = kw["encoder_attention_mask"]

            def blocks(h, a, ts=ts, rows=ids[b]):
                rope, ca_rope = _coords_rope(tr, model, rows, F, H, W)
                mods = dict(temb=_embed(tr.time_embed, ts, n), temb_ca_scale_shift=_embed(
                    tr.av_cross_attn_video_scale_shift, ts, n), temb_ca_gate=_embed(tr.av_cross_attn_video_a2v_gate, ts, n))
                for blk in tr.transformer_blocks[start:end + 1]:
                    h, a = blk(h, a, video_rotary_emb=rope, ca_video_rotary_emb=ca_rope, **mods, **kw)
                return h, a

            h, a = seen[start][0][b:b + 1, ids[b]], seen[start][1]["audio"][b:b + 1]   # dense route-start values
            ref_h, ref_a = blocks(h, a)
            torch.testing.assert_close(x_kept[b:b + 1], ref_h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(routed[end + 1][1]["audio"][b:b + 1], ref_a, rtol=1e-5, atol=1e-5)
            if b == 0:   # teeth: the kept tokens at other positions (or with other timesteps) give other values
                assert not torch.allclose(x_kept[:1], blocks(h, a, rows=ids[b].flip(0))[0], rtol=1e-3, atol=1e-3)
                if per_token:
                    assert not torch.allclose(x_kept[:1], blocks(h, a, ts=ts.flip(0))[0], rtol=1e-3, atol=1e-3)


def test_audio_stream_untouched_by_routing():
    """The audio stream is never gathered: full length in every block, bit-identical to dense up to the route's
    start block; after it, it read only the kept video tokens (it differs from dense, and the subsequence check above
    pins it). With every token kept (ratio 0, permuted) the audio output equals dense, which equals diffusers'."""
    r = fc.routed_run(FAMILY, SPAN, frames=3, cond=masked_cond)
    start, end = r.route.start_layer_idx, r.route.end_layer_idx
    for i, ((_, dense), (_, routed)) in enumerate(zip(r.dense, r.routed)):
        assert routed["audio"].shape == dense["audio"].shape == (3, 18, 32)
        if i <= start:
            assert torch.equal(routed["audio"], dense["audio"])
    assert not torch.allclose(r.routed[end + 1][1]["audio"], r.dense[end + 1][1]["audio"])
    model = fc.make(FAMILY, fc.RATIO_ZERO, frames=3)
    x, t, y = fc.inputs(model, frames=3)
    model.train()
    with torch.no_grad(), fc.fixed_selection(model, fc.random_permutation(7)):
        with torch.enable_grad():
            model(x, t, y)
        routed_audio = model.last_audio
        model.eval()(x, t, y)
    torch.testing.assert_close(routed_audio, model.last_audio, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        kw = model.pipeline_inputs(x, t, model.conditioning(y, None))
        _, reference = model.pristine_transformer()(**kw)
    torch.testing.assert_close(model.last_audio, reference, rtol=1e-6, atol=1e-6)


def test_ratio_zero_permuted_per_token_timesteps_equals_dense():
    """A permutation moves each token's own timestep modulation (temb, a2v scale/shift and gate) and RoPE rows."""
    model = fc.make(FAMILY, fc.RATIO_ZERO, frames=3)
    x, _, y = fc.inputs(model, frames=3)
    fc.check_ratio_zero_model(model, (x, fc.per_token_timesteps(model), y), cond=masked_cond(model))


def test_single_frame_image_latents():
    """Images (B, C, H, W) run as one frame (B, C, 1, H, W): one frame, one audio latent (1 / 24 s x 25 per s)."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    with torch.no_grad():
        image, single = model(x, t, y), model(x.unsqueeze(2), t, y)
    torch.testing.assert_close(image.unsqueeze(2), single, rtol=0, atol=0)
    assert model.audio_frames(1) == 1 and model.audio_frames(3) == 18


def test_prompts_are_ltx2_pipelines_encode_prompt_and_feed_the_connectors(tmp_path):
    """Our stored text (tiny Gemma3ForConditionalGeneration, the Gemma tokens) equals LTX2Pipeline.encode_prompt's
    stacked hidden states and left-padded mask; the tiny preset's connectors take that width and give diffusers'
    forward on it."""
    enc = load_text_encoders(FAMILY, save_tiny_text_encoders(FAMILY, tmp_path / "enc"))
    prompts = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
    ours = encode_prompts(FAMILY, enc, prompts, max_length=16)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, audio_vae=None, connectors=None,
                        transformer=None, vocoder=None, text_encoder=enc.models["text_encoder"],
                        tokenizer=enc.tokenizers["tokenizer"])
    with torch.inference_mode():
        text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16,
                                              device="cpu")
    assert type(pipe.text_encoder).__name__ == "Gemma3ForConditionalGeneration" and text.shape == (3, 16, 96)
    np.testing.assert_allclose(ours["text"], text.float().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours["text_mask"], mask.bool().numpy())
    assert ours["text_mask"][:, -1].all() and not ours["text_mask"][:, 0].any()      # left padding
    model = fc.make(FAMILY, frames=3).eval()
    cond = {k: torch.from_numpy(v) for k, v in ours.items()}
    x, t, y = fc.inputs(model, frames=3)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond),
                                   rtol=1e-6, atol=1e-6)


def test_pretrained_folder_loads_its_connectors(tmp_path):
    """model.pretrained: the transformer from transformer/, its connectors from the same folder's connectors/ (as
    LTX2Pipeline holds them); a folder without connectors/ is one error naming the path."""
    model = fc.make(FAMILY, frames=3, seed=3).eval()
    model.save_pretrained(str(tmp_path / "pipe"))
    loaded = fc.build_family(FAMILY, input_size=8, in_channels=4, num_classes=5, frames=3,
                             pretrained=str(tmp_path / "pipe")).eval()
    x, t, y = fc.inputs(model, frames=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, y, cond=masked_cond(model)), model(x, t, y, cond=masked_cond(model)),
                                   rtol=0, atol=0)
    model.transformer.save_pretrained(tmp_path / "bare" / "transformer")
    with pytest.raises(FamilyConfigError, match="connectors"):
        fc.build_family(FAMILY, input_size=8, in_channels=4, num_classes=5, frames=3, pretrained=str(tmp_path / "bare"))
