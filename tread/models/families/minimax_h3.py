"""MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel, joint video + audio) with TREAD routing: text-to-video.

One packed sequence [text | video] under full self-attention (no cross-attention), one AdaLN row per (timestep,
modality) pair per row (video 0, text 1, audio 2) and a 3-axis RoPE over per-row (t, h, w) ids. Only video rows are
routed: each kept row keeps its true position id and its own modulation row; the text rows (and the refiner before
the blocks) are never routed. Video-only: the data has no audio, and the transformer takes zero audio rows, so the
audio stream is empty (its projections are never used). Layout and row ids are the modular pipeline's own
(`MiniMaxH3PrepareLayoutStep.build_packed_sequence`), each prompt laid out as the pipeline lays it out alone (its
real text length shifts the video's rotary clock). The transformer takes t = 1 - sigma and predicts a data-ward
velocity; the family feeds 1 - sigma and negates the output (docs/families.md, "MiniMax-H3").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32

VIDEO_TAG, TEXT_TAG, MODALITIES = 0, 1, 3   # the pipeline's MINIMAX_H3_*_TAG; MINIMAX_H3_MODALITY_NUM

MINIMAX_H3_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks (+ 2 text refiner blocks, never routed), width 64 (4 heads x 16, 12
    # of each head's channels rotated), a Qwen3-VL stand-in of width 32; 1x2x2 latent cells per token.
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, hidden_size=64, num_layers=8, num_refiner_layers=2,
                 ffn_dim=128, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32,
                 time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=2),
    # GPU benchmarks (~0.38B parameters): width 1024 (8 heads x 128), 16 blocks + 2 refiner blocks, the released
    # text width 5120 and RoPE split; a narrow timestep embedding (each block's AdaLN projection is 18 x width wide).
    "mid": dict(num_attention_heads=8, attention_head_dim=128, hidden_size=1024, num_layers=16, num_refiner_layers=2,
                ffn_dim=4096, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=5120, freq_dim=256,
                time_embed_hidden_dim=1024, time_embed_dim=256, rope_freq_dim=16),
    # MiniMaxAI/MiniMax-H3 (transformer/ partition, 33.1B): MiniMaxH3Transformer3DModel's defaults, which its
    # docstring, the modular pipeline's fallbacks (24 latent channels, 32 audio channels, patch (1, 2, 2)) and its
    # text-encoder step (Qwen3-VL hidden_states[50], 5120 wide) agree with. Real weights: model.pretrained.
    "minimax-h3": dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50,
                       num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2),
                       text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376, time_embed_dim=2688, rope_freq_dim=16,
                       rope_theta=10000.0, norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5),
}


def _h3():
    """diffusers' MiniMax-H3 modules: the transformer's and the modular pipeline's layout step (deferred: diffusers
    is optional)."""
    from diffusers.models.transformers import transformer_minimax_h3 as model   # deferred: diffusers is optional
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as layout  # deferred: diffusers is optional

    return model, layout


@dataclass(frozen=True)
class Folded:
    """What a block's `attention_mask` argument carries here: the batch is folded into one sequence (1, B*S, D), so
    that diffusers' block applies per-row modulation rows and RoPE rows of every sample; attention unfolds it."""

    batch: int
    key_mask: Optional[torch.Tensor]   # (B, S) bool, False at padded text rows; None: every row is real


