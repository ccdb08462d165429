"""FLUX.2 (diffusers Flux2Transformer2DModel, Flux2Pipeline) with TREAD routing.

Routes count over the dual blocks, then the single blocks; the shared modulation is computed once per forward
and the reference images are never-routed context (docs/families.md, "Implementation notes").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, RoutedFamily, cond32
from tread.models.families.flux import FluxFamily, _rotate

FLUX2_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 dual + 6 single blocks, width 64 (4 heads x 16), 4 RoPE axes of 4, text
    # width 32; not guidance-distilled (model.guidance not needed).
    "tiny": dict(patch_size=1, num_layers=2, num_single_layers=6, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, timestep_guidance_channels=32, axes_dims_rope=[4, 4, 4, 4],
                 guidance_embeds=False),
    # A mid-size model for GPU benchmarks (~0.68B parameters): width 1536, 4 + 12 blocks, FLUX.2-dev's text width
    # (3 Mistral-Small hidden states of 5120), RoPE axes and MLP ratio.
    "mid": dict(patch_size=1, num_layers=4, num_single_layers=12, attention_head_dim=128, num_attention_heads=12,
                joint_attention_dim=15360, axes_dims_rope=[32, 32, 32, 32], guidance_embeds=False),
    # FLUX.2-dev geometry (~32B; 32-channel FLUX.2 VAE latents, packed to 128): load the weights with model.pretrained.
    "flux2-dev": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                      num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                      mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, eps=1e-6, guidance_embeds=True),
}

RopeTable = tuple[torch.Tensor, torch.Tensor]


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, head_dim))


def _attend(proc: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: Optional[torch.Tensor], rope: Optional[RopeTable]) -> torch.Tensor:
    """Both processors' common tail: RoPE on query and key (when given), diffusers' dispatched attention with the
    processor's backend, the heads merged."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if rope is not None:
        cos, sin = rope
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=proc._attention_backend,
                                parallel_config=proc._parallel_config)
    return out.flatten(2, 3).to(query.dtype)


