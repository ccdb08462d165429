"""Tiny randomly initialised text encoders and word-level tokenizers per family, saved as a diffusers-style
pipeline folder: offline stand-ins for tests, the built-in text data and the CPU worked example.

They are tiny configs of the classes the pipelines load, with the real special tokens, so template prefixes
have the lengths the pipelines drop (Qwen-Image's 34 tokens, HunyuanVideo's 108).
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Sequence

import torch

from tread.encoders.text_families import CLIP_DEFAULT_LENGTH, EncoderSlot, PathLike, family_spec

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


# Chat templates (ours, minimal): the markers the real ones put around a system and a user message.
MISTRAL_CHAT = ("{{ bos_token }}{% for m in messages %}{% set c = m['content'] if m['content'] is string else "
                "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
                "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ c }}[/SYSTEM_PROMPT]"
                "{% elif m['role'] == 'user' %}[INST]{{ c }}[/INST]{% else %}{{ c }}{{ eos_token }}{% endif %}"
                "{% endfor %}")
QWEN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# style: (special tokens in id order, bos, eos, pad, unk, chat template)
CHAT_STYLES = {
    "mistral": (("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                 "[IMG_BREAK]", "[IMG_END]", "<pad>"), "<s>", "</s>", "<pad>", "<unk>", MISTRAL_CHAT),
    "qwen": (("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
              "<|video_pad|>", "<unk>"), None, "<|im_end|>", "<|endoftext|>", "<unk>", QWEN_CHAT),
    "gemma": (("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>",
              "<unk>", None),
    # Llama-3.1-Instruct: bos <|begin_of_text|> prepended, eos <|eot_id|>, no pad token (HiDreamImagePipeline sets
    # it to eos); "<unk>" only because a word-level vocabulary needs one (Llama-3's byte-level BPE has none).
    "llama3": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<unk>"), "<|begin_of_text|>", "<|eot_id|>", None, "<unk>", None),
}
LM_LENGTH = 4096   # tokenizer model_max_length and model positions of the language-model encoders


def _tiny_chat_tokenizer(style: str, words: Sequence[str]):
    """A word-level tokenizer with `style`'s special tokens (bos prepended where the real one adds it);
    punctuation runs and line breaks are tokens of their own."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special, bos, eos, pad, unk, chat = CHAT_STYLES[style]
    vocab = {t: i for i, t in enumerate(special)}
    for w in list(words) + [",", ".", ":", "\n"]:
        vocab.setdefault(w.lower(), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    named = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=LM_LENGTH,
                                        extra_special_tokens=[t for t in special if t not in named.values()],
                                        **{k: v for k, v in named.items() if v})
    if chat:
        tokenizer.chat_template = chat
    return tokenizer, vocab


def _lm_sizes(vocab: dict) -> dict:
    """The common tiny decoder sizes: width 32, 4 heads of 8 (2 key/value heads), 2 layers."""
    return dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=LM_LENGTH)


def _tiny_mistral3(words: Sequence[str]):
    """flux2: Mistral3ForConditionalGeneration (30 text layers: the pipeline stacks hidden states 10, 20, 30;
    a 1-layer Pixtral vision tower) + a PixtralProcessor (the pipeline's tokenizer is an AutoProcessor)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    tokenizer, vocab = _tiny_chat_tokenizer("mistral", words)
    text = dict(_lm_sizes(vocab), model_type="mistral", num_hidden_layers=30, bos_token_id=vocab["<s>"],
                eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, patch_size=8, image_size=64)
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                            image_token_index=vocab["[IMG]"], spatial_merge_size=2))
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8),
                                 tokenizer=tokenizer, patch_size=8, spatial_merge_size=2, chat_template=MISTRAL_CHAT)
    return model, processor


def _tiny_qwen2_5_vl(words: Sequence[str]):
    """qwen_image: Qwen2_5_VLForConditionalGeneration (multimodal RoPE sections of the 8-wide heads: 2 + 1 + 1;
    a 1-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer, vocab = _tiny_chat_tokenizer("qwen", words)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]}
    text = dict(_lm_sizes(vocab), rope_parameters=rope, bos_token_id=None, eos_token_id=vocab["<|im_end|>"],
                pad_token_id=vocab["<|endoftext|>"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0], patch_size=14)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config), tokenizer