class FoldedMiniMaxH3AttnProcessor:
    """MiniMaxH3AttnProcessor (same projections, norms, diffusers' _apply_rotary_emb and dispatch) on a folded batch:
    projections, norms and RoPE run per row on (1, B*S, ...); attention runs per sample on (B, S, ...), padded text
    keys masked. Without a Folded mask it is diffusers' processor (the text refiner's calls)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, rotary_emb: Any = None,
                 attention_mask: Any = None) -> torch.Tensor:
        model, _ = _h3()
        if not isinstance(attention_mask, Folded):
            return model.MiniMaxH3AttnProcessor()(attn, hidden_states, rotary_emb, attention_mask)
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if rotary_emb is not None:
            query, key = model._apply_rotary_emb(query, *rotary_emb), model._apply_rotary_emb(key, *rotary_emb)
        B = attention_mask.batch
        query, key, value = (t.reshape(B, -1, *t.shape[2:]) for t in (query, key, value))
        mask = attention_mask.key_mask
        out = model.dispatch_attention_fn(query, key, value, attn_mask=None if mask is None else mask[:, None, None],
                                          dropout_p=0.0, is_causal=False, backend=self._attention_backend,
                                          parallel_config=None)
        out = out.flatten(2, 3).type_as(query).reshape(1, -1, attn.inner_dim)
        return attn.to_out[1](attn.to_out[0](out))


class MiniMaxH3Family(RoutedFamily):
    family = "minimax_h3"
    hub_hint = "MiniMaxAI/MiniMax-H3"
    diffusers_class = "MiniMaxH3Transformer3DModel"
    text_dim_key = "text_dim"
    frames_axis = True
    joint_text = True

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """in_channels from the data (the class has no out_channels / sample_size keys). Also checks here what the
        constructor would fail on with an IndexError: patch_size is (pt, ph, pw)."""
        patch = list(diffusers_config.get("patch_size", (1, 2, 2)))
        if len(patch) != 3:
            raise FamilyConfigError(f"model.config.patch_size={patch} must be 3 numbers (pt, ph, pw).")
        return {"in_channels": in_channels}

    def latent_patch(self) -> tuple[int, int, int]:
        pt, ph, pw = (int(p) for p in self.transformer.config.patch_size)
        return pt, ph, pw

    def check_shapes(self) -> None:
        c = self.transformer.config
        if c.in_channels != self.in_channels:
            raise FamilyConfigError(f"model.config.in_channels={c.in_channels} must equal data.channels="
                                    f"{self.in_channels} (the released VAE has 24 latent channels).")
        if 6 * c.rope_freq_dim > c.attention_head_dim:
            raise FamilyConfigError(
                f"model.config.rope_freq_dim={c.rope_freq_dim}: RoPE rotates 2 x 3 x rope_freq_dim = "
                f"{6 * c.rope_freq_dim} channels of each head, more than attention_head_dim={c.attention_head_dim}; "
                f"allowed: rope_freq_dim <= {c.attention_head_dim // 6}.")
        if int(c.patch_size[0]) != 1:
            raise FamilyConfigError(f"model.config.patch_size={list(c.patch_size)}: the pipeline's layout "
                                    f"(build_packed_sequence) has one row block per latent frame; allowed: a time "
                                    f"patch of 1, (1, ph, pw).")
        self._check_video_patch()

    def install_processors(self) -> None:
        for block in self.routable_blocks():
            block.attn.set_processor(FoldedMiniMaxH3AttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        """sigma = noise_level / 1000 (1: noise); embed feeds the transformer t = 1 - sigma (MiniMaxH3Scheduler:
        timesteps = 1 - sigmas, t = 1 clean)."""
        return noise_level / 1000.0

    # -- the pipeline's layout ------------------------------------------------------------------------
    def text_lengths(self, mask: Optional[torch.Tensor], batch: int, length: int) -> list[int]:
        """Each prompt's real text rows (a host read of the mask; the layout depends on them). The pipeline encodes
        one prompt unpadded, so the mask must keep a prefix (stored text is right-padded) of at least one row."""
        if mask is None:
            return [length] * batch
        lengths = mask.sum(1)
        prefix = torch.arange(length, device=mask.device)[None, :] < lengths[:, None]
        if not torch.equal(mask.bool(), prefix) or bool((lengths == 0).any()):
            raise FamilyConfigError("cond['text_mask'] must keep a non-empty prefix of each prompt's rows (the real "
                                    "tokens first, padding after: how precompute stores MiniMax-H3 text).")
        return [int(n) for n in lengths.tolist()]

    def layout(self, length: int, grid: Grid) -> Any:
        """MiniMaxH3PrepareLayoutStep.build_packed_sequence for one prompt of `length` text rows on token grid
        `grid`, with no keyframes and no audio rows: (position_ids (L + N, 3) float64, token_tags, video_indices,
        audio_indices, text_indices, ...)."""
        _, layout = _h3()
        (t, h, w), (pt, ph, pw) = grid, self.latent_patch()
        tags = torch.full((length,), TEXT_TAG, dtype=torch.long)
        return layout.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, t * pt, h * ph, w * pw, 0, self.latent_patch(), 2, 2, VIDEO_TAG)

    def video_positions(self, lengths: list[int], grid: Grid, device: torch.device) -> torch.Tensor:
        """(B, N, 3) float64: each sample's video rows' ids in its own layout."""
        by_length = {n: self.layout(n, grid)[0][n:] for n in set(lengths)}
        return torch.stack([by_length[n] for n in lengths]).to(device)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, N, C*pt*ph*pw): the pipeline's patchify_video_latents, rows of each sample."""
        _, layout = _h3()
        rows = layout.patchify_video_latents(x, self.latent_patch())
        return rows.reshape(x.shape[0], -1, rows.shape[-1])

    def unpatchify(self, rows: torch.Tensor, grid: Grid) -> torch.Tensor:
        """patchify's inverse (MiniMaxH3AfterDenoiseStep's): (B, N, C*pt*ph*pw) -> (B, C, T, H, W)."""
        (t, h, w), (pt, ph, pw) = grid, self.latent_patch()
        B = rows.shape[0]
        x = rows.reshape(B, t, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, -1, t * pt, h * ph, w * pw)

    # -- the three steps -----------------------------------------------------------------------------
    def refine(self, text: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """context_embedder + token_refiner (unmasked attention) on each prompt's real rows only, as the pipeline runs
        them on its unpadded prompt: prompts grouped by length; padded rows stay as embedded (masked keys later)."""
        tr = self.transformer
        embedded = tr.context_embedder(text.to(tr.context_embedder.weight.dtype))
        if min(lengths) == text.shape[1]:
            return tr.token_refiner(embedded)
        out = embedded.clone()
        for n in sorted(set(lengths)):
            rows = torch.tensor([b for b, m in enumerate(lengths) if m == n], device=text.device)
            out[rows, :n] = tr.token_refiner(embedded[rows, :n])
        return out

    def row_timesteps(self, timestep: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """sigma (B,) or (B, N) -> (the distinct t = 1 - sigma (U,), the video rows' index into them (B, N), the text
        rows' (B,)). Text rows take their sample's generated video t (build_row_timesteps: text inherits the video
        timestep; per token: the noisiest row's). Per sample, the B values serve as they are (no host sync); per
        token, torch.unique(sorted, return_inverse) reduces them, as build_row_timesteps does."""
        t = 1 - self.token_timestep(timestep, N)
        if t.dim() == 1:
            rows = torch.arange(t.shape[0], device=t.device)
            return t, rows[:, None].expand(-1, N), rows
        values, inverse = torch.unique(torch.cat([t, t.amin(1, keepdim=True)], 1), sorted=True, return_inverse=True)
        return values, inverse[:, :N], inverse[:, N]

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid, (B, L) = self.transformer, self.grid_of(x), cond["text"].shape[:2]
        N = grid[0] * grid[1] * grid[2]
        lengths = self.text_lengths(cond.get("text_mask"), B, L)
        cos, sin = tr.rope(self.video_positions(lengths, grid, x.device).reshape(-1, 3))
        text_ids = torch.zeros(L, 3, dtype=torch.float64, device=x.device)
        text_ids[:, 0] = torch.arange(L, device=x.device)             # text rows sit at their row index on t
        text_cos, text_sin = tr.rope(text_ids)
        values, video_rows, text_rows = self.row_timesteps(timestep, N)
        time_embedder = tr.time_embedder
        temb = time_embedder(tr.time_proj(values).to(time_embedder.linear_1.weight.dtype))
        hidden = tr.proj_in(self.patchify(x).to(tr.proj_in.weight.dtype))
        text = self.refine(cond["text"], lengths)
        per_token = {"rope_cos": cos.view(B, N, -1), "rope_sin": sin.view(B, N, -1),
                     "adaln": video_rows * MODALITIES + VIDEO_TAG}
        key_mask = None if min(lengths) == L else torch.arange(L, device=x.device)[None] < torch.tensor(
            lengths, device=x.device)[:, None]
        extra = {"temb": temb, "out_rows": video_rows, "text_adaln": (text_rows * MODALITIES + TEXT_TAG)[:, None]
                 .expand(-1, L), "text_rope": (text_cos.expand(B, -1, -1), text_sin.expand(B, -1, -1)),
                 "key_mask": key_mask}
        return Embedded(hidden.to(text.dtype), text, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        e = emb.extra

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, text: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                B, L, K = x.shape[0], text.shape[1], x.shape[1]
                rows = torch.cat([text, x], 1)                                   # the pipeline's order [text | video]
                adaln = torch.cat([e["text_adaln"], tok["adaln"]], 1).reshape(-1)
                cos = torch.cat([e["text_rope"][0], tok["rope_cos"]], 1).flatten(0, 1)
                sin = torch.cat([e["text_rope"][1], tok["rope_sin"]], 1).flatten(0, 1)
                mask = e["key_mask"]
                mask = None if mask is None else torch.cat([mask, mask.new_ones(B, K)], 1)
                out = block(rows.reshape(1, -1, rows.shape[-1]), cond32(e["temb"]), adaln, (cos, sin),
                            Folded(B, mask)).view(B, L + K, -1)
                return out[:, L:], out[:, :L]
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        """norm_out (per-row timestep rows) and proj_out on the video rows; negated: the transformer's data-ward
        velocity x0 - noise becomes the usual noise - x0."""
        tr, (B, N, D) = self.transformer, x.shape
        h = tr.norm_out(x.reshape(1, B * N, D), cond32(emb.extra["temb"]), emb.extra["out_rows"].reshape(-1))
        out = tr.proj_out(h.to(tr.proj_out.weight.dtype)).view(B, N, -1)
        return -self.unpatchify(out, emb.grid)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """transformer(...) as MiniMaxH3LoopDenoiser calls it, one prompt per call (the pipeline packs one request
        into one sequence): the layout step's rows for the prompt's real text, no audio rows, the row timesteps
        reduced by torch.unique; the video output unpatchified and negated."""
        grid, (B, L) = self.grid_of(x), cond["text"].shape[:2]
        N = grid[0] * grid[1] * grid[2]
        lengths = self.text_lengths(cond.get("text_mask"), B, L)
        t = 1 - self.token_timestep(timestep, N)
        outs = []
        for b, n in enumerate(lengths):
            position_ids, tags, video, audio, text, _, _ = self.layout(n, grid)
            row_t = torch.empty(n + N, dtype=t.dtype)
            row_t[video] = t[b].cpu()
            row_t[text] = row_t[video].min()
            values, indices = torch.unique(row_t, sorted=True, return_inverse=True)
            dev = x.device
            outs.append(transformer(
                hidden_states=self.patchify(x[b:b + 1]), audio_hidden_states=x.new_zeros(
                    1, 0, transformer.config.audio_in_channels), encoder_hidden_states=cond["text"][b:b + 1, :n],
                timestep=values.to(dev), timestep_indices=indices.to(dev), token_tags=tags.to(dev),
                position_ids=position_ids.to(dev), video_indices=video.to(dev), audio_indices=audio.to(dev),
                text_indices=text.to(dev), return_dict=False)[0])
        return -self.unpatchify(torch.cat(outs), grid)


FAMILY = MiniMaxH3Family
PRESETS = MINIMAX_H3_PRESETS
