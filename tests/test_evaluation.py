"""Evaluation: Fréchet distance, feature statistics, feature extractors, image I/O, references, fid.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from tread.data import ensure_toy_classifier
from tread.encoders import features as feat_mod
from tread.encoders.errors import EncoderError
from tread.encoders.features import (InceptionFeatures, ToyClassifierFeatures, build_feature_extractor,
                                     save_random_inception_weights)
from tread.encoders.toy_classifier import (ToyClassifier, cache_path, load_toy_classifier, save_toy_classifier,
                                           train_toy_classifier)
from tread.evaluation.extractors import extract_features, feature_extractor
from tread.evaluation.frechet import FeatureStats, frechet_distance
from tread.evaluation.images import load_images, make_grid, save_image_grid, save_npz, save_png_folder
from tread.evaluation.reference import (compute_stats, load_reference, load_reference_full, reference_for_dataset,
                                        save_reference)

from conftest import blob_images
from tread.schema import compose
from tread.checkpoint.tensorfile import load_state, save_state


def random_gaussian_stats(rng, d, n=None):
    x = rng.standard_normal((n or 3 * d, d)) @ rng.standard_normal((d, d)) + rng.standard_normal(d)
    return x.mean(0), np.cov(x, rowvar=False)


class PixelFeatures(nn.Module):
    """A fast stand-in extractor: a fixed random projection of 8x8-pooled pixels (pool), the 2x2-pooled
    pixels (spatial) and a projection of the pool features (logits)."""

    name, dim, spatial_dim, num_logits = "pixels", 16, 12, 5

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3 * 64, self.dim)
        self.head = nn.Linear(self.dim, self.num_logits)

    def forward(self, x):
        return self.proj(nn.functional.adaptive_avg_pool2d(x.float() / 255, 8).flatten(1))

    def forward_all(self, x):
        pool = self(x)
        spatial = nn.functional.adaptive_avg_pool2d(x.float() / 255, 2).permute(0, 2, 3, 1).flatten(1)
        return {"pool": pool, "spatial": spatial, "logits": self.head(pool)}


# ----------------------------------------------------------------------------- frechet


def test_frechet_distance_matches_direct_scipy():
    rng = np.random.default_rng(0)
    mu1, s1 = random_gaussian_stats(rng, 12)
    mu2, s2 = random_gaussian_stats(rng, 12)
    direct = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    # Independent formula: tr sqrtm(S1 S2) = sum sqrt(eig(S1^1/2 S2 S1^1/2)).
    r1 = scipy.linalg.sqrtm(s1).real
    eig = np.linalg.eigvalsh(r1 @ s2 @ r1)
    independent = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2) - 2 * np.sqrt(np.clip(eig, 0, None)).sum()
    fid = frechet_distance(mu1, s1, mu2, s2)
    assert isinstance(fid, float)
    assert fid == pytest.approx(direct, rel=1e-6)
    assert fid == pytest.approx(independent, rel=1e-6)


def test_frechet_distance_methods_agree_and_handle_rank_deficiency():
    rng = np.random.default_rng(4)
    mu1, s1 = random_gaussian_stats(rng, 30)
    mu2, s2 = random_gaussian_stats(rng, 30)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(frechet_distance(mu1, s1, mu2, s2, method="sqrtm"),
                                                               rel=1e-9)
    # 5 samples in 30-d: rank-4 covariances (the few-sample case); still finite and >= 0 up to round-off
    a, b = rng.standard_normal((5, 30)), rng.standard_normal((5, 30)) + 0.3
    fid = frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
    assert np.isfinite(fid) and fid > 0
    same = frechet_distance(a.mean(0), np.cov(a, rowvar=False), a.mean(0), np.cov(a, rowvar=False))
    assert abs(same) < 1e-6 * fid
    with pytest.raises(ValueError, match="NaN or inf"):
        frechet_distance(mu1 * np.nan, s1, mu2, s2)
    with pytest.raises(ValueError, match="method"):
        frechet_distance(mu1, s1, mu2, s2, method="svd")


def test_frechet_distance_identity_and_mean_shift():
    rng = np.random.default_rng(1)
    mu, s = random_gaussian_stats(rng, 10)
    assert abs(frechet_distance(mu, s, mu, s)) < 1e-6
    d = rng.standard_normal(10)
    assert frechet_distance(mu, s, mu + d, s) == pytest.approx(float(d @ d), rel=1e-6, abs=1e-6)


def test_frechet_distance_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="differ in shape"):
        frechet_distance(np.zeros(4), np.eye(4), np.zeros(5), np.eye(5))
    with pytest.raises(ValueError, match="sigma2 has shape"):
        frechet_distance(np.zeros(4), np.eye(4), np.zeros(4), np.eye(3))


def test_feature_stats_streaming_and_merge_match_numpy():
    x = np.random.default_rng(2).standard_normal((301, 7)) * 3 + 5
    stream = FeatureStats()
    for i in range(0, len(x), 64):  # a mix of tensors and arrays
        stream.update(torch.from_numpy(x[i:i + 64]) if i % 128 else x[i:i + 64])
    assert stream.n == 301
    np.testing.assert_allclose(stream.mean(), x.mean(0), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(stream.cov(), np.cov(x, rowvar=False), rtol=1e-10, atol=1e-10)
    merged = FeatureStats().update(x[:100]).merge(FeatureStats().update(x[100:]))
    assert merged.n == 301
    np.testing.assert_allclose(merged.mean(), x.mean(0), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(merged.cov(), np.cov(x, rowvar=False), rtol=1e-10, atol=1e-10)
    whole = FeatureStats().update(x)
    np.testing.assert_allclose(whole.cov(), np.cov(x, rowvar=False), rtol=1e-10, atol=1e-10)
    assert whole.all_reduce() is whole  # not distributed: a no-op
    assert set(whole.to_npz_dict()) == {"mu", "sigma"}
    with pytest.raises(ValueError, match="feature dim"):
        whole.update(np.zeros((2, 3)))


def _metrics_on_this_rank(rank, world, images):
    """FeatureAccumulator and ReferenceBuilder over this rank's share (rank 1 of 2 adds nothing for the
    builder, to check that an empty rank still joins), gathered; returns what every rank must agree on."""
    from tread.evaluation.metrics import FeatureAccumulator
    from tread.evaluation.reference import ReferenceBuilder

    torch.manual_seed(0)
    ext = PixelFeatures().eval().requires_grad_(False)
    acc = FeatureAccumulator(ext, ["fid", "sfid", "is", "kid"])
    mine = list(range(len(images)))[rank::world]
    for i in range(0, len(mine), 3):
        idx = mine[i:i + 3]
        acc.add(torch.from_numpy(images[idx]).permute(0, 3, 1, 2), idx)
    acc.gather()
    builder = ReferenceBuilder(ext, total=len(images), store_images=7, seed=1)
    if rank == 0:
        builder.add(images[:9], range(9))
    if rank == world - 1:
        builder.add(torch.from_numpy(images[9:]), range(9, len(images)))
    builder.all_reduce()
    kept = builder._kept()
    return {"n": acc.n, "indices": acc.indices, "pool_rows": acc.pool_rows, "logits": acc.logits,
            "mu": acc.pool_stats.mean(), "sigma_s": acc.spatial_stats.cov(), "ref_n": builder.n,
            "ref_mu_s": builder.spatial.mean(), "kept": kept[0][np.argsort(kept[1])], "image_size": builder.image_size}


def _all_reduce_worker(rank, store_path, x, images):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    stats = FeatureStats().update(x[rank::2]).all_reduce()
    save_state((stats.n, stats.mean(), stats.cov(), _metrics_on_this_rank(rank, 2, images)), f"{store_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_feature_stats_all_reduce_two_processes(tmp_path):
    """FeatureStats.all_reduce, FeatureAccumulator.gather and ReferenceBuilder.all_reduce over 2 gloo ranks:
    every rank ends with what one process computes alone."""
    x = np.random.default_rng(3).standard_normal((50, 4))
    images = blob_images(17, 16, seed=5)
    torch.multiprocessing.spawn(_all_reduce_worker, args=(str(tmp_path / "store"), x, images), nprocs=2)
    single = _metrics_on_this_rank(0, 1, images)
    for rank in range(2):
        n, mu, cov, multi = load_state(tmp_path / f"store.{rank}")
        assert n == 50
        np.testing.assert_allclose(mu, x.mean(0), atol=1e-12)
        np.testing.assert_allclose(cov, np.cov(x, rowvar=False), atol=1e-12)
        assert multi["n"] == single["n"] == 17 and multi["ref_n"] == 17 and multi["image_size"] == (16, 16)
        assert multi["indices"].tolist() == list(range(17))
        for key in ("pool_rows", "logits"):
            torch.testing.assert_close(multi[key], single[key])
        for key in ("mu", "sigma_s", "ref_mu_s"):
            np.testing.assert_allclose(multi[key], single[key], rtol=1e-10, atol=1e-12)
        assert multi["kept"].shape == (7, 16, 16, 3)
        np.testing.assert_array_equal(multi["kept"], single["kept"])


# ----------------------------------------------------------------------------- images


def test_npz_round_trip_and_bad_npz(tmp_path):
    images = blob_images(5, 16)
    path = save_npz(torch.from_numpy(images), tmp_path / "s.npz", labels=np.arange(5))
    np.testing.assert_array_equal(load_images(path), images)
    assert np.load(path)["arr_1"].tolist() == [0, 1, 2, 3, 4]
    np.savez(tmp_path / "bad.npz", arr_0=images.astype(np.float32))
    with pytest.raises(ValueError, match="bad.npz"):
        load_images(tmp_path / "bad.npz")
    np.savez(tmp_path / "nchw.npz", arr_0=images.transpose(0, 3, 1, 2))
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        load_images(tmp_path / "nchw.npz")
    with pytest.raises(FileNotFoundError):
        load_images(tmp_path / "missing.npz")


def test_npz_streaming_reader(tmp_path):
    from tread.utils.readers import iter_npz_batches, npz_array_info

    images = blob_images(7, 8)
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "a.npz", arr_0=images, other=np.arange(3))
        assert npz_array_info(tmp_path / "a.npz") == ((7, 8, 8, 3), np.dtype(np.uint8))
        batches = list(iter_npz_batches(tmp_path / "a.npz", batch_size=3))
        assert [len(b) for b in batches] == [3, 3, 1] and batches[0].flags.writeable
        np.testing.assert_array_equal(np.concatenate(batches), images)
    with pytest.raises(ValueError, match="no 'arr_1' array"):
        npz_array_info(tmp_path / "a.npz", "arr_1")


def test_png_folder_round_trip_and_errors(tmp_path):
    images = blob_images(4, 16)
    folder = save_png_folder(images, tmp_path / "imgs", start_index=3)
    assert sorted(p.name for p in folder.iterdir()) == [f"{i:06d}.png" for i in range(3, 7)]
    np.testing.assert_array_equal(load_images(folder), images)
    save_png_folder(blob_images(1, 8), folder, start_index=10)
    with pytest.raises(ValueError, match="sizes differ"):
        load_images(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        load_images(tmp_path / "empty")


def test_image_grid(tmp_path):
    grid = make_grid(blob_images(5, 8), nrow=3, upscale=2)
    assert grid.shape == (2 + 2 * 18, 2 + 3 * 18, 3)
    path = save_image_grid(blob_images(5, 8), tmp_path / "g" / "grid.png", nrow=3, upscale=2)
    np.testing.assert_array_equal(load_images(path.parent)[0], grid)
    assert [p.name for p in path.parent.iterdir()] == ["grid.png"]  # no temp files left behind


# ----------------------------------------------------------------------------- references


def test_reference_save_load_and_checks(tmp_path):
    ext = PixelFeatures().eval().requires_grad_(False)
    images = blob_images(40)
    stats = compute_stats(ext, images, batch_size=16)
    ref = save_reference(tmp_path / "ref.npz", stats, ext.name, images=images)
    mu, sigma = load_reference(ref, ext)
    np.testing.assert_allclose(mu, stats.mean())
    assert int(np.load(ref)["num_images"]) == 40 and str(np.load(ref)["feature"]) == "pixels"
    # An ADM-style file with only images: statistics are computed from arr_0.
    save_npz(images, tmp_path / "adm.npz")
    mu2, sigma2 = load_reference(tmp_path / "adm.npz", ext)
    assert frechet_distance(mu, sigma, mu2, sigma2) == pytest.approx(0, abs=1e-6)
    other = PixelFeatures()
    other.name = "inception"
    with pytest.raises(ValueError, match="'pixels' features.*'inception'"):
        load_reference(ref, other)
    with pytest.raises(FileNotFoundError, match="fid.py mode=ref"):
        load_reference(tmp_path / "nope.npz", ext)


def test_extract_features_accepts_tensor_array_or_batches():
    ext = PixelFeatures().eval()
    nhwc = blob_images(20)
    nchw = torch.from_numpy(nhwc).permute(0, 3, 1, 2)
    expected = compute_stats(ext, nhwc, batch_size=7).mean()
    for images in (nchw, nchw.numpy(), [nchw[:5], nchw[5:]]):
        np.testing.assert_allclose(extract_features(ext, images, batch_size=6).mean(), expected, atol=1e-6)


class Latents(torch.utils.data.Dataset):
    """A stand-in latent dataset: pixels in [-1, 1] with identity decoding."""

    meta = {"shape": [3, 16, 16], "num_classes": 2, "decode": {"type": "identity"}}
    buckets = None       # what reference_for_dataset reads of a dataset (tread.data.DatasetInfo): one shape

    def __init__(self, root):
        self.root = root
        self.x = torch.from_numpy(blob_images(30, 16)).permute(0, 3, 1, 2).float() / 127.5 - 1

    def __getitems__(self, idx):      # the batched read every latent dataset has
        return self.x[idx], torch.tensor(idx) % 2

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 2


def test_reference_for_dataset_decodes_and_caches(tmp_path, monkeypatch):
    from tread import data

    calls = []

    def decode(latents, meta, **kwargs):
        calls.append(kwargs)
        return ((latents + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)

    monkeypatch.setattr(data, "decode_to_uint8", decode, raising=False)
    ext = PixelFeatures().eval()
    subset = np.sort(np.random.default_rng(0).choice(30, 20, replace=False))
    images = blob_images(30, 16)[subset]
    expected = compute_stats(ext, images).mean()
    out = tmp_path / "ref.npz"
    reference_for_dataset(Latents("/data/aTrue"), ext, out, max_images=20, batch_size=8)
    np.testing.assert_allclose(load_reference(out, ext)[0], expected, atol=1e-6)
    with np.load(out) as saved:  # ADM layout: images, pool and spatial statistics
        np.testing.assert_array_equal(saved["arr_0"], images)
        assert saved["mu_s"].shape == (12,) and int(saved["resolution"]) == 16
    mtime = out.stat().st_mtime_ns
    reference_for_dataset(Latents("/data/aTrue"), ext, out, max_images=20)  # cached: same features/data/count
    assert out.stat().st_mtime_ns == mtime
    reference_for_dataset(Latents("/data/aTrue"), ext, out, max_images=10)  # another count: rebuilt
    assert int(np.load(out)["num_images"]) == 10
    # decode options reach decode_to_uint8 and are part of the cache key
    calls.clear()
    reference_for_dataset(Latents("/data/aTrue"), ext, out, max_images=10, decode_kwargs={"vae": "x.pt"})
    assert calls and calls[0] == {"vae": "x.pt"} and str(np.load(out)["decode"]) == "vae='x.pt'"
    # An older cache (pool statistics only) is rebuilt with the new keys.
    save_reference(out, compute_stats(ext, images[:10]), ext.name, extra={"source": np.array("/data/aTrue")})
    reference_for_dataset(Latents("/data/aTrue"), ext, out, max_images=10)
    assert {"mu_s", "sigma_s", "arr_0"} <= set(np.load(out).files)
    ref = load_reference_full(out, ext, need=("fid", "sfid", "precision"))
    assert ref.pool_rows.shape == (10, 16) and ref.mu_s.shape == (12,)


def test_reference_for_dataset_uses_the_posterior_mean_of_moments(tmp_path, monkeypatch):
    """'moments' data (mean, logvar) is decoded from data.draw_latents(mode="mean") = latent_scale * mean:
    no sampling noise, whatever the variance."""
    from tread import data

    def decode(latents, meta, **kwargs):  # model-space pixels in [-1, 1] -> uint8 NHWC
        return ((latents + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)

    monkeypatch.setattr(data, "decode_to_uint8", decode, raising=False)
    ext = PixelFeatures().eval()

    class Moments(Latents):
        meta = {"shape": [6, 16, 16], "num_classes": 2, "latent_kind": "moments", "latent_scale": 0.5,
                "decode": {"type": "identity"}}

        def __getitems__(self, idx):  # raw mean = 2 x (so 0.5 * mean = x), large logvar
            return torch.cat([self.x[idx] * 2, torch.full_like(self.x[idx], 3.0)], dim=1), torch.tensor(idx) % 2

    reference_for_dataset(Moments("/data/m"), ext, tmp_path / "m.npz", max_images=12)
    subset = np.sort(np.random.default_rng(0).choice(30, 12, replace=False))
    with np.load(tmp_path / "m.npz") as saved:
        np.testing.assert_array_equal(saved["arr_0"], blob_images(30, 16)[subset])


# ----------------------------------------------------------------------------- Inception


@pytest.fixture(scope="module")
def random_inception_weights(tmp_path_factory):
    """torch-fidelity's Inception-v3 architecture with random weights, saved in its weights format."""
    return save_random_inception_weights(tmp_path_factory.mktemp("inception") / "random-inception.pth")


