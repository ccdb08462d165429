"""Kandinsky 5.0 image and video (diffusers Kandinsky5Transformer3DModel) with TREAD routing.

Routes count over the visual (decoder) blocks; the text runs through its own encoder blocks first and is never
routed. Each video token carries its 3-D RoPE row (a per-token tensor); modulation is per sample (timestep + CLIP
pooled). Attention is always dense: NABLA's block mask needs the full grid in 8x8 fractal order, which the kept
tokens of a route do not form, so a NABLA config runs diffusers' dense attention. docs/families.md ("Kandinsky 5")
gives the facts and the tests that pin them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32

_QWEN_CLIP = dict(in_text_dim=3584, in_text_dim2=768, patch_size=(1, 2, 2))   # Qwen2.5-VL-7B, CLIP-L pooled
KANDINSKY5_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 visual blocks, width 64 (4 heads x 16), Qwen / CLIP stand-ins of width 32;
    # visual_cond as the released video models (the T2V pipeline's [latents, zeros, zero mask] channels).
    "tiny": dict(in_text_dim=32, in_text_dim2=32, time_dim=32, patch_size=(1, 2, 2), model_dim=64, ff_dim=128,
                 num_text_blocks=1, num_visual_blocks=8, axes_dims=(4, 6, 6), visual_cond=True),
    # A mid-size model for GPU benchmarks (~0.45B parameters): width 1024 (16 heads x 64), 16 visual blocks.
    "mid": dict(_QWEN_CLIP, time_dim=512, model_dim=1024, ff_dim=4096, num_text_blocks=2, num_visual_blocks=16,
                axes_dims=(16, 24, 24), visual_cond=True),
    # The released geometries (kandinskylab/kandinsky-5 configs/*.yaml dit_params; 16-channel latents): T2I Lite
    # (configs/config_t2i.yaml, FLUX VAE), T2V / I2V Lite (configs/config_5s_sft.yaml, k5_lite_i2v_5s_sft_sd.yaml,
    # HunyuanVideo VAE), T2V / I2V Pro (configs/k5_pro_t2v_5s_sft_hd*.yaml). Load the weights with model.pretrained.
    "kandinsky5-t2i-lite": dict(_QWEN_CLIP, in_visual_dim=16, out_visual_dim=16, time_dim=512, model_dim=2560,
                                ff_dim=10240, num_text_blocks=2, num_visual_blocks=50, axes_dims=(32, 48, 48),
                                visual_cond=False),
    "kandinsky5-t2v-lite": dict(_QWEN_CLIP, in_visual_dim=16, out_visual_dim=16, time_dim=512, model_dim=1792,
                                ff_dim=7168, num_text_blocks=2, num_visual_blocks=32, axes_dims=(16, 24, 24),
                                visual_cond=True),
    "kandinsky5-t2v-pro": dict(_QWEN_CLIP, in_visual_dim=16, out_visual_dim=16, time_dim=1024, model_dim=4096,
                               ff_dim=16384, num_text_blocks=4, num_visual_blocks=60, axes_dims=(32, 48, 48),
                               visual_cond=True),
}
VAE_SPATIAL = 8   # both VAEs' spatial factor: the T2V pipeline picks its RoPE scale from the pixel size
ROPE_MAX_POS = 128   # Kandinsky5RoPE3D's default max_pos per axis (the transformer does not configure it)


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Kandinsky5AttnProcessor's apply_rotary, rounding to bfloat16 as diffusers does."""
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    return (rope * x_).sum(dim=-1).reshape(*x.shape).to(torch.bfloat16).type_as(x)


class TextMaskedKandinsky5AttnProcessor:
    """Kandinsky5AttnProcessor's maths (dense) with a key mask over the text rows: diffusers' transformer takes no
    text mask (its pipelines feed one unpadded prompt, cu_seqlens trimmed), so the padded rows of fixed-length text
    data are masked out of the text self-attention and the visual cross-attention instead. `key_mask` (B, L) bool
    is set by the family before each forward (one processor object shared by those modules)."""

    _attention_backend = None
    _parallel_config = None
    key_mask: Optional[torch.Tensor] = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, rotary_emb: Optional[torch.Tensor] = None,
                 sparse_params: Any = None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn  # deferred: diffusers is optional

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = lambda t: t.unflatten(-1, (attn.num_heads, -1))
        query, key, value = heads(attn.to_query(hidden_states)), heads(attn.to_key(context)), heads(attn.to_value(context))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query, key = _rotate(query, rotary_emb), _rotate(key, rotary_emb)
        mask = None if self.key_mask is None else self.key_mask[:, None, None, :]
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        return attn.out_layer(out.flatten(-2, -1))


