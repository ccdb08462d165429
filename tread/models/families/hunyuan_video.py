"""HunyuanVideo 1.5 (diffusers HunyuanVideo15Transformer3DModel) with TREAD routing.

The video tokens are routed; the refined text, glyph and image-embedding streams are never-routed context and
the condition channels enter before routing (docs/families.md, "HunyuanVideo 1.5").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.models.families.base import Embedded, FamilyConfigError, RoutedFamily, cond32
from tread.models.families.first_frame import FIRST_FRAME, I2V_MASK, IMAGE_EMBEDS

GLYPH_LEN = 256        # the pipelines' tokenizer_2_max_length: zero ByT5 rows when a prompt has no glyph text
SIGLIP_TOKENS = 729    # the pipelines' vision_num_semantic_tokens: zero SigLIP rows in text-to-video

_RELEASED = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                 num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                 text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                 rope_axes_dim=(16, 56, 56), use_meanflow=False)

HUNYUAN_VIDEO_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), 2x2 patches, text widths 32.
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, num_layers=8, num_refiner_layers=1, mlp_ratio=4.0,
                 patch_size=2, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=32,
                 rope_axes_dim=(4, 6, 6)),
    # A mid-size model for GPU benchmarks (~0.6B parameters): width 1024, 16 blocks, the released text widths.
    "mid": dict(num_attention_heads=8, attention_head_dim=128, num_layers=16, num_refiner_layers=2, mlp_ratio=4.0,
                patch_size=1, patch_size_t=1, text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                rope_axes_dim=(16, 56, 56)),
    # hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (and _i2v) geometry, 32-channel VAE: load the
    # weights with model.pretrained. The 720p checkpoints differ only in target_size (pipeline default size).
    "hunyuanvideo-1.5-480p": dict(_RELEASED, target_size=640),
    "hunyuanvideo-1.5-720p": dict(_RELEASED, target_size=960, task_type="t2v"),
}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb(use_real=True, sequence_dim=1) on x (B, S, H, Dh), interleaved pairs, with cos/sin
    (S, Dh) shared by the batch or (B, S, Dh) per sample."""
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos.to(x.device) + rotated.float() * sin.to(x.device)).to(x.dtype)


