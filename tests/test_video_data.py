"""Video latent data (docs/video.md "Format", "Frame buckets"): the [C, T, H, W] format, its meta "video" block and
first-frame latents written and read back; video buckets and bucketed video datasets; data.frames."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tread.data import (COND_KEYS, LatentDataset, LatentDatasetError, has_model_conditioning, model_shape,
                        read_meta, write_latent_dataset)
from tread.data.integrity import check_integrity
from tread.data.meta import draw_latents

pytestmark = pytest.mark.usefixtures("one_thread")

VIDEO = {"frames": 9, "frame_stride": 2, "fps": 12.0, "temporal_factor": 4}   # T = 1 + 8 / 4 = 3


def clips(n=5, c=4, t=3, h=6, w=8, seed=0):
    """Stored latents (n, c, t, h, w) float32 and their first frames (n, c, 1, h, w)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, c, t, h, w), np.float32), rng.standard_normal((n, c, 1, h, w), np.float32)


def write_video(path, n=5, first_frame=True, **kw):
    x, ff = clips(n)
    write_latent_dataset(path, x, np.arange(n) % 3, num_classes=3, dtype="float32", latent_scale=0.5,
                         video=VIDEO, extras={"first_frame": ff} if first_frame else None, **kw)
    return x, ff


def test_round_trip_items_and_batches(tmp_path):
    x, ff = write_video(tmp_path / "v")
    ds = LatentDataset(tmp_path / "v")
    assert ds.shape == (4, 3, 6, 8) == model_shape(ds.meta) and ds.frames == 3 and ds.video == VIDEO
    assert ds.conditioning["first_frame"] == (4, 1, 6, 8) and ds.has_extras
    item, label, extras = ds[2]
    torch.testing.assert_close(item, torch.from_numpy(x[2]) * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(extras["first_frame"], torch.from_numpy(ff[2]) * 0.5, rtol=0, atol=0)
    assert int(label) == 2
    xb, yb, eb = ds.__getitems__([4, 0, 3])
    assert xb.shape == (3, 4, 3, 6, 8) and eb["first_frame"].shape == (3, 4, 1, 6, 8)
    torch.testing.assert_close(xb, torch.from_numpy(x[[4, 0, 3]]) * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(eb["first_frame"], torch.from_numpy(ff[[4, 0, 3]]) * 0.5, rtol=0, atol=0)
    assert yb.tolist() == [1, 0, 0]
    assert "first_frame" in COND_KEYS and has_model_conditioning(ds.conditioning)
    assert {c.key for c in check_integrity(ds.root)} == {"latents", "labels", "first_frame_latents"}
    assert all(c.how == "trusted" and c.nonfinite == 0 for c in check_integrity(ds.root))


def test_video_without_first_frame_and_float16(tmp_path):
    x, _ = clips(3)
    write_latent_dataset(tmp_path / "v", x, np.zeros(3, np.int64), num_classes=1, video=VIDEO)
    ds = LatentDataset(tmp_path / "v")
    out = ds.__getitems__([0, 1, 2])
    assert len(out) == 2 and out[0].shape == (3, 4, 3, 6, 8) and not ds.has_extras
    np.testing.assert_array_equal(out[0].numpy(), x.astype(np.float16).astype(np.float32))


def test_moments_video_draws_per_channel_half(tmp_path):
    rng = np.random.default_rng(1)
    mom = rng.standard_normal((2, 8, 3, 4, 4), np.float32)
    write_latent_dataset(tmp_path / "m", mom, np.zeros(2, np.int64), num_classes=1, dtype="float32", video=VIDEO,
                         extra_meta={"latent_kind": "moments"}, latent_scale=2.0)
    ds = LatentDataset(tmp_path / "m")
    assert ds.shape == (4, 3, 4, 4)
    x, _ = ds.__getitems__([0, 1])
    torch.testing.assert_close(draw_latents(x, ds.meta, mode="mean"), torch.from_numpy(mom[:, :4]) * 2.0)


def test_image_data_unchanged(tmp_path):
    """Image data keeps shape [C, H, W], no "video" key, frames 1."""
    write_latent_dataset(tmp_path / "i", np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64), num_classes=1)
    ds = LatentDataset(tmp_path / "i")
    assert ds.shape == (3, 4, 4) and ds.frames == 1 and ds.video is None and "video" not in ds.meta


def _edit_meta(root, **changes):
    meta = json.loads((root / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("change, words", [
    ({"video": None}, "has no 'video' key"),
    ({"video": {**VIDEO, "frames": 10}}, "10 frames at temporal_factor 4"),
    ({"video": {**VIDEO, "frames": 13}}, "shape[1] = 3 latent frames"),
    ({"video": {**VIDEO, "fps": -1}}, "'video.fps' is -1"),
    ({"video": {**VIDEO, "frame_stride": 0}}, "'video.frame_stride' is 0"),
    ({"video": "yes"}, "'video' is 'yes'"),
    ({"shape": [4, 3, 6]}, "has a 'video' key"),
])
def test_bad_video_meta_one_line(tmp_path, change, words):
    write_video(tmp_path / "v", first_frame=False)
    _edit_meta(tmp_path / "v", **change)
    with pytest.raises(LatentDatasetError) as err:
        read_meta(tmp_path / "v")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_first_frame_needs_video_and_shape(tmp_path):
    with pytest.raises(LatentDatasetError, match="not video data"):
        write_latent_dataset(tmp_path / "a", np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64),
                             num_classes=1, extras={"first_frame": np.zeros((2, 3, 1, 4, 4), np.float32)})
    x, _ = clips(2)
    with pytest.raises(LatentDatasetError, match=r"first_frame.*shape \(2, 4, 1, 6, 8\)"):
        write_latent_dataset(tmp_path / "b", x, np.zeros(2, np.int64), num_classes=1, video=VIDEO,
                             extras={"first_frame": np.zeros((2, 4, 3, 6, 8), np.float32)})
    assert not (tmp_path / "b").exists()


def test_first_frame_file_of_wrong_shape_is_refused(tmp_path):
    write_video(tmp_path / "v")
    np.save(tmp_path / "v" / "first_frame_latents.npy", np.zeros((5, 4, 2, 6, 8), np.float32))
    with pytest.raises(LatentDatasetError, match=r"first_frame_latents.*must be float32 of shape \[5, 4, 1, 6, 8\]"):
        LatentDataset(tmp_path / "v")


# ----------------------------------------------------------------------------- frame buckets

from tread.data import BucketedDataset, make_sampler, write_bucketed_dataset   # noqa: E402
from tread.data.buckets import (Bucket, BucketError, assign_video_bucket, check_frame_counts, frames_for,  # noqa: E402
                                parse_buckets, parse_frame_buckets, video_buckets)


def test_video_bucket_names_and_product():
    sizes = parse_buckets("48x32,32x32")
    buckets = video_buckets(sizes, parse_frame_buckets("17,1,9"))
    assert [b.name for b in buckets] == ["32x32x1", "32x32x9", "32x32x17", "48x32x1", "48x32x9", "48x32x17"]
    assert Bucket(32, 48, 17).size == Bucket(32, 48) and Bucket(32, 48).name == "48x32"


@pytest.mark.parametrize("have, stride, want", [(17, 1, 17), (16, 1, 9), (9, 1, 9), (8, 1, 1), (33, 2, 17),
                                                (32, 2, 9), (17, 2, 9), (0, 1, None)])
def test_frames_for_never_repeats(have, stride, want):
    assert frames_for(have, stride, [1, 9, 17]) == want
    if want is not None:
        assert (want - 1) * stride + 1 <= have


def test_assign_video_bucket_by_aspect_then_frames():
    buckets = video_buckets(parse_buckets("48x32,32x32,32x48"), [5, 9])
    name = lambda i: None if i is None else buckets[i].name   # noqa: E731
    assert name(assign_video_bucket(96, 64, 12, 1, buckets)) == "48x32x9"      # landscape, 12 frames: 9
    assert name(assign_video_bucket(64, 64, 8, 1, buckets)) == "32x32x5"       # square, 8 frames: 5
    assert name(assign_video_bucket(40, 70, 17, 2, buckets)) == "32x48x9"      # portrait, 17 at stride 2: 9
    assert assign_video_bucket(64, 64, 4, 1, buckets) is None                  # shorter than the smallest


def test_frame_count_errors_name_flag_and_fix():
    with pytest.raises(BucketError, match=r"--frame-buckets: frame count\(s\) 8, 10 are not 1 \+ k \* 4.*e.g. 9"):
        check_frame_counts([1, 8, 10, 17], 4, "--frame-buckets", "the VAE's temporal factor")
    for bad in ("1,x", "0,5", "5,5", ""):
        with pytest.raises(BucketError, match="--frame-buckets"):
            parse_frame_buckets(bad)


def _video_parts(counts=(4, 6), frames=(5, 9)):
    """Two video buckets of a 32x48 (h x w) size, identity latents (3, T, 4, 6) with T = frames (factor 1)."""
    parts = []
    for i, (n, f) in enumerate(zip(counts, frames)):
        x = np.random.default_rng(i).standard_normal((n, 3, f, 4, 6), np.float32)
        parts.append({"bucket": Bucket(32, 48, f), "latents": x, "labels": np.arange(n) % 2,
                      "video": {"frames": f, "frame_stride": 1, "fps": 24.0, "temporal_factor": 1},
                      "extras": {"first_frame": x[:, :, :1]}})
    return parts


def test_bucketed_video_dataset_round_trip_and_sampler(tmp_path):
    parts = _video_parts()
    write_bucketed_dataset(tmp_path / "b", parts, vae_factor=8, stride=16, num_classes=2, dtype="float32")
    ds = BucketedDataset(tmp_path / "b")
    assert [b.name for b in ds.buckets] == ["48x32x5", "48x32x9"] and ds.shapes == [(3, 5, 4, 6), (3, 9, 4, 6)]
    assert ds.video["frame_stride"] == 1 and ds.conditioning["first_frame"] == (3, 1, 4, 6)
    sampler = make_sampler(ds, batch_size=2, seed=0, rank=0, world_size=1)
    seen = 0
    for batch in sampler.epoch_batches(0):
        x, y, extras = ds.__getitems__(batch)
        b = ds.bucket_of(batch[0])
        local = np.asarray(batch) - ds.offsets[b]
        torch.testing.assert_close(x, torch.from_numpy(parts[b]["latents"][local]), rtol=0, atol=0)
        torch.testing.assert_close(extras["first_frame"], x[:, :, :1], rtol=0, atol=0)
        seen += len(batch)
    assert seen == 10


def test_bucketed_video_parts_must_share_stride(tmp_path):
    parts = _video_parts()
    parts[1]["video"] = {**parts[1]["video"], "frame_stride": 2}
    write_bucketed_dataset(tmp_path / "b", parts, vae_factor=8, stride=16, num_classes=2, dtype="float32")
    with pytest.raises(BucketError, match=r"differ in video \(frame_stride"):
        BucketedDataset(tmp_path / "b")


# ----------------------------------------------------------------------------- data.frames at start-up

from types import SimpleNamespace   # noqa: E402


from tread.schema import ConfigError   # noqa: E402
from tread.training.setup import check_frames   # noqa: E402


def _cfg(path, frames):
    """check_frames' data section."""
    return SimpleNamespace(path=str(path), frames=frames)


def _model(frames_axis=False, frames=1, patch=(1, 2, 2)):
    """What check_frames reads of a backbone."""
    return SimpleNamespace(frames_axis=frames_axis, frames=frames, i2v=False, latent_patch=lambda: patch)


def test_data_frames_must_match_single_shape_data(tmp_path):
    write_video(tmp_path / "v", first_frame=False)                     # T = 3
    ds = LatentDataset(tmp_path / "v")
    video_model = _model(True, 3)
    check_frames(_cfg(ds.root, 3), ds, video_model, 'wan-tiny')
    with pytest.raises(ConfigError, match=r"has 3 latent frame\(s\) per sample but data.frames=1, model.frames=1; "
                                          r"set data.frames=3"):
        check_frames(_cfg(ds.root, 1), ds, _model(True, 1), 'wan-tiny')
    with pytest.raises(ConfigError, match=r"is video \(9 frames per clip, latents \[4, 3, 6, 8\]\) but model "
                                          r"wan-tiny takes images"):
        check_frames(_cfg(ds.root, 3), ds, _model(), 'wan-tiny')
    write_latent_dataset(tmp_path / "i", np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64), num_classes=1)
    images = LatentDataset(tmp_path / "i")
    check_frames(_cfg(images.root, 1), images, _model(True, 1), 'wan-tiny')   # images: T = 1
    with pytest.raises(ConfigError, match=r"has 1 latent frame\(s\) per sample \(images\) but data.frames=5"):
        check_frames(_cfg(images.root, 5), images, _model(True, 5), 'wan-tiny')


def test_frame_buckets_need_whole_temporal_patches(tmp_path):
    write_bucketed_dataset(tmp_path / "b", _video_parts(), vae_factor=8, stride=16, num_classes=2, dtype="float32")
    ds = BucketedDataset(tmp_path / "b")                               # T = 5 and 9
    check_frames(_cfg(ds.root, 1), ds, _model(True, 1, (1, 2, 2)), 'wan-tiny')
    with pytest.raises(ConfigError, match=r"48x32x5 \(T=5\), 48x32x9 \(T=9\) .* not whole 2-frame temporal patches"):
        check_frames(_cfg(ds.root, 1), ds, _model(True, 2, (2, 2, 2)), 'wan-tiny')