class BatchedRopeFlux2AttnProcessor:
    """diffusers' Flux2AttnProcessor (dual-stream blocks), same maths, with a RoPE table (cos, sin) of (S, Dh) or
    (B, S, Dh); separate or fused projections."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[RopeTable] = None) -> Any:
        fused = getattr(attn, "fused_projections", False)
        if fused:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = (_heads(t, attn.head_dim) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None and encoder_hidden_states is not None:
            if fused:
                eq, ek, ev = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
            else:
                eq, ek, ev = (attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
                              attn.add_v_proj(encoder_hidden_states))
            eq, ek, ev = (_heads(t, attn.head_dim) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            query, key, value = torch.cat([eq, query], 1), torch.cat([ek, key], 1), torch.cat([ev, value], 1)
        out = _attend(self, query, key, value, attention_mask, image_rotary_emb)
        context = None
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            context, out = attn.to_add_out(out[:, :text_len]), out[:, text_len:]
        out = attn.to_out[1](attn.to_out[0](out))
        return out if context is None else (out, context)


class BatchedRopeFlux2ParallelSelfAttnProcessor:
    """diffusers' Flux2ParallelSelfAttnProcessor (the single-stream blocks' Flux2ParallelSelfAttention: fused QKV +
    MLP-in projection, fused attention-out + MLP-out projection), same maths, with a per-sample RoPE table allowed."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[RopeTable] = None) -> torch.Tensor:
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)   # diffusers' split by the global ratio
        qkv, mlp = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        query, key, value = (_heads(t, attn.head_dim) for t in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        out = _attend(self, query, key, value, attention_mask, image_rotary_emb)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class Flux2Family(RoutedFamily):
    family = "flux2"
    hub_hint = "black-forest-labs/FLUX.2-dev"
    diffusers_class = "Flux2Transformer2DModel"
    text_dim_key = "joint_attention_dim"
    pooled_dim_key = None            # Mistral hidden states only: no pooled text embedding
    PACK = FluxFamily.PACK           # the pipeline patchifies 2x2 latent cells into one token, as FLUX packs them
    REFERENCE_T = 10                 # Flux2Pipeline._prepare_image_ids(scale=10): reference i has T = 10 + 10 i
    ROPE_AXES = 4                    # ids (T, H, W, L)
    takes_references = True
    reference_advice = "set model.kontext=true (FLUX.2 reference editing)"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj")   # + the single blocks' fused projection

    # FLUX's conventions, shared: 2x2 packing (C, 2, 2) row-major, block order, t / 1000, the guidance tensor.
    data_config = classmethod(FluxFamily.data_config.__func__)
    latent_patch = FluxFamily.latent_patch
    pack, unpack = FluxFamily.pack, FluxFamily.unpack
    blocks_of = FluxFamily.blocks_of
    # context parallelism: FLUX's (joint attention of both block kinds; the text and its RoPE rows split too)
    joint_text, text_rows = FluxFamily.joint_text, FluxFamily.text_rows
    group_attention_modules = FluxFamily.group_attention_modules
    timestep = FluxFamily.timestep
    _guidance = FluxFamily._guidance

    def __init__(self, transformer: nn.Module, *, guidance: Optional[float] = None, kontext: bool = False,
                 **kwargs: Any):
        if not isinstance(kontext, bool):
            raise FamilyConfigError(f"model.kontext={kontext!r} is not allowed; allowed: true or false.")
        distilled = bool(transformer.config.guidance_embeds)
        if distilled and guidance is None:
            raise FamilyConfigError("model.guidance must be set for a guidance-distilled FLUX.2 (guidance_embeds: "
                                    "true), e.g. model.guidance=4.0 (Flux2Pipeline's default guidance_scale); got "
                                    "null.")
        if not distilled and guidance is not None:
            raise FamilyConfigError(f"model.guidance={guidance} is set but this FLUX.2 transformer has no guidance "
                                    f"embedding (guidance_embeds: false), so it would be ignored; allowed: "
                                    f"model.guidance=null, or model.config.guidance_embeds=true (fresh weights).")
        self.guidance, self.kontext = guidance, kontext
        super().__init__(transformer, **kwargs)

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_packed_io(c, "FLUX.2")
        axes = list(c.axes_dims_rope)
        if len(axes) != self.ROPE_AXES or sum(axes) != c.attention_head_dim or any(a % 2 for a in axes):
            raise FamilyConfigError(
                f"model.config.axes_dims_rope={axes} is not allowed; allowed: 4 even numbers (one per id coordinate "
                f"T, H, W, L) summing to attention_head_dim={c.attention_head_dim}.")

    def install_processors(self) -> None:
        from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

        for module in self.transformer.modules():
            if isinstance(module, Flux2Attention):
                module.set_processor(BatchedRopeFlux2AttnProcessor())
            elif isinstance(module, Flux2ParallelSelfAttention):
                module.set_processor(BatchedRopeFlux2ParallelSelfAttnProcessor())

    # -- ids (Flux2Pipeline's conventions) --------------------------------------------------------------
    def image_ids(self, device: torch.device, hw: Sequence[int], t: int = 0) -> torch.Tensor:
        """(h * w, 4) ids (t, row, col, 0) of a packed (h, w) grid, row-major (the target: t = 0)."""
        h, w = hw
        ids = torch.zeros(h, w, self.ROPE_AXES, device=device)
        ids[..., 0] = t
        ids[..., 1] = torch.arange(h, device=device)[:, None]
        ids[..., 2] = torch.arange(w, device=device)[None, :]
        return ids.reshape(h * w, self.ROPE_AXES)

    def text_ids(self, text_len: int, device: torch.device) -> torch.Tensor:
        """(L, 4) ids (0, 0, 0, l): the text position on the fourth axis."""
        ids = torch.zeros(text_len, self.ROPE_AXES, device=device)
        ids[:, 3] = torch.arange(text_len, device=device)
        return ids

    def reference_ids(self, refs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The references' ids, concatenated in order: reference i on its own packed grid with T = 10 + 10 i."""
        return torch.cat([self.image_ids(device, (r.shape[-2] // self.PACK, r.shape[-1] // self.PACK),
                                         t=self.REFERENCE_T * (i + 1)) for i, r in enumerate(refs)])

    # -- references -----------------------------------------------------------------------------------
    @staticmethod
    def references(cond: Mapping[str, Any]) -> list[torch.Tensor]:
        """cond["reference"] as a list of (B, C, Hr, Wr) latents (one tensor: one reference image)."""
        ref = cond.get("reference")
        if ref is None:
            return []
        return [ref] if isinstance(ref, torch.Tensor) else list(ref)

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """The text conditioning (RoutedFamily's; label dropout zeroes text only) plus, with kontext, the reference
        latents cond["reference"] (any sizes): the model always conditions on its references, in both CFG branches."""
        text = self.text_conditioning(labels, cond)
        if not self.kontext:
            return text
        ref = (cond or {}).get("reference")
        refs = self.references(cond or {})
        B, C = labels.shape[0], self.in_channels
        bad = [r for r in refs if not (isinstance(r, torch.Tensor) and r.dim() == 4 and r.shape[:2] == (B, C)
                                       and r.shape[2] > 0 and r.shape[3] > 0 and r.shape[2] % 2 == 0
                                       and r.shape[3] % 2 == 0)]
        if not refs or bad:
            got = "none" if not refs else ", ".join(f"shape {list(r.shape)}" if isinstance(r, torch.Tensor)
                                                     else type(r).__name__ for r in bad)
            raise FamilyConfigError(
                f"model.kontext=true needs the reference images' latents cond['reference']: a tensor (B, "
                f"data.channels, H, W) = ({B}, {C}, H, W) with even H and W, or a list of them (one per reference "
                f"image), got {got}: train on data with reference_latents.npy (precompute --reference-images DIR), "
                f"or set model.kontext=false.")
        return {**text, "reference": ref}

    def check_reference(self, conditioning: Mapping[str, Any], x: torch.Tensor) -> None:
        """FLUX.2's references may have any sizes (each its own grid): nothing to check against the target."""

    # -- the forward in three steps -------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        guidance = self._guidance(x.shape[0], x.device)
        t = timestep.to(x.dtype) * 1000                                           # as diffusers: input dtype
        temb = tr.time_guidance_embed(t, None if guidance is None else guidance.to(x.dtype) * 1000)   # (B, D)
        hidden = tr.x_embedder(self.pack(x))                                       # (B, N, D)
        context = tr.context_embedder(cond["text"])                                # (B, L, D)
        L, B, N = context.shape[1], x.shape[0], hidden.shape[1]
        refs = self.references(cond) if self.kontext else []
        ids = [self.text_ids(L, x.device), self.image_ids(x.device, grid[1:])]
        if refs:
            ids.append(self.reference_ids(refs, x.device))
        cos, sin = tr.pos_embed(torch.cat(ids))                                    # (L + N [+ R], Dh)
        per_token = {"rope_cos": cos[L:L + N].unsqueeze(0).expand(B, N, -1),
                     "rope_sin": sin[L:L + N].unsqueeze(0).expand(B, N, -1)}
        extra = {"temb": temb, "text_cos": cos[:L], "text_sin": sin[:L],
                 # the shared modulation: computed once, handed to every block
                 "mod_img": tr.double_stream_modulation_img(temb), "mod_txt": tr.double_stream_modulation_txt(temb),
                 "mod_single": tr.single_stream_modulation(temb)}
        if refs:   # never routed: the reference tokens travel with the text as context
            context = (context, tr.x_embedder(torch.cat([self.pack(r) for r in refs], dim=1)))   # (B, R, D)
            extra.update(ref_cos=cos[L + N:], ref_sin=sin[L + N:])
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        e = emb.extra
        text_cos, text_sin = e["text_cos"], e["text_sin"]
        ref_rope = (e["ref_cos"], e["ref_sin"]) if "ref_cos" in e else None
        dual = len(self.transformer.transformer_blocks)

        def run(index: int, block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                text, ref = context if ref_rope is not None else (context, None)
                B, L, K = x.shape[0], text.shape[1], x.shape[1]
                cos = [text_cos.unsqueeze(0).expand(B, L, -1), tok["rope_cos"]]
                sin = [text_sin.unsqueeze(0).expand(B, L, -1), tok["rope_sin"]]
                if ref is not None:   # [kept target, references] through the image weights, like diffusers
                    cos.append(ref_rope[0].unsqueeze(0).expand(B, -1, -1))
                    sin.append(ref_rope[1].unsqueeze(0).expand(B, -1, -1))
                    x = torch.cat([x, ref], dim=1)
                rope = (torch.cat(cos, dim=1), torch.cat(sin, dim=1))
                if index < dual:
                    text, x = block(hidden_states=x, encoder_hidden_states=text, temb_mod_img=cond32(e["mod_img"]),
                                    temb_mod_txt=cond32(e["mod_txt"]), image_rotary_emb=rope)
                else:   # the block concatenates [text, image] and splits them again
                    text, x = block(hidden_states=x, encoder_hidden_states=text, temb_mod=cond32(e["mod_single"]),
                                    image_rotary_emb=rope, split_hidden_states=True)
                return (x, text) if ref is None else (x[:, :K], (text, x[:, K:]))
            return fn

        return [run(i, b) for i, b in enumerate(self.routable_blocks())]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        return self.unpack(tr.proj_out(tr.norm_out(x, emb.extra["temb"])), emb.grid)   # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs Flux2Pipeline builds: packed latents [target, references...], ids
        [target ids, reference ids], text ids, t / 1000, guidance; the output's target part kept."""
        L, grid = cond["text"].shape[1], self.grid_of(x)
        hidden, img_ids = self.pack(x), self.image_ids(x.device, grid[1:])
        refs = self.references(cond) if self.kontext else []
        if refs:
            hidden = torch.cat([hidden, *(self.pack(r) for r in refs)], dim=1)
            img_ids = torch.cat([img_ids, self.reference_ids(refs, x.device)])
        out = transformer(hidden_states=hidden, encoder_hidden_states=cond["text"], timestep=timestep,
                          img_ids=img_ids, txt_ids=self.text_ids(L, x.device),
                          guidance=self._guidance(x.shape[0], x.device), return_dict=False)[0]
        return self.unpack(out[:, :grid[1] * grid[2]], grid)


FAMILY = Flux2Family
PRESETS = FLUX2_PRESETS
