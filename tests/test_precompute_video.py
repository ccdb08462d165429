"""scripts/precompute_latents.py --videos (tread/data/precompute/video.py; docs/video.md "Precompute clips"): a few tiny
clips (mp4/gif files and frame folders) encoded by a tiny random AutoencoderKLWan into a video latent dataset, checked
against encode_video itself; frame buckets; each bad clip or flag as one `error:` line before anything is encoded."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image

from tread.cli.precompute import cli
from tread.data import BucketedDataset, LatentDataset
from tread.data.video import read_clip, write_video
from tread.encoders.vae import encode_video, to_model_space, video_vae_info

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    """A tiny random AutoencoderKLWan (temporal factor 4, spatial 4) saved as a local folder."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[True, True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                           scale_factor_temporal=4, scale_factor_spatial=4).eval()
    path = tmp_path_factory.mktemp("wan_vae")
    vae.save_pretrained(path)
    return path


def frames_of(n: int, w: int = 16, h: int = 16, seed: int = 0) -> np.ndarray:
    """uint8 (n, h, w, 3) smooth moving frames (they survive video compression)."""
    y, x = np.mgrid[0:h, 0:w]
    out = [np.stack([(x * 8 + t * 20) % 256, (y * 8 + seed * 50) % 256, np.full_like(x, 40 * t % 256)], -1)
           for t in range(n)]
    return np.asarray(out, np.uint8)


def frame_folder(folder: Path, frames: np.ndarray) -> Path:
    folder.mkdir(parents=True)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"frame_{i:03d}.png")
    return folder


def base(videos, out, vae, *extra) -> list[str]:
    size = [] if "--buckets" in extra else ["--resolution", "16"]     # buckets give the sizes themselves
    return ["--videos", str(videos), "--out", str(out), "--vae", str(vae), "--device", "cpu", *size,
            "--workers", "0", "--dtype", "float32", *extra]


def test_clips_encoded_as_encode_video_does(tmp_path, wan_dir):
    clips = tmp_path / "clips"
    frame_folder(clips / "cat" / "a", frames_of(6))
    frame_folder(clips / "dog" / "b", frames_of(9, seed=1))
    write_video(clips / "dog" / "c.gif", frames_of(7, seed=2), fps=8.0)
    (clips / "cat" / "a.txt").write_text("a cat\n")               # a sidecar is not a clip
    out = tmp_path / "ds"
    assert cli(base(clips, out, wan_dir, "--frames", "5", "--first-frame", "--shard-size", "2")) == 0
    ds = LatentDataset(out)
    assert ds.shape == (4, 2, 4, 4) and len(ds) == 3 and ds.meta["class_names"] == ["cat", "dog"]
    assert ds.video == {"frames": 5, "frame_stride": 1, "fps": None, "temporal_factor": 4}   # 24 (folders), 8 (gif)
    assert ds.meta["decode"]["class"] == "AutoencoderKLWan" and ds.latent_scale == 1.0
    vae = AutoencoderKLWan.from_pretrained(wan_dir).eval()
    info = video_vae_info(vae)
    x, y, extras = ds.__getitems__([0, 1, 2])
    assert y.tolist() == [0, 1, 1]
    for i, path in enumerate([clips / "cat" / "a", clips / "dog" / "b", clips / "dog" / "c.gif"]):
        pixels = torch.from_numpy(read_clip(path, 5)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
        want = to_model_space(encode_video(vae, pixels, kind="mean"), info)
        torch.testing.assert_close(x[i:i + 1], want, rtol=1e-4, atol=1e-4)
        first = to_model_space(encode_video(vae, pixels[:, :, :1], kind="mean"), info)
        torch.testing.assert_close(extras["first_frame"][i:i + 1], first, rtol=1e-4, atol=1e-4)
    assert not (tmp_path / "ds.parts").exists()


def test_frame_buckets_and_stride(tmp_path, wan_dir):
    clips = tmp_path / "clips"
    frame_folder(clips / "a", frames_of(9))                  # stride 2: 5 frames (needs 9)
    frame_folder(clips / "b", frames_of(8))                  # stride 2: 1 frame (5 would need 9)
    frame_folder(clips / "c", frames_of(12, w=32))           # landscape, 5 frames at stride 2
    out = tmp_path / "ds"
    argv = base(clips, out, wan_dir, "--frame-buckets", "1,5", "--frame-stride", "2", "--buckets", "16x16,32x16",
                "--bucket-stride", "8")
    assert cli(argv) == 0
    ds = BucketedDataset(out)
    assert [b.name for b in ds.buckets] == ["16x16x1", "16x16x5", "32x16x5"] and ds.bucket_sizes == [1, 1, 1]
    assert ds.shapes == [(4, 1, 4, 4), (4, 2, 4, 4), (4, 2, 4, 8)]
    assert [p.video["frames"] for p in ds.parts] == [1, 5, 5] and ds.video["frame_stride"] == 2


def _error_line(capsys, argv) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]   # progress bars may precede it
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err
    return lines[0]


