"""REPA targets stored beside the latents (tread/data/repa_features.py): scripts/precompute_latents.py
--repa-encoder stores the encoder's features of every image and of its flip; a run with the same encoder aligns with
them (model.repa.targets auto|precomputed) and gives the decode path's losses where both see the same images; other
encoders' features are refused (precomputed) or passed over with a note (auto); runs without REPA never read them."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from conftest import TINY, compose_cfg, shared_cache
from PIL import Image
from test_precompute import vae_dir  # noqa: F401 - the tiny AutoencoderKL fixture, shared

import tread.cli.precompute as pl
from tread.data import LatentDataset, LatentDatasetError, build_dataset, decode_to_uint8, read_meta
from tread.data.images import center_crop_arr
from tread.data.precompute.request import PrecomputeError, PrecomputeRequest, check_request
from tread.data.repa_features import encoder_digest, encoder_input
from tread.data.writer import LatentDatasetWriter, write_latent_dataset
from tread.encoders.patch import build_patch_encoder
from tread.models.errors import ModelConfigError
from tread.training.loop import train
from tread.training.run_log import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

RES = 16
QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1",
         "repa=toy_random", "train.max_steps=2"]


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    """Two classes of random images of different sizes (center-cropped to RES when encoded)."""
    root, rng = tmp_path_factory.mktemp("imgs") / "classes", np.random.default_rng(0)
    for k, (cls, size) in enumerate([("a", (20, 16)), ("a", (16, 30)), ("b", (33, 40))]):
        (root / cls).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / cls / f"{k}.png")
    return root


def test_precompute_stores_the_encoders_features_of_each_image_and_its_flip(tmp_path, images_dir, vae_dir):
    out = tmp_path / "ds"
    pl.main(["--images", str(images_dir), "--out", str(out), "--vae", str(vae_dir), "--resolution", str(RES),
             "--device", "cpu", "--batch-size", "2", "--shard-size", "2", "--workers", "0", "--flip",
             "--dtype", "float32", "--repa-encoder", "toy_random"])
    encoder = build_patch_encoder("toy_random", resolution=RES)
    meta = read_meta(out)
    assert meta["repa_features"] == {"encoder": "toy_random", "digest": encoder_digest(encoder), "dim": 128,
                                     "grid": [RES // 4, RES // 4], "weights": None, "resolution": RES}
    paths = sorted(images_dir.rglob("*.png"))
    crops = np.stack([center_crop_arr(Image.open(p), RES) for p in paths])
    with torch.no_grad():
        want = encoder(encoder_input(torch.from_numpy(crops))).numpy()
        flipped = encoder(encoder_input(torch.from_numpy(np.ascontiguousarray(crops[:, :, ::-1])))).numpy()
    stored = np.load(out / "repa_features.npy")
    assert stored.shape == (6, 128, RES // 4, RES // 4) and stored.dtype == np.float32
    np.testing.assert_allclose(stored[:3], want, atol=1e-5)      # two shards merged in image order
    np.testing.assert_allclose(stored[3:], flipped, atol=1e-5)   # a flipped copy: its own image's features
    assert np.abs(want - flipped).max() > 1e-3

    ds = LatentDataset(out)                      # not read unless a REPA run asks
    assert not ds.has_extras and len(ds.__getitems__([0, 4])) == 2
    ds.read_repa_features()
    x, y, extras = pickle.loads(pickle.dumps(ds)).__getitems__([4, 0])     # a loader worker's copy reads them too
    assert ds.has_extras and list(extras) == ["repa_features"]
    np.testing.assert_array_equal(extras["repa_features"].numpy(), stored[[4, 0]])


@pytest.fixture(scope="module")
def stored_copy(tmp_path_factory):
    """The tiny run's built-in data copied (float32) with toy_random's features of its images as training decodes
    them (identity data), so the stored and the decoded targets are the same numbers."""
    cfg = compose_cfg("train", TINY + [f"paths.cache_dir={shared_cache(tmp_path_factory)}", *QUIET])
    source = build_dataset(cfg.data)
    meta = source.meta
    latents, labels = np.load(source.root / "latents.npy").astype(np.float32), np.load(source.root / "labels.npy")
    encoder = build_patch_encoder("toy_random", resolution=int(cfg.data.resolution))
    images = decode_to_uint8(torch.from_numpy(latents) * meta["latent_scale"], meta)
    with torch.no_grad():
        features = encoder(encoder_input(images)).numpy()
    path = tmp_path_factory.mktemp("stored") / "toy_repa"
    write_latent_dataset(path, latents, labels, num_classes=meta["num_classes"], latent_scale=meta["latent_scale"],
                         decode=meta["decode"], dtype="float32", extras={"repa_features": features},
                         repa_features={"encoder": "toy_random", "digest": encoder_digest(encoder), "dim": 128,
                                        "grid": list(features.shape[-2:])})
    return path


def copy_with(source, path, features, **meta):
    """The dataset at `source` written again at `path` with `features` as its REPA features (meta changed by
    `meta`)."""
    old = read_meta(source)
    with LatentDatasetWriter(path, shape=old["shape"], num_samples=old["num_samples"],
                             num_classes=old["num_classes"], decode=old["decode"], dtype="float32",
                             repa_features={**old["repa_features"], **meta}) as writer:
        writer.write(0, np.load(source / "latents.npy"), np.load(source / "labels.npy"), {"repa_features": features})
    return path


def losses(run_dir):
    return [(r["loss"], r["repa_loss"]) for r in read_metrics(run_dir) if r["type"] == "train"]


def test_stored_targets_give_the_decode_paths_losses(tiny_cfg, stored_copy, tmp_path):
    data = [f"data.path={stored_copy}", "data.builtin=null"]
    stored = train(tiny_cfg(*QUIET, *data, "model.repa.targets=precomputed"), tmp_path / "stored")
    decoded = train(tiny_cfg(*QUIET, *data, "model.repa.targets=decoded"), tmp_path / "decoded")
    assert stored["repa_targets"] == "precomputed" and decoded["repa_targets"] == "decoded"
    assert stored["repa_encoder_flops_per_step"] == 0 < decoded["repa_encoder_flops_per_step"]
    assert len(losses(tmp_path / "stored")) == 2
    np.testing.assert_allclose(losses(tmp_path / "stored"), losses(tmp_path / "decoded"), rtol=1e-5)
    # the stored numbers are what the step aligns with: each sample given another's features changes the loss
    shifted = copy_with(stored_copy, tmp_path / "shifted", np.roll(np.load(stored_copy / "repa_features.npy"), 1, 0))
    train(tiny_cfg(*QUIET, f"data.path={shifted}", "data.builtin=null"), tmp_path / "shifted_run")
    assert losses(tmp_path / "shifted_run")[0][1] != pytest.approx(losses(tmp_path / "decoded")[0][1], rel=1e-3)


def test_another_encoders_features_are_refused_or_passed_over(tiny_cfg, stored_copy, tmp_path, capsys):
    # the same data, its features marked as another toy_random's
    other = copy_with(stored_copy, tmp_path / "other", np.load(stored_copy / "repa_features.npy"), digest="0" * 64)
    data = [f"data.path={other}", "data.builtin=null"]
    with pytest.raises(ModelConfigError, match=r"model.repa.targets=precomputed but the data's REPA features were "
                                               r"made by other toy_random weights \(digest 000000000000"):
        train(tiny_cfg(*QUIET, *data, "model.repa.targets=precomputed"), tmp_path / "refused")
    assert not (tmp_path / "refused" / "checkpoints").exists()
    summary = train(tiny_cfg(*QUIET, *data), tmp_path / "auto")          # targets: auto
    assert summary["repa_targets"] == "decoded"
    assert "note: REPA targets are decoded each step: the data's REPA features were made by other" in \
        capsys.readouterr().out


def test_builtin_data_without_features_needs_decoding(tiny_cfg, tmp_path):
    with pytest.raises(ModelConfigError, match="model.repa.targets=precomputed but the data stores no REPA "
                                               "features .* --repa-encoder toy_random"):
        train(tiny_cfg(*QUIET, "model.repa.targets=precomputed"), tmp_path / "run")


@pytest.mark.parametrize("change,message", [
    ({"repa_features": None}, "meta has files.repa_features but no 'repa_features'"),
    ({"repa_features": {"encoder": "toy", "digest": "ab", "dim": 4, "grid": [2]}},
     r"key 'repa_features.grid' is \[2\] but must be \[h, w\]"),
    ({"repa_features": {"encoder": "", "digest": "ab", "dim": 4, "grid": [2, 2]}},
     "key 'repa_features.encoder' is '' but must be a non-empty string"),
])
def test_bad_repa_meta_is_one_error(tmp_path, change, message):
    path = tmp_path / "ds"
    write_latent_dataset(path, np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64), num_classes=1,
                         extras={"repa_features": np.zeros((2, 4, 2, 2), np.float32)},
                         repa_features={"encoder": "toy", "digest": "ab", "dim": 4, "grid": [2, 2]})
    meta = read_meta(path)
    meta.update(change)
    if meta["repa_features"] is None:
        del meta["repa_features"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LatentDatasetError, match=message):
        LatentDataset(path)


def test_features_of_another_shape_than_described_are_refused(tmp_path):
    with pytest.raises(LatentDatasetError, match=r"extras\['repa_features'\] .* of shape \(2, 4, 2, 2\) .* got "
                                                 r"shape \(2, 4, 3, 3\)"):
        write_latent_dataset(tmp_path / "ds", np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64),
                             num_classes=1, extras={"repa_features": np.zeros((2, 4, 3, 3), np.float32)},
                             repa_features={"encoder": "toy", "digest": "ab", "dim": 4, "grid": [2, 2]})


@pytest.mark.parametrize("extra,message", [
    ({"repa_encoder": "clip"}, "--repa-encoder='clip' is not valid: one of toy, toy_random, toy_fid, dinov2"),
    ({"repa_encoder": "dinov2"}, "--repa-encoder-weights=None is not valid: a local transformers Dinov2Model"),
    ({"repa_encoder": "toy", "repa_encoder_weights": "x"}, "--repa-encoder-weights='x' is not valid: left out"),
    ({"repa_encoder_weights": "x"}, "--repa-encoder-weights only applies with --repa-encoder NAME"),
])
def test_bad_repa_flags_fail_before_any_work(tmp_path, images_dir, extra, message):
    with pytest.raises(PrecomputeError, match=message):
        check_request(PrecomputeRequest(images=str(images_dir), out=str(tmp_path / "ds"), **extra))


def test_clips_take_no_repa_encoder(tmp_path):
    (tmp_path / "clips").mkdir()
    with pytest.raises(PrecomputeError, match="--repa-encoder cannot be used with --videos"):
        check_request(PrecomputeRequest(videos=str(tmp_path / "clips"), frames=1, out=str(tmp_path / "ds"),
                                        repa_encoder="toy_random"))
