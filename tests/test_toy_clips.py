"""Moving toy shapes (tread/data/builtin/toy_clips.py): the clips move as their direction says, the built-in
toy_shapes_clips dataset reads back, and clip files (mp4 / gif / frame folders + caption sidecars) decode back to
the generated frames."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tread.data import BUILTINS, LatentDataset, LatentDatasetError, build_dataset
from tread.data.buckets import Bucket
from tread.data.builtin.toy import TOY_CLASS_NAMES
from tread.data.builtin.toy_clips import (DIRECTIONS, clip_captions, ensure_toy_clips, generate_toy_clips, to_uint8,
                                  write_clip_files)
from tread.data.video import find_clips, probe_clip, read_clip, video_encoder_available
from tread.schema.base import ConfigError, check
from tread.schema.data import BUILTIN_ARGS

REPO = Path(__file__).resolve().parents[1]


def centroids(clip: np.ndarray) -> np.ndarray:
    """(F, 2) x, y centre of what differs from the frame's corner pixel (the background), per frame."""
    c = clip.transpose(1, 2, 3, 0)                                   # (F, H, W, 3)
    weight = np.abs(c - c[:, :1, :1]).sum(-1)                         # (F, H, W)
    ys, xs = np.mgrid[:c.shape[1], :c.shape[2]]
    return np.stack([(weight * xs).sum((1, 2)), (weight * ys).sum((1, 2))], 1) / weight.sum((1, 2))[:, None]


def test_clips_are_deterministic_and_move_their_way():
    clips, labels, direction = generate_toy_clips(2, 9, 24, seed=3)
    assert clips.shape == (20, 3, 9, 24, 24) and clips.dtype == np.float32
    assert clips.min() >= -1 and clips.max() <= 1
    assert labels.tolist() == list(range(10)) * 2 and set(direction.tolist()) <= set(range(4))
    again = generate_toy_clips(2, 9, 24, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((clips, labels, direction), again))
    assert not np.array_equal(clips, generate_toy_clips(2, 9, 24, seed=4)[0])
    for clip, way in zip(clips, direction):
        step = np.diff(centroids(clip), axis=0).mean(0)              # pixels per frame, (dx, dy)
        dx, dy = DIRECTIONS[list(DIRECTIONS)[way]]
        assert np.dot(step, (dx, dy)) > 0.5 and abs(np.dot(step, (dy, dx))) < 0.2
    still = generate_toy_clips(1, 1, 16)[0]
    assert still.shape == (10, 3, 1, 16, 16)
    assert clip_captions(0, 0) == ["a red disc moving right", "a video of a red disc moving right"]


def test_builtin_dataset_reads_back(tmp_path):
    cfg = {"builtin": "toy_shapes_clips", "path": str(tmp_path / "clips"),
           "builtin_args": {"num_per_class": 2, "frames": 5, "resolution": 8, "seed": 1, "first_frame": True}}
    data = build_dataset(cfg)
    assert BUILTINS["toy_shapes_clips"] is ensure_toy_clips and isinstance(data, LatentDataset)
    clips, labels, _ = generate_toy_clips(2, 5, 8, seed=1)
    assert data.meta["shape"] == [3, 5, 8, 8] and data.meta["decode"] == {"type": "identity"}
    assert data.meta["video"] == {"frames": 5, "frame_stride": 1, "fps": 8.0, "temporal_factor": 1}
    assert data.meta["class_names"] == TOY_CLASS_NAMES and len(data) == 20
    x, y, extras = data[3]
    assert torch.allclose(x, torch.from_numpy(clips[3]), atol=1e-3) and y == labels[3]   # stored as float16
    assert torch.equal(extras["first_frame"], x[:, :1])
    assert ensure_toy_clips(tmp_path / "clips", 2, 5, 8, 1, first_frame=True) == tmp_path / "clips"  # reused
    with pytest.raises(LatentDatasetError, match=r"already holds a dataset with meta.json builtin="):
        ensure_toy_clips(tmp_path / "clips", 2, 9, 8, 1)
    plain = ensure_toy_clips(tmp_path / "plain", 1, 3, 8)
    assert "first_frame_latents" not in LatentDataset(plain).meta["files"]


def test_builtin_args_schema():
    good = {"num_per_class": 1, "frames": 9, "resolution": 16, "seed": 0}
    assert check(BUILTIN_ARGS["toy_shapes_clips"], good, "data.builtin_args").first_frame is False
    for bad in ({**good, "frames": 0}, {**good, "resolution": 2}, {**good, "fps": 3}):
        with pytest.raises(ConfigError, match="data.builtin_args"):
            check(BUILTIN_ARGS["toy_shapes_clips"], bad, "data.builtin_args")


def test_clip_files_decode_back(tmp_path):
    sizes = [Bucket(16, 16, 9), Bucket(16, 24, 5)]
    written = write_clip_files(tmp_path / "out", sizes, 1, seed=2)
    assert written == {"16x16x9": 10, "24x16x5": 10}
    found = find_clips(tmp_path / "out")
    assert len(found) == 20
    kinds = {"dir" if p.is_dir() else p.suffix for p in found}
    assert kinds == ({".mp4", ".gif", "dir"} if video_encoder_available() else {".gif", "dir"})
    for k, size in enumerate(sizes):
        clips, labels, direction = generate_toy_clips(1, size.frames, (size.height, size.width), seed=2 + k)
        pixels = to_uint8(clips)
        for i in range(10):
            name = TOY_CLASS_NAMES[labels[i]].replace(" ", "_")
            clip = next(p for p in found if p.parent.name == name and p.name.startswith(f"{size.name}_{i:04d}"))
            assert probe_clip(clip).num_frames == size.frames
            caption = clip.parent / f"{size.name}_{i:04d}.txt"
            assert caption.read_text().splitlines() == clip_captions(labels[i], direction[i])
            back = read_clip(clip, size.frames).astype(int)
            # mean error per value: PNG frames are exact, a GIF's shared palette nearly so, H.264 (4:2:0 chroma
            # at 16 px) is lossy
            assert np.abs(back - pixels[i]).mean() <= {".mp4": 12, ".gif": 1.5}.get(clip.suffix, 0)
    with pytest.raises(FileExistsError, match="not empty"):
        write_clip_files(tmp_path / "out", sizes, 1)
    with pytest.raises(LatentDatasetError, match=r"allowed: a non-empty list of \['mp4', 'gif', 'frames'\]"):
        write_clip_files(tmp_path / "new", sizes, 1, formats=["avi"])
    with pytest.raises(LatentDatasetError, match="need a frame count each"):
        write_clip_files(tmp_path / "new", [Bucket(16, 16)], 1)


def test_script_writes_clips_and_refuses_in_one_line(tmp_path):
    script = [sys.executable, str(REPO / "scripts" / "toy_clips.py")]
    done = subprocess.run(script + [str(tmp_path / "c"), "--sizes", "16x16", "--frames", "5", "--per-class", "1",
                                    "--formats", "frames"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert len(find_clips(tmp_path / "c")) == 10 and all(p.is_dir() for p in find_clips(tmp_path / "c"))
    again = subprocess.run(script + [str(tmp_path / "c")], capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 1 and again.stderr.splitlines() == [
        f"error: '{tmp_path / 'c'}' already exists and is not empty; choose a new folder"]
