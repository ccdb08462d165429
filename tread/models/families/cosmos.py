"""Cosmos-Predict2 (diffusers CosmosTransformer3DModel) with TREAD routing.

The Predict2 pipelines' EDM preconditioning is a change of variables of our rectified flow, so the raw
output is our velocity; docs/families.md ("Cosmos-Predict2") gives the derivation and what is routed.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches
from tread.models.families.first_frame import FIRST_FRAME, I2V_MASK, conditioned

_GEOMETRY = dict(mlp_ratio=4.0, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
                 concat_padding_mask=True, extra_pos_embed_type=None)
COSMOS_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), a T5 stand-in of width 32.
    "tiny": dict(_GEOMETRY, num_attention_heads=4, attention_head_dim=16, num_layers=8, mlp_ratio=2.0,
                 text_embed_dim=32, adaln_lora_dim=16, rope_scale=(1.0, 4.0, 4.0)),
    # A mid-size model for GPU benchmarks (~0.5B parameters): width 1536 (12 x 128), 12 blocks, T5-11B text width.
    "mid": dict(_GEOMETRY, num_attention_heads=12, attention_head_dim=128, num_layers=12, text_embed_dim=1024,
                rope_scale=(1.0, 3.0, 3.0)),
    # diffusers' scripts/convert_cosmos_to_diffusers.py TRANSFORMER_CONFIGS (Wan 2.1 VAE: 16 channels): nvidia/
    # Cosmos-Predict2-2B-Text2Image, -2B-Video2World (+1 condition-mask channel) and -14B-Text2Image.
    "cosmos-predict2-2b-t2i": dict(_GEOMETRY, in_channels=16, out_channels=16, num_attention_heads=16,
                                   attention_head_dim=128, num_layers=28, text_embed_dim=1024,
                                   rope_scale=(1.0, 4.0, 4.0)),
    "cosmos-predict2-2b-video2world": dict(_GEOMETRY, in_channels=17, out_channels=16, num_attention_heads=16,
                                           attention_head_dim=128, num_layers=28, text_embed_dim=1024,
                                           rope_scale=(1.0, 3.0, 3.0)),
    "cosmos-predict2-14b-t2i": dict(_GEOMETRY, in_channels=16, out_channels=16, num_attention_heads=40,
                                    attention_head_dim=128, num_layers=36, text_embed_dim=1024,
                                    rope_scale=(1.0, 4.0, 4.0)),
}
VAE_SPATIAL = 8   # the Wan 2.1 VAE's spatial factor: the pipelines' padding mask is at pixel size (H * 8, W * 8)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-2) on x (B, H, S, Dh), with cos/sin (S, Dh)
    shared by the batch or (B, S, Dh) per sample."""
    cos, sin = (c[None, None] if c.dim() == 2 else c[:, None] for c in (cos, sin))
    real, imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
    rotated = torch.cat([-imag, real], dim=-1)
    return (x.float() * cos.to(x.device) + rotated.float() * sin.to(x.device)).to(x.dtype)