class BatchedRopeHunyuanVideo15AttnProcessor:
    """HunyuanVideo15AttnProcessor2_0's joint attention whose RoPE rows (cos, sin) may be per sample, each
    (S_video, Dh) or (B, S_video, Dh); attention_mask (B, L) over the context rows."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn   # deferred: a heavy import

        heads = lambda t: t.unflatten(2, (attn.heads, -1))
        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), \
            heads(attn.to_v(hidden_states))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query, key = _rotate(query, *image_rotary_emb), _rotate(key, *image_rotary_emb)
        if encoder_hidden_states is not None:
            eq, ek, ev = (heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = torch.cat([query, eq], 1), torch.cat([key, ek], 1), torch.cat([value, ev], 1)
        B, S = query.shape[:2]
        valid = F.pad(attention_mask.bool(), (S - attention_mask.shape[1], 0), value=True)    # (B, S)
        out = dispatch_attention_fn(query, key, value, attn_mask=valid[:, None, None, :], dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = (out * valid[:, :, None, None].to(out.dtype)).flatten(2, 3).to(query.dtype)  # all-masked rows: 0
        if encoder_hidden_states is None:
            return out, None
        L = encoder_hidden_states.shape[1]
        video, context = out[:, :-L], out[:, -L:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(context)


class HunyuanVideo15Family(RoutedFamily):
    family = "hunyuan_video"
    hub_hint = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    diffusers_class = "HunyuanVideo15Transformer3DModel"
    text_dim_key = "text_embed_dim"
    frames_axis = True
    i2v_mode = "channels"           # model.i2v: cond["first_frame"] fills the pipeline's condition channels (embed)

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """[latents, condition latents, mask] channel-wise (the pipelines' latent_model_input): 2C + 1 in, C out."""
        return {"in_channels": 2 * in_channels + 1, "out_channels": in_channels}

    def latent_patch(self) -> tuple[int, int, int]:
        c = self.transformer.config
        return int(c.patch_size_t), int(c.patch_size), int(c.patch_size)

    def check_shapes(self) -> None:
        c, channels = self.transformer.config, self.in_channels
        if c.in_channels != 2 * channels + 1:
            raise FamilyConfigError(
                f"model.config.in_channels={c.in_channels} must be 2 x data.channels + 1 = {2 * channels + 1}: "
                f"HunyuanVideo 1.5 takes [latents, condition latents, mask] channel-wise (data.channels={channels}; "
                f"the released 32-channel VAE: 65).")
        if (c.out_channels or c.in_channels) != channels:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal data.channels={channels}: "
                                    f"the model predicts the latent itself.")
        self._check_video_patch()
        axes = list(c.rope_axes_dim)
        if len(axes) != 3 or sum(axes) != c.attention_head_dim or any(a % 2 for a in axes):
            raise FamilyConfigError(f"model.config.rope_axes_dim={axes} must be 3 even numbers (t, h, w) summing to "
                                    f"attention_head_dim={c.attention_head_dim}.")
        if c.use_meanflow:
            raise FamilyConfigError("model.config.use_meanflow=true (the step-distilled I2V model) needs a second "
                                    "timestep timestep_r that this trainer does not give; allowed: false.")

    def install_processors(self) -> None:
        for block in self.blocks_of(self.transformer):
            block.attn.set_processor(BatchedRopeHunyuanVideo15AttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    # context parallelism: joint attention over [video, context]; the context rows (text, glyph, image) and their
    # mask split with the video tokens
    joint_text, text_columns = True, ("mask",)

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn for block in self.routable_blocks()]

    # noise_level = t * 1000 is what the pipelines feed (scheduler timesteps, sigma * 1000): the default timestep().

    # -- conditioning --------------------------------------------------------------------------------------------
    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """RoutedFamily's text conditioning plus the data's glyph stream (with text data; zeroed and masked out for
        the null label, as the pipeline's glyph-less negative prompt) and I2V inputs (kept in both CFG branches)."""
        text = super().conditioning(labels, cond)
        cond = cond or {}
        for key in (IMAGE_EMBEDS, FIRST_FRAME, I2V_MASK):
            if cond.get(key) is not None:
                text[key] = cond[key]
        if text.get(IMAGE_EMBEDS) is not None and cond.get(I2V_MASK) is not None:   # text-to-video samples: none
            text[IMAGE_EMBEDS] = text[IMAGE_EMBEDS] * cond[I2V_MASK].to(text[IMAGE_EMBEDS].dtype)[:, None, None]
        if cond.get("text") is not None and cond.get("glyph") is not None:
            glyph = cond["glyph"]
            gmask = cond.get("glyph_mask")
            gmask = torch.ones(glyph.shape[:2], dtype=torch.bool, device=glyph.device) if gmask is None else gmask
            if self.num_classes:
                keep = labels != self.num_classes
                glyph, gmask = glyph * keep.to(glyph.dtype)[:, None, None], gmask.bool() & keep[:, None]
            text["glyph"], text["glyph_mask"] = glyph, gmask
        return text

    def condition_latents(self, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[condition latents, mask] (B, C + 1, T, H, W): zeros (text-to-video), or with cond["first_frame"] the
        image-to-video layout (latents and mask 1 at frame 0, for the samples cond["i2v"] selects)."""
        B, C, T, H, W = x.shape
        first = cond.get(FIRST_FRAME)
        if first is None:
            return x.new_zeros(B, C + 1, T, H, W)
        first = first.unsqueeze(2) if first.dim() == 4 else first
        if tuple(first.shape) != (B, C, 1, H, W):
            raise FamilyConfigError(f"cond['first_frame'] has shape {list(first.shape)}; allowed: the first frame's "
                                    f"latents {[B, C, 1, H, W]} (or without the frame axis) for latents {list(x.shape)}.")
        use = cond.get(I2V_MASK)
        use = x.new_ones(B) if use is None else use.to(x.dtype)
        frame0 = torch.cat([first.to(x.dtype), x.new_ones(B, 1, 1, H, W)], dim=1) * use.view(B, 1, 1, 1, 1)
        return torch.cat([frame0, x.new_zeros(B, C + 1, T - 1, H, W)], dim=2)

    def context(self, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The never-routed context (B, L', D) and its keep-mask (B, L'): diffusers' forward's streams (image, glyph,
        text, each + cond_type_embed) reordered valid-first; streams the data does not bring are left out."""
        tr, text = self.transformer, cond["text"]
        mask = cond.get("text_mask")
        mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device) if mask is None else mask.bool()
        kind = lambda h, k: h + tr.cond_type_embed(torch.full(h.shape[:2], k, dtype=torch.long, device=h.device))
        ctx = kind(tr.context_embedder(text, timestep, mask), 0)
        rows, masks = [ctx * mask[..., None].to(ctx.dtype)], [mask]           # invalid text rows zeroed
        if cond.get("glyph") is not None:
            gmask = cond["glyph_mask"].bool()
            glyph = kind(tr.context_embedder_2(cond["glyph"]), 1)
            rows.insert(0, glyph * gmask[..., None].to(glyph.dtype))
            masks.insert(0, gmask)
        if cond.get(IMAGE_EMBEDS) is not None:
            img = cond[IMAGE_EMBEDS]
            # diffusers: the image rows count when the batch's embeddings are not all zero; per sample here, so a
            # batch mixing image- and text-to-video samples (train.i2v_probability < 1) gives each its own
            used = (img != 0).flatten(1).any(1)                               # (B,), no host sync
            proj = tr.image_embedder(img) * used.to(ctx.dtype)[:, None, None]
            rows.insert(0, kind(proj, 2))
            masks.insert(0, used[:, None].expand(img.shape[:2]))
        rows, valid = torch.cat(rows, 1), torch.cat(masks, 1)
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices   # valid first, order kept
        return rows.gather(1, order[..., None].expand_as(rows)), valid.gather(1, order)

    # -- the three steps -----------------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        if timestep.dim() != 1:
            raise FamilyConfigError(f"HunyuanVideo 1.5 modulates per sample: the timestep must be (B,), got "
                                    f"{tuple(timestep.shape)} (no per-token timesteps in this model).")
        cos, sin = tr.rope(x)                                                   # (N, Dh) each, (t, h, w) order
        hidden = tr.x_embedder(torch.cat([x, self.condition_latents(x, cond)], dim=1))   # (B, N, D)
        temb = tr.time_embed(timestep)
        context, mask = self.context(timestep, cond)
        per_token = {"rope_cos": cos.expand(B, -1, -1), "rope_sin": sin.expand(B, -1, -1)}
        return Embedded(hidden, context, per_token, {"temb": temb, "mask": mask}, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb, mask = emb.extra["temb"], emb.extra["mask"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                return block(x, context, cond32(temb), mask, (tok["rope_cos"], tok["rope_sin"]))
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        """norm_out, proj_out and diffusers' unpatchify: features (C, pt, ph, pw) -> (B, C, T, H, W)."""
        tr, (t, h, w), (pt, ph, pw) = self.transformer, emb.grid, self.latent_patch()
        out = tr.proj_out(tr.norm_out(x, emb.extra["temb"]))
        out = out.reshape(x.shape[0], t, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(x.shape[0], -1, t * pt, h * ph, w * pw)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs as the pipelines build them: [latents, condition latents, mask], the
        pipeline's zero ByT5 rows (256, mask 0) and zero SigLIP rows (729) where the data brings none."""
        from diffusers import HunyuanVideo15Pipeline   # deferred: a heavy import, tests only

        B, c, dev = x.shape[0], transformer.config, x.device
        text, mask = cond["text"], cond.get("text_mask")
        mask = torch.ones(text.shape[:2], device=dev) if mask is None else mask
        glyph = cond.get("glyph", x.new_zeros(B, GLYPH_LEN, c.text_embed_2_dim))
        gmask = cond.get("glyph_mask", torch.zeros(B, glyph.shape[1], dtype=torch.long, device=dev))
        image = cond.get("image_embeds", x.new_zeros(B, SIGLIP_TOKENS, c.image_embed_dim))
        first = cond.get("first_frame")
        if first is None:      # HunyuanVideo15Pipeline's own zeros (its method reads nothing from the pipeline)
            latents, lmask = HunyuanVideo15Pipeline.prepare_cond_latents_and_mask(None, x, x.dtype, dev)
        else:                  # HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask, VAE encode done
            latents = (first.unsqueeze(2) if first.dim() == 4 else first).repeat(1, 1, x.shape[2], 1, 1).to(x.dtype)
            latents[:, :, 1:] = 0
            lmask = x.new_zeros(B, 1, *x.shape[2:])
            lmask[:, :, 0] = 1.0
            if cond.get(I2V_MASK) is not None:   # the samples not selected: the text-to-video pipeline's zeros
                keep = cond[I2V_MASK].to(x.dtype).view(B, 1, 1, 1, 1)
                latents, lmask = latents * keep, lmask * keep
        hidden = torch.cat([x, latents, lmask], dim=1)
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                           encoder_attention_mask=mask, encoder_hidden_states_2=glyph, encoder_attention_mask_2=gmask,
                           image_embeds=image, return_dict=False)[0]


FAMILY = HunyuanVideo15Family
PRESETS = HUNYUAN_VIDEO_PRESETS
