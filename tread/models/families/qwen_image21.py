"""Qwen-Image 2.1 (diffusers QwenImage21Transformer2DModel) with TREAD routing: text-to-image.

One single-stream sequence [text, target image] under diffusers' block-causal mask `(q >= kv) or same image block`:
text is causal and never sees the image, the target image is one bidirectional block that sees all (valid) text.
Routing drops target tokens only: the kept tokens are the target block of a shorter sequence whose segments and
modulation rows diffusers' own functions build for that sequence, each kept token with its own RoPE row. The text
stream is never routed. Each prompt is positioned as the pipeline encodes it alone (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import (Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, pack_cells,
                                        unpack_cells)
from tread.models.families.qwen_image import _rotate

# Each Qwen3-VL image slot stands for 2x2 target tokens (transformer_qwenimage21._IMG_TOKENS_PER_SLOT): the
# pipeline's latent sides are even, and the forward needs the token count to be a multiple of 4.
SLOT_SIDE = 2
# QwenImage21Rope's tables: 8192 non-negative and 1024 negative positions (rows / columns are centred on zero).
ROPE_POSITIVE, ROPE_NEGATIVE = 8192, 1024

QWEN_IMAGE21_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), a Qwen3-VL stand-in of width 32; 2x2 latent
    # cells per token (the config's patch_size), so 16x16 toy latents make the 8x8 token grid of every tiny preset.
    "tiny": dict(patch_size=2, num_layers=8, attention_head_dim=16, num_attention_heads=4, context_in_dim=32,
                 axes_dims_rope=(4, 6, 6)),
    # A mid-size model for GPU benchmarks (~0.34B parameters): width 1024 (8 heads x 128), 24 blocks, Qwen3-VL-8B's
    # width 4096, 2x2 cells per token on the benchmark latents.
    "mid": dict(patch_size=2, num_layers=24, attention_head_dim=128, num_attention_heads=8, context_in_dim=4096,
                axes_dims_rope=(16, 56, 56)),
    # Qwen/Qwen-Image-2.1 (7B): QwenImage21Transformer2DModel's defaults, which its docstring, the pipeline (64-channel
    # AutoencoderKLQwenImage21 latents at 1/16, consumed unpatched) and Qwen3-VL-8B's width 4096 agree with.
    "qwen-image-2.1": dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                           num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                           eps=1e-6, causal_condition=True),
}


def _text_first_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: list,
                          key_valid: Optional[torch.Tensor], parallel_config: Any) -> torch.Tensor:
    """QwenImage21AttnProcessor's prefill (diffusers' maths and calls): each prefix segment attends to the keys
    [0, end) (text segments causally inside themselves), the target block to every key; padded text keys dropped."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn   # deferred: diffusers is optional

    prefix_len, outputs, dev = (segments[-1][1] if segments else 0), [], query.device
    for start, end, is_text in segments:
        mask = None
        if is_text:
            n = end - start
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=dev),
                              torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))], dim=1)[None, None]
        if key_valid is not None:
            mask = key_valid[:, None, None, :end] if mask is None else mask & key_valid[:, None, None, :end]
        outputs.append(dispatch_attention_fn(query[:, start:end], key[:, :end], value[:, :end], attn_mask=mask,
                                             dropout_p=0.0, backend=None, parallel_config=parallel_config))
    outputs.append(dispatch_attention_fn(query[:, prefix_len:], key, value,
                                         attn_mask=None if key_valid is None else key_valid[:, None, None, :],
                                         dropout_p=0.0, backend=None, parallel_config=parallel_config))
    return torch.cat(outputs, dim=1)