class BatchedRopeCosmosAttnProcessor:
    """CosmosAttnProcessor2_0's maths with a RoPE table (cos, sin) that may be per sample: each (S, Dh) or
    (B, S, Dh). Attention goes through diffusers' dispatch_attention_fn (set_attention_backend applies)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn  # deferred: diffusers is optional

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = lambda t: t.unflatten(2, (attn.heads, -1)).transpose(1, 2)      # (B, H, S, Dh)
        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(context)), heads(attn.to_v(context))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query, key = _rotate(query, *image_rotary_emb), _rotate(key, *image_rotary_emb)
        out = dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                    attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


# Cosmos2VideoToWorldPipeline's sigma_conditioning default: the given frames' EDM sigma, t = sigma / (sigma + 1).
SIGMA_CONDITIONING = 1e-4


class CosmosFamily(RoutedFamily):
    family = "cosmos"
    hub_hint = "nvidia/Cosmos-Predict2-2B-Text2Image"
    diffusers_class = "CosmosTransformer3DModel"
    text_dim_key = "text_embed_dim"
    frames_axis = True
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    # model.i2v (Video2World geometry): the clean first frames in place at the pipeline's t_conditioning, per latent
    # frame, with the condition-mask channel 1 on them (Cosmos2VideoToWorldPipeline's cond_indicator / cond_mask).
    i2v_mode = "frames"
    i2v_given_level = 1000.0 * SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1.0)
    i2v_per_frame = True

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """The data's channels (a V2W preset's own in_channels wins); refuses, before diffusers' constructor divides
        by zero, a head dim CosmosRotaryPosEmbed cannot split."""
        head_dim = diffusers_config.get("attention_head_dim", 128)
        if head_dim % 2 or head_dim < 12:
            raise FamilyConfigError(f"model.diffusers_config.attention_head_dim={head_dim}: CosmosRotaryPosEmbed splits the head "
                                    f"dim into t/h/w parts of at least 4; allowed: even and >= 12.")
        return {"in_channels": in_channels, "out_channels": in_channels}

    def __init__(self, transformer: nn.Module, *, frame_rate: Optional[float] = None, expand_timesteps: bool = False,
                 **kwargs: Any):
        if frame_rate is not None and (isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float))
                                       or frame_rate <= 0):
            raise FamilyConfigError(f"model.frame_rate={frame_rate!r} is not allowed; allowed: null (images: plain "
                                    f"temporal RoPE positions) or a positive number (the video's fps, e.g. 16).")
        self.frame_rate, self.expand_timesteps = frame_rate, bool(expand_timesteps)
        super().__init__(transformer, **kwargs)

    def latent_patch(self) -> tuple[int, int, int]:
        pt, ph, pw = (int(p) for p in self.transformer.config.patch_size)
        return pt, ph, pw

    def check_shapes(self) -> None:
        c, C = self.transformer.config, self.in_channels
        if len(c.patch_size) != 3 or int(c.patch_size[0]) != 1:
            raise FamilyConfigError(f"model.config.patch_size={list(c.patch_size)} must be (1, ph, pw): one latent "
                                    f"frame per token (every released Cosmos model: (1, 2, 2)).")
        if c.in_channels not in (C, C + 1):
            raise FamilyConfigError(f"model.config.in_channels={c.in_channels} does not fit data.channels={C}; "
                                    f"allowed: {C} (Text2Image) or {C + 1} (Video2World: + the condition mask).")
        if self.i2v and c.in_channels != C + 1:
            raise FamilyConfigError(f"model.i2v=true needs the Video2World geometry: model.config.in_channels="
                                    f"{c.in_channels}, allowed: {C + 1} (data.channels + the condition-mask channel; "
                                    f"e.g. model.preset=cosmos-predict2-2b-video2world).")
        if c.out_channels != C:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal data.channels={C}: "
                                    f"Cosmos predicts a latent of the input's shape (the Wan 2.1 VAE: 16 channels).")
        self._check_video_patch()
        if c.use_crossattn_projection or c.img_context_dim_in:
            raise FamilyConfigError(
                f"model.config.use_crossattn_projection={c.use_crossattn_projection} / img_context_dim_in="
                f"{c.img_context_dim_in}: Cosmos 2.5 (Qwen2.5-VL text) and Transfer are not supported; allowed: "
                f"false / null (Cosmos-Predict2).")
        if c.extra_pos_embed_type not in (None, "learnable"):
            raise FamilyConfigError(f"model.config.extra_pos_embed_type={c.extra_pos_embed_type!r}; allowed: null "
                                    f"(Predict2) or 'learnable'.")
        self.check_grid(self.token_grid)

    def check_grid(self, grid: Grid) -> None:
        """CosmosRotaryPosEmbed and CosmosLearnablePositionalEmbed slice tables of max_size // patch rows per axis."""
        c, (pt, ph, pw) = self.transformer.config, self.latent_patch()
        limits = (c.max_size[0] // pt, c.max_size[1] // ph, c.max_size[2] // pw)
        if any(g > m for g, m in zip(grid, limits)):
            t, h, w = grid
            raise FamilyConfigError(
                f"model.family=cosmos: latents {h * ph}x{w * pw} x {t * pt} frames make a {h}x{w} x {t} token grid, "
                f"beyond model.config.max_size={list(c.max_size)} (latent cells T, H, W); allowed: at most "
                f"{limits[1]}x{limits[2]} tokens x {limits[0]} frames.")

    def install_processors(self) -> None:
        for block in self.blocks_of(self.transformer):
            block.attn1.set_processor(BatchedRopeCosmosAttnProcessor())

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn1 for block in self.routable_blocks()]

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # t = sigma / (sigma + 1) of the Predict2 pipelines, in [0, 1]

    # -- inputs as the pipelines build them --------------------------------------------------------
    def _text(self, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The text embeddings with masked rows zeroed (the pipelines' _get_t5_prompt_embeds padding)."""
        text, mask = cond["text"], cond.get("text_mask")
        return text if mask is None else text * mask.to(text.dtype).unsqueeze(-1)

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """RoutedFamily's text conditioning plus the I2V inputs (the given frames mark the condition mask)."""
        text = super().conditioning(labels, cond)
        text.update({k: cond[k] for k in (FIRST_FRAME, I2V_MASK) if cond and cond.get(k) is not None})
        return text

    def condition_mask(self, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B, 1, T, H, W): 1 on the given frames of the conditioned samples (model.i2v), else 0 (text-to-world)."""
        mask = x.new_zeros(x.shape[0], 1, *x.shape[2:])
        use = conditioned(cond, x.shape[0], x.device) if self.i2v else None
        if use is not None:
            mask[:, :, :cond[FIRST_FRAME].shape[2]] = use.to(x.dtype).view(-1, 1, 1, 1, 1)
        return mask

    def _channels(self, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """x (B, C, T, H, W) + the condition mask (Video2World geometry) + the zero padding mask, as diffusers'
        forward concatenates them from the pipelines' inputs."""
        parts = [x]
        if self.transformer.config.in_channels == self.in_channels + 1:
            parts.append(self.condition_mask(x, cond))
        if self.transformer.config.concat_padding_mask:
            parts.append(x.new_zeros(x.shape[0], 1, *x.shape[2:]))
        return torch.cat(parts, dim=1) if len(parts) > 1 else x

    def _timestep(self, timestep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B,) per sample, or (B, T) per latent frame (refused otherwise); expand_timesteps turns (B,) into (B, T), the
        per-frame form Cosmos2VideoToWorldPipeline always feeds (numerically the same)."""
        B, T = x.shape[0], x.shape[2]
        if timestep.dim() == 1 and self.expand_timesteps:
            return timestep[:, None].expand(-1, T)
        if timestep.dim() == 2 and tuple(timestep.shape) != (B, T) or timestep.dim() > 2:
            raise FamilyConfigError(f"a per-frame noise level must be (B, T) = ({B}, {T}) latent frames; got "
                                    f"{tuple(timestep.shape)}.")
        return timestep

    # -- the three steps ---------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        timestep = self._timestep(timestep, x)
        xin = self._channels(x, cond)
        cos, sin = tr.rope(xin, fps=self.frame_rate)                                # (N, Dh) each
        hidden = tr.patch_embed(xin).flatten(1, 3)                                  # (B, N, D)
        per_token = {"rope_cos": cos.expand(B, -1, -1), "rope_sin": sin.expand(B, -1, -1)}
        if tr.learnable_pos_embed is not None:                                      # added in every block
            per_token["pos"] = tr.learnable_pos_embed(xin)                          # (B, N, D)
        temb, emb_t = tr.time_embed(hidden, timestep.flatten())                     # (B[*T], 3D), (B[*T], D)
        if timestep.dim() == 2:   # per frame -> per token (B, N, .), frame-major as the tokens
            hw = grid[1] * grid[2]
            temb, emb_t = (v.view(B, grid[0], 1, -1).expand(-1, -1, hw, -1).flatten(1, 2) for v in (temb, emb_t))
            per_token.update(temb=temb, emb_t=emb_t)
        return Embedded(hidden, self._text(cond), per_token, {"temb": temb, "emb_t": emb_t}, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        shared = emb.extra if "temb" not in emb.per_token else None

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                src = tok if shared is None else shared
                out = block(x, context, cond32(src["emb_t"]), cond32(src["temb"]), (tok["rope_cos"], tok["rope_sin"]),
                            tok.get("pos"))
                return out, context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        out = tr.proj_out(tr.norm_out(x, emb.extra["emb_t"], emb.extra["temb"]))   # features (ph, pw, pt=1, C)
        return unpack_patches(out, emb.grid, self.latent_patch(), int(tr.config.out_channels))

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward as the Predict2 pipelines call it (x_sigma * c_in = our x_t, timestep t, fps, the zero
        masks); the raw output is the velocity."""
        B, C, T, H, W = x.shape
        timestep = self._timestep(timestep, x)
        kw: dict[str, Any] = {}
        if transformer.config.in_channels == C + 1:
            kw["condition_mask"] = self.condition_mask(x, cond)
        return transformer(hidden_states=x, timestep=timestep if timestep.dim() == 1 else timestep.view(B, 1, T, 1, 1),
                           encoder_hidden_states=self._text(cond), fps=self.frame_rate,
                           padding_mask=x.new_zeros(1, 1, H * VAE_SPATIAL, W * VAE_SPATIAL), return_dict=False,
                           **kw)[0]


FAMILY = CosmosFamily
PRESETS = COSMOS_PRESETS
