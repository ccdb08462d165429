"""Caption dropout (train.caption_dropout, train.caption_dropout_mode): in the training step, each sample of text data
loses its caption with probability p and is trained on the unconditional input instead, as the family's diffusers
pipeline feeds it to classifier-free guidance. docs/data.md ("Caption dropout") has the table per family.

    empty   the encoded empty prompt "" (what StableDiffusion3Pipeline, PixArt, Wan, AuraFlow, Sana, HiDream, Lumina2,
            Z-Image and Chroma encode for a missing negative prompt; FLUX and Qwen-Image encode a negative prompt
            only when one is given, and "" is the one to give): its text, text_mask, pooled and llama parts, stored
            once by precompute --empty-prompt (the caption table's last row: tread/data/meta.py)
    zeros   zero text and pooled embeddings (tread/models/families/base.py null_text: what label dropout of text
            data trains and what this project's sampler gives an empty negative prompt)
    auto    the family's: zeros for FLUX.2 (guidance-distilled; its pipeline has no negative prompt, so no
            unconditional input to match), empty for every other family

The draw is torch.rand(B) < p on the training stream, after label dropout (tread/training/step.py lists the order),
and only when p > 0, so runs without caption dropout draw exactly as before. Label dropout stays as it is (labels to
the null class, which for text data also zeroes the text in the model): the two are drawn independently, and a
sample dropped by both ends with zeros.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from tread.data import build_dataset
from tread.models.families.base import null_text
from tread.sampling.prompts import PromptError, resolve_mode
from tread.schema.base import ConfigError

def caption_dropout_settings(cfg: Any, data_meta: Mapping[str, Any], dataset: Any = None
                             ) -> tuple[float, str, Optional[dict[str, torch.Tensor]]]:
    """(p, mode, empty prompt) of a training config: train.caption_dropout, its mode resolved ("empty" | "zeros"; as
    configured when p is 0) and, for "empty", the data's encoded empty prompt (one sample's text parts, on the CPU).
    The data (`data_meta`, the dataset's meta; `dataset`, or cfg.data opened again, for the empty prompt) must
    fit: one error."""
    t = cfg.train
    p, mode = float(t.get("caption_dropout", 0.0) or 0.0), t.get("caption_dropout_mode", "auto")
    if p <= 0:
        return 0.0, mode, None
    try:
        resolved = resolve_mode(mode, cfg.model.get("family"))
    except PromptError as err:
        raise ConfigError(str(err)) from None
    where = f"'{cfg.data.get('path')}'"
    cond = data_meta.get("conditioning") or {}
    if cond.get("text") is None:
        raise ConfigError(f"train.caption_dropout={p} needs text data (text_embeds.npy), but the data at {where} has "
                          f"none; allowed: train.caption_dropout=0 for class-conditional data.")
    if resolved == "zeros":
        return p, resolved, None
    if not (cond.get("captions") or {}).get("empty_prompt"):
        raise ConfigError(f"train.caption_dropout_mode={mode}{' (empty for this family)' if mode == 'auto' else ''} "
                          f"needs the encoded empty prompt in the data, but the data at {where} has none; allowed: "
                          f"precompute it with --empty-prompt, or train.caption_dropout_mode=zeros.")
    dataset = dataset if dataset is not None else build_dataset(cfg.data)   # its stored empty prompt
    return p, resolved, getattr(dataset, "parts", [dataset])[0].empty_prompt()


def drop_captions(cond: Mapping[str, torch.Tensor], p: float, mode: str,
                  empty: Optional[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`cond` (a batch's text parts {"text": (B, L, D), ...}) with each sample's caption dropped with probability
    `p` (one torch.rand(B) draw on cond["text"]'s device): for "empty" its text parts replaced by `empty`'s (one
    sample's {"text": (L, D), ...}, on the device), for "zeros" null_text's zero text and pooled embeddings."""
    text = cond["text"]
    drop = torch.rand(text.shape[0], device=text.device) < p
    if mode == "zeros":
        return null_text(cond, drop)
    out = dict(cond)
    for key, value in empty.items():
        if key in out:
            where = drop.view(-1, *([1] * (out[key].dim() - 1)))
            out[key] = torch.where(where, value.to(out[key].dtype).unsqueeze(0), out[key])
    return out