def test_inception_url_matches_torch_fidelity():
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    assert feat_mod.INCEPTION_URL == URL_INCEPTION_V3


def test_inception_features_from_weights_file(random_inception_weights):
    ext = build_feature_extractor("inception", inception_weights=random_inception_weights)
    assert ext.name == "inception" and ext.dim == 2048 and not ext.training
    assert not any(p.requires_grad for p in ext.parameters())
    out = ext(torch.from_numpy(blob_images(2, 64)).permute(0, 3, 1, 2))
    assert out.shape == (2, 2048) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_inception_missing_weights_and_no_network(tmp_path, monkeypatch):
    with pytest.raises(EncoderError, match="eval.inception_weights") as err:
        InceptionFeatures(tmp_path / "absent.pth")
    assert f"file (eval.inception_weights / inception_weights) at '{tmp_path / 'absent.pth'}'. To provide it: " \
           f"download https://" in str(err.value)

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(EncoderError, match="inception_weights=") as err:
        InceptionFeatures()
    assert "weights-inception-2015-12-05-6726825d.pth" in str(err.value) and "\n" not in str(err.value)
    assert str(tmp_path / "hub" / "checkpoints") in str(err.value)


def test_inception_wrong_weights_file(tmp_path):
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "other.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    for name in ("other.pth", "garbage.pth"):
        with pytest.raises(EncoderError, match="not usable as torch-fidelity Inception-v3 weights"):
            InceptionFeatures(tmp_path / name)


