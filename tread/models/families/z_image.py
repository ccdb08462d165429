"""Z-Image (diffusers ZImageTransformer2DModel) with TREAD routing: the text-to-image path (omni mode refused).

Routes count over `transformer.layers`; the refiners, the caption and the image pad tokens are never-routed
context. The transformer is fed 1 - sigma and its output negated (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches

SEQ_MULTI_OF = 32   # diffusers transformer_z_image.SEQ_MULTI_OF: every sequence is padded to a multiple of it

Z_IMAGE_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 main blocks (+ 2 + 2 refiners, never routed), width 64 (4 heads x 16),
    # Qwen3 stand-in width 32.
    "tiny": dict(all_patch_size=[2], all_f_patch_size=[1], dim=64, n_layers=8, n_refiner_layers=2, n_heads=4,
                 n_kv_heads=4, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64]),
    # A mid-size model for GPU benchmarks (~0.5B parameters): width 1536, 12 main + 2 + 2 refiner blocks, Qwen3-4B
    # text width.
    "mid": dict(all_patch_size=[2], all_f_patch_size=[1], dim=1536, n_layers=12, n_refiner_layers=2, n_heads=12,
                n_kv_heads=12, cap_feat_dim=2560, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512]),
    # Z-Image-Turbo (Tongyi-MAI/Z-Image-Turbo, 6B) geometry = ZImageTransformer2DModel's defaults: load the weights
    # with model.pretrained.
    "z-image-turbo": dict(all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30,
                          n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                          cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                          axes_lens=[1024, 512, 512]),
}


class ZImageFamily(RoutedFamily):
    family = "z_image"
    hub_hint = "Tongyi-MAI/Z-Image-Turbo"
    diffusers_class = "ZImageTransformer2DModel"
    text_dim_key = "cap_feat_dim"

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """in_channels from the data (the transformer has no out_channels / sample_size keys). Also checks here, with
        a FamilyConfigError, what diffusers' constructor would only assert: head_dim = sum(axes_dims)."""
        dim, heads = diffusers_config.get("dim", 3840), diffusers_config.get("n_heads", 30)
        axes = list(diffusers_config.get("axes_dims", [32, 48, 48]))
        if dim % heads or sum(axes) != dim // heads or any(a % 2 for a in axes):
            raise FamilyConfigError(
                f"model.diffusers_config.axes_dims={axes} must be even numbers summing to the head dim dim / n_heads = "
                f"{dim} / {heads}{'' if dim % heads else ' = ' + str(dim // heads)} (dim must be a multiple of "
                f"n_heads): RoPE rotates pairs of each head's channels, axis by axis.")
        return {"in_channels": in_channels}

    # -- geometry and checks ------------------------------------------------------------------------------
    @property
    def patch(self) -> int:
        return int(self.transformer.config.all_patch_size[0])

    @property
    def key(self) -> str:
        """The all_x_embedder / all_final_layer entry used: the first (patch_size, f_patch_size) pair."""
        c = self.transformer.config
        return f"{c.all_patch_size[0]}-{c.all_f_patch_size[0]}"

    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.patch, self.patch

    def check_shapes(self) -> None:
        c = self.transformer.config
        if c.siglip_feat_dim is not None:
            raise FamilyConfigError(
                f"model.config.siglip_feat_dim={c.siglip_feat_dim}: that is Z-Image-Omni, which ZImageOmniPipeline "
                f"always runs in omni mode ([caption, reference images, target, SigLIP] with per-token noisy/clean "
                f"modulation); only the text-to-image mode is supported here: set siglip_feat_dim null (a "
                f"Z-Image / Z-Image-Turbo transformer).")
        if int(c.all_f_patch_size[0]) != 1:
            raise FamilyConfigError(f"model.config.all_f_patch_size={list(c.all_f_patch_size)}: images have one "
                                    f"frame, the first entry must be 1.")
        if c.in_channels != self.in_channels:
            raise FamilyConfigError(f"model.config.in_channels={c.in_channels} must equal data.channels="
                                    f"{self.in_channels} (the transformer patchifies the latents as they are).")
        if self.input_size % self.patch:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be a multiple of model.config."
                                    f"all_patch_size[0]={self.patch}.")
        side = self.input_size // self.patch
        if side > min(c.axes_lens[1], c.axes_lens[2]):
            raise FamilyConfigError(f"model.config.axes_lens={list(c.axes_lens)}: the token grid is {side} x {side} "
                                    f"(data.resolution={self.input_size} / patch {self.patch}); axes_lens[1] and "
                                    f"axes_lens[2] must be at least {side}.")

    def check_grid(self, grid: Grid) -> None:
        """RopeEmbedder looks rows and columns up in tables of axes_lens[1] / axes_lens[2] positions."""
        _, h, w = grid
        lens = list(self.transformer.config.axes_lens)
        if h > lens[1] or w > lens[2]:
            raise FamilyConfigError(
                f"model.family=z_image: latents {h * self.patch}x{w * self.patch} make a {h}x{w} token grid, beyond "
                f"the RoPE tables (model.config.axes_lens={lens}); allowed: rows <= axes_lens[1]={lens[1]} and "
                f"columns <= axes_lens[2]={lens[2]}.")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        """sigma = noise_level / 1000 (1: noise); embed and diffusers_forward feed the transformer 1 - sigma, as the
        pipeline does ((1000 - timestep) / 1000)."""
        return noise_level / 1000.0

    # -- omni (reference images) is refused ----------------------------------------------------------------
    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        if cond and cond.get("reference") is not None:
            raise FamilyConfigError(_NO_OMNI)
        return super().conditioning(labels, cond)

    # -- helpers ---------------------------------------------------------------------------------------------
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, p * p * C), features ordered (pH, pW, C) as `_patchify_image`."""
        B, C, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, (H // p) * (W // p), p * p * C)

    def caption_lengths(self, mask: torch.Tensor) -> torch.Tensor:
        """(B,) real caption tokens per sample (reads the mask on the host: the padded lengths are shapes)."""
        lengths = mask.sum(1).long()
        if bool((lengths == 0).any()):
            raise FamilyConfigError("cond['text_mask'] has a sample with no text token; Z-Image's pipeline always "
                                    "gives at least the chat template's tokens.")
        return lengths

    def _refine(self, layer: nn.Module, *args: Any) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return _checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    # -- the three steps --------------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, dev, grid = self.transformer, x.device, self.grid_of(x)
        B, (_, h, w) = x.shape[0], grid
        N = h * w
        P = (-N) % SEQ_MULTI_OF                                                  # image pad tokens
        adaln = tr.t_embedder((1 - timestep) * tr.t_scale).type_as(x)             # pipeline: t = 1 - sigma

        # caption: real tokens first (stable), embedded, cap_pad_token up to c_i, zeros up to the batch's longest
        text, mask = cond["text"], cond.get("text_mask")
        L = text.shape[1]
        if mask is None:    # every prompt has L real tokens: no host read
            lengths = torch.full((B,), L, dtype=torch.long, device=dev)
            C = L + (-L) % SEQ_MULTI_OF
        else:
            lengths = self.caption_lengths(mask)                                 # (B,)
            order = torch.sort((~mask.bool()).to(torch.uint8), dim=1, stable=True).indices
            text = torch.gather(text, 1, order[..., None].expand_as(text))
            C = int((lengths + (-lengths) % SEQ_MULTI_OF).max())
        padded = lengths + (-lengths) % SEQ_MULTI_OF                              # c_i
        if C + 1 >= tr.config.axes_lens[0]:
            raise FamilyConfigError(f"a caption of {int(lengths.max())} tokens (padded to {C}) needs RoPE positions "
                                    f"up to {C + 1}, but model.config.axes_lens[0]={tr.config.axes_lens[0]}.")
        cap = tr.cap_embedder(text)                                               # (B, L, D)
        D = cap.shape[2]
        cap = torch.cat([cap, cap.new_zeros(B, C - L, D)], 1) if C > L else cap[:, :C]
        k = torch.arange(C, device=dev)[None, :]
        real, valid = k < lengths[:, None], k < padded[:, None]                   # (B, C)
        cap = torch.where(real[..., None], cap, torch.where(valid[..., None], tr.cap_pad_token, 0.0).to(cap.dtype))
        cap_ids = torch.zeros(B, C, 3, dtype=torch.long, device=dev)
        cap_ids[..., 0] = k + 1
        cap_freqs = tr.rope_embedder(cap_ids.reshape(-1, 3)).reshape(B, C, -1)
        cap_freqs = torch.where(valid[..., None], cap_freqs, torch.zeros_like(cap_freqs))
        cap_mask = None if mask is None or bool((padded == C).all()) else valid
        for layer in tr.context_refiner:
            cap = self._refine(layer, cap, cap_mask, cap_freqs)

        # image: patches embedded, x_pad_token up to a multiple of 32, ids (c_i + 1, row, col), pads (0, 0, 0)
        hidden = tr.all_x_embedder[self.key](self.patchify(x))                   # (B, N, D)
        img_ids = torch.zeros(B, N + P, 3, dtype=torch.long, device=dev)
        img_ids[:, :N, 0] = (padded + 1)[:, None]
        img_ids[:, :N, 1] = torch.arange(h, device=dev).repeat_interleave(w)[None]
        img_ids[:, :N, 2] = torch.arange(w, device=dev).repeat(h)[None]
        img_freqs = tr.rope_embedder(img_ids.reshape(-1, 3)).reshape(B, N + P, -1)
        seq = torch.cat([hidden, tr.x_pad_token.expand(B, P, -1)], 1)
        for layer in tr.noise_refiner:
            seq = self._refine(layer, seq, None, img_freqs, adaln)

        joint_mask = None if cap_mask is None else torch.cat([cap_mask.new_ones(B, P), cap_mask], 1)  # pads + cap
        extra = {"adaln": adaln, "ctx_freqs": torch.cat([img_freqs[:, N:], cap_freqs], 1), "ctx_mask": joint_mask}
        return Embedded(seq[:, :N], (seq[:, N:], cap), {"rope": img_freqs[:, :N]}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        adaln, ctx_freqs, ctx_mask = emb.extra["adaln"], emb.extra["ctx_freqs"], emb.extra["ctx_mask"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                pad, cap = context
                B, K, P = x.shape[0], x.shape[1], pad.shape[1]
                mask = None if ctx_mask is None else torch.cat([ctx_mask.new_ones(B, K), ctx_mask], 1)
                out = block(torch.cat([x, pad, cap], 1), mask, torch.cat([tok["rope"], ctx_freqs], 1),
                            cond32(adaln))
                return out[:, :K], (out[:, K:K + P], out[:, K + P:])
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        out = self.transformer.all_final_layer[self.key](x, c=emb.extra["adaln"])   # (B, N, p*p*C)
        img = unpack_patches(out, emb.grid, (1, self.patch, self.patch), self.out_channels).squeeze(2)
        return -img                                       # the pipeline's noise_pred = -output: velocity noise - x0

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs as ZImagePipeline builds them: a list of (C, 1, H, W) latents, t = 1 -
        sigma, each prompt's real tokens (`prompt_embeds[i][prompt_masks[i]]`); the output stacked and negated."""
        text, mask = cond["text"], cond.get("text_mask")
        caps = [text[i][mask[i].bool()] if mask is not None else text[i] for i in range(text.shape[0])]
        c = transformer.config
        out = transformer(list(x.unsqueeze(2).unbind(0)), 1 - timestep, caps, patch_size=c.all_patch_size[0],
                          f_patch_size=c.all_f_patch_size[0], return_dict=False)[0]
        return -torch.stack(out, 0).squeeze(2)


_NO_OMNI = ("Z-Image's reference-image (omni) mode is not supported: only text-to-image. ZImageOmniPipeline runs "
            "clean reference images with per-token noisy/clean modulation (noise_mask, t_clean = t_embedder(1)) and "
            "SigLIP features in a [caption, references, target, SigLIP] sequence, which this family does not route "
            "with a proof; use data without reference_latents.npy.")

FAMILY = ZImageFamily
PRESETS = Z_IMAGE_PRESETS
