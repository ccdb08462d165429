"""Precomputing a bucketed dataset (scripts/precompute_latents.py --buckets / --bucket-pixels): images of three
aspect ratios at two sizes go to their buckets, are resized minimally and center-cropped there, encoded at that
shape, and stored per bucket with their crop records; bad bucket arguments fail before any work."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import tread.cli.precompute as pl
import tread.data.precompute.run as work
from tread.data import Bucket, BucketedDataset, fit_crop
from tread.data.images import list_image_folder
from tread.data.precompute.request import PrecomputeError
from tread.encoders.vae import encode, load_vae

from test_precompute import offline, vae_dir  # noqa: F401  (fixtures: the tiny VAE downsamples by 2)

# (width, height) -> the bucket it must land in (stride 4 = VAE factor 2 x patch 2)
KINDS = {(18, 18): "16x16", (26, 13): "24x12", (13, 26): "12x24",
         (40, 40): "32x32", (60, 30): "48x24", (30, 60): "24x48"}
BUCKETS = "16x16,24x12,12x24,32x32,48x24,24x48"


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed") / "imgs"
    rng = np.random.default_rng(3)
    for k, (w, h) in enumerate(KINDS):
        for cls in ("a", "b"):
            (root / cls).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / cls / f"{k}_{w}x{h}.png")
    return root


def run(images, out, vae, *extra):
    return pl.main(["--images", str(images), "--out", str(out), "--vae", str(vae), "--device", "cpu",
                    "--batch-size", "3", "--shard-size", "2", "--workers", "0", "--bucket-stride", "4",
                    *map(str, extra)])


def test_buckets_end_to_end_with_flips(tmp_path, mixed_folder, vae_dir, capsys):  # noqa: F811
    out = tmp_path / "ds"
    run(mixed_folder, out, vae_dir, "--buckets", BUCKETS, "--flip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]           # no parts or staging folders left
    assert "images per bucket" in capsys.readouterr().out
    ds = BucketedDataset(out)
    assert sorted(b.name for b in ds.buckets) == sorted(KINDS.values()) and ds.bucket_sizes == [4] * 6
    for b, bucket in enumerate(ds.buckets):
        assert ds.shapes[b] == (4, bucket.height // 2, bucket.width // 2)
    paths, _, _ = list_image_folder(mixed_folder)
    vae = load_vae(str(vae_dir))
    for b, bucket in enumerate(ds.buckets):
        mine = [p for p in paths if KINDS[Image.open(p).size] == bucket.name]
        assert len(mine) == 2
        images, records = zip(*(fit_crop(Image.open(p), bucket) for p in mine))
        crops = ds.crops(b)
        np.testing.assert_array_equal(crops[:2], np.stack(records))
        assert (crops[2:, 5] == crops[:2, 3] - bucket.width - crops[:2, 5]).all()      # mirrored crop boxes
        stored = np.load(out / bucket.name / "latents.npy").astype(np.float32)
        want = encode(vae, np.stack(images)).numpy()
        np.testing.assert_allclose(stored[:2], want.astype(np.float16), rtol=1e-3, atol=1e-3)
        x = ds.__getitems__([int(ds.offsets[b]), int(ds.offsets[b]) + 3])[0]
        assert x.shape == (2, 8, bucket.height // 2, bucket.width // 2)               # moments: 2 x 4 channels


def test_pixel_budgets_give_mixed_area_buckets(tmp_path, mixed_folder, vae_dir):  # noqa: F811
    out = tmp_path / "ds"
    run(mixed_folder, out, vae_dir, "--bucket-pixels", "256,1024")
    ds = BucketedDataset(out)
    areas = sorted({b.area for b in ds.buckets})
    assert min(areas) <= 256 and max(areas) > 512                   # small images in small buckets, big in big
    for b, bucket in enumerate(ds.buckets):
        assert bucket.width % 4 == 0 and bucket.height % 4 == 0
        for oh, ow, *_ in ds.crops(b).tolist():
            assert (ow * oh >= 1000) == (bucket.area > 512)


def test_resume_with_other_buckets_is_refused(tmp_path, mixed_folder, vae_dir, monkeypatch):  # noqa: F811
    out = tmp_path / "ds"
    calls = {"n": 0}
    original = work.encode_shard

    def crash_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(work, "encode_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run(mixed_folder, out, vae_dir, "--buckets", BUCKETS)
    monkeypatch.setattr(work, "encode_shard", original)
    with pytest.raises(PrecomputeError, match="other settings.*buckets"):
        run(mixed_folder, out, vae_dir, "--buckets", "16x16,32x32")
    run(mixed_folder, out, vae_dir, "--buckets", BUCKETS)                       # resumes the finished shards
    assert BucketedDataset(out).bucket_sizes == [2] * 6


@pytest.mark.parametrize("extra, message", [
    (["--buckets", "16x16,26x12"], r"--buckets: bucket\(s\) 26x12 are off the bucket stride 4"),
    (["--buckets", "16x"], r"--buckets='16x' is not valid"),
    (["--buckets", "16x16", "--bucket-pixels", "256"], "both given"),
    (["--bucket-pixels", "256,abc"], r"--bucket-pixels='256,abc' is not valid"),
    (["--bucket-pixels", "10"], r"--bucket-pixels=10 is not valid"),
    (["--buckets", "16x16", "--ref-out", "{ref}"], "--ref-out needs one image size"),
])
def test_bad_bucket_arguments_fail_before_any_work(tmp_path, mixed_folder, extra, message, monkeypatch):
    monkeypatch.setattr(work, "make_plan", lambda args: pytest.fail("work started despite a bad argument"))
    argv = ["--images", str(mixed_folder), "--out", str(tmp_path / "ds"), "--bucket-stride", "4",
            *[a.replace("{ref}", str(tmp_path / "ref.npz")) for a in extra]]
    with pytest.raises(PrecomputeError, match=message):
        pl.main(argv)
    assert pl.cli(argv) == 2


def test_a_bucket_stride_off_the_vae_factor_fails_before_encoding(tmp_path, mixed_folder, vae_dir):  # noqa: F811
    with pytest.raises(PrecomputeError, match=r"--bucket-stride=3 .*multiple of 2"):
        pl.main(["--images", str(mixed_folder), "--out", str(tmp_path / "ds"), "--vae", str(vae_dir), "--device",
                 "cpu", "--buckets", "24x12", "--bucket-stride", "3"])
    assert not (tmp_path / "ds").exists()


def test_an_unreadable_image_is_one_error_before_encoding(tmp_path, mixed_folder, vae_dir):  # noqa: F811
    import shutil

    images = tmp_path / "imgs"
    shutil.copytree(mixed_folder, images)
    (images / "a" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(Exception, match="broken.png"):
        run(images, tmp_path / "ds", vae_dir, "--buckets", BUCKETS)
    assert not (tmp_path / "ds").exists()


def test_square_bucket_data_is_the_plain_center_crop():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    from tread.data import center_crop_arr

    np.testing.assert_array_equal(fit_crop(image, Bucket(16, 16))[0], center_crop_arr(image, 16))
