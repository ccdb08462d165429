"""The ADM metric suite: IS, precision/recall, KID, FID/sFID through FeatureAccumulator and compute_metrics,
Inception's forward_all, ADM reference batches read as they are, and the images-on-disk pipeline."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn as nn

from tread.encoders.features import build_feature_extractor, save_random_inception_weights
from tread.evaluation.images import save_npz, save_png_folder
from tread.evaluation.metrics import (METRICS, FeatureAccumulator, compute_metrics, inception_score, kid,
                                manifold_radii, precision_recall)
from tread.evaluation.reference import Reference, ReferenceBuilder, build_reference, load_reference_full


def scipy_fid(x, mu2, sigma2):
    """FID of feature rows x against (mu2, sigma2), directly with scipy (the ADM / TTUR recipe)."""
    mu1, sigma1 = x.mean(0), np.cov(x, rowvar=False)
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2).real
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(sigma1 + sigma2 - 2 * covmean))


class LookupExtractor(nn.Module):
    """Features looked up from fixed tables by the index written into each 2x2 image's first pixel,
    so metrics of known feature rows can go through the whole accumulator path."""

    name = "lookup"

    def __init__(self, pool, spatial, logits):
        super().__init__()
        self.register_buffer("pool", torch.as_tensor(pool, dtype=torch.float32))
        self.register_buffer("spatial", torch.as_tensor(spatial, dtype=torch.float32))
        self.register_buffer("logits", torch.as_tensor(logits, dtype=torch.float32))
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # extractor_device() looks at parameters
        self.dim, self.spatial_dim, self.num_logits = self.pool.shape[1], self.spatial.shape[1], self.logits.shape[1]

    @staticmethod
    def images(indices):
        idx = torch.as_tensor(indices)
        x = torch.zeros(len(idx), 3, 2, 2, dtype=torch.uint8)
        x[:, 0, 0, 0], x[:, 1, 0, 0] = (idx // 256).to(torch.uint8), (idx % 256).to(torch.uint8)
        return x

    def _index(self, x):
        return x[:, 0, 0, 0].long() * 256 + x[:, 1, 0, 0].long()

    def forward(self, x):
        return self.pool[self._index(x)]

    def forward_all(self, x):
        i = self._index(x)
        return {"pool": self.pool[i], "spatial": self.spatial[i], "logits": self.logits[i]}


@pytest.fixture(scope="module")
def lookup():
    rng = np.random.default_rng(0)
    n = 40
    pool = rng.standard_normal((n, 6)) @ rng.standard_normal((6, 6)) + 1.0
    spatial = rng.standard_normal((n, 5)) * 2.0
    logits = rng.standard_normal((n, 4)) * 3.0
    return LookupExtractor(pool, spatial, logits), pool, spatial, logits


def lookup_reference(rng, ext, n_ref=30):
    ref_pool = rng.standard_normal((n_ref, ext.dim)) * 1.5
    ref_spatial = rng.standard_normal((n_ref, ext.spatial_dim)) + 0.5
    return Reference(feature="lookup", mu=ref_pool.mean(0), sigma=np.cov(ref_pool, rowvar=False),
                     mu_s=ref_spatial.mean(0), sigma_s=np.cov(ref_spatial, rowvar=False), num_images=n_ref,
                     pool_rows=torch.from_numpy(ref_pool).float())


# ----------------------------------------------------------------------------- Inception Score


def test_inception_score_hand_worked():
    # Uniform predictions: p_i = mean p, every KL is 0 -> IS = exp(0) = 1.
    assert inception_score(torch.zeros(7, 10)) == pytest.approx(1.0, abs=1e-12)
    # K confident, evenly spread classes: KL(one-hot || uniform) = log K for every row -> IS = K.
    for k in (2, 5):
        assert inception_score(100.0 * torch.eye(k).repeat(3, 1)) == pytest.approx(k, rel=1e-9)
    # One split of p1 = (1, 0), p2 = (1/2, 1/2): mean = (3/4, 1/4); KL1 = log(4/3),
    # KL2 = 1/2 log(2/3) + 1/2 log(2) = 1/2 log(4/3) -> IS = exp(3/4 log(4/3)) = (4/3)^(3/4).
    two = torch.tensor([[100.0, 0.0], [0.0, 0.0]])
    assert inception_score(two) == pytest.approx((4 / 3) ** 0.75, rel=1e-9)
    # split_size=2 over 5 rows: splits [0, 1], [2, 3], [4] (the last one shorter, as ADM's range()).
    # Split 1: two confident distinct classes -> 2; split 2: the pair above -> (4/3)^(3/4);
    # split 3: a single row equals its own mean -> 1. IS = their mean.
    rows = torch.cat([100.0 * torch.eye(2), two, torch.tensor([[3.0, -1.0]])])
    expected = (2 + (4 / 3) ** 0.75 + 1) / 3
    assert inception_score(rows, split_size=2) == pytest.approx(expected, rel=1e-9)
    assert inception_score(rows, split_size=5000) == pytest.approx(inception_score(rows, split_size=5))


def test_inception_score_matches_adm_numpy_formula():
    logits = np.random.default_rng(1).standard_normal((23, 9)) * 2
    preds = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    scores = []
    for i in range(0, len(preds), 10):  # ADM's loop, verbatim in numpy
        part = preds[i:i + 10]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    assert inception_score(torch.from_numpy(logits), split_size=10) == pytest.approx(np.mean(scores), rel=1e-10)


# ----------------------------------------------------------------------------- precision / recall


def points(xs):
    """1-D points embedded in 2-D (second coordinate 0), integers: exact float32 distances."""
    return torch.tensor([[float(x), 0.0] for x in xs])


def test_precision_recall_hand_worked():
    ref = points([0, 1, 10, 11, 50, 51])
    sam = points([2, 5, 9, 30, 32])
    # k=1 radii (squared distance to the nearest other point of the same set):
    #   ref: 0-1, 10-11, 50-51 pairs -> radius^2 1 for all;
    #   samples: 2->5: 9, 5->2: 9, 9->5: 16, 30->32: 4, 32->30: 4.
    assert manifold_radii(ref, k=1).tolist() == [1, 1, 1, 1, 1, 1]
    assert manifold_radii(sam, k=1).tolist() == [9, 9, 16, 4, 4]
    # precision: samples within a reference ball: 2 (to ref 1: d^2 = 1 <= 1) and 9 (to ref 10: 1 <= 1),
    #   both exactly on the boundary (ADM's `<=`); 5, 30, 32 are not -> 2/5.
    # recall: refs within a sample ball: 0 (to 2: 4 <= 9), 1 (to 2: 1 <= 9), 10 (to 9: 1 <= 16),
    #   11 (to 9: 4 <= 16); 50 and 51 are 18+ from 32 (324 > 4) -> 4/6.
    p, r = precision_recall(ref, sam, k=1)
    assert p == pytest.approx(2 / 5) and r == pytest.approx(4 / 6)
    # k=3 counts the 3rd other point (self is the 0th): ref 0's neighbours 1, 10, 11 -> radius^2 11^2;
    # ref 50's are 51, 11, 10 -> 40^2. Samples: 2 -> 5, 9, 30 -> 28^2; 9 -> 5, 2, 30 -> 21^2; ...
    assert manifold_radii(ref, k=3).tolist() == [121, 100, 100, 121, 1600, 1681]
    assert manifold_radii(sam, k=3).tolist() == [784, 625, 441, 625, 729]
    # precision: 2, 5, 9 lie in ref 0's ball (radius 11), 30 and 32 in ref 50's (radius 40) -> 1.
    # recall: 0..11 lie in sample 2's ball (radius 28), 50 and 51 in sample 30's (radius 25) -> 1.
    assert precision_recall(ref, sam, k=3) == (1.0, 1.0)


def test_precision_recall_identical_and_disjoint():
    x = torch.randn(30, 8, generator=torch.Generator().manual_seed(0))
    assert precision_recall(x, x.clone()) == (1.0, 1.0)  # every point is in its own ball (d = 0)
    assert precision_recall(x, x + 1000.0) == (0.0, 0.0)


def test_precision_recall_batching_matches_brute_force():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((37, 5))
    sam = rng.standard_normal((29, 5)) * 1.3 + 0.4
    k = 3

    def sq(a, b):
        return ((a[:, None, :] - b[None]) ** 2).sum(-1)

    radii_ref = np.sort(sq(ref, ref), 1)[:, k]
    radii_sam = np.sort(sq(sam, sam), 1)[:, k]
    d = sq(ref, sam)
    precision = np.mean((d <= radii_ref[:, None]).any(0))
    recall = np.mean((d <= radii_sam[None, :]).any(1))
    assert 0 < precision < 1 and 0 < recall < 1
    for rb, cb in ((10000, 10000), (7, 5), (1, 3)):
        p, r = precision_recall(torch.from_numpy(ref), sam, k=k, row_batch=rb, col_batch=cb)
        assert (p, r) == pytest.approx((precision, recall), abs=1e-12)


# ----------------------------------------------------------------------------- KID


def test_kid_same_distribution_near_zero_and_deterministic():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((200, 16)), rng.standard_normal((200, 16))
    same, same_std = kid(a, b, subsets=20, subset_size=100)
    shifted, _ = kid(a, b + 0.5, subsets=20, subset_size=100)
    assert abs(same) < 3 * same_std + 1e-3 and shifted > 20 * abs(same) and shifted > 0.1
    assert kid(a, b, subsets=20, subset_size=100) == (same, same_std)  # fixed seed
    assert kid(a, b, subsets=20, subset_size=100, seed=1) != (same, same_std)
    # subset_size is clamped to the smaller set instead of failing
    assert np.isfinite(kid(a[:10], b, subsets=3, subset_size=1000)[0])


def test_kid_matches_torch_fidelity():
    from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, KEY_METRIC_KID_STD, kid_features_to_metric

    rng = np.random.default_rng(4)
    ref = torch.from_numpy(rng.standard_normal((60, 12)))
    sam = torch.from_numpy(rng.standard_normal((50, 12)) * 1.2 + 0.1)
    theirs = kid_features_to_metric(ref, sam, kid_subsets=7, kid_subset_size=40, rng_seed=123, verbose=False)
    mean, std = kid(ref, sam, subsets=7, subset_size=40, seed=123)
    assert mean == pytest.approx(theirs[KEY_METRIC_KID_MEAN], rel=1e-9)
    assert std == pytest.approx(theirs[KEY_METRIC_KID_STD], rel=1e-9)


# ----------------------------------------------------------------------------- accumulator + compute_metrics


def test_compute_metrics_fid_sfid_match_scipy(lookup):
    ext, pool, spatial, logits = lookup
    ref = lookup_reference(np.random.default_rng(5), ext)
    acc = FeatureAccumulator(ext)
    for i in range(0, 40, 16):
        acc.add(LookupExtractor.images(range(i, min(i + 16, 40))), range(i, min(i + 16, 40)))
    scores = compute_metrics(acc, ref, kid_subsets=5, kid_subset_size=20)
    assert list(scores) == ["fid", "sfid", "is", "precision", "recall", "kid", "kid_std", "num_samples"]
    assert scores["fid"] == pytest.approx(scipy_fid(pool, ref.mu, ref.sigma), rel=1e-6)
    assert scores["sfid"] == pytest.approx(scipy_fid(spatial, ref.mu_s, ref.sigma_s), rel=1e-6)
    assert scores["is"] == pytest.approx(inception_score(torch.from_numpy(logits)), rel=1e-6)
    p, r = precision_recall(ref.pool_rows, torch.from_numpy(pool).float())
    assert (scores["precision"], scores["recall"]) == (p, r)
    assert scores["kid"] == pytest.approx(kid(ref.pool_rows, pool, subsets=5, subset_size=20)[0], rel=1e-5)
    assert scores["num_samples"] == 40
    # Only what is asked for is collected and returned.
    only = FeatureAccumulator(ext, ["sfid"]).add(LookupExtractor.images(range(40)), range(40))
    assert only.pool_stats is None and only.pool_rows is None
    assert set(compute_metrics(only, ref, ["sfid"])) == {"sfid", "num_samples"}
    assert only.n == 40 and only.gathered and only.gather() is only  # gathered once; gather() again: no-op


def test_accumulator_independent_of_order_and_batch_size(lookup):
    ext = lookup[0]
    ref = lookup_reference(np.random.default_rng(6), ext)
    kwargs = dict(is_split_size=7, kid_subsets=4, kid_subset_size=15)  # IS splits depend on the row order

    def run(order, batch):
        acc = FeatureAccumulator(ext)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            acc.add(LookupExtractor.images(idx), idx)
        acc.gather()  # one process: sorts by index
        assert acc.indices.tolist() == list(range(40))
        return compute_metrics(acc, ref, **kwargs)

    base = run(list(range(40)), 40)
    perm = np.random.default_rng(7).permutation(40).tolist()
    for order, batch in ((perm, 3), (perm[::-1], 11), (list(range(40)), 1)):
        other = run(order, batch)
        for key, value in base.items():
            assert other[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_compute_metrics_clear_errors(lookup):
    ext = lookup[0]
    ref = lookup_reference(np.random.default_rng(8), ext)
    few = FeatureAccumulator(ext).add(LookupExtractor.images([0, 1, 2]), [0, 1, 2])
    with pytest.raises(ValueError, match="precision/recall with k=3 need at least 4 samples"):
        compute_metrics(few, ref, ["precision"])
    one = FeatureAccumulator(ext, ["fid"]).add(LookupExtractor.images([5]), [5])
    with pytest.raises(ValueError, match="fid needs at least 2 samples"):
        compute_metrics(one, ref, ["fid"])
    acc = FeatureAccumulator(ext).add(LookupExtractor.images(range(10)), range(10))
    bare = Reference(feature="lookup", mu=ref.mu, sigma=ref.sigma, path="adm.npz")
    with pytest.raises(ValueError, match="precision.*adm.npz has no arr_0"):
        compute_metrics(acc, bare, ["precision", "recall"])
    with pytest.raises(ValueError, match="sfid needs the reference's mu_s/sigma_s"):
        compute_metrics(acc, bare, ["sfid"])
    with pytest.raises(ValueError, match=r"metrics \['kid'\] were not collected"):
        compute_metrics(FeatureAccumulator(ext, ["fid"]), ref, ["kid"])
    with pytest.raises(ValueError, match="'inception' features"):
        compute_metrics(acc, Reference(feature="inception", mu=ref.mu, sigma=ref.sigma), ["fid"])
    with pytest.raises(ValueError, match="not valid"):
        FeatureAccumulator(ext, ["fid", "lpips"])
    dup = FeatureAccumulator(ext, ["fid"]).add(LookupExtractor.images([1, 2]), [1, 2])
    dup.add(LookupExtractor.images([2, 3]), [2, 3])
    with pytest.raises(ValueError, match="index 2 was added more than once"):
        dup.gather()


def test_accumulator_without_samples_is_presized(lookup):
    """A rank that generated nothing still has correctly shaped stats and rows to reduce and gather."""
    ext = lookup[0]
    acc = FeatureAccumulator(ext).gather()
    assert acc.n == 0 and acc.pool_stats.dim == ext.dim and acc.spatial_stats.dim == ext.spatial_dim
    assert acc.pool_rows.shape == (0, ext.dim) and acc.logits.shape == (0, ext.num_logits)


# ----------------------------------------------------------------------------- Inception


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    path = save_random_inception_weights(tmp_path_factory.mktemp("inception") / "random-inception.pth", seed=0)
    return build_feature_extractor("inception", inception_weights=path)


def test_random_inception_weights_are_deterministic(tmp_path):
    a = torch.load(save_random_inception_weights(tmp_path / "a.pth", seed=3), weights_only=True)
    b = torch.load(save_random_inception_weights(tmp_path / "b.pth", seed=3), weights_only=True)
    c = torch.load(save_random_inception_weights(tmp_path / "c.pth", seed=4), weights_only=True)
    key = "Mixed_6d.branch1x1.conv.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
    assert set(a) == set(c) and "fc.weight" in a


def test_inception_forward_all_matches_manual_forward(inception):
    from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x

    images = torch.from_numpy(np.random.default_rng(9).integers(0, 256, (2, 3, 40, 40), dtype=np.uint8))
    out = inception.forward_all(images)
    assert inception.spatial_dim == 2023 and inception.num_logits == 1008
    assert out["pool"].shape == (2, 2048) and out["spatial"].shape == (2, 2023) and out["logits"].shape == (2, 1008)
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in out.values())
    torch.testing.assert_close(out["pool"], inception(images))  # forward() = pool features
    net = inception.net
    # logits: pool_3 times the softmax weights, without the bias (ADM's softmax graph).
    torch.testing.assert_close(out["logits"], out["pool"] @ net.fc.weight.T, rtol=1e-4, atol=1e-4)
    # spatial: an independent forward up to Mixed_6d.branch1x1 (ADM's mixed_6/conv), channels [:7], NHWC.
    with torch.no_grad():
        x = interpolate_bilinear_2d_like_tensorflow1x(images.float(), size=(299, 299), align_corners=False)
        x = (x - 128) / 128
        for name in ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1",
                     "Conv2d_4a_3x3", "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b",
                     "Mixed_6c"):
            x = getattr(net, name)(x)
        conv = net.Mixed_6d.branch1x1(x)                                   # (2, 192, 17, 17)
    assert conv.shape == (2, 192, 17, 17)
    spatial = out["spatial"].view(2, 17, 17, 7)
    torch.testing.assert_close(spatial, conv[:, :7].permute(0, 2, 3, 1), rtol=1e-4, atol=1e-5)
    assert spatial[1, 3, 5, 6].item() == pytest.approx(conv[1, 6, 3, 5].item(), rel=1e-4, abs=1e-5)


@pytest.mark.slow  # ~5-10 s on 2 shared CPU cores: 12 Inception images, two ~2K-d Fréchet distances
def test_images_on_disk_to_metrics_json(inception, tmp_path):
    rng = np.random.default_rng(10)
    ref_images = rng.integers(0, 256, (4, 24, 24, 3), dtype=np.uint8)
    sample_images = np.clip(ref_images.astype(int) + rng.integers(-30, 30, (4, 24, 24, 3)), 0, 255).astype(np.uint8)
    save_png_folder(ref_images, tmp_path / "ref_imgs")
    out = build_reference(tmp_path / "ref.npz", inception, tmp_path / "ref_imgs", batch_size=4)
    with np.load(out) as data:
        assert {"arr_0", "mu", "sigma", "mu_s", "sigma_s", "feature", "num_images", "source",
                "resolution"} <= set(data.files)
        np.testing.assert_array_equal(data["arr_0"], ref_images)  # all 4 kept (< store_images)
        assert data["mu_s"].shape == (2023,) and int(data["resolution"]) == 24 and int(data["num_images"]) == 4
        assert str(data["feature"]) == "inception" and str(data["source"]) == str(tmp_path / "ref_imgs")
    reference = load_reference_full(out, inception, batch_size=4, need=METRICS)
    assert reference.pool_rows.shape == (4, 2048) and reference.resolution == (24, 24)
    # Statistics saved by the builder and rows recomputed from arr_0 by the loader describe the same images.
    np.testing.assert_allclose(reference.mu, reference.pool_rows.double().mean(0).numpy(), rtol=1e-4, atol=1e-5)
    acc = FeatureAccumulator(inception)
    acc.add(torch.from_numpy(sample_images).permute(0, 3, 1, 2), [0, 1, 2, 3])
    scores = compute_metrics(acc, reference)
    text = json.dumps(scores)
    assert set(json.loads(text)) == {"fid", "sfid", "is", "precision", "recall", "kid", "kid_std", "num_samples"}
    assert all(math.isfinite(v) for v in scores.values()) and scores["num_samples"] == 4
    assert scores["fid"] > 0 and scores["sfid"] > 0 and 1 <= scores["is"] <= 4
    assert 0 <= scores["precision"] <= 1 and 0 <= scores["recall"] <= 1


# ----------------------------------------------------------------------------- ADM reference batches


def test_adm_npz_read_as_is(lookup, tmp_path):
    """Stored mu/sigma (whole-dataset statistics) are used for FID, the arr_0 images for precision/recall."""
    ext = lookup[0]
    rng = np.random.default_rng(11)
    arr_0 = LookupExtractor.images(range(20, 40)).permute(0, 2, 3, 1).numpy()   # NHWC, features 20..39
    fake_mu, fake_sigma = rng.standard_normal(ext.dim) + 5, np.eye(ext.dim) * 3
    fake_mu_s, fake_sigma_s = rng.standard_normal(ext.spatial_dim), np.eye(ext.spatial_dim) * 2
    path = tmp_path / "VIRTUAL_ref.npz"
    np.savez(path, arr_0=arr_0, mu=fake_mu, sigma=fake_sigma, mu_s=fake_mu_s, sigma_s=fake_sigma_s)
    ref = load_reference_full(path, ext, need=METRICS)
    np.testing.assert_array_equal(ref.mu, fake_mu)
    np.testing.assert_array_equal(ref.sigma_s, fake_sigma_s)
    torch.testing.assert_close(ref.pool_rows, ext.pool[20:40])
    assert ref.num_images == 20 and ref.feature == "lookup" and ref.resolution == (2, 2)
    acc = FeatureAccumulator(ext).add(LookupExtractor.images(range(20)), range(20))
    scores = compute_metrics(acc, ref, kid_subsets=3, kid_subset_size=10)
    pool = lookup[1][:20]
    assert scores["fid"] == pytest.approx(scipy_fid(pool, fake_mu, fake_sigma), rel=1e-6)
    assert scores["sfid"] == pytest.approx(scipy_fid(lookup[2][:20], fake_mu_s, fake_sigma_s), rel=1e-6)
    expected = precision_recall(ext.pool[20:40], ext.pool[:20])
    assert (scores["precision"], scores["recall"]) == expected
    # Without stored statistics they come from arr_0, and rows only when asked for.
    np.savez(tmp_path / "images_only.npz", arr_0=arr_0)
    only = load_reference_full(tmp_path / "images_only.npz", ext, need=["fid", "sfid"])
    assert only.pool_rows is None
    np.testing.assert_allclose(only.mu, lookup[1][20:40].mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(only.sigma_s, np.cov(lookup[2][20:40], rowvar=False), rtol=1e-4, atol=1e-4)


def test_reference_checks_name_the_file_and_fix(lookup, tmp_path):
    ext = lookup[0]
    np.savez(tmp_path / "stats_only.npz", mu=np.zeros(ext.dim), sigma=np.eye(ext.dim))
    assert load_reference_full(tmp_path / "stats_only.npz", ext, need=["fid"]).pool_rows is None
    with pytest.raises(ValueError, match=r"stats_only.npz has no arr_0.*reference images.*fid.py mode=ref"):
        load_reference_full(tmp_path / "stats_only.npz", ext, need=["fid", "precision"])
    with pytest.raises(ValueError, match=r"stats_only.npz has no arr_0.*mu_s/sigma_s \(sfid\)"):
        load_reference_full(tmp_path / "stats_only.npz", ext, need=["sfid"])
    np.savez(tmp_path / "wrong_dim.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    with pytest.raises(ValueError, match=r"wrong_dim.npz has mu of shape \(2048,\).*'lookup' gives 6-d"):
        load_reference_full(tmp_path / "wrong_dim.npz", ext)
    np.savez(tmp_path / "other.npz", mu=np.zeros(ext.dim), sigma=np.eye(ext.dim), feature=np.array("inception"))
    with pytest.raises(ValueError, match="'inception' features.*'lookup'.*fid.py mode=ref"):
        load_reference_full(tmp_path / "other.npz", ext)
    with pytest.raises(FileNotFoundError, match="fid.py mode=ref"):
        load_reference_full(tmp_path / "absent.npz", ext)


def test_reference_builder_streams_keeps_subset_and_matches_one_pass(lookup, tmp_path):
    ext = lookup[0]
    nhwc = LookupExtractor.images(range(40)).permute(0, 2, 3, 1)
    builder = ReferenceBuilder(ext, total=40, store_images=10, seed=3)
    for i in np.random.default_rng(12).permutation(40).reshape(8, 5):   # any order, any batching
        builder.add(nhwc[i].numpy() if i[0] % 2 else nhwc[i], i)
    out = builder.all_reduce().save(tmp_path / "r.npz", source="unit")
    from tread.evaluation.reference import subset_indices

    with np.load(out) as data:
        kept = subset_indices(40, 10, seed=3)
        np.testing.assert_array_equal(data["arr_0"], nhwc[kept].numpy())   # sorted by index
        np.testing.assert_allclose(data["mu"], lookup[1].mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(data["sigma_s"], np.cov(lookup[2], rowvar=False), rtol=1e-4, atol=1e-4)
        assert str(data["feature"]) == "lookup" and int(data["num_images"]) == 40 and str(data["source"]) == "unit"
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 40\)"):
        ReferenceBuilder(ext, total=40).add(nhwc[:2], [39, 40])


def test_build_reference_from_npz_and_folder_subsets(lookup, tmp_path):
    ext = lookup[0]
    nhwc = LookupExtractor.images(range(30)).permute(0, 2, 3, 1).numpy()
    np.savez_compressed(tmp_path / "src.npz", arr_0=nhwc)                  # streamed from the zip member
    from tread.evaluation.reference import subset_indices

    chosen = subset_indices(30, 11)
    out = build_reference(tmp_path / "a.npz", ext, tmp_path / "src.npz", max_images=11, store_images=4,
                          batch_size=4)
    with np.load(out) as data:
        assert int(data["num_images"]) == 11 and data["arr_0"].shape == (4, 2, 2, 3)
        np.testing.assert_allclose(data["mu"], lookup[1][chosen].mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(data["arr_0"], nhwc[chosen[subset_indices(11, 4)]])
    save_png_folder(nhwc[:9], tmp_path / "imgs")
    out = build_reference(tmp_path / "b.npz", ext, tmp_path / "imgs", max_images=5, batch_size=2)
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_0"], nhwc[subset_indices(9, 5)])
    save_png_folder(np.zeros((1, 3, 3, 3), np.uint8), tmp_path / "imgs", start_index=9)
    with pytest.raises(ValueError, match="image sizes differ"):
        build_reference(tmp_path / "c.npz", ext, tmp_path / "imgs", batch_size=2)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither an image folder"):
        build_reference(tmp_path / "d.npz", ext, tmp_path / "x.bin")
