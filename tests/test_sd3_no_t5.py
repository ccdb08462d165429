"""SD3 without T5: encode_prompts(..., t5=False) against StableDiffusion3Pipeline(text_encoder_3=None), the
family's model.use_t5=false (the T5 part of any dataset's embeddings is ignored), precompute --no-t5, errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute as pl
from conftest import TINY, compose_cfg
from tread.data import LatentDataset
from tread.encoders.text import TextEncoderError, encode_prompts, load_text_encoders
from tread.encoders.text_families import SD3_T5_WIDTH
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.schema.builders import build_model
from tread.models.families import FamilyConfigError
from tread.schema import ConfigError, check_train
from test_precompute import vae_dir  # noqa: F401 (fixture)

PROMPTS = ["a photo of a red disc", "", "dog with zebra stripes"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_tiny_text_encoders("sd3", tmp_path_factory.mktemp("enc") / "sd3")


@pytest.fixture(scope="module")
def clip_only_dir(sd3_dir, tmp_path_factory):
    """The same pipeline folder without text_encoder_3/ and tokenizer_3/ (T5 never downloaded)."""
    out = tmp_path_factory.mktemp("enc") / "sd3_no_t5"
    shutil.copytree(sd3_dir, out, ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3"))
    return out


def sd3_model(*overrides):
    torch.manual_seed(0)
    return build_model(compose_cfg("train", TINY + ["model=sd3", *overrides]).model).eval()


def test_encoding_without_t5_equals_the_pipeline_without_text_encoder_3(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    enc = load_text_encoders("sd3", sd3_dir, t5=False)
    assert sorted(enc.models) == ["text_encoder", "text_encoder_2"] and not enc.t5
    transformer = sd3_model().transformer                             # the zeros' width: its joint_attention_dim
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=None, vae=None,
                                    text_encoder=enc.models["text_encoder"], tokenizer=enc.tokenizers["tokenizer"],
                                    text_encoder_2=enc.models["text_encoder_2"],
                                    tokenizer_2=enc.tokenizers["tokenizer_2"], text_encoder_3=None, tokenizer_3=None)
    text, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, device="cpu", do_classifier_free_guidance=False,
                                            max_sequence_length=12)
    ours = encode_prompts("sd3", enc, PROMPTS, max_length=12)
    assert ours["text"].shape == tuple(text.shape) == (3, 77 + 12, transformer.config.joint_attention_dim)
    np.testing.assert_allclose(ours["text"], text.float().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours["pooled"], pooled.float().numpy(), rtol=1e-5, atol=1e-6)
    assert not ours["text"][:, 77:].any() and ours["text"][:, :77].any()
    # loaded with T5 and told not to use it: the same arrays; with T5 the CLIP part is the same too
    full = load_text_encoders("sd3", sd3_dir)
    again = encode_prompts("sd3", full, PROMPTS, max_length=12, t5=False)
    assert all(np.array_equal(again[k], ours[k]) for k in ("text", "pooled"))
    with_t5 = encode_prompts("sd3", full, PROMPTS, max_length=12)
    assert np.array_equal(with_t5["text"][:, :77], ours["text"][:, :77]) and with_t5["text"][:, 77:].any()


def test_t5_is_not_needed_and_the_width_comes_from_the_config_files(clip_only_dir, tmp_path):
    enc = load_text_encoders("sd3", clip_only_dir, t5=False)
    assert encode_prompts("sd3", enc, "a cat", max_length=4)["text"].shape == (1, 77 + 4, SD3_T5_WIDTH)
    with_transformer = tmp_path / "pipe"
    shutil.copytree(clip_only_dir, with_transformer)
    (with_transformer / "transformer").mkdir()
    (with_transformer / "transformer" / "config.json").write_text(json.dumps({"joint_attention_dim": 32}))
    enc = load_text_encoders("sd3", with_transformer, t5=False)
    assert enc.t5_width == 32 and encode_prompts("sd3", enc, "a cat")["text"].shape == (1, 77 + 256, 32)
    with pytest.raises(TextEncoderError, match=r"sd3 text encoder 'text_encoder_3' \(T5 \(T5EncoderModel\)\): no "
                                               r"model at .*text_encoder_3"):
        load_text_encoders("sd3", clip_only_dir)                      # with T5: its folder is needed


def test_t5_false_errors(sd3_dir, clip_only_dir):
    with pytest.raises(TextEncoderError, match=r"t5=False \(no T5 encoder\) is for sd3 only; flux's text "
                                               r"embeddings are its T5's output. Allowed: t5=True for flux"):
        load_text_encoders("flux", sd3_dir, t5=False)
    with pytest.raises(TextEncoderError, match=r"t5=False .* is for sd3 only; pixart"):
        encode_prompts("pixart", {}, ["a cat"], t5=False)
    with pytest.raises(TextEncoderError, match=r"sd3 text encoder paths \['text_encoder_3'\] are given with "
                                               r"t5=False \(no T5\); allowed: leave them out"):
        load_text_encoders("sd3", {"pipeline": clip_only_dir, "text_encoder_3": sd3_dir}, t5=False)
    enc = load_text_encoders("sd3", clip_only_dir, t5=False)
    with pytest.raises(TextEncoderError, match=r"t5=True, but these sd3 encoders were loaded without T5"):
        encode_prompts("sd3", enc, ["a cat"], t5=True)


def test_use_t5_false_on_class_labels_is_refused_not_ignored():
    """On class-labelled data the class table stands in for the text: use_t5=false would change nothing, so the run
    is refused at start-up, in one line; text data passes."""
    off = sd3_model("model.use_t5=false")
    with pytest.raises(FamilyConfigError, match=r"^model.use_t5=false zeroes the T5 part .* the data at '/d' has none "
                                                r"\(class labels"):
        off.check_text_data({"text": None, "pooled": None}, "'/d'")
    off.check_text_data({"text": (77 + 12, 32), "pooled": 32}, "'/d'")
    sd3_model().check_text_data({"text": None, "pooled": None}, "'/d'")


def test_use_t5_false_ignores_the_t5_part_of_the_data():
    on, off = sd3_model(), sd3_model("model.use_t5=false")
    assert off.load_state_dict(on.state_dict()) is not None and not off.use_t5
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, on.in_channels, on.input_size, on.input_size, generator=gen)
    noise, labels = torch.tensor([300.0, 800.0]), torch.tensor([1, on.num_classes])   # the null label: no text
    a = {"text": torch.randn(2, 77 + 12, 32, generator=gen), "pooled": torch.randn(2, 32, generator=gen)}
    b = {**a, "text": torch.cat([a["text"][:, :77], torch.randn(2, 12, 32, generator=gen)], dim=1)}
    zeroed = {**a, "text": torch.cat([a["text"][:, :77], torch.zeros(2, 12, 32)], dim=1)}
    with torch.no_grad():
        assert torch.equal(off(x, noise, labels, cond=a), off(x, noise, labels, cond=b))
        assert torch.equal(off(x, noise, labels, cond=a), on(x, noise, labels, cond=zeroed))
        assert not torch.allclose(on(x, noise, labels, cond=a), on(x, noise, labels, cond=b))   # T5 matters with it
        torch.testing.assert_close(off.reference_forward(x, noise, labels, cond=b),           # diffusers' forward
                                   on.reference_forward(x, noise, labels, cond=zeroed), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, match", [
    (["model=flux", "+model.use_t5=false"], r"^model.use_t5 is a key of model.family=sd3; model.family=flux does not take it.$"),
    (["model=sd3", "model.use_t5=no"], r"^model.use_t5='no' is not allowed; allowed: true or false \(SD3"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_train(compose_cfg("train", TINY + overrides))




def test_precompute_no_t5_without_the_t5_folder(tmp_path, vae_dir, sd3_dir, clip_only_dir):
    images = tmp_path / "imgs"
    (images / "cls").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(images / "cls" / f"img{i}.png")
    captions = {f"cls/img{i}.png": p for i, p in enumerate(PROMPTS)}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    base = ["--images", str(images), "--vae", str(vae_dir), "--resolution", "16", "--device", "cpu", "--workers",
            "0", "--captions", str(tmp_path / "captions.json"), "--max-text-length", "6"]
    with pytest.raises(pl.PrecomputeError, match=r"--no-t5 is for --text-family sd3 only .* --text-family flux"):
        pl.main(base + ["--out", str(tmp_path / "bad"), "--text-family", "flux", "--text-encoders", str(sd3_dir),
                        "--no-t5"])
    out = tmp_path / "ds"
    pl.main(base + ["--out", str(out), "--text-family", "sd3", "--text-encoders", str(clip_only_dir), "--no-t5"])
    ds = LatentDataset(out)
    want = encode_prompts("sd3", load_text_encoders("sd3", sd3_dir), PROMPTS, max_length=6, t5=False)
    text = np.load(out / "text_embeds.npy")                  # stored in --dtype (float16)
    assert text.shape == (3, 77 + 6, SD3_T5_WIDTH)          # no transformer/ nor T5 config here: SD3's 4096
    assert np.array_equal(text[:, :77, :32], want["text"][:, :77].astype(text.dtype))
    assert not text[:, :77, 32:].any() and not text[:, 77:].any()
    pooled = np.load(out / "pooled_embeds.npy")
    assert np.array_equal(pooled, want["pooled"].astype(pooled.dtype))
    assert ds.meta["conditioning"]["text"]["t5"] is False
    assert len(ds.meta["conditioning"]["text"]["encoders"]) == 2