class BatchedRopeQwenImage21AttnProcessor:
    """QwenImage21AttnProcessor (the default, SDPA prefill) whose RoPE rows may be per sample: rotary_emb (S, Dh/2)
    shared or (B, S, Dh/2), complex. Training only: no KV cache (the cache is an inference shortcut)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                 rotary_emb: Optional[torch.Tensor] = None, layer_cache: Any = None, kv_cache_mode: Any = None,
                 cache_write_slice: Any = None, segments: Optional[list] = None,
                 key_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer_cache is not None or kv_cache_mode is not None or segments is None:
            raise ValueError("BatchedRopeQwenImage21AttnProcessor runs the block-causal prefill from `segments`, "
                             "without a KV cache (use diffusers' processors for cached sampling).")
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q).to(v.dtype), attn.norm_k(k).to(v.dtype)
        if rotary_emb is not None:
            q, k = _rotate(q, rotary_emb), _rotate(k, rotary_emb)
        out = _text_first_attention(q, k, v, segments, key_valid, self._parallel_config)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class QwenImage21Family(RoutedFamily):
    family = "qwen_image21"
    hub_hint = "Qwen/Qwen-Image-2.1"
    diffusers_class = "QwenImage21Transformer2DModel"
    text_dim_key = "context_in_dim"

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        return {"in_channels": in_channels, "out_channels": in_channels}   # no sample_size key

    @property
    def patch(self) -> int:
        return int(self.transformer.config.patch_size)

    @property
    def causal_condition(self) -> bool:
        return bool(self.transformer.config.causal_condition)

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_patch_io(c, "the pipeline feeds the latents' channels as they are", width_key=None)
        axes = list(c.axes_dims_rope)
        if len(axes) != 3 or sum(axes) != c.attention_head_dim or any(a % 2 for a in axes):
            raise FamilyConfigError(f"model.config.axes_dims_rope={axes} must be 3 even numbers summing to "
                                    f"attention_head_dim={c.attention_head_dim} (RoPE on frame, row, column).")
        side = self.input_size // self.patch
        self.check_grid((1, side, side))

    def check_grid(self, grid: Grid) -> None:
        """Even token rows and columns (a Qwen3-VL slot is 2x2 tokens); rows and columns centred on zero within
        QwenImage21Rope's negative table."""
        _, h, w = grid
        if h % SLOT_SIDE or w % SLOT_SIDE or max(h, w) > 2 * ROPE_NEGATIVE:
            raise FamilyConfigError(
                f"model.family=qwen_image21: a {h}x{w} token grid (latents / patch_size {self.patch}) is not allowed; "
                f"allowed: even rows and columns (each Qwen3-VL image slot stands for 2x2 tokens, as the pipeline's "
                f"latent sides are) of at most {2 * ROPE_NEGATIVE} (the RoPE table).")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def install_processors(self) -> None:
        for block in self.blocks_of(self.transformer):
            block.attn.set_processor(BatchedRopeQwenImage21AttnProcessor())

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # the pipeline feeds t / 1000; QwenImage21TemporalTimesteps scales back

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        if cond and cond.get("reference") is not None:
            raise FamilyConfigError(_NO_CONDITION_IMAGES)
        return super().conditioning(labels, cond)

    # -- the pipeline's inputs ----------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, C*p*p): with patch_size 1 the pipeline's _pack_latents (a row-major flatten)."""
        return pack_cells(x, self.patch)

    def prompt(self, cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(text (B, L, D), real tokens per sample (B,), key mask (B, L) or None). Each sample is what
        QwenImage21Pipeline.encode_prompt gives its prompt alone (no padding: the image's frame index is the prompt's
        length), held in a batch as [real tokens first, padding] with the padding masked as keys: text is causal,
        so no real token sees it. L is the batch's longest prompt (a host read: it is a shape)."""
        text, mask = cond["text"], cond.get("text_mask")
        B, L = text.shape[:2]
        if mask is None:
            return text, torch.full((B,), L, dtype=torch.long, device=text.device), None
        mask = mask.to(device=text.device, dtype=torch.bool)
        lengths = mask.sum(1)
        longest = int(lengths.max())
        if bool((lengths == 0).any()):
            raise FamilyConfigError("cond['text_mask'] has a sample with no text token; QwenImage21Pipeline always "
                                    "gives at least its chat template's tokens (an empty prompt is encoded as ' ').")
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :longest]   # real tokens first
        text = torch.gather(text, 1, order[..., None].expand(-1, -1, text.shape[2]))
        valid = torch.arange(longest, device=text.device)[None] < lengths[:, None]
        return text, lengths, None if bool(valid.all()) else valid

    def layout(self, text_len: int, image_len: int, device: torch.device) -> tuple[list, Optional[torch.Tensor]]:
        """diffusers' metadata of a [text, target] sequence: (the prefix segments QwenImage21AttnProcessor reads,
        the target-token mask that picks the modulation rows, None without causal_condition), built by diffusers'
        own functions on the host."""
        from diffusers.models.transformers import transformer_qwenimage21 as qi21   # deferred: diffusers is optional

        pad = torch.cat([torch.zeros(text_len, dtype=torch.bool), torch.ones(image_len, dtype=torch.bool)])
        image_ids, target = qi21.QwenImage21Transformer2DModel.build_token_metadata(pad, [(1, image_len, 1)])
        segments = qi21._qwenimage21_prefix_segments(image_ids, text_len)
        return segments, target.to(device) if self.causal_condition else None

    def rope_rows(self, lengths: torch.Tensor, text_len: int, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """QwenImage21Rope's rows, complex: text (L, Dh/2), text position i at (i, i, i); image (B, N, Dh/2) at frame
        lengths[b] (the sample's prompt length), rows and columns centred on zero. The index layout is diffusers'
        (QwenImage21Rope.forward), computed without host reads; the rows are looked up in its tables."""
        _, h, w = grid
        if text_len + max(h, w) > ROPE_POSITIVE:
            raise FamilyConfigError(f"text of {text_len} tokens and a {h}x{w} grid exceed QwenImage21Rope's "
                                    f"{ROPE_POSITIVE} positions.")
        dev = lengths.device
        freqs = [f.to(dev) for f in self.transformer.pos_embed.freqs]
        t = torch.arange(text_len, device=dev)
        text = torch.cat([freqs[0][t], freqs[1][t], freqs[2][t]], dim=-1)
        rows = (torch.arange(h, device=dev) - (h - h // 2)).repeat_interleave(w)
        cols = (torch.arange(w, device=dev) - (w - w // 2)).repeat(h)
        image = torch.cat([freqs[0][lengths][:, None].expand(-1, h * w, -1),
                           (torch.cat([freqs[1][rows], freqs[2][cols]], dim=-1))[None].expand(len(lengths), -1, -1)],
                          dim=-1)
        return text, image

    # -- the three steps ----------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        text, lengths, valid = self.prompt(cond)
        hidden = tr.img_in(self.pack(x))                                           # (B, N, D)
        t = timestep.to(hidden.dtype)
        if self.causal_condition:   # diffusers: one extra t = 0 row, read by the text tokens
            t = torch.cat([t, t.new_zeros(1)])
        temb = tr.time_text_embed(t, hidden)
        text_rope, image_rope = self.rope_rows(lengths.to(x.device), text.shape[1], grid)
        extra = {"temb": temb, "modulation": tr.modulation(temb), "text_rope": text_rope, "valid": valid}
        return Embedded(hidden, tr.txt_in(text), {"rope": torch.view_as_real(image_rope)}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        modulation, text_rope, valid = emb.extra["modulation"], emb.extra["text_rope"], emb.extra["valid"]
        layouts: dict[tuple[int, int], tuple] = {}

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                (B, K), L = x.shape[:2], context.shape[1]
                if (L, K) not in layouts:   # the kept sequence's segments and modulation rows, once per length
                    layouts[(L, K)] = self.layout(L, K, x.device)
                segments, target = layouts[(L, K)]
                rope = torch.cat([text_rope.unsqueeze(0).expand(B, -1, -1),
                                  torch.view_as_complex(tok["rope"].float().contiguous())], dim=1)
                key_valid = None if valid is None else torch.cat([valid, valid.new_ones(B, K)], dim=1)
                out = block(hidden_states=torch.cat([context, x], dim=1), modulation=cond32(modulation),
                            rotary_emb=rope, target_token_mask=target, segments=segments, key_valid=key_valid)
                return out[:, L:], out[:, :L]
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr, (_, h, w) = self.transformer, emb.grid
        target = torch.ones(x.shape[1], dtype=torch.bool, device=x.device) if self.causal_condition else None
        out = tr.proj_out(tr.norm_out(x, cond32(emb.extra["temb"]), target))
        return unpack_cells(out, h, w, self.patch)                                 # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on QwenImage21Pipeline's inputs, one prompt at a time (as `pipe(prompt)`): the packed
        latents, the prompt's real tokens (no mask), img_shapes [(1, h, w)], img_mask = the text's image_pad_mask
        (all False: no condition image) + one slot per 2x2 target tokens; the output's target part."""
        (_, h, w), hidden = self.grid_of(x), self.pack(x)
        text, lengths, _ = self.prompt(cond)
        N, outs = hidden.shape[1], []
        for b, n in enumerate(lengths.tolist()):
            img_mask = torch.cat([torch.zeros(1, n, dtype=torch.bool), torch.ones(1, N // 4, dtype=torch.bool)], 1)
            out = transformer(hidden_states=hidden[b:b + 1], encoder_hidden_states=text[b:b + 1, :n],
                              timestep=timestep[b:b + 1], img_shapes=[[(1, h, w)]], img_mask=img_mask.to(x.device),
                              return_dict=False)[0]
            outs.append(out[:, -N:])
        return unpack_cells(torch.cat(outs), h, w, self.patch)


_NO_CONDITION_IMAGES = (
    "Qwen-Image 2.1 condition images (editing, reference_latents.npy) are not supported: the pipeline substitutes "
    "their latents into the text stream at the Qwen3-VL encoder's image slots, so the prompt embeddings depend on "
    "the image pixels, which the stored text embeddings do not carry (target-only routing itself stays well defined "
    "there: tests/test_family_qwen_image21.py); use data without reference_latents.npy.")

FAMILY = QwenImage21Family
PRESETS = QWEN_IMAGE21_PRESETS
