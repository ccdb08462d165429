"""HiDream prompts end to end: the four text encoders HiDreamImagePipeline loads (tiny random stand-ins of the real
classes), the Llama hidden states encode_prompts returns (batch first), llama_embeds.npy in the latent format
(writer, reader, the one-line errors), precompute --text-family hidream, and the stored states reaching the model in
its forward and in training. The shared pipeline checks (shapes, batch independence, equality with the pipeline's
own encode_prompt, error messages) run for hidream in tests/test_text_pipelines.py; nothing touches the network."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute as pl
from tread.data import LatentDataset, LatentDatasetError, LatentDatasetWriter, draw_latents, write_latent_dataset
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.models.families import FamilyConfigError, build_family
from tread.models.families.hidream import HIDREAM_PRESETS
from tread.training.loop import train
from test_precompute import vae_dir  # noqa: F401 (fixture: a tiny AutoencoderKL, 16 px -> 4 x 8 x 8)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = HIDREAM_PRESETS["tiny"]
LAYERS = max(TINY["llama_layers"]) + 1           # the tiny Llama's layers: those llama_layers reaches (0..5)
PROMPTS = ["a photo of a red disc", "", "a cat and a dog on a tree with stripes"]
CAPTIONS = {"a_cat/0.png": "a cat on a tree", "a_cat/1.png": "a red cat",
            "b_dog/0.png": "a dog with stripes", "b_dog/1.png": "a blue dog in a house"}


@pytest.fixture(scope="module")
def encoders_dir(tmp_path_factory):
    return save_tiny_text_encoders("hidream", tmp_path_factory.mktemp("enc") / "hidream")


@pytest.fixture(scope="module")
def encoders(encoders_dir):
    return load_text_encoders("hidream", encoders_dir)


# ----------------------------------------------------------------------------- (a) tiny encoders

def test_tiny_encoders_are_the_pipelines_classes_at_the_tiny_presets_widths(tmp_path, encoders_dir, encoders):
    import transformers

    state = torch.random.get_rng_state()
    save_tiny_text_encoders("hidream", tmp_path / "again", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)          # the global RNG is left alone
    assert json.loads((encoders_dir / "model_index.json").read_text())["_class_name"] == "HiDreamImagePipeline"
    m = encoders.models
    assert [type(m[k]).__name__ for k in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")] == \
        ["CLIPTextModelWithProjection"] * 2 + ["T5EncoderModel", "LlamaForCausalLM"]
    # pooled = [CLIP-L ; CLIP-G] projections = text_emb_dim; T5 = caption_channels[0]; Llama = caption_channels[1]
    assert m["text_encoder"].config.projection_dim + m["text_encoder_2"].config.projection_dim == TINY["text_emb_dim"]
    assert m["text_encoder_3"].config.d_model == TINY["caption_channels"][0]
    llama = m["text_encoder_4"].config
    assert llama.hidden_size == TINY["caption_channels"][1] and llama.num_hidden_layers == LAYERS == 6
    assert m["text_encoder"].config.max_position_embeddings >= 218       # the pipeline feeds CLIP up to 218 tokens
    tok = encoders.tokenizers["tokenizer_4"]
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert "<|end_of_text|>" in tok.get_vocab() and tok("a cat")["input_ids"][0] == tok.bos_token_id


# ----------------------------------------------------------------------------- (b) encoding

def test_llama_states_are_every_layers_hidden_states_batch_first(encoders):
    """encode_prompts' "llama" (B, n, L, Dl) is Llama's hidden_states[1:] of the padded prompts (pad = eos, as the
    pipeline sets it), batch first; text is T5 (B, L, 32), pooled [CLIP-L ; CLIP-G] (B, 32); deterministic."""
    out = encode_prompts("hidream", encoders, PROMPTS, max_length=10)
    assert {k: v.shape for k, v in out.items()} == {"text": (3, 10, 32), "pooled": (3, 32),
                                                   "llama": (3, LAYERS, 10, 24)}
    tok, llama = encoders.tokenizers["tokenizer_4"], encoders.models["text_encoder_4"]
    tok.pad_token = tok.eos_token
    ids = tok(PROMPTS, padding="max_length", max_length=10, truncation=True, return_tensors="pt")
    with torch.no_grad():
        states = llama(ids.input_ids, attention_mask=ids.attention_mask, output_hidden_states=True).hidden_states
    np.testing.assert_allclose(out["llama"], torch.stack(states[1:], dim=1).numpy(), rtol=1e-5, atol=1e-6)
    again = encode_prompts("hidream", encoders, PROMPTS, max_length=10)
    assert all(np.array_equal(again[k], out[k]) for k in out)
    default = encode_prompts("hidream", encoders, "a cat")                # the pipeline's max_sequence_length: 128
    assert default["text"].shape == (1, 128, 32) and default["llama"].shape == (1, LAYERS, 128, 24)


# ----------------------------------------------------------------------------- (c) storage

def _arrays(n=4, length=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4, 8, 8)).astype(np.float32)
    extras = {"text": rng.standard_normal((n, length, 32)).astype(np.float32),
              "pooled": rng.standard_normal((n, 32)).astype(np.float32),
              "llama": rng.standard_normal((n, LAYERS, length, 24)).astype(np.float32)}
    return x, np.arange(n) % 2, extras


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_llama_states_round_trip_through_writer_and_reader(tmp_path, dtype):
    x, y, extras = _arrays()
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=2, dtype=dtype, extras=extras,
                                conditioning_meta={"llama": {"hidden_states": "1:"}})
    ds = LatentDataset(path)
    assert ds.meta["files"]["llama_embeds"] == "llama_embeds.npy"
    assert ds.meta["conditioning"]["llama"] == {"layers": LAYERS, "seq_len": 5, "dim": 24, "hidden_states": "1:"}
    assert ds.conditioning["llama"] == (LAYERS, 5, 24) and ds.has_extras
    stored = np.load(path / "llama_embeds.npy")
    assert stored.dtype == np.dtype(dtype) and np.array_equal(stored, extras["llama"].astype(dtype))
    item = ds[2][2]["llama"]
    assert item.dtype == torch.float32 and item.shape == (LAYERS, 5, 24)
    assert torch.equal(item, torch.from_numpy(stored[2].astype(np.float32)))
    _, _, batch = ds.__getitems__([3, 0])
    assert batch["llama"].shape == (2, LAYERS, 5, 24) and batch["llama"].dtype == torch.float32
    assert torch.equal(batch["llama"], torch.from_numpy(stored[[3, 0]].astype(np.float32)))
    assert list(batch) == ["text", "pooled", "llama"]


def _edit_meta(path, fn):
    meta = json.loads((path / "meta.json").read_text())
    fn(meta)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: _edit_meta(p, lambda m: m["conditioning"].pop("llama")),
     r"meta has files\.llama_embeds but no conditioning\.llama; an optional file and its description go together"),
    (lambda p: _edit_meta(p, lambda m: m["files"].pop("llama_embeds")),
     r"meta has conditioning\.llama but no files\.llama_embeds"),
    (lambda p: _edit_meta(p, lambda m: m["conditioning"]["llama"].update(layers=0)),
     r"key 'conditioning\.llama' is \{'layers': 0, .*\} but must be an object with positive integers 'layers'"),
    (lambda p: _edit_meta(p, lambda m: (m["conditioning"].pop("text"), m["files"].pop("text_embeds"))),
     r"key 'conditioning\.llama' is .* but must be absent without conditioning\.text"),
    (lambda p: np.save(p / "llama_embeds.npy", np.zeros((4, LAYERS, 5, 23), np.float32)),
     r"llama_embeds\.npy' \(files\.llama_embeds\) holds a float32 array of shape \[4, 6, 5, 23\] but must be float16 "
     r"or float32 of shape \[4, 6, 5, 24\] \(meta\.json num_samples, conditioning\.llama layers, seq_len and dim\)"),
])
def test_bad_llama_data_is_one_line_naming_file_key_and_value(tmp_path, corrupt, message):
    x, y, extras = _arrays()
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=2, dtype="float32", extras=extras)
    corrupt(path)
    with pytest.raises(LatentDatasetError, match=message) as err:
        LatentDataset(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_writer_refuses_bad_llama_arguments(tmp_path):
    x, y, extras = _arrays()
    for kwargs, message in [({"llama_shape": (LAYERS, 5)}, r"llama_shape .* is \(6, 5\) but must be \(layers, L, "
                                                           r"Dl\)"),
                            ({"llama_shape": (LAYERS, 5, 24)}, r"llama_shape=\(6, 5, 24\) .* needs text_shape=\(L, "
                                                               r"D\)"),
                            ({"text_shape": (5, 32), "conditioning_meta": {"llama": {"note": 1}}},
                             r"conditioning_meta\['llama'\] .* no llama_shape was given")]:
        with pytest.raises(LatentDatasetError, match=message):
            LatentDatasetWriter(tmp_path / "w", shape=(4, 8, 8), num_samples=4, num_classes=2, **kwargs)
    bad = {**extras, "llama": extras["llama"][:, :, :, :-1]}
    with pytest.raises(LatentDatasetError, match=r"extras\['llama'\] .* must be a \(n, layers, L, Dl\) float array of "
                                                 r"Llama hidden states of shape \(4, 6, 5, 24\)"):
        with LatentDatasetWriter(tmp_path / "w", shape=(4, 8, 8), num_samples=4, num_classes=2, text_shape=(5, 32),
                                 llama_shape=(LAYERS, 5, 24)) as writer:
            writer.write(0, x, y, {"text": extras["text"], "llama": bad["llama"]})
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- (d) end to end

@pytest.fixture(scope="module")
def hidream_data(tmp_path_factory, vae_dir, encoders_dir):  # noqa: F811 (vae_dir is the imported fixture)
    """4 captioned 16-px images (2 classes), precomputed with --text-family hidream in float32, 2 images per shard,
    with --flip: 8 samples."""
    root = tmp_path_factory.mktemp("hidream_data")
    rng = np.random.default_rng(0)
    for name in CAPTIONS:
        (root / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "imgs" / name)
    (root / "captions.json").write_text(json.dumps(CAPTIONS))
    pl.main(["--images", str(root / "imgs"), "--out", str(root / "ds"), "--vae", str(vae_dir), "--resolution", "16",
             "--device", "cpu", "--workers", "0", "--dtype", "float32", "--shard-size", "2", "--flip",
             "--captions", str(root / "captions.json"), "--text-family", "hidream", "--text-encoders",
             str(encoders_dir), "--max-text-length", "8"])
    return root / "ds"


def test_precompute_stores_the_llama_states(hidream_data, encoders):
    ds = LatentDataset(hidream_data)
    assert len(ds) == 8 and ds.conditioning["text"] == (8, 32) and ds.conditioning["pooled"] == 32
    assert ds.conditioning["llama"] == (LAYERS, 8, 24)
    text_meta = ds.meta["conditioning"]["text"]
    assert text_meta["family"] == "hidream" and len(text_meta["encoders"]) == 4 and text_meta["max_length"] == 8
    want = encode_prompts("hidream", encoders, list(CAPTIONS.values()), max_length=8)
    for key, file in (("text", "text_embeds"), ("pooled", "pooled_embeds"), ("llama", "llama_embeds")):
        stored = np.load(hidream_data / f"{file}.npy")
        assert stored.dtype == np.float32                                     # --dtype float32
        np.testing.assert_allclose(stored[:4], want[key], rtol=1e-5, atol=1e-5)
        assert np.array_equal(stored[4:], stored[:4])                         # flipped copies keep their caption's


def _model(num_classes=2):
    torch.manual_seed(0)
    return build_family("hidream", input_size=8, in_channels=4, num_classes=num_classes).eval()


def test_the_stored_llama_states_reach_the_blocks(hidream_data):
    """The dataset's cond (text, pooled, llama) in our forward equals diffusers' forward with those Llama states;
    other Llama states change the output; zero states of the T5 length equal data without states."""
    model, ds = _model(), LatentDataset(hidream_data)
    x, y, extras = ds.__getitems__([0, 5, 2])
    x = draw_latents(x, ds.meta, mode="mean")                             # --kind moments: (mean, logvar) stored
    cond = {k: extras[k] for k in ("text", "pooled", "llama")}
    t = torch.tensor([100.0, 500.0, 900.0])
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond=cond), rtol=1e-5, atol=1e-5)
        other = {**cond, "llama": cond["llama"].flip(0)}
        assert not torch.allclose(model(x, t, y, cond=other), ours, atol=1e-4)
        zeros = {**cond, "llama": torch.zeros_like(cond["llama"])}
        no_llama = {k: v for k, v in cond.items() if k != "llama"}
        torch.testing.assert_close(model(x, t, y, cond=zeros), model(x, t, y, cond=no_llama), rtol=0, atol=0)


def test_training_on_the_precomputed_data_passes_llama_and_logs_finite_losses(hidream_data, tiny_cfg, tmp_path,
                                                                            monkeypatch):
    from tread.models.families.hidream import HiDreamFamily

    seen = []
    real = HiDreamFamily.llama_states
    monkeypatch.setattr(HiDreamFamily, "llama_states",
                        lambda self, cond: seen.append(tuple(cond["llama"].shape[1:])) or real(self, cond))
    run = tmp_path / "run"
    train(tiny_cfg("model=hidream", f"data.path={hidream_data}", "data.builtin=null", "data.resolution=8",
                   "data.num_classes=2", "data.channels=4", "train.max_steps=2", "train.batch_size=4",
                   "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0"), run)
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["type"] == "train"]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert seen and set(seen) == {(LAYERS, 8, 24)}, seen[:3]


def test_prompts_at_eval_time_pass_the_llama_states_on(hidream_data, encoders_dir, encoders):
    """sample.py prompts / eval.validation_prompts (encode_for_model): the Llama states reach cond as the data
    stored them (length and layers); a model trained without them gets none; a Llama of another width is refused."""
    from tread.sampling.prompts import PromptError, encode_for_model

    model, meta = _model(), LatentDataset(hidream_data).meta
    emb = encode_for_model(model, meta, ["a red cat", "a dog"], "a blue house", str(encoders_dir), key="te")
    assert {k: tuple(v.shape) for k, v in emb.cond.items()} == {"text": (2, 8, 32), "pooled": (2, 32),
                                                                "llama": (2, LAYERS, 8, 24)}
    want = encode_prompts("hidream", encoders, ["a red cat", "a dog", "a blue house"], max_length=8)["llama"]
    np.testing.assert_allclose(emb.cond["llama"].numpy(), want[:2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(emb.negative["llama"].numpy(), want[2:], rtol=1e-5, atol=1e-6)
    cond = emb.cond_fn(1)([0, 1, 2])
    assert cond["llama"].shape == (3, LAYERS, 8, 24) and torch.equal(cond["llama"][2], emb.cond["llama"][1])
    with torch.no_grad():
        out = model(torch.randn(3, 4, 8, 8), torch.full((3,), 500.0), torch.zeros(3, dtype=torch.long), cond=cond)
    assert out.shape == (3, 4, 8, 8) and torch.isfinite(out).all()
    without = {**meta, "conditioning": {k: v for k, v in meta["conditioning"].items() if k != "llama"}}
    assert set(encode_for_model(model, without, ["a cat"], "", str(encoders_dir), key="te").cond) == {"text", "pooled"}
    torch.manual_seed(0)
    narrow = build_family("hidream", input_size=8, in_channels=4, num_classes=2, config={"caption_channels": [32, 16]})
    with pytest.raises(PromptError, match=r"^te='.*' gives 24-wide Llama embeddings, but the model takes 16 "
                                          r"\(model.config.caption_channels\[1\], hidream\)"):
        encode_for_model(narrow, meta, ["a cat"], "", str(encoders_dir), key="te")


def test_precompute_without_encoders_names_both_repos(hidream_data, tmp_path):
    imgs, captions = hidream_data.parent / "imgs", hidream_data.parent / "captions.json"
    with pytest.raises(pl.PrecomputeError, match=r"^--text-family hidream needs its text encoders: .*hf download "
                                                 r"HiDream-ai/HiDream-I1-Full .*text_encoder_4 \(Llama-3\.1-8B-"
                                                 r"Instruct \(LlamaForCausalLM\)\): .*hf download meta-llama/Meta-"
                                                 r"Llama-3\.1-8B-"
                                                 r"Instruct --exclude 'original/\*' --local-dir DIR/text_encoder_4"):
        pl.main(["--images", str(imgs), "--out", str(tmp_path / "ds"), "--captions", str(captions),
                 "--text-family", "hidream"])


def test_builtin_text_data_stores_the_llama_states_too(tmp_path, encoders_dir):
    from tread.data.builtin.toy_text import ensure_toy_text_dataset

    ds = LatentDataset(ensure_toy_text_dataset(tmp_path / "toy", num_per_class=1, resolution=8, family="hidream",
                                               text_encoders=encoders_dir, max_text_length=6))
    assert ds.conditioning["llama"] == (LAYERS, 6, 24) and ds.conditioning["pooled"] == 32
    assert ds[0][2]["llama"].shape == (LAYERS, 6, 24)


def test_llama_data_is_checked_at_start_up():
    """Before any work: too few Llama layers for model.config.llama_layers is one error; another family refuses data
    with Llama states (it would train without them, silently)."""
    cond = {"text": (10, 32), "text_mask": False, "pooled": 32, "loss_mask": None, "llama": (LAYERS, 10, 24)}
    model = build_family("hidream", input_size=16, in_channels=3, num_classes=10)
    model.check_text_data(cond, "/d")
    with pytest.raises(FamilyConfigError, match=f"holds 3 Llama layers per caption, but model.config.llama_layers "
                                                f"reaches layer {LAYERS - 1}"):
        model.check_text_data({**cond, "llama": (3, 10, 24)}, "/d")
    flux = build_family("flux", input_size=16, in_channels=3, num_classes=10)
    with pytest.raises(FamilyConfigError, match="has Llama hidden states .* which model.family=flux would ignore"):
        flux.check_text_data({**cond, "text": (10, flux.text_dim), "pooled": None}, "/d")
