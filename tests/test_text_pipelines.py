"""Prompts -> text embeddings for the families whose encoding is delegated to their diffusers pipeline's own
encode_prompt (tread/encoders/text_pipelines.py): flux2, qwen_image, chroma, sana, z_image, lumina2, ltx_video,
hunyuan_video, hidream (four encoders: T5 text, CLIP pooled, Llama states; more in tests/test_hidream_prompts.py). Tiny
random encoders of the pipelines' real classes (tread.encoders.tiny_text) stand in for the real ones; nothing touches
the network."""
from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
import torch

from tread.encoders.text import TextEncoderError, encode_prompts, load_text_encoders, resolve_text_encoder_paths
from tread.encoders.text_families import FAMILIES, MODEL_TYPES, TEXT_FAMILIES
from tread.encoders.tiny_text import save_tiny_text_encoders

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = ("flux2", "qwen_image", "chroma", "sana", "z_image", "lumina2", "hidream", "ltx_video", "hunyuan_video")
PROMPTS = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
# max_length per family: flux2's and lumina2's count their system prompt's tokens (about 30 here)
LENGTH = {"flux2": 64, "qwen_image": 20, "chroma": 16, "sana": 16, "z_image": 24, "lumina2": 48, "hidream": 12,
          "ltx_video": 16, "hunyuan_video": 16}
WIDTH = {"flux2": 96, "qwen_image": 32, "chroma": 32, "sana": 32, "z_image": 32, "lumina2": 32, "hidream": 32,
         "ltx_video": 32, "hunyuan_video": 32}
MODEL = {"flux2": "Mistral3ForConditionalGeneration", "qwen_image": "Qwen2_5_VLForConditionalGeneration",
         "chroma": "T5EncoderModel", "sana": "Gemma2Model", "z_image": "Qwen3Model", "lumina2": "Gemma2Model",
         "hidream": "CLIPTextModelWithProjection", "ltx_video": "T5EncoderModel",
         "hunyuan_video": "Qwen2_5_VLTextModel"}
# The outputs besides "text" and "text_mask": hidream's pooled CLIP projections and Llama hidden states (6 layers)
OTHER = {"hidream": {"pooled": (32,), "llama": (6, LENGTH["hidream"], 24)}}
ZERO_PADDED = ("qwen_image", "z_image")  # variable-length pipeline outputs, zero-padded to max_length here


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_pipelines")
    return {family: save_tiny_text_encoders(family, root / family) for family in NEW}


@pytest.fixture(scope="module")
def loaded(folders):
    return {family: load_text_encoders(family, folders[family]) for family in NEW}


def test_families_are_registered():
    assert set(NEW) <= set(TEXT_FAMILIES) and all(FAMILIES[f].via_pipeline for f in NEW)
    assert [f for f in NEW if FAMILIES[f].pooled] == ["hidream"]
    assert {f: FAMILIES[f].max_length for f in NEW} == {"flux2": 512, "qwen_image": 512, "chroma": 512, "sana": 300,
                                                       "z_image": 512, "lumina2": 256, "hidream": 128,
                                                       "ltx_video": 128, "hunyuan_video": 1000}


@pytest.mark.parametrize("family", NEW)
def test_tiny_folder_loads_the_pipelines_classes(folders, loaded, family):
    import diffusers
    import transformers

    spec, enc = FAMILIES[family], loaded[family]
    assert json.loads((folders[family] / "model_index.json").read_text())["_class_name"] == spec.pipeline
    model, tokenizer = enc.models["text_encoder"], enc.tokenizers["tokenizer"]
    assert type(model) is getattr(transformers, MODEL[family])
    parameters = inspect.signature(getattr(diffusers, spec.pipeline).__init__).parameters
    for slot in spec.slots:   # the class the pipeline declares for each encoder (Z-Image: any PreTrainedModel)
        assert isinstance(enc.models[slot.model], parameters[slot.model].annotation)
    if family == "flux2":  # the pipeline's tokenizer is an AutoProcessor
        assert isinstance(tokenizer, transformers.PixtralProcessor) and tokenizer.chat_template
    if family == "z_image":  # the pipeline applies the chat template
        assert tokenizer.chat_template
    assert enc.paths == {k: str(folders[family] / k) for s in spec.slots for k in (s.model, s.tokenizer)}


