"""FLUX.3 (diffusers Flux3Transformer2DModel, Flux3ModularPipeline) with TREAD routing.

FLUX.3 runs each token mode through its own "mode" blocks first (image, reference images and text each attend
within themselves only), then the joint single blocks over [text, image, references]. Routes count over the image
mode blocks, then the single blocks; the text and reference mode blocks run beside the image mode block of the same
index on their never-routed streams (docs/families.md, "Implementation notes").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.models.families.base import Embedded, FamilyConfigError, RoutedFamily, cond32
from tread.models.families.flux import FluxFamily, _rotate
from tread.models.families.flux2 import Flux2Family

FLUX3_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 mode + 6 single blocks (8 routable), width 64 (4 heads x 16), 4 RoPE axes
    # of 4; text width 256 = the pipeline's 8 stacked hidden states of the tiny 32-wide Qwen3-VL (tiny_text.py).
    "tiny": dict(num_layers=2, num_single_layers=6, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=256, timestep_channels=32, axes_dims_rope=[4, 4, 4, 4]),
    # A mid-size model for GPU benchmarks (~0.34B parameters): width 1024 (8 heads x 128), 3 mode + 13 single
    # blocks (16 routable), the released text width (8 Qwen3-VL hidden states of 2560), RoPE axes and MLP ratio.
    "mid": dict(num_layers=3, num_single_layers=13, attention_head_dim=128, num_attention_heads=8,
                joint_attention_dim=20480, axes_dims_rope=[32, 32, 32, 32]),
    # The released FLUX.3 geometry (Flux3Transformer2DModel's defaults, transformer_flux3.py; 32-channel FLUX.2 VAE
    # latents packed 2x2 to 128): load the weights with model.pretrained. The step-distilled checkpoints are the
    # same geometry with flow_map=true, which training refuses (check_shapes).
    "flux3": dict(in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
                  axes_dims_rope=[32, 32, 32, 32], rope_theta=10000, eps=1e-6, flow_map=False),
}

RopeTable = tuple[torch.Tensor, torch.Tensor]


class BatchedRopeFlux3AttnProcessor:
    """diffusers' Flux3AttnProcessor, same maths (QK norm and RoPE in fp32, one cast back to the value dtype), with a
    RoPE table (cos, sin) of (S, Dh) or (B, S, Dh): the kept image tokens have per-sample positions."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[RopeTable] = None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        query, key = attn.norm_q(query.float()), attn.norm_k(key.float())
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        query, key = query.to(value.dtype), key.to(value.dtype)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class Flux3Family(RoutedFamily):
    family = "flux3"
    hub_hint = "black-forest-labs/FLUX.3"   # diffusers 0.42.1's source names no hub repo: pass your local copy
    diffusers_class = "Flux3Transformer2DModel"
    text_dim_key = "joint_attention_dim"
    pooled_dim_key = None            # stacked Qwen3-VL hidden states only
    PACK = FluxFamily.PACK           # the pipeline's latents are 2x2-patchified (C, 2, 2) VAE latents, one per token
    ROPE_SCALE = 0.5                 # Flux3PrepareLatentsStep(image_rope_scale=0.5): image rows / cols x 0.5
    ROPE_AXES = 4                    # ids (T, H, W, L)
    takes_references = True
    reference_advice = "set model.kontext=true (FLUX.3 image-to-image references)"

    pack, unpack = FluxFamily.pack, FluxFamily.unpack
    timestep = FluxFamily.timestep   # the pipeline feeds t = sigma in [0, 1]; the transformer scales by 1000
    # references: FLUX.2's handling (a tensor or a list of (B, C, H, W) latents, any sizes, checked once)
    references = staticmethod(Flux2Family.references)
    conditioning, check_reference = Flux2Family.conditioning, Flux2Family.check_reference

    def __init__(self, transformer: nn.Module, *, kontext: bool = False, **kwargs: Any):
        if not isinstance(kontext, bool):
            raise FamilyConfigError(f"model.kontext={kontext!r} is not allowed; allowed: true or false.")
        self.kontext = kontext
        super().__init__(transformer, **kwargs)

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        packed = in_channels * cls.PACK ** 2
        return {"in_channels": packed, "cond_in_channels": packed}

    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.PACK, self.PACK

    def check_shapes(self) -> None:
        c, packed = self.transformer.config, self.in_channels * self.PACK ** 2
        for key in ("in_channels", "cond_in_channels"):
            if getattr(c, key) != packed:
                raise FamilyConfigError(
                    f"model.config.{key}={getattr(c, key)} must be 4 x data.channels = {packed}: FLUX.3's pipeline "
                    f"packs 2x2 latent cells into one token (target and reference images alike).")
        if self.input_size % self.PACK:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be even: FLUX.3 packs 2x2 latent cells.")
        axes = list(c.axes_dims_rope)
        if len(axes) != self.ROPE_AXES or sum(axes) != c.attention_head_dim or any(a % 2 for a in axes):
            raise FamilyConfigError(
                f"model.config.axes_dims_rope={axes} is not allowed; allowed: 4 even numbers (one per id coordinate "
                f"T, H, W, L) summing to attention_head_dim={c.attention_head_dim}.")
        if c.flow_map:
            raise FamilyConfigError(
                "model.config.flow_map=true (a step-distilled FLUX.3) is not allowed: its forward needs the "
                "timestep each sampling step jumps to, which flow-matching training has none of; allowed: false.")

    def install_processors(self) -> None:
        from diffusers.models.transformers.transformer_flux3 import Flux3Attention

        for module in self.transformer.modules():
            if isinstance(module, Flux3Attention):
                module.set_processor(BatchedRopeFlux3AttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        """Route indices: the image mode blocks, then the joint single blocks."""
        return [*transformer.mode_blocks["image"], *transformer.single_transformer_blocks]

    # -- ids (Flux3 modular pipeline's conventions: before_denoise.py) -----------------------------------------
    def image_ids(self, device: torch.device, hw: Sequence[int], l_coord: int = 0) -> torch.Tensor:
        """(h * w, 4) ids (0, row / 2, col / 2, l) of a packed (h, w) grid, row-major: _prepare_image_ids (target:
        l = 0; reference i: l = -(1 + i))."""
        h, w = hw
        ids = torch.zeros(h, w, self.ROPE_AXES, device=device)
        ids[..., 1] = torch.arange(h, device=device)[:, None] * self.ROPE_SCALE
        ids[..., 2] = torch.arange(w, device=device)[None, :] * self.ROPE_SCALE
        ids[..., 3] = l_coord
        return ids.reshape(h * w, self.ROPE_AXES)

    text_ids = Flux2Family.text_ids   # (L, 4) ids (0, 0, 0, l): Flux3TextRoPEInputsStep._prepare_text_ids, as FLUX.2

    def reference_ids(self, refs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The references' ids, concatenated in order (Flux3PrepareImageCondLatentsStep): reference i on its own
        packed grid with l = -(1 + i)."""
        return torch.cat([self.image_ids(device, (r.shape[-2] // self.PACK, r.shape[-1] // self.PACK), -(1 + i))
                          for i, r in enumerate(refs)])

    # -- the forward in three steps -------------------------------------------------------------------------
    def _time_embeddings(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(image temb, zero temb), each (B, 1, D): the image tokens at t, the text and references at 0."""
        tr = self.transformer
        t = tr.timestep_embedder(tr.time_proj(timestep.to(dtype) * 1000).to(dtype))[:, None]
        zero = tr.timestep_embedder(tr.time_proj(torch.zeros_like(timestep, dtype=dtype)).to(dtype))[:, None]
        return t, zero

    def _modulations(self, temb: torch.Tensor, zero: torch.Tensor, refs: bool) -> dict[str, torch.Tensor]:
        """Per mode the early (mode blocks) and single (joint blocks) modulation, (B, 1, 3D) per sample: every token
        of a mode shares its timestep, so diffusers' per-token rows (B, S, 3D) are these rows repeated."""
        tr, act, zero_act = self.transformer, F.silu(temb), F.silu(zero)
        early, single = tr.early_stream_modulations, tr.single_stream_modulations
        mods = {"img_early": early["image"](act), "img_single": single["image"](act),
                "txt_early": early["txt"](zero_act), "txt_single": single["txt"](zero_act)}
        if refs:
            mods.update(ref_early=early["image_cond"](zero_act), ref_single=single["image_cond"](zero_act))
        return mods

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        refs = self.references(cond) if self.kontext else []
        temb, zero = self._time_embeddings(timestep, x.dtype)
        hidden = tr.x_embedders["image"](self.pack(x))                             # (B, N, D)
        context = tr.context_embedder(cond["text"])                                # (B, L, D)
        L, B, N = context.shape[1], x.shape[0], hidden.shape[1]
        text_cos, text_sin = tr.pos_embed(self.text_ids(L, x.device))
        cos, sin = tr.pos_embed(self.image_ids(x.device, grid[1:]))                 # (N, Dh)
        per_token = {"rope_cos": cos.unsqueeze(0).expand(B, N, -1), "rope_sin": sin.unsqueeze(0).expand(B, N, -1)}
        extra = {"temb": temb, "text_rope": (text_cos, text_sin), **self._modulations(temb, zero, bool(refs))}
        if refs:   # never routed: the reference tokens travel with the text as context
            context = (context, tr.x_embedders["image_cond"](torch.cat([self.pack(r) for r in refs], dim=1)))
            extra["ref_rope"] = tr.pos_embed(self.reference_ids(refs, x.device))
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        tr = self.transformer
        modes = len(tr.mode_blocks["image"])
        fns = [self._mode_fn(i, emb) for i in range(modes)]
        return fns + [self._single_fn(block, emb) for block in tr.single_transformer_blocks]

    def _mode_fn(self, index: int, emb: Embedded) -> Callable[..., Any]:
        """Mode block `index`: the kept image tokens through the image mode block (their own RoPE rows); the text
        (and references) through their mode blocks of the same index, whole: no mode sees another."""
        tr, e = self.transformer, emb.extra
        image, text_block = tr.mode_blocks["image"][index], tr.txt_mode_blocks[index]
        ref_block = tr.mode_blocks["image_cond"][index] if "ref_rope" in e else None

        def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
            text, ref = context if ref_block is not None else (context, None)
            x = image(x, cond32(e["img_early"]), (tok["rope_cos"], tok["rope_sin"]))
            text = text_block(text, cond32(e["txt_early"]), e["text_rope"])
            if ref_block is None:
                return x, text
            return x, (text, ref_block(ref, cond32(e["ref_early"]), e["ref_rope"]))
        return fn

    def _single_fn(self, block: nn.Module, emb: Embedded) -> Callable[..., Any]:
        """A joint single block over [text, kept image tokens, references], as diffusers' forward calls it: the
        content's per-token modulation [image rows, reference rows] and RoPE [text, image, reference] rows."""
        e = emb.extra

        def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
            text, ref = context if "ref_rope" in e else (context, None)
            B, L, K = x.shape[0], text.shape[1], x.shape[1]
            cos = [e["text_rope"][0].unsqueeze(0).expand(B, L, -1), tok["rope_cos"]]
            sin = [e["text_rope"][1].unsqueeze(0).expand(B, L, -1), tok["rope_sin"]]
            content, mod = x, e["img_single"]
            if ref is not None:
                R = ref.shape[1]
                cos.append(e["ref_rope"][0].unsqueeze(0).expand(B, R, -1))
                sin.append(e["ref_rope"][1].unsqueeze(0).expand(B, R, -1))
                content = torch.cat([x, ref], dim=1)
                mod = torch.cat([mod.expand(B, K, -1), e["ref_single"].expand(B, R, -1)], dim=1)
            text, content = block(hidden_states=content, encoder_hidden_states=text, temb_mod=cond32(mod),
                                  temb_mod_context=cond32(e["txt_single"]),
                                  image_rotary_emb=(torch.cat(cos, dim=1), torch.cat(sin, dim=1)))
            return (content, text) if ref is None else (content[:, :K], (text, content[:, K:]))
        return fn

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        return self.unpack(tr.proj_out(tr.norm_out(x, emb.extra["temb"])), emb.grid)   # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs the modular pipeline builds: packed target tokens and ids, text ids,
        t in [0, 1]; with kontext the references' tokens and ids as image_cond_hidden_states / image_cond_ids."""
        grid, refs = self.grid_of(x), (self.references(cond) if self.kontext else [])
        kw = {}
        if refs:
            kw = {"image_cond_hidden_states": torch.cat([self.pack(r) for r in refs], dim=1),
                  "image_cond_ids": self.reference_ids(refs, x.device)}
        out = transformer(hidden_states=self.pack(x), encoder_hidden_states=cond["text"], timestep=timestep,
                          img_ids=self.image_ids(x.device, grid[1:]),
                          txt_ids=self.text_ids(cond["text"].shape[1], x.device), return_dict=False, **kw)[0]
        return self.unpack(out, grid)


FAMILY = Flux3Family
PRESETS = FLUX3_PRESETS
