"""Aspect-ratio buckets: geometry (derive, assign, resize and crop), the bucketed dataset format, and the bucket
sampler (one bucket per batch on every rank, seeded, exactly resumable mid-epoch, resolution schedule phases)."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from tread.data import (Bucket, BucketBatchSampler, BucketedDataset, BucketError, LatentLoader, assign_bucket,
                        center_crop_arr, derive_buckets, fit_crop, make_sampler, parse_buckets,
                        write_bucketed_dataset)
from tread.data.buckets import mirrored_crop


# ----------------------------------------------------------------------------- geometry

def test_parse_buckets_is_width_by_height_and_refuses_bad_items():
    assert parse_buckets("768x512, 512X512") == [Bucket(512, 768), Bucket(512, 512)]
    assert Bucket(512, 768).name == "768x512" and Bucket(512, 768).aspect == 1.5
    for bad, says in (("768x", "is not WIDTHxHEIGHT"), ("0x64", "is not WIDTHxHEIGHT"), ("64x64,64x64", "twice")):
        with pytest.raises(BucketError, match=says):
            parse_buckets(bad)


def test_derived_buckets_fill_the_budget_on_the_stride_within_the_aspect_limit():
    buckets = derive_buckets([256 * 256], 16, max_aspect=2.0)
    assert Bucket(256, 256) in buckets
    for b in buckets:
        assert b.height % 16 == 0 and b.width % 16 == 0 and b.area <= 256 * 256
        assert 0.5 <= b.aspect <= 2.0
        assert (b.height + 16) * b.width > 256 * 256          # no taller bucket of that width fits the budget
    two = derive_buckets([128 * 128, 256 * 256], 16)
    assert set(derive_buckets([128 * 128], 16)) | set(buckets) == set(two)
    with pytest.raises(BucketError, match="--bucket-pixels=100"):
        derive_buckets([100], 16)


def test_assignment_prefers_no_upscaling_then_the_closest_aspect_then_the_larger_area():
    buckets = [Bucket(64, 64), Bucket(64, 96), Bucket(96, 64), Bucket(128, 128), Bucket(128, 192)]
    assert buckets[assign_bucket(300, 200, buckets)] == Bucket(128, 192)    # big landscape: the big 3:2
    assert buckets[assign_bucket(100, 66, buckets)] == Bucket(64, 96)       # small landscape: only small ones fit
    assert buckets[assign_bucket(70, 100, buckets)] == Bucket(96, 64)       # portrait
    assert buckets[assign_bucket(200, 200, buckets)] == Bucket(128, 128)
    assert buckets[assign_bucket(30, 20, buckets)] == Bucket(64, 96)        # smaller than all: least upscaling


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (64, 64), (1000, 90), (97, 401)])
def test_fit_crop_covers_the_bucket_minimally_and_records_the_crop(size):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    bucket = Bucket(64, 96)
    arr, crop = fit_crop(image, bucket)
    assert arr.shape == (64, 96, 3) and arr.dtype == np.uint8
    oh, ow, rh, rw, top, left = crop.tolist()
    assert (oh, ow) == (size[1], size[0]) and rh >= 64 and rw >= 96 and (rh == 64 or rw == 96)
    assert 0 <= top <= rh - 64 and 0 <= left <= rw - 96
    assert abs(rh / rw - oh / ow) <= 1.0 / min(rh, rw) + 1e-9 or min(rh, rw) in (64, 96)
    flipped = mirrored_crop(crop, bucket)
    assert flipped[5] == rw - 96 - left


@pytest.mark.parametrize("size", [(300, 200), (64, 64), (517, 1200)])
def test_square_bucket_is_exactly_the_adm_center_crop(size):
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    arr, _ = fit_crop(image, Bucket(48, 48))
    np.testing.assert_array_equal(arr, center_crop_arr(image, 48))


# ----------------------------------------------------------------------------- the format

def make_bucketed(path, sizes=(10, 7, 3), shapes=((4, 4), (4, 6), (6, 4)), text=False):
    parts = []
    for k, (n, (h, w)) in enumerate(zip(sizes, shapes)):
        latents = np.full((n, 2, h, w), k, np.float32) + np.arange(n, dtype=np.float32)[:, None, None, None] / 100
        extras = {"text": np.full((n, 3, 5), k, np.float32)} if text else None
        parts.append({"bucket": Bucket(h * 8, w * 8), "latents": latents, "labels": np.arange(n) % 2,
                      "extras": extras, "crops": np.tile(np.arange(6, dtype=np.int32), (n, 1))})
    return write_bucketed_dataset(path, parts, vae_factor=8, stride=16, num_classes=2, dtype="float32")


def test_bucketed_dataset_round_trips_and_batches_stay_in_one_bucket(tmp_path):
    ds = BucketedDataset(make_bucketed(tmp_path / "b", text=True))
    assert len(ds) == 20 and ds.bucket_sizes == [10, 7, 3] and ds.shapes == [(2, 4, 4), (2, 4, 6), (2, 6, 4)]
    assert [b.name for b in ds.buckets] == ["32x32", "48x32", "32x48"]
    x, y, extras = ds.__getitems__([12, 10, 16])
    assert x.shape == (3, 2, 4, 6) and torch.allclose(x[:, 0, 0, 0], torch.tensor([1.02, 1.00, 1.06]))
    assert extras["text"].shape == (3, 3, 5) and (extras["text"] == 1).all()
    assert ds.crops(2).shape == (3, 6)
    with pytest.raises(ValueError, match="one bucket"):
        ds.__getitems__([9, 10])
    with pytest.raises(BucketError, match="no single shape"):
        ds.shape


def test_buckets_that_differ_in_more_than_shape_are_refused(tmp_path):
    root = make_bucketed(tmp_path / "b")
    import json
    meta_file = root / "48x32" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["num_classes"] = 3
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(BucketError, match="differ in num_classes"):
        BucketedDataset(root)


# ----------------------------------------------------------------------------- the sampler

def drain(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_every_batch_comes_from_one_bucket_on_every_rank_and_buckets_are_weighted_by_size():
    sizes, offsets = [40, 24, 9, 3], [0, 40, 64, 73]
    samplers = [BucketBatchSampler(sizes, 4, seed=5, rank=r, world_size=2) for r in range(2)]
    assert samplers[0].dropped == [3]                       # 3 samples < 4 x 2: no batch
    bpe = samplers[0].batches_per_epoch
    assert bpe == 5 + 3 + 1
    streams = [drain(s, 3 * bpe) for s in samplers]
    bucket = lambda i: max(b for b, o in enumerate(offsets) if o <= i)  # noqa: E731
    for a, b in zip(*streams):
        assert len({bucket(i) for i in a + b}) == 1       # both ranks, one bucket
        assert not set(a) & set(b)                        # disjoint shards
    for e in range(3):
        epoch = streams[0][e * bpe:(e + 1) * bpe]
        counts = np.bincount([bucket(b[0]) for b in epoch], minlength=4)
        assert counts.tolist() == [5, 3, 1, 0]
        assert len({i for b in epoch for i in b}) == bpe * 4       # no sample twice in an epoch
    assert streams[0][:bpe] != streams[0][bpe:2 * bpe]             # epochs reshuffle


@pytest.mark.parametrize("world", [1, 2])
def test_resume_mid_epoch_is_exact_on_every_rank(world):
    sizes = [17, 11, 8]
    for rank in range(world):
        full = drain(BucketBatchSampler(sizes, 2, seed=1, rank=rank, world_size=world), 20)
        for k in (0, 4, 7, 11):          # mid-epoch, and past an epoch boundary
            stream = BucketBatchSampler(sizes, 2, seed=1, rank=rank, world_size=world).batches_from(k)
            assert [next(stream) for _ in range(20 - k)] == full[k:]


def test_loader_over_a_bucketed_dataset_resumes_exactly_with_workers(tmp_path):
    ds = BucketedDataset(make_bucketed(tmp_path / "b", sizes=(12, 8, 6)))

    def loader(workers):
        return LatentLoader(ds, 2, seed=3, num_workers=workers, sampler=make_sampler(ds, 2, 3, 0, 1))

    first = loader(0)
    whole = [next(first)[0] for _ in range(16)]
    assert {tuple(x.shape[2:]) for x in whole} == {(4, 4), (4, 6), (6, 4)}
    interrupted = loader(2)
    for _ in range(7):
        next(interrupted)
    state = interrupted.state_dict()
    assert state["index"] == 7
    resumed = loader(1)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)[0], whole[k]) for k in range(7, 16))


def test_resolution_schedule_draws_small_buckets_first_and_resumes_in_either_phase(tmp_path):
    ds = BucketedDataset(make_bucketed(tmp_path / "b", sizes=(12, 8, 6), shapes=((4, 4), (8, 8), (8, 12))))
    schedule = [{"until_step": 3, "max_pixels": 32 * 32}, {"until_step": None, "min_pixels": 64 * 64}]
    sampler = make_sampler(ds, 2, 0, 0, 1, schedule, batches_per_step=2)
    stream = sampler.batches_from(0)
    batches = [next(stream) for _ in range(20)]
    buckets = [ds.bucket_of(b[0]) for b in batches]
    assert set(buckets[:6]) == {0} and set(buckets[6:]) == {1, 2}
    for k in (2, 6, 9):
        again = make_sampler(ds, 2, 0, 0, 1, schedule, batches_per_step=2).batches_from(k)
        assert [next(again) for _ in range(20 - k)] == batches[k:]
    assert sampler.locate(7) == {"epoch": 0, "batch": 1, "phase": 1}
    with pytest.raises(BucketError, match="selects no bucket"):
        make_sampler(ds, 2, 0, 0, 1, [{"until_step": None, "max_pixels": 10}])
    with pytest.raises(BucketError, match="until_step"):
        make_sampler(ds, 2, 0, 0, 1, [{"until_step": None}, {"until_step": None}])


def test_a_bucket_set_with_no_full_batch_is_one_error():
    with pytest.raises(ValueError, match="needs at least 8 samples"):
        BucketBatchSampler([3, 5], 4, seed=0, world_size=2)
    assert math.isclose(BucketBatchSampler([8, 5], 4, seed=0, world_size=2).batches_per_epoch, 1)