HUNYUAN_PREFIX = 108   # HunyuanVideo15Pipeline's prompt_template_encode_start_idx: the tokens it drops


def _hunyuan_chat(tokenizer) -> str:
    """QWEN_CHAT with '.' tokens after the system message, so that HunyuanVideo15Pipeline's template prefix (up to the
    user's text) is the 108 tokens it drops, as with the real Qwen tokenizer."""
    from diffusers.pipelines.hunyuan_video1_5 import pipeline_hunyuan_video1_5 as hv  # deferred: a heavy import

    system = inspect.signature(hv.HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    tokenizer.chat_template = QWEN_CHAT
    text = tokenizer.apply_chat_template(hv.format_text_input(["x"], system), tokenize=False)[0]
    prefix = text[:text.index("<|im_start|>user\n") + len("<|im_start|>user\n")]
    filler = HUNYUAN_PREFIX - len(tokenizer(prefix)["input_ids"])
    if filler < 0:
        raise ValueError(f"the tiny tokenizer's HunyuanVideo template prefix is {HUNYUAN_PREFIX - filler} tokens, "
                         f"more than the {HUNYUAN_PREFIX} the pipeline drops")
    return QWEN_CHAT.replace("{{ m['content'] }}", "{{ m['content'] }}{% if m['role'] == 'system' %}"
                             + " ." * filler + "{% endif %}")


def _tiny_qwen2_5_vl_text(words: Sequence[str]):
    """hunyuan_video: Qwen2_5_VLTextModel (3 layers: the pipeline takes hidden_states[-3]) and the chat template
    _hunyuan_chat."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    tokenizer, vocab = _tiny_chat_tokenizer("qwen", words)
    tokenizer.chat_template = _hunyuan_chat(tokenizer)
    config = Qwen2_5_VLTextConfig(**dict(_lm_sizes(vocab), num_hidden_layers=3),
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
                                  bos_token_id=None, eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    return Qwen2_5_VLTextModel(config), tokenizer


def _tiny_byt5():
    """hunyuan_video's text_encoder_2: a 32-wide T5EncoderModel over ByT5's 384 ids, and ByT5Tokenizer (bytes: no
    vocabulary file, built offline)."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = T5Config(d_model=32, d_ff=37, num_layers=2, num_heads=4, d_kv=8, vocab_size=len(tokenizer),
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config), tokenizer


def _tiny_gemma2(words: Sequence[str]):
    """sana, lumina2: Gemma2Model."""
    from transformers import Gemma2Config, Gemma2Model

    tokenizer, vocab = _tiny_chat_tokenizer("gemma", words)
    config = Gemma2Config(**_lm_sizes(vocab), pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"],
                          bos_token_id=vocab["<bos>"])
    return Gemma2Model(config), tokenizer


def _tiny_qwen3(words: Sequence[str]):
    """z_image: Qwen3Model."""
    from transformers import Qwen3Config, Qwen3Model

    tokenizer, vocab = _tiny_chat_tokenizer("qwen", words)
    config = Qwen3Config(**_lm_sizes(vocab), bos_token_id=None, eos_token_id=vocab["<|im_end|>"],
                         pad_token_id=vocab["<|endoftext|>"])
    return Qwen3Model(config), tokenizer


def _tiny_llama(words: Sequence[str]):
    """hidream: LlamaForCausalLM, 24 wide (the tiny preset's caption_channels[1]; 4 heads of 6) with 6 layers (its
    llama_layers reach layer 5; the pipeline keeps hidden_states[1:], one per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, vocab = _tiny_chat_tokenizer("llama3", words)
    config = LlamaConfig(**dict(_lm_sizes(vocab), hidden_size=24, intermediate_size=48, num_hidden_layers=6,
                                head_dim=6), bos_token_id=vocab["<|begin_of_text|>"], eos_token_id=vocab["<|eot_id|>"])
    return LlamaForCausalLM(config), tokenizer


# QWEN_CHAT for content given as a list of {"type": "text", ...} parts (QwenImage21Pipeline's system message).
QWEN_VL_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_qwen3_vl(words: Sequence[str]):
    """qwen_image21: Qwen3VLForConditionalGeneration (interleaved multimodal RoPE sections 2 + 1 + 1 of the 8-wide
    heads; a 1-block vision tower) + a Qwen3VLProcessor (the pipeline's `processor`) with QWEN_VL_CHAT."""
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                              Qwen3VLVideoProcessor)

    tokenizer, vocab = _tiny_chat_tokenizer("qwen", words)
    tokenizer.chat_template = QWEN_VL_CHAT
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = dict(_lm_sizes(vocab), rope_parameters=rope, pad_token_id=vocab["<|endoftext|>"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                           video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                           vision_end_token_id=vocab["<|vision_end|>"])
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
                                 tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2),
                                 chat_template=QWEN_VL_CHAT)
    return Qwen3VLForConditionalGeneration(config), processor