def test_unknown_features_name():
    for build in (build_feature_extractor, lambda name: feature_extractor(name, cache_dir="unused")):
        with pytest.raises(EncoderError, match="eval.features.*toy_classifier"):
            build("clip")


def fid_cfg(**kw):
    """configs/fid.yaml composed without the command line, as tread.cli.fid.run() takes it."""
    return OmegaConf.merge(compose([], "fid"), {"cache_dir": "unused", **kw})


@pytest.mark.slow  # ~11 s: 299px Inception on CPU and a 2048x2048 sqrtm
@pytest.mark.filterwarnings("ignore:Matrix is singular")  # 6 images, 2048-d: rank-deficient covariances
def test_fid_inception_end_to_end(tmp_path, random_inception_weights):
    import tread.cli.fid as fid

    save_png_folder(blob_images(6, 48, seed=1), tmp_path / "ref_imgs")
    save_npz(blob_images(6, 48, seed=2), tmp_path / "samples.npz")
    common = dict(features="inception", inception_weights=str(random_inception_weights), batch_size=4)
    ref = fid.run(fid_cfg(mode="ref", source=str(tmp_path / "ref_imgs"), out=str(tmp_path / "ref.npz"), **common))
    assert ref["num_images"] == 6
    metrics = fid.run(fid_cfg(mode="calc", images=str(tmp_path / "samples.npz"), ref=str(tmp_path / "ref.npz"),
                              out_json=str(tmp_path / "m.json"), **common))
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["fid"] == pytest.approx(metrics["fid"]) and np.isfinite(saved["fid"])
    assert saved["num_images"] == 6 and saved["features"] == "inception"


