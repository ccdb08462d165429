"""The layout of a latent dataset's optional arrays (tread/data/meta.py): what the writer's arguments declare
(text embeddings, masks, Llama states, loss masks, stored REPA features), checked, as the meta keys they add and the
shape and storage dtype of each array (tread/data/writer.py writes them)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from .meta import GLYPH_KEYS, IMAGE_EMBEDS_KEYS, LLAMA_KEYS, LatentDatasetError

# What each extras array holds, for error messages.
EXTRA_WHAT = {"text": "(n, L, D) float array of text embeddings", "text_mask": "(n, L) bool attention mask",
              "pooled": "(n, P) float array of pooled embeddings",
              "llama": "(n, layers, L, Dl) float array of Llama hidden states",
              "glyph": "(n, Lg, Dg) float array of glyph (ByT5) embeddings",
              "glyph_mask": "(n, Lg) bool glyph mask (all False for a caption without quoted text)",
              "loss_mask": "(n, Hm, Wm) loss mask (uint8 0..255, or float in [0, 1])",
              "reference": "(n, C, H, W) float array of reference latents (stored values, like the latents)",
              "first_frame": "(n, C, 1, H, W) float array of first-frame latents (stored values, like the latents)",
              "repa_features": "(n, dim, h, w) float array of the REPA encoder's patch features",
              "image_embeds": "(n, S, Di) float array of first-frame image embeddings"}
EXTRA_NDIM = {"text": 3, "text_mask": 2, "pooled": 2, "llama": 4, "glyph": 3, "glyph_mask": 2, "loss_mask": 3, "reference": 4, "first_frame": 5,
              "repa_features": 4, "image_embeds": 3}
DECLARE = ("text_shape=(L, D), text_mask=True, pooled_dim=P, llama_shape=(layers, L, Dl), glyph_shape=(Lg, Dg), "
           "loss_mask_shape=(Hm, Wm), image_embeds_shape=(S, Di), "
           "reference_latents=True, first_frame_latents=True, repa_features={encoder, digest, dim, grid}")
# conditioning keys the writer sets itself, and the writer argument each part comes from
_RESERVED = {"text": ("seq_len", "dim", "mask"), "pooled": ("dim",), "llama": LLAMA_KEYS, "glyph": GLYPH_KEYS,
             "image_embeds": IMAGE_EMBEDS_KEYS,
             "captions": ("rows", "empty_prompt")}
_ARG_OF = {"text": "text_shape", "pooled": "pooled_dim", "llama": "llama_shape", "glyph": "glyph_shape",
           "image_embeds": "image_embeds_shape",
           "captions": "caption_counts/empty_prompt"}


def _dims(value: Any, n: int, name: str, what: str, root: Path) -> Optional[tuple[int, ...]]:
    """None, or `value` as a tuple of n positive Python ints (n=0: a single int, as a 1-tuple); numpy ints are
    converted (they are not JSON-serialisable)."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (tuple, list, np.ndarray)) else [value] if n == 0 else None
    if items is None or len(items) != max(n, 1) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v > 0 for v in items):
        raise LatentDatasetError(f"{name} for '{root}' is {value!r} but must be {what}, or None")
    return tuple(int(v) for v in items)