@pytest.mark.parametrize("family", NEW)
def test_encode_prompts_shapes_masks_determinism(loaded, family):
    enc, length = loaded[family], LENGTH[family]
    out = encode_prompts(family, enc, PROMPTS, max_length=length)
    masked = family not in ("flux2", "hidream")
    glyph = ["glyph", "glyph_mask"] if family == "hunyuan_video" else []   # quoted text: tests/test_hunyuan_glyph.py
    assert list(out) == ["text"] + (["text_mask"] if masked else []) + list(OTHER.get(family, {})) + glyph
    for key, shape in OTHER.get(family, {}).items():
        assert out[key].shape == (3, *shape) and out[key].dtype == np.float32 and np.isfinite(out[key]).all()
        assert not np.allclose(out[key][0], out[key][2])
    text = out["text"]
    assert text.shape == (3, length, WIDTH[family]) and text.dtype == np.float32 and np.isfinite(text).all()
    assert not np.allclose(text[0], text[2])
    if masked:
        mask = out["text_mask"]
        assert mask.dtype == bool and mask.shape == (3, length)
        n = mask.sum(1)
        assert n[1] < n[0] < n[2] < length  # prompts of different lengths, padding left over
        for row, count in zip(mask, n):  # real positions first, then padding (False)
            assert row[:count].all() and not row[count:].any()
        if family in ZERO_PADDED:
            assert not text[~mask].any()
    again = encode_prompts(family, enc, PROMPTS, max_length=length)
    alone = encode_prompts(family, enc, PROMPTS[2:], max_length=length)  # independent of the batch
    for key in out:
        np.testing.assert_array_equal(again[key], out[key])
        np.testing.assert_allclose(alone[key][0], out[key][2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["chroma", "z_image", "lumina2", "hidream", "ltx_video"])
def test_default_length_is_the_pipelines(loaded, family):
    out = encode_prompts(family, loaded[family], "a cat")
    lengths = {k: v.shape[-1 if k == "text_mask" else -2] for k, v in out.items() if k != "pooled"}
    assert set(lengths.values()) == {FAMILIES[family].max_length}, lengths


def _pipeline(family, enc):
    import diffusers

    cls = getattr(diffusers, FAMILIES[family].pipeline)
    parts = {k: v for s in FAMILIES[family].slots
             for k, v in ((s.model, enc.models[s.model]), (s.tokenizer, enc.tokenizers[s.tokenizer]))}
    if family == "hunyuan_video":   # its __init__ reads vae.config and takes a guider
        parts.update(guider=None, vae=diffusers.AutoencoderKLHunyuanVideo15(block_out_channels=(8,) * 5))
    return cls(**{"vae": None, **parts}, transformer=None, scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def _reference(family, pipe, length):
    """The pipeline's own encode_prompt, as its __call__ calls it: (text (B, L', D) or per-sample rows, mask or
    None)."""
    import diffusers

    prompts = list(PROMPTS)
    if family == "flux2":
        return pipe.encode_prompt(prompts, device="cpu", max_sequence_length=length)[0], None
    if family == "qwen_image":
        return pipe.encode_prompt(prompts, device="cpu", max_sequence_length=length)
    if family == "chroma":
        r = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False, max_sequence_length=length)
        return r[0], r[2]
    if family == "sana":
        instruction = inspect.signature(diffusers.SanaPipeline.__call__).parameters["complex_human_instruction"]
        r = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu", max_sequence_length=length,
                               complex_human_instruction=instruction.default)
        return r[0], r[1]
    if family == "z_image":
        return pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False,
                                  max_sequence_length=length)[0], None
    if family == "hunyuan_video":   # (Qwen text, mask, ByT5 glyph, its mask)
        pipe.tokenizer_max_length = length
        r = pipe.encode_prompt(prompts, device="cpu", batch_size=len(prompts))
        return r[0], r[1], {"glyph": r[2], "glyph_mask": r[3]}
    r = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu", max_sequence_length=length)
    if family == "hidream":   # (t5, neg, llama (layers, B, L, Dl), neg, pooled, neg)
        return r[0], None, {"pooled": r[4], "llama": r[2].transpose(0, 1)}
    return r[0], r[1]


