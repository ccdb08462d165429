"""HunyuanVideo 1.5's two extra inputs, from files to training.

Glyphs: encode_prompts returns the pipeline's ByT5 embeddings of a caption's quoted text (glyph, glyph_mask),
precompute stores them beside the text (glyph_embeds.npy, glyph_mask.npy, meta conditioning.glyph), the reader gives
them back per caption, and the transformer's forward uses them.
Image embeddings (image-to-video): precompute --first-frame --image-encoder stores each first frame through the i2v
pipeline's SigLIP exactly as its _get_image_embeds (image_embeds.npy); model.i2v training passes them on with the
first frames, zeroed for the samples trained as text-to-video."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY, compose_cfg
from family_checks import make
from tread.cli.precompute import main as precompute
from tread.data import Bucket, LatentDataset, LatentDatasetError, write_latent_dataset
from tread.data.builtin.toy_clips import write_clip_files
from tread.encoders.image_embeds import load_image_encoder, save_tiny_image_encoder
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.training.first_frames import FirstFrames
from tread.training.loop import train
from test_video_vae import tiny_hunyuan

pytestmark = pytest.mark.usefixtures("one_thread")
QUOTED = ['a sign that reads "open" on a door', "a red disc", 'the words "tread" and “fast”']


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    folder = save_tiny_text_encoders("hunyuan_video", tmp_path_factory.mktemp("hv_text"))
    return folder, load_text_encoders("hunyuan_video", folder)


def test_quoted_text_gives_glyph_rows_and_plain_text_none(encoders):
    out = encode_prompts("hunyuan_video", encoders[1], QUOTED, max_length=16)
    assert out["glyph"].shape == (3, 256, 32) and out["glyph_mask"].dtype == np.bool_
    assert out["glyph_mask"][0].any() and out["glyph_mask"][2].any() and not out["glyph_mask"][1].any()
    assert not out["glyph"][1].any()                       # no quoted text: zero rows, as the pipeline gives
    assert out["glyph_mask"][2].sum() > out["glyph_mask"][0].sum()   # two quoted texts, more bytes


def test_glyph_round_trips_through_writer_and_reader(tmp_path):
    g = np.random.default_rng(0)
    n, extras = 3, {"text": g.standard_normal((3, 4, 8)).astype(np.float32),
                    "glyph": g.standard_normal((3, 6, 5)).astype(np.float32),
                    "glyph_mask": np.array([[1, 1, 0, 0, 0, 0], [0] * 6, [1] * 6], bool)}
    write_latent_dataset(tmp_path / "d", np.zeros((n, 4, 2, 2), np.float32), np.zeros(n, np.int64), num_classes=1,
                         dtype="float32", extras=extras)
    ds = LatentDataset(tmp_path / "d")
    assert ds.meta["conditioning"]["glyph"] == {"seq_len": 6, "dim": 5} and ds.conditioning["glyph"] == (6, 5)
    _, _, batch = ds.__getitems__([2, 1])
    np.testing.assert_array_equal(batch["glyph"].numpy(), extras["glyph"][[2, 1]])
    assert batch["glyph_mask"].dtype == torch.bool and batch["glyph_mask"][1].sum() == 0   # all False is allowed
    with pytest.raises(LatentDatasetError, match="glyph_shape=.* needs text_shape"):
        write_latent_dataset(tmp_path / "e", np.zeros((n, 4, 2, 2), np.float32), np.zeros(n, np.int64),
                             num_classes=1, extras={k: extras[k] for k in ("glyph", "glyph_mask")})


@pytest.mark.slow
def test_precomputed_glyphs_reach_the_transformer(tmp_path, encoders, cache_dir):
    clips = tmp_path / "clips"
    write_clip_files(clips, [Bucket(32, 32, 9)], num_per_class=1, captions=True)
    sidecars = sorted(clips.rglob("*.txt"))
    for i, path in enumerate(sidecars):
        path.write_text(QUOTED[i % 3] + "\n")
    tiny_hunyuan().save_pretrained(tmp_path / "vae")
    precompute(["--videos", str(clips), "--out", str(tmp_path / "data"), "--vae", str(tmp_path / "vae"), "--frames", "9",
                "--resolution", "32", "--device", "cpu", "--workers", "0", "--dtype", "float32",
                "--text-family", "hunyuan_video", "--text-encoders", str(encoders[0]), "--max-text-length", "16",
                "--caption-sidecars"])
    ds = LatentDataset(tmp_path / "data")
    assert ds.conditioning["glyph"] == (256, 32) and ds.meta["files"]["glyph_embeds"] == "glyph_embeds.npy"
    _, _, batch = ds.__getitems__(list(range(len(ds))))
    direct = encode_prompts("hunyuan_video", encoders[1], [QUOTED[i % 3] for i in range(len(ds))], max_length=16)
    np.testing.assert_allclose(batch["glyph"].numpy(), direct["glyph"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(batch["glyph_mask"].numpy(), direct["glyph_mask"])
    model = make("hunyuan_video", frames=3, input_size=8, in_channels=ds.shape[0]).eval()
    x, t = torch.randn(2, *ds.shape), torch.rand(2) * 1000
    cond = {k: batch[k][:2] for k in ("text", "text_mask", "glyph", "glyph_mask")}
    with torch.no_grad():
        out = model(x, t, torch.zeros(2, dtype=torch.long), cond=cond)
        ref = model.reference_forward(x, t, torch.zeros(2, dtype=torch.long), cond=cond)
        plain = model(x, t, torch.zeros(2, dtype=torch.long), cond={k: cond[k] for k in ("text", "text_mask")})
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[0], plain[0], atol=1e-5)          # sample 0's glyph rows change its output
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={cache_dir}", "model=hunyuan_video", "data=latents", f"data.path={ds.root}",
        f"data.channels={ds.shape[0]}", "data.resolution=8", f"data.frames={ds.shape[1]}", "data.num_classes=10",
        "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 5}]", "train.max_steps=2",
        "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, tmp_path / "run")


def test_image_embeds_are_the_pipelines(tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from PIL import Image

    enc = load_image_encoder(save_tiny_image_encoder(tmp_path / "siglip"), "--image-encoder")
    frames = np.random.default_rng(0).integers(0, 255, (2, 40, 48, 3), dtype=np.uint8)   # resized to 32 x 32
    ours = enc(frames)
    with torch.no_grad():
        ref = [HunyuanVideo15ImageToVideoPipeline._get_image_embeds(enc.model, enc.processor, Image.fromarray(f), "cpu")
               for f in frames]
    assert ours.shape == (2, 16, 32)
    np.testing.assert_allclose(ours, torch.cat(ref).numpy(), rtol=1e-5, atol=1e-6)


def test_image_embeds_count_per_sample(encoders):
    """A batch mixing image- and text-to-video samples: each sample's image rows count only where it has them (diffusers
    decides once per batch), so each row of the batch equals diffusers' forward of that sample alone."""
    model = make("hunyuan_video", frames=3, input_size=8).eval()
    x, t = torch.randn(2, 4, 3, 8, 8), torch.rand(2) * 1000
    cond = {"text": torch.randn(2, 5, 32), "image_embeds": torch.randn(2, 16, 32)}
    cond["image_embeds"][1] = 0                                 # sample 1: text-to-video
    y = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        out = model(x, t, y, cond=cond)
        alone = [model.reference_forward(x[i:i + 1], t[i:i + 1], y[:1], cond={k: v[i:i + 1] for k, v in cond.items()})
                 for i in range(2)]
        masked = model(x, t, y, cond={**cond, "i2v": torch.tensor([False, True])})
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked[1], out[1])
    with torch.no_grad():   # the i2v mask drops sample 0's image rows: its text-to-video forward
        t2v = model.reference_forward(x[:1], t[:1], y[:1], cond={"text": cond["text"][:1],
                                                                "image_embeds": torch.zeros(1, 16, 32)})
    torch.testing.assert_close(masked[:1], t2v, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(masked[0], out[0], atol=1e-5)


def test_i2v_training_passes_image_embeds_with_the_first_frames():
    extras = {"text": torch.zeros(2, 3, 4), "first_frame": torch.zeros(2, 4, 1, 8, 8),
              "image_embeds": torch.ones(2, 16, 32)}
    cond = FirstFrames(1.0, frames_in_loss=False).condition({"text": extras["text"]}, extras, 2)
    assert set(cond) == {"text", "first_frame", "image_embeds"}


@pytest.mark.slow
def test_precomputed_image_embeds_train_with_i2v(tmp_path, cache_dir):
    clips = tmp_path / "clips"
    write_clip_files(clips, [Bucket(32, 32, 9)], num_per_class=1, captions=False)
    tiny_hunyuan().save_pretrained(tmp_path / "vae")
    siglip = save_tiny_image_encoder(tmp_path / "siglip")
    precompute(["--videos", str(clips), "--out", str(tmp_path / "data"), "--vae", str(tmp_path / "vae"), "--frames", "9",
                "--resolution", "32", "--device", "cpu", "--workers", "0", "--dtype", "float32", "--first-frame",
                "--image-encoder", str(siglip)])
    ds = LatentDataset(tmp_path / "data")
    assert ds.conditioning["image_embeds"] == (16, 32) and ds.meta["files"]["image_embeds"] == "image_embeds.npy"
    _, _, batch = ds.__getitems__([0, 3])
    from tread.data.video import clip_tree, read_clip
    files, _ = clip_tree(clips)
    first = np.stack([read_clip(files[i], 1)[0] for i in (0, 3)])
    np.testing.assert_allclose(batch["image_embeds"].numpy(), load_image_encoder(siglip, "x")(first),
                               rtol=1e-5, atol=1e-6)
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={cache_dir}", "model=hunyuan_video", "data=latents", f"data.path={ds.root}",
        f"data.channels={ds.shape[0]}", "data.resolution=8", f"data.frames={ds.shape[1]}", "data.num_classes=10",
        "model.i2v=true", "train.i2v_probability=0.5",
        "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 5}]", "train.max_steps=2",
        "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, tmp_path / "run")
