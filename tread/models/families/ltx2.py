"""LTX-2 (diffusers LTX2VideoTransformer3DModel, audio-visual) with TREAD routing.

Only video tokens are routed, with their self-attention RoPE rows, their a2v/v2a cross-attention RoPE rows and (per-token
timesteps) their modulation. The audio stream is never routed: it keeps all its tokens in every block (context), its
RoPE is its own, and in a routed block its v2a cross-attention reads the kept video tokens. The text connectors
(LTX2TextConnectors: LTX2Pipeline runs them after encode_prompt) are part of this model (`self.connectors`, frozen),
so the data holds encode_prompt's output. Video data has no audio: the audio stream is fed fixed-seed Gaussian noise at
sigma 1 (timestep 1000), the state the pipeline's audio starts from (docs/families.md, "LTX-2").
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, cond32, mask_bias
from tread.models.families.ltx_video import LTXVideoFamily
from tread.models.families.norms import norms_follow_input

_BLOCK = dict(activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
              norm_eps=1e-6, attention_bias=True, attention_out_bias=True)

LTX2_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, video width 64 (4 x 16), audio width 32 (2 x 16), a tiny Gemma-3
    # stand-in of width 32 (2 layers: 3 hidden states stacked), 2x2 latent cells per token.
    "tiny": dict(patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
                 audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=16,
                 audio_cross_attention_dim=32, num_layers=8, caption_channels=32, **_BLOCK),
    # GPU benchmarks (~0.4B with its connectors): video width 1024 (16 x 64), audio 512 (8 x 64), 16 blocks, the
    # released audio token width (8 channels x 16 mel bins); text: 3 stacked hidden states of a 1024-wide encoder.
    "mid": dict(patch_size=2, patch_size_t=1, num_attention_heads=16, attention_head_dim=64, cross_attention_dim=1024,
                audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=8, audio_attention_head_dim=64,
                audio_cross_attention_dim=512, num_layers=16, caption_channels=1024, **_BLOCK),
    # LTX-2.0 (19B): diffusers scripts/convert_ltx2_to_diffusers.py get_ltx2_transformer_config("2.0") (= the class
    # defaults). Real weights: model.pretrained (its connectors/ folder is loaded too).
    "ltx2-19b": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                     attention_head_dim=128, cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
                     audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                     num_layers=48, caption_channels=3840, **_BLOCK),
}


def _connector(width: int, heads: int, head_dim: int, layers: int, registers: Optional[int], factor: int) -> dict:
    kw: dict[str, Any] = dict(caption_channels=width, text_proj_in_factor=factor)
    for side in ("video", "audio"):
        kw.update({f"{side}_connector_num_attention_heads": heads, f"{side}_connector_attention_head_dim": head_dim,
                   f"{side}_connector_num_layers": layers, f"{side}_connector_num_learnable_registers": registers})
    return kw


# LTX2TextConnectors configs by the transformer's caption_channels (their output width). 3840: the converter's
# get_ltx2_text_encoder_config("2.0") = the class defaults (Gemma-3-12B: 48 layers + embeddings = 49 stacked states,
# 30 x 128 heads, 2 layers, 128 learnable registers: the text length must be a multiple of 128).
CONNECTORS: dict[int, dict[str, Any]] = {32: _connector(32, 4, 8, 1, None, 3),
                                         1024: _connector(1024, 8, 128, 1, None, 3),
                                         3840: _connector(3840, 30, 128, 2, 128, 49)}
DEFAULT_FRAME_RATE = 24.0        # LTX2Pipeline.__call__(frame_rate=24.0)
AUDIO_SIGMA = 1.0                # the audio stream's sigma in video-only training: pure noise (pipeline step 0)
AUDIO_SEED = 0                   # the audio noise is the same for every step: a deterministic forward


class LTX2Family(LTXVideoFamily):
    family = "ltx2"
    hub_hint = "Lightricks/LTX-2"
    diffusers_class = "LTX2VideoTransformer3DModel"
    text_dim_key = "caption_channels"
    i2v_mode = ""                  # LTX2ImageToVideoPipeline is not wired (docs/families.md, "LTX-2")

    def save_pretrained(self, folder: str) -> None:
        """transformer/ and connectors/, as LTX2Pipeline's folder holds them (what _build_connectors loads)."""
        super().save_pretrained(folder)
        self.connectors.save_pretrained(f"{folder}/connectors")

    def group_attention_modules(self) -> list[nn.Module]:
        """Context parallelism is refused (RoutedFamily's one line): LTX-Video's split of attn1 alone would leave the
        audio stream and the audio-video cross-attentions unsplit."""
        return []

    def __init__(self, transformer: nn.Module, *, frame_rate: float = DEFAULT_FRAME_RATE,
                 connectors: Optional[Mapping[str, Any]] = None, audio_sigma: Optional[float] = AUDIO_SIGMA,
                 **kwargs: Any):
        """connectors: LTX2TextConnectors config overrides (tests); audio_sigma: the audio stream's sigma, None for the
        video's (the pipeline's joint schedule; with data that has no audio, that labels noise as partly clean)."""
        self.connector_config = self._connector_config(transformer.config, connectors)
        self.audio_sigma = audio_sigma
        super().__init__(transformer, frame_rate=frame_rate, **kwargs)
        # Frozen, as the pipeline's text stage: training (full or model.lora) adapts the transformer only.
        self.connectors = norms_follow_input(self._build_connectors(transformer.config).requires_grad_(False))

    # -- configuration ---------------------------------------------------------------------------
    @staticmethod
    def _connector_config(config: Any, overrides: Optional[Mapping[str, Any]]) -> dict[str, Any]:
        width = int(config.caption_channels)
        if width not in CONNECTORS and not overrides:
            raise FamilyConfigError(f"model.config.caption_channels={width} has no text connector preset; allowed: "
                                    f"{sorted(CONNECTORS)} (the connectors' output width).")
        return {**CONNECTORS.get(width, {}), **dict(overrides or {})}

    def _build_connectors(self, config: Any) -> nn.Module:
        """Fresh connectors, or with real weights (config._name_or_path: diffusers sets it in from_pretrained) the
        pipeline folder's connectors/ subfolder."""
        from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors  # deferred: a heavy optional dependency

        source = config.get("_name_or_path") if isinstance(config, dict) else getattr(config, "_name_or_path", None)
        if not source:
            return LTX2TextConnectors(**self.connector_config)
        try:
            return LTX2TextConnectors.from_pretrained(source, subfolder="connectors",
                                                      local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1" or None)
        except (OSError, ValueError) as err:
            raise FamilyConfigError(f"model.pretrained='{source}' (ltx2): its text connectors (connectors/, "
                                    f"LTX2TextConnectors) do not load: {str(err).splitlines()[0]}") from None

    @property
    def text_dim(self) -> int:
        """The stored text width: encode_prompt's stack of text-encoder hidden states, caption_channels x layers."""
        c = self.connector_config
        return int(c.get("caption_channels", 3840)) * int(c.get("text_proj_in_factor", 49))

    def check_shapes(self) -> None:
        super().check_shapes()
        c = self.transformer.config
        audio = c.audio_num_attention_heads * c.audio_attention_head_dim
        if c.audio_cross_attention_dim != audio:
            raise FamilyConfigError(
                f"model.config.audio_cross_attention_dim={c.audio_cross_attention_dim} must equal the audio width "
                f"audio_num_attention_heads x audio_attention_head_dim = {audio}: the a2v / v2a RoPE is that wide.")
        if not c.use_prompt_embeddings:
            raise FamilyConfigError("model.config.use_prompt_embeddings=false (LTX-2.3's per-modality connectors) is "
                                    "not allowed; allowed: true (LTX-2.0: caption projections in the transformer).")

    @property
    def use_cross_timestep(self) -> bool:
        """LTX-2.3+ (prompt modulation) takes the other modality's sigma for the a2v/v2a modulation; LTX-2.0 its own
        (the transformer's docstring: use_cross_timestep)."""
        return bool(self.transformer.prompt_modulation)

    # -- inputs ----------------------------------------------------------------------------------
    def audio_frames(self, latent_frames: int) -> int:
        """LTX2Pipeline.__call__'s audio latent length: round(pixel frames / frame_rate x audio latents per second)."""
        c = self.transformer.config
        pixel_frames = (latent_frames - 1) * int(c.vae_scale_factors[0]) + 1
        per_second = c.audio_sampling_rate / c.audio_hop_length / c.audio_scale_factor
        return max(1, round(pixel_frames / self.frame_rate * per_second))

    def audio_latents(self, batch: int, latent_frames: int, like: torch.Tensor) -> torch.Tensor:
        """(B, L_audio, audio_in_channels) packed audio latents: fixed-seed noise (no audio in the data), the same
        for every sample, so that a sample's output does not depend on its place in the batch."""
        g = torch.Generator().manual_seed(AUDIO_SEED)
        shape = (1, self.audio_frames(latent_frames), int(self.transformer.config.audio_in_channels))
        return torch.randn(shape, generator=g).to(device=like.device, dtype=like.dtype).expand(batch, -1, -1)

    def sigmas(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(video sigma, audio timestep), both (B,) in timestep units: the pipelines pass the per-sample timestep as
        sigma (the I2V pipeline too, beside its (B, N) video timestep); the audio at audio_sigma x 1000."""
        sigma = timestep if timestep.dim() == 1 else timestep.amax(1)
        if self.audio_sigma is None:
            return sigma, sigma
        return sigma, torch.full_like(sigma, self.audio_sigma * self.transformer.config.timestep_scale_multiplier)

    def connect(self, cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LTX2Pipeline's connectors on the stored encode_prompt output: (video text, audio text, mask (B, L))."""
        text, mask = cond["text"], cond.get("text_mask")
        registers = self.connector_config.get("video_connector_num_learnable_registers", 128)
        if registers and text.shape[1] % registers:
            raise FamilyConfigError(f"text of {text.shape[1]} positions: the LTX-2 connectors' {registers} learnable "
                                    f"registers need a multiple of {registers} (data max_text_length).")
        if mask is None:
            mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
        return self.connectors(text, mask, padding_side="left")   # Gemma pads left (the pipeline's default)

    def pipeline_inputs(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> dict:
        """The transformer's kwargs as LTX2Pipeline.__call__ builds them (connectors run, coords precomputed)."""
        tr, B, (F, H, W) = self.transformer, x.shape[0], x.shape[2:]
        text, audio_text, mask = self.connect(cond)
        sigma, audio_t = self.sigmas(timestep)
        audio = self.audio_latents(B, F, x)
        return dict(hidden_states=self.pack(x), audio_hidden_states=audio, encoder_hidden_states=text,
                    audio_encoder_hidden_states=audio_text, timestep=self.token_timestep(timestep, self.tokens_in(x)),
                    audio_timestep=audio_t, sigma=sigma, audio_sigma=audio_t, encoder_attention_mask=mask,
                    audio_encoder_attention_mask=mask, num_frames=F, height=H, width=W, fps=self.frame_rate,
                    audio_num_frames=audio.shape[1],
                    video_coords=tr.rope.prepare_video_coords(B, F, H, W, x.device, fps=self.frame_rate),
                    audio_coords=tr.audio_rope.prepare_audio_coords(B, audio.shape[1], x.device),
                    use_cross_timestep=self.use_cross_timestep, return_dict=False)

    # -- the routed forward ------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        kw = self.pipeline_inputs(x, timestep, cond)
        hidden, B = tr.proj_in(kw["hidden_states"]), x.shape[0]
        audio = tr.audio_proj_in(kw["audio_hidden_states"])
        mods = self._modulation(kw, B, hidden.dtype)
        ropes = self._ropes(kw["video_coords"], kw["audio_coords"], x.device)
        per_token = {k: ropes.pop(k) for k in ("rope_cos", "rope_sin", "ca_rope_cos", "ca_rope_sin")}
        if kw["timestep"].dim() == 2:   # per-token video timesteps: their modulation goes with the tokens
            per_token.update({k: mods.pop(k) for k in ("temb", "v_ss", "v_gate") if mods[k].shape[1] > 1})
        context = {"text": tr.caption_projection(kw["encoder_hidden_states"]).view(B, -1, hidden.shape[-1]),
                   "audio_text": tr.audio_caption_projection(kw["audio_encoder_hidden_states"]).view(
                       B, -1, audio.shape[-1]),
                   "audio": audio}
        extra = {**mods, **ropes, "mask": mask_bias(kw["encoder_attention_mask"], hidden.dtype)}
        return Embedded(hidden, context, per_token, extra, grid)

    def _modulation(self, kw: Mapping[str, Any], B: int, dtype: torch.dtype) -> dict[str, Optional[torch.Tensor]]:
        """The transformer forward's step 3 (timestep embeddings and global modulation), as it computes them."""
        tr, c = self.transformer, self.transformer.config
        t, audio_t, sigma = kw["timestep"], kw["audio_timestep"], kw["sigma"]

        def ada(layer: nn.Module, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, embedded = layer(values.flatten(), batch_size=B, hidden_dtype=dtype)
            return out.view(B, -1, out.shape[-1]), embedded.view(B, -1, embedded.shape[-1])

        gate = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        video_ca = audio_t if self.use_cross_timestep else t
        audio_ca = sigma if self.use_cross_timestep else audio_t
        mods: dict[str, Optional[torch.Tensor]] = {}
        mods["temb"], mods["embedded"] = ada(tr.time_embed, t)
        mods["temb_audio"], mods["audio_embedded"] = ada(tr.audio_time_embed, audio_t)
        mods["v_ss"], mods["v_gate"] = ada(tr.av_cross_attn_video_scale_shift, video_ca)[0], \
            ada(tr.av_cross_attn_video_a2v_gate, video_ca * gate)[0]
        mods["a_ss"], mods["a_gate"] = ada(tr.av_cross_attn_audio_scale_shift, audio_ca)[0], \
            ada(tr.av_cross_attn_audio_v2a_gate, audio_ca * gate)[0]
        prompt = tr.prompt_modulation and c.use_prompt_adaln_single
        mods["temb_prompt"] = ada(tr.prompt_adaln, sigma)[0] if prompt else None
        mods["temb_prompt_audio"] = ada(tr.audio_prompt_adaln, audio_t)[0] if prompt else None
        return mods

    def _ropes(self, video_coords: torch.Tensor, audio_coords: torch.Tensor, device: torch.device) -> dict:
        """Self-attention and a2v/v2a RoPE of both streams. The video rows are per token: 'split' RoPE (B, H, N, d) is
        kept as (B, N, H, d) so that routing gathers tokens along dim 1."""
        tr = self.transformer
        token_major = (lambda t: t.transpose(1, 2)) if tr.config.rope_type == "split" else (lambda t: t)
        (cos, sin), (ca_cos, ca_sin) = tr.rope(video_coords, device), tr.cross_attn_rope(video_coords[:, 0:1], device)
        return {"rope_cos": token_major(cos), "rope_sin": token_major(sin), "ca_rope_cos": token_major(ca_cos),
                "ca_rope_sin": token_major(ca_sin), "audio_rope": tr.audio_rope(audio_coords, device),
                "audio_ca_rope": tr.cross_attn_audio_rope(audio_coords[:, 0:1], device)}

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        shared = emb.extra
        head_major = (lambda t: t.transpose(1, 2)) if self.transformer.config.rope_type == "split" else (lambda t: t)

        def mod(tok: Mapping[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
            return tok[name] if name in tok else cond32(shared[name])

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, ctx: Mapping[str, torch.Tensor], tok: Mapping[str, torch.Tensor]):
                x, audio = block(
                    hidden_states=x, audio_hidden_states=ctx["audio"], encoder_hidden_states=ctx["text"],
                    audio_encoder_hidden_states=ctx["audio_text"], temb=mod(tok, "temb"),
                    temb_audio=mod(tok, "temb_audio"), temb_ca_scale_shift=mod(tok, "v_ss"),
                    temb_ca_audio_scale_shift=mod(tok, "a_ss"), temb_ca_gate=mod(tok, "v_gate"),
                    temb_ca_audio_gate=mod(tok, "a_gate"), temb_prompt=mod(tok, "temb_prompt"),
                    temb_prompt_audio=mod(tok, "temb_prompt_audio"),
                    video_rotary_emb=(head_major(tok["rope_cos"]), head_major(tok["rope_sin"])),
                    audio_rotary_emb=tuple(cond32(r) for r in shared["audio_rope"]),
                    ca_video_rotary_emb=(head_major(tok["ca_rope_cos"]), head_major(tok["ca_rope_sin"])),
                    ca_audio_rotary_emb=tuple(cond32(r) for r in shared["audio_ca_rope"]),
                    encoder_attention_mask=cond32(shared["mask"]), audio_encoder_attention_mask=cond32(shared["mask"]))
                return x, {**ctx, "audio": audio}
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        """The video output; the audio stream's output is kept (detached) as self.last_audio for the checks."""
        tr = self.transformer
        self.last_audio = _out(tr.audio_scale_shift_table, tr.audio_norm_out, tr.audio_proj_out,
                               emb.context["audio"], emb.extra["audio_embedded"]).detach()
        video = _out(tr.scale_shift_table, tr.norm_out, tr.proj_out, x, emb.extra["embedded"])
        return self.unpack(video, emb.grid)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """transformer(...) on the inputs LTX2Pipeline builds (pipeline_inputs): the video output, unpacked."""
        return self.unpack(transformer(**self.pipeline_inputs(x, timestep, cond))[0], self.grid_of(x))


def _out(table: torch.Tensor, norm: nn.Module, proj: nn.Module, h: torch.Tensor, embedded: torch.Tensor):
    """The transformer forward's output layer (step 6) for one stream."""
    values = table[None, None] + embedded[:, :, None]
    return proj(norm(h) * (1 + values[:, :, 1]) + values[:, :, 0])


FAMILY = LTX2Family
PRESETS = LTX2_PRESETS