def conditioning_layout(root: Path, dtype: str, text_shape, text_mask: bool, pooled_dim, loss_mask_shape,
                         conditioning_meta: Optional[Mapping[str, Any]], llama_shape=None,
                         captions: Optional[dict] = None, glyph_shape=None, image_embeds_shape=None
                         ) -> tuple[dict, dict]:
    """(meta keys to add, {extras key: (per-sample or per-caption shape, storage dtype)}) for the writer's optional
    arrays; `captions` is the caption table's meta ({"rows", "empty_prompt"}) or None."""
    text = _dims(text_shape, 2, "text_shape", "(L, D): two positive integers (sequence length, embedding size)",
                 root)
    pooled = _dims(pooled_dim, 0, "pooled_dim", "a positive integer (P, the pooled embedding size)", root)
    llama = _dims(llama_shape, 3, "llama_shape", "(layers, L, Dl): three positive integers (Llama layers, sequence "
                                                 "length, hidden size)", root)
    glyph = _dims(glyph_shape, 2, "glyph_shape", "(Lg, Dg): two positive integers (glyph sequence length, "
                                                 "embedding size)", root)
    image = _dims(image_embeds_shape, 2, "image_embeds_shape", "(S, Di): two positive integers (image tokens, "
                                                              "embedding size)", root)
    lm = _dims(loss_mask_shape, 2, "loss_mask_shape", "(Hm, Wm): two positive integers (the mask resolution)",
               root)
    if not isinstance(text_mask, (bool, np.bool_)):
        raise LatentDatasetError(f"text_mask for '{root}' is {text_mask!r} but must be True or False")
    if text_mask and text is None:
        raise LatentDatasetError(f"text_mask=True for '{root}' needs text_shape=(L, D): the attention mask belongs "
                                 f"to the sequence text embeddings")
    if llama is not None and text is None:
        raise LatentDatasetError(f"llama_shape={llama} for '{root}' needs text_shape=(L, D): the Llama hidden states "
                                 f"go with the T5 text embeddings (HiDream)")
    if glyph is not None and text is None:
        raise LatentDatasetError(f"glyph_shape={glyph} for '{root}' needs text_shape=(L, D): the glyph embeddings go "
                                 f"with the text embeddings (HunyuanVideo 1.5)")
    if captions is not None and text is None:
        raise LatentDatasetError(f"caption_counts/empty_prompt for '{root}' need text_shape=(L, D): a caption table "
                                 f"holds text embeddings")
    ours = {"text": None if text is None else {"seq_len": text[0], "dim": text[1], "mask": bool(text_mask)},
            "pooled": None if pooled is None else {"dim": pooled[0]},
            "llama": None if llama is None else dict(zip(LLAMA_KEYS, llama)),
            "glyph": None if glyph is None else dict(zip(GLYPH_KEYS, glyph)),
            "image_embeds": None if image is None else dict(zip(IMAGE_EMBEDS_KEYS, image)), "captions": captions}
    cond = _described(root, ours, dict(conditioning_meta or {}))
    meta: dict = {}
    if conditioning_meta is not None or any(v is not None for v in ours.values()):
        meta["conditioning"] = cond
    if lm is not None:
        meta["loss_mask"] = {"shape": list(lm)}
    specs: dict = {}
    if text is not None:
        specs["text"] = (text, dtype)
        if text_mask:
            specs["text_mask"] = (text[:1], "bool")
    for key, shape in (("pooled", pooled), ("llama", llama), ("glyph", glyph), ("image_embeds", image)):
        if shape is not None:
            specs[key] = (shape, dtype)
    if glyph is not None:
        specs["glyph_mask"] = (glyph[:1], "bool")
    if lm is not None:
        specs["loss_mask"] = (lm, "uint8")
    return meta, specs


def _described(root: Path, ours: dict, extra: dict) -> dict:
    """meta "conditioning": each stored part's shape keys (`ours`: part -> dict or None) with the descriptive
    keys conditioning_meta (`extra`) adds; describing an absent array, or contradicting a stored one, is an
    error."""
    cond: dict = {k: v for k, v in extra.items() if k not in ours}
    for part, described in ours.items():
        given = extra.get(part)
        if given is None:
            if described is not None:
                cond[part] = described
            continue
        arg = _ARG_OF[part]
        if described is None or not isinstance(given, Mapping):
            raise LatentDatasetError(f"conditioning_meta['{part}'] for '{root}' is {given!r}, but " +
                                     (f"no {arg} was given (describe only stored arrays)" if described is None
                                      else "it must be a dict of descriptive keys (e.g. 'family', 'encoders')"))
        clash = {k: (given[k], described[k]) for k in _RESERVED[part] if k in given and given[k] != described[k]}
        if clash:
            raise LatentDatasetError(f"conditioning_meta['{part}'] for '{root}' contradicts the arrays: {clash} "
                                     f"(given, from {arg}/text_mask)")
        cond[part] = {**described, **{k: v for k, v in given.items() if k not in _RESERVED[part]}}
    return cond