def test_each_bad_clip_is_named_before_encoding(tmp_path, wan_dir, capsys):
    clips = tmp_path / "clips"
    frame_folder(clips / "ok", frames_of(5))
    frame_folder(clips / "short", frames_of(3))
    mixed = frame_folder(clips / "mixed", frames_of(5))
    Image.fromarray(frames_of(1, w=24)[0]).save(mixed / "frame_009.png")
    (clips / "corrupt.mp4").write_bytes(b"\x00\x01 not a video" * 20)
    (clips / "empty.gif").write_bytes(b"")
    err = _error_line(capsys, base(clips, tmp_path / "ds", wan_dir, "--frames", "5"))
    assert "4 of 5 clip(s)" in err and "nothing was encoded" in err
    for words in ("corrupt.mp4' cannot be decoded", "empty.gif'", "mixes frame sizes", "short' has 3 frames; 5 at "
                  "stride 1 need 5"):
        assert words in err
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.parts").exists()


@pytest.mark.parametrize("extra, words", [
    (["--frames", "6"], "--frames: frame count(s) 6 are not 1 + k * 4"),
    (["--frame-buckets", "1,4"], "--frame-buckets: frame count(s) 4 are not 1 + k * 4"),
    (["--frames", "5", "--flip"], "--flip cannot be used with --videos"),
    ([], "needs --frames F"),
    (["--frames", "5", "--frame-buckets", "1,5"], "exactly one of them"),
    (["--frames", "5", "--kind", "moments"], "--kind='moments' is not valid"),
    (["--frames", "5", "--frame-stride", "0"], "--frame-stride=0 is not valid"),
    (["--frames", "5", "--vae-class", "AutoencoderKL"], "--vae-class='AutoencoderKL' is not valid"),
    (["--frames", "5", "--resolution", "18"], "--resolution=18 is not valid: a multiple of 4"),
])
def test_bad_flags_one_line(tmp_path, wan_dir, capsys, extra, words):
    frame_folder(tmp_path / "clips" / "a", frames_of(9))
    assert words in _error_line(capsys, base(tmp_path / "clips", tmp_path / "ds", wan_dir, *extra))
    assert not (tmp_path / "ds.parts").exists() or not any((tmp_path / "ds.parts").glob("shard_*"))


def test_video_flags_without_videos_and_unknown_vae_class(tmp_path, capsys):
    frame_folder(tmp_path / "imgs" / "c" / "x", frames_of(1))
    err = _error_line(capsys, ["--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "o"), "--frames", "5"])
    assert "--frames only apply with --videos" in err
    frame_folder(tmp_path / "clips" / "a", frames_of(5))
    (tmp_path / "novae").mkdir()
    (tmp_path / "novae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    err = _error_line(capsys, base(tmp_path / "clips", tmp_path / "ds", tmp_path / "novae", "--frames", "5"))
    assert "its config.json says 'AutoencoderKL'" in err and "--vae-class" in err


def test_clip_broken_past_its_headers_is_one_line(tmp_path, wan_dir, capsys):
    """Headers sound (probed fine), data truncated: the encoding names it in one line."""
    folder = frame_folder(tmp_path / "clips" / "a", frames_of(5))
    data = (folder / "frame_002.png").read_bytes()
    (folder / "frame_002.png").write_bytes(data[:60])
    err = _error_line(capsys, base(tmp_path / "clips", tmp_path / "ds", wan_dir, "--frames", "5"))
    assert "frame_002.png" in err and "rerun" in err and not (tmp_path / "ds").exists()