# Two multi-word tokens stand in for the real Qwen BPE's merges, so that Kandinsky5T2VPipeline's template prefix is
# the 128 tokens it drops (131 words and marks otherwise).
KANDINSKY5_MERGES = ("video game", "user generated content")


def _tiny_qwen2_5_vl_kandinsky5(words: Sequence[str]):
    """kandinsky5: _tiny_qwen2_5_vl with KANDINSKY5_MERGES in its tokenizer (and embedding rows for them)."""
    model, tokenizer = _tiny_qwen2_5_vl(words)
    tokenizer.add_tokens(list(KANDINSKY5_MERGES))
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model, tokenizer


def _tiny_gemma3(words: Sequence[str]):
    """ltx2: Gemma3ForConditionalGeneration (2 text layers: LTX2Pipeline stacks embeddings + 2 = 3 hidden states;
    a 1-layer SigLIP vision tower, image tokens past the word vocabulary: encode_prompt sends none)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer, vocab = _tiny_chat_tokenizer("gemma", words)
    text = dict(_lm_sizes(vocab), pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"],
                bos_token_id=vocab["<bos>"])
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    n = len(vocab)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=n,
                          boi_token_index=n + 1, eoi_token_index=n + 2)
    return Gemma3ForConditionalGeneration(config), tokenizer


QWEN3_VL_4B_LAYERS = 36   # Qwen3-VL-4B-Instruct's text layers: Krea2Pipeline's taps 2, 5, ..., 35 are inner ones


def _tiny_qwen3_vl_model(words: Sequence[str]):
    """krea2: Qwen3VLModel (Krea2Pipeline's text_encoder class; interleaved multimodal RoPE sections 2 + 1 + 1, a
    1-block vision tower) with Qwen3-VL-4B's 36 text layers, so that the pipeline's own text_encoder_select_layers
    exist and stay inner layers; its tokenizer is a plain AutoTokenizer (the pipeline writes the template itself)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tokenizer, vocab = _tiny_chat_tokenizer("qwen", words)
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = dict(_lm_sizes(vocab), num_hidden_layers=QWEN3_VL_4B_LAYERS, rope_parameters=rope,
                pad_token_id=vocab["<|endoftext|>"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                           video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                           vision_end_token_id=vocab["<|vision_end|>"])
    return Qwen3VLModel(config), tokenizer


def _tiny_mistral3_model(words: Sequence[str]):
    """ernie_image: Mistral3Model (ERNIE-Image's text_encoder, Ministral-3 3B: the base model, no LM head; 3 text
    layers: the pipeline takes hidden_states[-2]; a 1-layer Pixtral vision tower) + a plain tokenizer (the pipeline's
    AutoTokenizer, bos prepended, no template)."""
    from transformers import Mistral3Config, Mistral3Model

    tokenizer, vocab = _tiny_chat_tokenizer("mistral", words)
    text = dict(_lm_sizes(vocab), model_type="mistral", num_hidden_layers=3, bos_token_id=vocab["<s>"],
                eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, patch_size=8, image_size=64)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab["[IMG]"],
                            spatial_merge_size=2)
    return Mistral3Model(config), tokenizer


def _tiny_qwen3_vl_flux3(words: Sequence[str]):
    """flux3: _tiny_qwen3_vl with 32 text layers: Flux3TextEncoderStep stacks hidden states 4, 8, ..., 32 (8 x 32 =
    256 wide, the tiny preset's joint_attention_dim)."""
    from transformers import Qwen3VLForConditionalGeneration

    model, processor = _tiny_qwen3_vl(words)
    model.config.text_config.num_hidden_layers = 32
    return Qwen3VLForConditionalGeneration(model.config), processor


