"""HiDream-I1 (diffusers HiDreamImageTransformer2DModel) with TREAD routing.

Routes count over the dual blocks, then the single blocks. T5, the per-block Llama states and the non-square
pad tokens are never-routed context; under a route only the kept tokens reach the MoE (docs/families.md).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from tread.models.families.base import (ClassTextEmbedder, Embedded, FamilyConfigError, Grid, RoutedFamily, cond32,
                                        unpack_patches)

# Llama-3.1-8B-Instruct has 32 layers: HiDream-I1 uses layer i for block i and the last layer for blocks 32..47.
_I1_LLAMA = [*range(32), *[31] * 16]

HIDREAM_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 dual + 6 single blocks, width 64 (4 heads x 16), 4 experts (top 2),
    # T5 / Llama stand-ins of widths 32 / 24, pooled width 32; 6 Llama layers, the last reused (as the release).
    "tiny": dict(patch_size=2, num_layers=2, num_single_layers=6, attention_head_dim=16, num_attention_heads=4,
                 caption_channels=[32, 24], text_emb_dim=32, num_routed_experts=4, num_activated_experts=2,
                 axes_dims_rope=[4, 6, 6], llama_layers=[0, 1, 2, 3, 4, 5, 5, 5]),
    # A mid-size model for GPU benchmarks (~0.6B parameters): width 1024, 2 dual + 8 single blocks, the real text
    # widths (T5-XXL 4096, Llama-3.1-8B 4096, CLIP-L + CLIP-G pooled 2048), Llama layers spread over 32.
    "mid": dict(patch_size=2, num_layers=2, num_single_layers=8, attention_head_dim=128, num_attention_heads=8,
                caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4, num_activated_experts=2,
                axes_dims_rope=[64, 32, 32], llama_layers=[0, 4, 8, 12, 16, 20, 24, 28, 31, 31]),
    # HiDream-I1 (Full / Dev / Fast share it; FLUX VAE latents, 16 channels): load the weights with model.pretrained.
    "i1": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
               attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
               num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[64, 32, 32],
               max_resolution=[128, 128], llama_layers=_I1_LLAMA),
}


class HiDreamClassText(ClassTextEmbedder):
    """Class label -> T5 sequence and pooled vector (ClassTextEmbedder's tables) plus one Llama sequence per class,
    used as the hidden state of every Llama layer. Row `num_classes` is the null class (CFG)."""

    def __init__(self, num_classes: int, seq_len: int, text_dim: int, llama_dim: int, pooled_dim: int,
                 init_std: float = 1.0):
        super().__init__(num_classes, seq_len, text_dim, pooled_dim, init_std)
        self.llama_dim = llama_dim
        self.llama = nn.Embedding(num_classes + 1, seq_len * llama_dim)
        nn.init.normal_(self.llama.weight, std=init_std)

    def forward(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(labels)
        out["llama"] = self.llama(labels).view(labels.shape[0], self.seq_len, self.llama_dim)
        return out


class HiDreamFamily(RoutedFamily):
    family = "hidream"
    hub_hint = "HiDream-ai/HiDream-I1-Full"
    diffusers_class = "HiDreamImageTransformer2DModel"
    text_dim_key = "caption_channels"
    pooled_dim_key = "text_emb_dim"
    lora_targets = ("to_q", "to_k", "to_v", "to_out")   # HiDream's output projection is a plain Linear
    takes_llama = True

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        return {"in_channels": in_channels, "out_channels": in_channels}   # no sample_size key in HiDream

    def __init__(self, transformer: nn.Module, **kwargs: Any):
        super().__init__(transformer, **kwargs)
        if self.conditioner is not None:   # the class table with its Llama part (same names: conditioner.*)
            self.conditioner = HiDreamClassText(self.num_classes, self.text_len, self.text_dim, self.llama_dim,
                                                self.pooled_dim)

    @property
    def text_dim(self) -> int:
        return int(self.transformer.config.caption_channels[0])      # T5

    @property
    def llama_dim(self) -> int:
        return int(self.transformer.config.caption_channels[1])      # Llama

    @property
    def llama_layers(self) -> list[int]:
        return [int(k) for k in self.transformer.config.llama_layers]

    def check_shapes(self) -> None:
        c = self.transformer.config
        if not isinstance(c.patch_size, int) or c.patch_size < 1:
            raise FamilyConfigError(f"model.config.patch_size={c.patch_size!r} must be a positive integer (HiDream-I1: "
                                    f"2).")
        self._check_patch_io(c, "HiDream-I1 uses the FLUX VAE's 16-channel latents", width_key=None)
        if len(c.caption_channels or ()) != 2:
            raise FamilyConfigError(f"model.config.caption_channels={c.caption_channels} must be [T5 width, Llama "
                                    f"width] (HiDream-I1: [4096, 4096]).")
        blocks = c.num_layers + c.num_single_layers
        if c.llama_layers is None or len(c.llama_layers) != blocks:
            n = "null" if c.llama_layers is None else f"{len(c.llama_layers)} entries"
            raise FamilyConfigError(
                f"model.config.llama_layers={c.llama_layers} ({n}) must list one Llama layer index per block: "
                f"num_layers + num_single_layers = {blocks} entries (HiDream-I1: 0..31, then 31 sixteen times).")
        axes, head = list(c.axes_dims_rope), c.attention_head_dim
        if len(axes) != 3 or sum(axes) not in (head, head // 2) or any(a % 2 for a in axes):
            raise FamilyConfigError(
                f"model.config.axes_dims_rope={axes} must be 3 even numbers (one per id axis: 0, row, col) summing "
                f"to attention_head_dim={head} (or half of it: RoPE on the first half of each head).")
        if c.force_inference_output:
            raise FamilyConfigError(
                "model.config.force_inference_output=true runs the experts through diffusers' moe_infer under "
                "torch.no_grad even in training, so the experts and the gate would never train; allowed: false.")

    def check_grid(self, grid: Grid) -> None:
        """Non-square latents are padded to transformer.max_seq tokens (diffusers' patchify): at most that many."""
        _, h, w = grid
        tr, p = self.transformer, int(self.transformer.config.patch_size)
        if h != w and h * w > tr.max_seq:
            raise FamilyConfigError(
                f"model.family=hidream: non-square latents {h * p}x{w * p} make {h}x{w} = {h * w} tokens, more than "
                f"the {tr.max_seq} that diffusers pads non-square latents to (model.config.max_resolution="
                f"{list(tr.config.max_resolution)} / patch {p}^2); allowed: square latents, or h * w <= {tr.max_seq}.")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.double_stream_blocks, *transformer.single_stream_blocks]

    @contextlib.contextmanager
    def shape_only(self) -> Iterator[None]:
        """For a count on the meta device: each MoE feed-forward runs the gate, expert 0 on all tokens x top-k, the
        weighted sum and the shared expert (the same matmuls; diffusers' masked dispatch has no shape-only form)."""
        moes = [m for m in self.transformer.modules() if hasattr(m, "experts") and hasattr(m, "shared_experts")]
        for moe in moes:
            moe.forward = functools.partial(_moe_shapes, moe)
        try:
            yield
        finally:
            for moe in moes:
                del moe.forward

    # noise_level = t * 1000 is what HiDreamImagePipeline feeds (scheduler timesteps): the default timestep().

    # -- conditioning --------------------------------------------------------------------------------
    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """RoutedFamily's (class table: T5, Llama, pooled; text data: T5, pooled, null label zeroed) plus text data's
        Llama states cond["llama"], zeroed for the null label too."""
        text = super().conditioning(labels, cond)
        if cond and cond.get("text") is not None and cond.get("llama") is not None:
            llama = cond["llama"]
            if self.num_classes:
                keep = (labels != self.num_classes).to(llama.dtype).view(-1, *([1] * (llama.dim() - 1)))
                llama = llama * keep
            text["llama"] = llama
        return text

    def llama_states(self, cond: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        """What diffusers' `encoder_hidden_states_llama3` is: indexable by Llama layer, each (B, Ll, Dl)."""
        text, llama = cond["text"], cond.get("llama")
        need = max(self.llama_layers) + 1
        if llama is None:    # no Llama states in the data: zeros of the T5 length
            llama = text.new_zeros(text.shape[0], text.shape[1], self.llama_dim)
        if llama.dim() == 3 and llama.shape[-1] == self.llama_dim:
            return [llama] * need
        if llama.dim() == 4 and llama.shape[1] >= need and llama.shape[-1] == self.llama_dim:
            return llama.transpose(0, 1)       # (n, B, Ll, Dl) as the pipeline stacks them
        raise FamilyConfigError(
            f"cond['llama'] has shape {list(llama.shape)}; allowed: (B, L, {self.llama_dim}) (one Llama state for "
            f"every layer) or (B, n, L, {self.llama_dim}) with n >= {need} layers (model.config.llama_layers reaches "
            f"layer {need - 1}; {self.llama_dim} = model.config.caption_channels[1]).")

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        super().check_text_data(conditioning, where)
        llama = conditioning.get("llama")
        if llama is not None and int(llama[-1]) != self.llama_dim:
            raise FamilyConfigError(
                f"the Llama hidden states of the data at {where} are {llama[-1]} wide, but model.config."
                f"caption_channels[1]={self.llama_dim} (hidream): encode the captions with Llama-3.1-8B-Instruct, or "
                f"set model.config.caption_channels for a fresh model.")
        need = max(self.llama_layers) + 1
        if llama is not None and len(llama) == 3 and int(llama[0]) < need:
            raise FamilyConfigError(
                f"the data at {where} holds {llama[0]} Llama layers per caption, but model.config.llama_layers reaches "
                f"layer {need - 1} (hidream): encode the captions with a Llama of at least {need} layers "
                f"(Llama-3.1-8B-Instruct: 32), or set model.config.llama_layers for a fresh model.")

    # -- the three steps ----------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        N = grid[1] * grid[2]
        tokens, _, _, img_ids = tr.patchify(x)     # (B, N [+ P pads if non-square], .); img_ids (0, row, col), pads 0
        hidden = tr.x_embedder(tokens)                          # (B, N + P, D)
        D = hidden.shape[2]
        temb = tr.t_embedder(timestep, x.dtype) + tr.p_embedder(cond["pooled"])
        states = self.llama_states(cond)
        llama = [tr.caption_projection[i](states[k]).view(B, -1, D) for i, k in enumerate(self.llama_layers)]
        t5 = tr.caption_projection[-1](cond["text"]).view(B, -1, D)
        context = torch.cat([t5, llama[-1]], dim=1)              # initial_encoder_hidden_states (B, L0, D)
        L = t5.shape[1] + llama[-1].shape[1] + llama[0].shape[1]  # what each block attends to beside the image
        ids = torch.cat([img_ids, img_ids.new_zeros(B, L, 3)], dim=1)
        rope = tr.pe_embedder(ids)                              # (B, N + P + L, 1, Dh/2, 2, 2)
        if hidden.shape[1] > N:   # non-square: the pad tokens are never-routed context, as the text
            context = (context, hidden[:, N:])
        return Embedded(hidden[:, :N], context, {"rope": rope[:, :N]},
                        {"temb": temb, "text_rope": rope[:, N:], "llama": llama}, grid)

    @staticmethod
    def _key_mask(kept: int, pads: int, rest: int, like: torch.Tensor) -> torch.Tensor:
        """diffusers' hidden_states_masks over [kept image tokens, pad tokens, rest]: 1, 0 (their keys zeroed), 1."""
        B = like.shape[0]
        return torch.cat([like.new_ones(B, kept), like.new_zeros(B, pads), like.new_ones(B, rest)], dim=1)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb, text_rope, llama = emb.extra["temb"], emb.extra["text_rope"], emb.extra["llama"]
        n_dual, padded = len(self.transformer.double_stream_blocks), isinstance(emb.context, tuple)

        def dual(block: nn.Module, i: int) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                context, pad = context if padded else (context, None)
                K, L0 = x.shape[1], context.shape[1]
                text = torch.cat([context, cond32(llama[i])], dim=1)
                img, masks = (x, None) if pad is None else (torch.cat([x, pad], 1),
                                                            self._key_mask(K, pad.shape[1], 0, x))
                img, text = block(hidden_states=img, hidden_states_masks=masks, encoder_hidden_states=text,
                                  temb=cond32(temb), image_rotary_emb=torch.cat([tok["rope"], text_rope], dim=1))
                text = text[:, :L0]                                  # the Llama part's update is dropped
                return img[:, :K], (text if pad is None else (text, img[:, K:]))
            return fn

        def single(block: nn.Module, i: int) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                context, pad = context if padded else (context, None)
                K, L0 = x.shape[1], context.shape[1]
                P = 0 if pad is None else pad.shape[1]
                h = torch.cat([x, context, cond32(llama[i])] if pad is None else
                              [x, pad, context, cond32(llama[i])], dim=1)
                masks = None if pad is None else self._key_mask(K, P, h.shape[1] - K - P, x)
                h = block(hidden_states=h, hidden_states_masks=masks, encoder_hidden_states=None, temb=cond32(temb),
                          image_rotary_emb=torch.cat([tok["rope"], text_rope], dim=1))
                text = h[:, K + P:K + P + L0]
                return h[:, :K], (text if pad is None else (text, h[:, K:K + P]))
            return fn

        return [(dual if i < n_dual else single)(b, i) for i, b in enumerate(self.routable_blocks())]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        out = self.transformer.final_layer(x, emb.extra["temb"])          # (B, N, p*p*C), features (p, p, C)
        p = int(self.transformer.config.patch_size)
        return -unpack_patches(out, emb.grid, (1, p, p), self.out_channels).squeeze(2)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward as HiDreamImagePipeline calls it (output negated, line `noise_pred = -noise_pred`); in
        training mode diffusers returns (B, C, N [+ pads], p*p) patches, turned back into (B, C, H, W) here."""
        out = transformer(hidden_states=x, timesteps=timestep, encoder_hidden_states_t5=cond["text"],
                          encoder_hidden_states_llama3=self.llama_states(cond), pooled_embeds=cond["pooled"],
                          return_dict=False)[0]
        if transformer.training and not transformer.config.force_inference_output:
            B, C, _, p2 = out.shape
            p, (_, h, w) = int(p2 ** 0.5), self.grid_of(x)
            out = out[:, :, :h * w].reshape(B, C, h, w, p, p).permute(0, 1, 2, 4, 3, 5).reshape(B, C, h * p, w * p)
        return -out


FAMILY = HiDreamFamily
PRESETS = HIDREAM_PRESETS


def _moe_shapes(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """MOEFeedForwardSwiGLU.forward's matmuls in training, value-free (HiDreamFamily.shape_only)."""
    topk_idx, topk_weight, _ = moe.gate(x)
    rows = x.reshape(-1, x.shape[-1]).repeat_interleave(moe.num_activated_experts, dim=0)
    y = moe.experts[0](rows).view(*topk_weight.shape, -1)
    y = (y * topk_weight.unsqueeze(-1)).sum(dim=1).view(x.shape)
    return y + moe.shared_experts(x)