class Kandinsky5Family(RoutedFamily):
    family = "kandinsky5"
    hub_hint = "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"
    diffusers_class = "Kandinsky5Transformer3DModel"
    text_dim_key = "in_text_dim"
    pooled_dim_key = "in_text_dim2"   # CLIP's pooled output, added to the time embedding (all modulation)
    channel_keys = ("in_visual_dim", "out_visual_dim")
    frames_axis = True
    # "out_layer" alone would also match the (zero-initialised) modulations, the time embedding and the head
    lora_targets = ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer")

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        for key, name in (("in_channels", "in_visual_dim"), ("out_channels", "out_visual_dim")):
            if key in diffusers_config:   # the other families' key: say what this class calls it
                raise FamilyConfigError(f"model.config.{key}={diffusers_config[key]} is not a key of "
                                        f"Kandinsky5Transformer3DModel; allowed: model.config.{name} (= data.channels).")
        cls._check_axes(list(diffusers_config.get("axes_dims", (16, 24, 24))), diffusers_config.get("model_dim", 2048))
        return {"in_visual_dim": in_channels, "out_visual_dim": in_channels}

    @staticmethod
    def _check_axes(axes: list, model_dim: int) -> None:
        """Before diffusers' constructor asserts: the head dim is sum(axes_dims), one even RoPE part per axis."""
        if len(axes) != 3 or any(int(a) % 2 for a in axes) or int(model_dim) % sum(int(a) for a in axes):
            raise FamilyConfigError(f"model.config.axes_dims={[int(a) for a in axes]} must be 3 even numbers whose "
                                    f"sum (the head dim) divides model_dim={model_dim}.")

    def __init__(self, transformer: nn.Module, **kwargs: Any):
        self._text_attn = TextMaskedKandinsky5AttnProcessor()
        super().__init__(transformer, **kwargs)

    def latent_patch(self) -> tuple[int, int, int]:
        pt, ph, pw = (int(p) for p in self.transformer.config.patch_size)
        return pt, ph, pw

    def attention_width(self) -> int:
        return int(self.transformer.config.model_dim)

    def check_shapes(self) -> None:
        c, C = self.transformer.config, self.in_channels
        if len(c.patch_size) != 3 or int(c.patch_size[0]) != 1:
            raise FamilyConfigError(f"model.config.patch_size={list(c.patch_size)} must be (1, ph, pw): the pipelines "
                                    f"give one RoPE position per latent frame (every released model: (1, 2, 2)).")
        if c.in_visual_dim != C or c.out_visual_dim != C:
            raise FamilyConfigError(f"model.config.in_visual_dim={c.in_visual_dim} / out_visual_dim={c.out_visual_dim}"
                                    f" must equal data.channels={C} (the released models: 16 latent channels).")
        self._check_video_patch()
        self.check_grid(self.token_grid)

    def check_grid(self, grid: Grid) -> None:
        """Kandinsky5RoPE3D indexes tables of 128 positions per axis."""
        if max(grid) > ROPE_MAX_POS:
            t, h, w = grid
            raise FamilyConfigError(f"model.family=kandinsky5: a {h}x{w} x {t} token grid is beyond the 3-D RoPE "
                                    f"table; allowed: token grid sides (frames included) <= {ROPE_MAX_POS}.")

    def install_processors(self) -> None:
        """Visual self-attention keeps diffusers' processor (dense: sparse_params are never passed); the attentions
        whose keys are text rows take the text mask."""
        tr = self.transformer
        for block in tr.text_transformer_blocks:
            block.self_attention.set_processor(self._text_attn)
        for block in tr.visual_transformer_blocks:
            block.cross_attention.set_processor(self._text_attn)

    def group_attention_modules(self) -> list[nn.Module]:
        return []   # context parallelism: refused (base), the visual self-attention is not split here

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.visual_transformer_blocks)

    # noise_level = t * 1000 is the pipelines' timestep (FlowMatchEulerDiscreteScheduler.timesteps): the default.

    def rope_scale(self, grid: Grid) -> tuple[float, float, float]:
        """The pipelines' RoPE scale_factor: T2I (visual_cond false) (1, 1, 1); the T2V / I2V pipelines (visual_cond
        models) (1, 2, 2) when both pixel sides are in [480, 854], else (1, 3.16, 3.16) (_get_scale_factor)."""
        if not self.transformer.config.visual_cond:
            return (1.0, 1.0, 1.0)
        _, ph, pw = self.latent_patch()
        sides = (grid[1] * ph * VAE_SPATIAL, grid[2] * pw * VAE_SPATIAL)
        return (1.0, 2.0, 2.0) if all(480 <= s <= 854 for s in sides) else (1.0, 3.16, 3.16)

    # -- inputs as the pipelines build them --------------------------------------------------------
    def _channels_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, T, H, W) -> the pipelines' (B, T, H, W, C'), with visual_cond the T2V pipeline's zero
        condition latents and zero mask appended (prepare_latents)."""
        x = x.permute(0, 2, 3, 4, 1)
        if not self.transformer.config.visual_cond:
            return x
        return torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1)

    def _positions(self, grid: Grid, device: torch.device) -> list[torch.Tensor]:
        return [torch.arange(n, device=device) for n in grid]

    def _text_mask(self, cond: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        mask = cond.get("text_mask")
        return None if mask is None or bool(mask.all()) else mask.to(torch.bool)

    def _check_text(self, length: int) -> None:
        limit = self.transformer.text_rope_embeddings.max_pos
        if length > limit:
            raise FamilyConfigError(f"{length} text positions exceed Kandinsky5RoPE1D's {limit} (the pipelines' "
                                    f"max_sequence_length must be below 1024); allowed: at most {limit}.")

    # -- the three steps ---------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid, B = self.transformer, self.grid_of(x), x.shape[0]
        if timestep.dim() != 1:
            raise FamilyConfigError(f"model.family=kandinsky5 modulates per sample: the timestep must be (B,), got "
                                    f"{tuple(timestep.shape)}.")
        text = cond["text"]
        self._check_text(text.shape[1])
        self._text_attn.key_mask = self._text_mask(cond)
        time = tr.time_embeddings(timestep) + tr.pooled_text_embeddings(cond["pooled"])      # (B, time_dim)
        context = tr.text_embeddings(text)
        text_rope = tr.text_rope_embeddings(torch.arange(text.shape[1], device=x.device)).unsqueeze(0)
        for block in tr.text_transformer_blocks:            # never routed: the text's own encoder blocks
            context = block(context, time, text_rope)
        visual = tr.visual_embeddings(self._channels_last(x))                                  # (B, t, h, w, D)
        rope = tr.visual_rope_embeddings(visual.shape[:-1], self._positions(grid, x.device), self.rope_scale(grid))
        per_token = {"rope": rope.flatten(1, 3)}            # (B, N, 1, Dh/2, 2, 2): raster (t, h, w) order
        return Embedded(visual.flatten(1, 3), context, per_token, {"time": time}, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        time, mask = emb.extra["time"], self._text_attn.key_mask

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                self._text_attn.key_mask = mask   # again: a checkpointed block may recompute after another forward
                return block(x, context, cond32(time), tok["rope"], None), context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        t, h, w = emb.grid
        out = self.transformer.out_layer(x.reshape(x.shape[0], t, h, w, -1), emb.context, emb.extra["time"])
        return out.permute(0, 4, 1, 2, 3)                   # (B, T, H, W, C) -> (B, C, T, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward as the pipelines call it (dense, sparse_params None), one sample at a time with its
        text trimmed to its real rows when the data's text is padded (the pipeline's unpadded single prompt)."""
        mask = self._text_mask(cond)
        if mask is None:
            return self._diffusers_call(x, timestep, cond["text"], cond["pooled"], transformer)
        return torch.cat([self._diffusers_call(x[b:b + 1], timestep[b:b + 1], cond["text"][b:b + 1, mask[b]],
                                               cond["pooled"][b:b + 1], transformer) for b in range(x.shape[0])])

    def _diffusers_call(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor,
                        transformer: nn.Module) -> torch.Tensor:
        grid = self.grid_of(x)
        out = transformer(hidden_states=self._channels_last(x), encoder_hidden_states=text, timestep=timestep,
                          pooled_projections=pooled, visual_rope_pos=self._positions(grid, x.device),
                          text_rope_pos=torch.arange(text.shape[1], device=x.device),
                          scale_factor=self.rope_scale(grid), sparse_params=None, return_dict=False)
        return out.permute(0, 4, 1, 2, 3)


FAMILY = Kandinsky5Family
PRESETS = KANDINSKY5_PRESETS