def _tiny_qwen3_vl_h3(words: Sequence[str]):
    """minimax_h3: _tiny_qwen3_vl with 51 text layers: MiniMaxH3TextEncoderStep reads hidden_states[50] and refuses a
    stack of 50 or fewer layers (the 50th state of a 50-layer stack is post-norm)."""
    from transformers import Qwen3VLForConditionalGeneration

    model, processor = _tiny_qwen3_vl(words)
    model.config.text_config.num_hidden_layers = 51
    return Qwen3VLForConditionalGeneration(model.config), processor



def _tiny_umt5_vace(words):
    """wan_vace: Wan's tiny UMT5 (WanVACEPipeline loads the same UMT5EncoderModel)."""
    return _tiny_encoder("wan", EncoderSlot("text_encoder", "tokenizer", "t5", "UMT5"), words, None)

LM_BUILDERS = {"mistral3": _tiny_mistral3, "qwen2_5_vl": _tiny_qwen2_5_vl, "gemma2": _tiny_gemma2,
               "qwen3": _tiny_qwen3, "llama": _tiny_llama, "qwen2_5_vl_text": _tiny_qwen2_5_vl_text,
               "qwen3_vl": _tiny_qwen3_vl,
               "qwen2_5_vl_kandinsky5": _tiny_qwen2_5_vl_kandinsky5,
               "gemma3": _tiny_gemma3,
               "qwen3_vl_model": _tiny_qwen3_vl_model,
               "mistral3_model": _tiny_mistral3_model,
               "qwen3_vl_flux3": _tiny_qwen3_vl_flux3,
               "qwen3_vl_h3": _tiny_qwen3_vl_h3,
               "umt5_vace": _tiny_umt5_vace,
               # -- new encoder kinds above this line --
               }
# CLIP positions (and tokenizer model_max_length) per family: HiDreamImagePipeline feeds its CLIPs
# min(max_sequence_length, 218) tokens (128 by default), more than the usual 77.
CLIP_POSITIONS = {"hidream": 218}


def _tiny_encoder(family: str, slot: EncoderSlot, words: Sequence[str], clip_widths):
    """(model, tokenizer or processor) for one encoder of `family`."""
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel,
                              UMT5Config, UMT5EncoderModel)

    if slot.kind in LM_BUILDERS:
        return LM_BUILDERS[slot.kind](words)
    if family == "hunyuan_video" and slot.model == "text_encoder_2":
        return _tiny_byt5()
    if slot.kind in ("clip", "clip_proj"):
        positions = CLIP_POSITIONS.get(family, CLIP_DEFAULT_LENGTH)
        tokenizer, vocab = _tiny_tokenizer("clip", words, positions)
        width = next(clip_widths)
        config = CLIPTextConfig(hidden_size=width, intermediate_size=37, num_hidden_layers=2,
                                num_attention_heads=4, vocab_size=len(vocab), projection_dim=width,
                                max_position_embeddings=positions, bos_token_id=0, eos_token_id=1,
                                pad_token_id=1)
        return (CLIPTextModel if slot.kind == "clip" else CLIPTextModelWithProjection)(config), tokenizer
    tokenizer, vocab = _tiny_tokenizer("t5", words, 512)
    kwargs = dict(d_model=32, d_ff=37, num_layers=2, num_heads=4, d_kv=8, vocab_size=len(vocab),
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    umt5 = family in ("wan", "auraflow")
    return (UMT5EncoderModel(UMT5Config(**kwargs)) if umt5 else T5EncoderModel(T5Config(**kwargs))), tokenizer


def save_tiny_text_encoders(family: str, out_dir: PathLike, *, seed: int = 0,
                            words: Sequence[str] = TINY_WORDS) -> Path:
    """Write tiny random text encoders + word-level tokenizers for `family` as a diffusers-style pipeline folder at
    `out_dir` (widths fit the family's tiny preset); returns it. For tests and offline trials only: the
    embeddings mean nothing. Leaves the global RNG alone."""
    spec = family_spec(family)
    out = Path(out_dir).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    clip_widths = iter((16, 16) if family in ("sd3", "hidream") else (32,))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for slot in spec.slots:
            model, tokenizer = _tiny_encoder(family, slot, words, clip_widths)
            model.eval().save_pretrained(out / slot.model)
            tokenizer.save_pretrained(out / slot.tokenizer)
    index = {"_class_name": spec.pipeline,
             "_note": "tiny random text encoders (tread.encoders.tiny_text.save_tiny_text_encoders)"}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