def test_fid_validates_before_work(tmp_path):
    import tread.cli.fid as fid

    (tmp_path / "r.npz").touch()
    with pytest.raises(FileNotFoundError, match="images="):
        fid.run(fid_cfg(mode="calc", images=str(tmp_path / "none.npz"), ref=str(tmp_path / "r.npz")))
    with pytest.raises(ValueError, match="needs out="):
        fid.run(fid_cfg(mode="ref", source=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="inception_weights="):
        fid.run(fid_cfg(mode="ref", source=str(tmp_path), out="x.npz", features="inception",
                        inception_weights=str(tmp_path / "w.pth")))
    with pytest.raises(ValueError, match="mode=ref.*mode=calc"):
        fid.run(fid_cfg())  # mode is ??? (missing)


# ----------------------------------------------------------------------------- toy classifier

def small_budget():
    """A small training set (60 per class, 20 held out) and 3 epochs: ~1-2 s; the real budget is 300 x 4."""
    x, y = toy_images(60, seed=12345, with_labels=True)
    x_val, y_val = toy_images(20, seed=12346, with_labels=True)
    return dict(images=x, labels=y, val_images=x_val, val_labels=y_val, epochs=3)


@pytest.fixture(scope="module")
def small_toy_classifier():
    return train_toy_classifier(**small_budget())


def toy_images(num_per_class, seed, with_labels=False):
    from tread.data.builtin.toy import generate_toy_shapes

    x, y = generate_toy_shapes(num_per_class, 32, seed)
    x = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return (x, y) if with_labels else x


def test_toy_classifier_accuracy_and_determinism(small_toy_classifier):
    model, acc = small_toy_classifier
    assert acc > 0.6  # chance is 0.1
    again, acc2 = train_toy_classifier(**small_budget())
    x = toy_images(3, seed=7)
    assert acc2 == acc
    torch.testing.assert_close(again.features(x), model.features(x), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Matrix is singular")  # constant images: zero covariance
def test_toy_classifier_fid_separates_real_from_broken(small_toy_classifier):
    ext = ToyClassifierFeatures(small_toy_classifier[0]).eval()
    real_a, (real_b, labels_b) = toy_images(30, seed=101), toy_images(30, seed=202, with_labels=True)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, real_a.shape, generator=gen, dtype=torch.uint8)
    constant = torch.full_like(real_a, 128)
    one_class = real_b[labels_b == 0].repeat(10, 1, 1, 1)  # mode collapse: a single class

    def stats(x):
        s = extract_features(ext, x, batch_size=100)
        return s.mean(), s.cov()

    ref = stats(real_a)
    fid_real = frechet_distance(*stats(real_b), *ref)
    for broken in (noise, constant, one_class):
        assert frechet_distance(*stats(broken), *ref) > 5 * fid_real


def test_toy_classifier_forward_all(small_toy_classifier, tmp_path):
    model = small_toy_classifier[0]
    ext = ToyClassifierFeatures(model).eval()
    x = toy_images(1, seed=9)                                          # 10 images, 32 px
    out = ext.forward_all(x)
    # spatial: block 4's output (64 channels at 8x8 for 32 px), channels [:7] in NHWC order -> 448-d
    assert ext.dim == 64 and ext.num_logits == 10 and ext.spatial_dim == 8 * 8 * 7 and ext.resolution == 32
    assert out["pool"].shape == (10, 64) and out["spatial"].shape == (10, 448) and out["logits"].shape == (10, 10)
    with torch.no_grad():
        torch.testing.assert_close(out["pool"], ext(x))
        torch.testing.assert_close(out["logits"], model(x))
        mid = model.trunk[:ToyClassifierFeatures.SPATIAL_LAYER + 1](model._normalise(x))
    assert mid.shape == (10, 64, 8, 8)
    torch.testing.assert_close(out["spatial"].view(10, 8, 8, 7), mid[:, :7].permute(0, 2, 3, 1))
    assert ToyClassifierFeatures(ToyClassifier(resolution=20)).spatial_dim == 5 * 5 * 7  # 20 -> 10 -> 5
    # A reference of other-sized images cannot be scored with a classifier trained at 32 px.
    np.savez(tmp_path / "r64.npz", mu=np.zeros(64), sigma=np.eye(64), resolution=np.array(64))
    with pytest.raises(ValueError, match="r64.npz.*'resolution'.*64x64 images.*32x32"):
        load_reference_full(tmp_path / "r64.npz", ext)


def test_toy_classifier_cache_round_trip(tmp_path, monkeypatch):
    import tread.data.builtin.toy as toy

    calls = []

    def fake_train(images, labels, val_images, val_labels, *, seed, verbose=False):
        calls.append((seed, images.shape, images.dtype, val_images.shape, int(labels.max())))
        torch.manual_seed(seed)
        return ToyClassifier(resolution=images.shape[-1]).eval(), 0.95

    monkeypatch.setattr(toy, "train_toy_classifier", fake_train)
    path = ensure_toy_classifier(tmp_path, verbose=False)
    assert path == cache_path(tmp_path) and path.name == "toy_classifier_r32_s12345.pt" and path.is_file()
    assert json.loads(path.with_suffix(".json").read_text())["accuracy"] == 0.95
    assert ensure_toy_classifier(tmp_path, verbose=False) == path
    # 300 fresh images per class at 32 px (75 held out, from the next seed), trained once and then reused
    assert calls == [(12345, (3000, 3, 32, 32), torch.uint8, (750, 3, 32, 32), 9)]
    x = torch.from_numpy(blob_images(4)).permute(0, 3, 1, 2)
    torch.manual_seed(12345)
    trained = ToyClassifier().eval()  # what fake_train made (loading below draws from the global RNG too)
    torch.testing.assert_close(load_toy_classifier(path).features(x), trained.features(x), rtol=0, atol=0)
    ext = feature_extractor("toy_classifier", cache_dir=tmp_path)
    assert ext.name == "toy_classifier" and ext.dim == 64 and ext(x).shape == (4, 64)
    with pytest.raises(EncoderError, match="features toy_classifier need the classifier's file"):
        build_feature_extractor("toy_classifier")


def test_fid_ref_from_latent_dataset_then_calc(tmp_path):
    import tread.cli.fid as fid

    toy = pytest.importorskip("tread.data.builtin.toy")
    torch.manual_seed(0)
    save_toy_classifier(ToyClassifier().eval(), cache_path(tmp_path / "cache"), {"accuracy": None})
    root = toy.ensure_toy_dataset(tmp_path / "toy", num_per_class=8)
    common = dict(cache_dir=str(tmp_path / "cache"), batch_size=32)
    ref = fid.run(fid_cfg(mode="ref", source=str(root), out=str(tmp_path / "ref.npz"), max_images=50, **common))
    assert ref["num_images"] == 50 and ref["features"] == "toy_classifier"
    save_npz(toy_images(8, seed=0).permute(0, 2, 3, 1), tmp_path / "same.npz")  # the dataset's own images
    metrics = fid.run(fid_cfg(mode="calc", images=str(tmp_path / "same.npz"), ref=str(tmp_path / "ref.npz"), **common))
    assert metrics["num_images"] == 80 and 0 <= metrics["fid"] < 50

# The fid.py command line (ref / calc / bench) is tested in tests/test_fid.py.
