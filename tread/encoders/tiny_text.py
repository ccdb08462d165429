"""Tiny randomly initialised text encoders and word-level tokenizers per family, saved as a diffusers-style
pipeline folder: offline stand-ins for tests, the built-in text data and the CPU worked example (their
embeddings mean nothing; scripts/tiny_text_encoders.py writes them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from tread.encoders.text import CLIP_DEFAULT_LENGTH, PathLike, family_spec

TINY_WORDS = ("a an the of photo picture image with on in and red green blue yellow magenta cyan orange white "
              "purple lime disc square triangle ring plus horizontal vertical stripes checkerboard diamond x cat "
              "dog eel bird tree house").split()


def _tiny_tokenizer(style: str, words: Sequence[str], max_length: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if style == "clip":  # eos id 1 (not 2: CLIP treats eos_token_id 2 as "argmax of the ids")
        special = {"<|startoftext|>": 0, "<|endoftext|>": 1, "<unk>": 2}
        bos, eos, pad = "<|startoftext|>", "<|endoftext|>", "<|endoftext|>"
        template = f"{bos} $A {eos}"
    else:  # T5 / UMT5: pad 0, eos 1, unk 2; no bos
        special = {"<pad>": 0, "</s>": 1, "<unk>": 2}
        bos, eos, pad = None, "</s>", "<pad>"
        template = f"$A {eos}"
    vocab = dict(special)
    for w in words:
        vocab.setdefault(w.lower(), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in (bos, eos) if t is not None])
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token="<unk>",
                                   model_max_length=max_length, **kwargs), vocab


def save_tiny_text_encoders(family: str, out_dir: PathLike, *, seed: int = 0,
                            words: Sequence[str] = TINY_WORDS) -> Path:
    """Write tiny randomly initialised text encoders + word-level tokenizers for `family` as a diffusers-style
    pipeline folder (text_encoder*/, tokenizer*/, model_index.json) at `out_dir`; returns it. For tests and
    offline trials only: the embeddings mean nothing. Widths fit each family's tiny preset (text 32, pooled 32):
    CLIP-L 32 (flux) or CLIP-L 16 + CLIP-G 16 (sd3), T5 32; 2 layers each. Leaves the global RNG alone."""
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel,
                              UMT5Config, UMT5EncoderModel)

    spec = family_spec(family)
    out = Path(out_dir).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    clip_widths = iter((16, 16) if family == "sd3" else (32,))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for slot in spec.slots:
            if slot.kind in ("clip", "clip_proj"):
                tokenizer, vocab = _tiny_tokenizer("clip", words, CLIP_DEFAULT_LENGTH)
                width = next(clip_widths)
                config = CLIPTextConfig(hidden_size=width, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=len(vocab), projection_dim=width,
                                        max_position_embeddings=CLIP_DEFAULT_LENGTH, bos_token_id=0, eos_token_id=1,
                                        pad_token_id=1)
                model = (CLIPTextModel if slot.kind == "clip" else CLIPTextModelWithProjection)(config)
            else:
                tokenizer, vocab = _tiny_tokenizer("t5", words, 512)
                width = 32
                kwargs = dict(d_model=width, d_ff=37, num_layers=2, num_heads=4, d_kv=8, vocab_size=len(vocab),
                              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
                umt5 = family in ("wan", "auraflow")
                model = (UMT5EncoderModel(UMT5Config(**kwargs)) if umt5 else T5EncoderModel(T5Config(**kwargs)))
            model.eval().save_pretrained(out / slot.model)
            tokenizer.save_pretrained(out / slot.tokenizer)
    index = {"_class_name": spec.pipeline,
             "_note": "tiny random text encoders (tread.encoders.tiny_text.save_tiny_text_encoders)"}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