@pytest.mark.parametrize("family", NEW)
def test_encode_prompts_matches_the_diffusers_pipeline(loaded, family):
    enc, length = loaded[family], LENGTH[family]
    ours = encode_prompts(family, enc, PROMPTS, max_length=length)
    with torch.inference_mode():
        text, mask, *other = _reference(family, _pipeline(family, enc), length)
    extra = other[0] if other else {}   # hidream: pooled, llama
    assert set(ours) - {"text", "text_mask"} == set(extra)
    for key, value in extra.items():   # glyph_mask: the pipeline's 0/1 mask, ours bool
        np.testing.assert_allclose(ours[key].astype(np.float32), value.float().numpy(), rtol=1e-5, atol=1e-6)
    if isinstance(text, list):  # Z-Image: one row per prompt, its real tokens only
        mask = torch.stack([torch.arange(length) < len(row) for row in text])
        text = torch.stack([torch.cat([row, row.new_zeros(length - len(row), row.shape[1])]) for row in text])
    elif family == "qwen_image":  # padded to the batch's longest prompt; mask None when nothing is padding
        assert text.shape[1] < length
        mask = torch.ones(text.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        mask = torch.cat([mask, mask.new_zeros(3, length - text.shape[1])], dim=1)
        text = torch.cat([text, text.new_zeros(3, length - text.shape[1], text.shape[2])], dim=1)
    np.testing.assert_allclose(ours["text"], text.float().numpy(), rtol=1e-5, atol=1e-6)
    if mask is None:
        assert "text_mask" not in ours
    else:
        np.testing.assert_array_equal(ours["text_mask"], mask.bool().numpy())


def _other_model(family):
    # a Gemma-2 folder for the T5 families (chroma, ltx_video; hunyuan_video's ByT5), a T5 folder for the rest
    return "sana" if family in ("chroma", "ltx_video", "hunyuan_video") else "chroma"


def _lm_slot(family):
    """The family's language-model encoder, whose class depends on config.json's model_type: the only encoder but
    for hidream (the last: its Llama, text_encoder_4)."""
    return next(s for s in reversed(FAMILIES[family].slots) if s.kind in MODEL_TYPES)


def _paths(family, folders, **override):
    """Every encoder's and tokenizer's own folder from the tiny pipeline folder, some overridden (None: left out)."""
    paths = {k: folders[family] / k for s in FAMILIES[family].slots for k in (s.model, s.tokenizer)}
    return {k: v for k, v in {**paths, **override}.items() if v is not None}


@pytest.mark.parametrize("family", NEW)
def test_errors_name_family_encoder_and_path(folders, family, tmp_path):
    spec, slot = FAMILIES[family], _lm_slot(family)
    model, tok = slot.model, slot.tokenizer
    what = slot.what.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    advice = rf"hf download {spec.repo.replace('.', '[.]')} --include 'text_encoder\*/\*' 'tokenizer\*/\*'"
    own = advice
    if slot.download:   # hidream's Llama is not in its repo: the messages say where it comes from
        own = r"hf download meta-llama/Meta-Llama-3\.1-8B-Instruct --exclude 'original/\*' --local-dir DIR/text_enc"
        advice += ".*" + own
    with pytest.raises(TextEncoderError, match=rf"{family} text encoders: the pipeline folder '.*missing' does not "
                                               rf"exist.*{advice}"):
        load_text_encoders(family, tmp_path / "missing")
    with pytest.raises(TextEncoderError, match=rf"{family} text encoder '{model}' \({what}\): no model at "
                                               rf"'.*nowhere/{model}' \(no such folder\).*{own}"):
        load_text_encoders(family, _paths(family, folders, **{model: tmp_path / "nowhere" / model}))
    with pytest.raises(TextEncoderError, match=rf"{family} tokenizer '{tok}' of text encoder '{model}' "
                                               rf"\({what}\): no tokenizer files .* in '.*{family}/{model}'"):
        resolve_text_encoder_paths(family, _paths(family, folders, **{tok: None}))
    other = folders[_other_model(family)]
    with pytest.raises(TextEncoderError, match=rf"{family} text encoder '{model}' at '{other}/text_encoder' is "
                                               rf"a '(t5|gemma2)' model; expected {what} \(config.json model_type "
                                               rf"'[a-z0-9_]+'"):
        load_text_encoders(family, _paths(family, folders, **{model: other / "text_encoder",
                                                              tok: other / "tokenizer"}))


def test_a_tokenizer_without_its_chat_template_is_named(folders, tmp_path):
    broken = tmp_path / "z_image"
    shutil.copytree(folders["z_image"], broken)
    for name in ("chat_template.jinja", "chat_template.json"):
        (broken / "tokenizer" / name).unlink(missing_ok=True)
    config = json.loads((broken / "tokenizer" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    enc = load_text_encoders("z_image", broken)
    with pytest.raises(TextEncoderError, match=rf"z_image text encoder 'text_encoder' \(Qwen3 \(Qwen3Model\)\) at "
                                               rf"'{broken}/text_encoder' with tokenizer '{broken}/tokenizer': "
                                               rf"ZImagePipeline\.encode_prompt fails on them .*chat template"):
        encode_prompts("z_image", enc, ["a cat"], max_length=8)
