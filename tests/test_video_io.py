"""Video clips on disk (tread/data/video.py): finding, probing, decoding and writing mp4 / gif / frame folders, and
one error line for every bad clip (corrupt, zero frames, too short, mixed frame sizes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from tread.data import video
from tread.data.video import (FRAME_FOLDER_FPS, ClipInfo, VideoError, find_clips, frames_needed, is_clip, probe_clip,
                              read_clip, video_encoder_available, write_video)

REPO = Path(__file__).resolve().parents[1]
needs_x264 = pytest.mark.skipif(not video_encoder_available(), reason="PyAV build without libx264")


def grey_clip(frames: int = 9, height: int = 32, width: int = 32) -> np.ndarray:
    """Frame i is one flat grey level 25 * i (+ a colour tint), so a decoded frame tells which frame it was."""
    clip = np.empty((frames, height, width, 3), np.uint8)
    for i in range(frames):
        clip[i] = (25 * i, 25 * i, min(255, 25 * i + 20))
    return clip


def frame_index(frame: np.ndarray) -> int:
    return int(round(frame[..., 0].mean() / 25))


def write_frame_folder(folder: Path, clip: np.ndarray, names=None) -> Path:
    folder.mkdir(parents=True)
    for i, frame in enumerate(clip):
        Image.fromarray(frame).save(folder / (names[i] if names else f"frame_{i}.png"))
    return folder


def zero_frame_mp4(path: Path) -> Path:
    """An mp4 PyAV writes when the stream is set up but no frame is ever encoded (it holds no video stream)."""
    container = av.open(str(path), "w")
    stream = container.add_stream("libx264", rate=24)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()
    container.mux(stream.encode())
    container.close()
    return path


@needs_x264
def test_mp4_round_trip_probe_and_strided_read(tmp_path):
    clip = grey_clip(9)
    path = write_video(tmp_path / "a.mp4", clip, 24)
    assert path == tmp_path / "a.mp4" and path.is_file()
    assert probe_clip(path) == ClipInfo(path, 9, 32, 32, 24.0)
    every = read_clip(path, 9)
    assert every.dtype == np.uint8 and every.shape == (9, 32, 32, 3)
    assert np.abs(every.astype(int) - clip).max() <= 3            # H.264 of flat frames: nearly exact
    assert [frame_index(f) for f in read_clip(path, 4, stride=2)] == [0, 2, 4, 6]
    assert [frame_index(f) for f in read_clip(path, 3, stride=3, start=2)] == [2, 5, 8]
    assert not list(tmp_path.glob(".*"))                           # the atomic write left no temp file


@needs_x264
def test_odd_sides_are_padded_for_yuv420p(tmp_path):
    clip = grey_clip(3, 31, 33)
    path = write_video(tmp_path / "odd.mp4", clip, 12)
    info = probe_clip(path)
    assert (info.height, info.width, info.fps) == (32, 34, 12.0)
    back = read_clip(path, 3)
    assert np.abs(back[:, :31, :33].astype(int) - clip).max() <= 3
    assert np.abs(back[:, 31, :33].astype(int) - clip[:, 30]).max() <= 3   # the padded row repeats the last one


def test_gif_when_not_mp4_or_without_encoder(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (50, 3), dtype=np.uint8)
    clip = np.repeat(np.repeat(colours[rng.integers(0, 50, (5, 8, 8))], 4, 1), 4, 2)   # 8x8 blocks of 50 colours
    path = write_video(tmp_path / "a.webm", clip, 25)
    assert path == tmp_path / "a.gif"
    assert probe_clip(path) == ClipInfo(path, 5, 32, 32, 25.0)
    assert np.array_equal(read_clip(path, 5), clip)        # <= 256 colours: the palette holds them exactly
    monkeypatch.setattr(video, "video_encoder_available", lambda: False)
    assert write_video(tmp_path / "b.mp4", clip, 25) == tmp_path / "b.gif"
    assert np.array_equal(read_clip(tmp_path / "b.gif", 5), read_clip(path, 5))


def test_frame_folder_natural_order_and_exact_read(tmp_path):
    clip = grey_clip(11)
    folder = write_frame_folder(tmp_path / "clip", clip)
    (folder / "clip.txt").write_text("a caption file inside is ignored\n")
    assert is_clip(folder)
    assert probe_clip(folder) == ClipInfo(folder, 11, 32, 32, FRAME_FOLDER_FPS)
    assert [p.name for p in video.frame_files(folder)][:3] == ["frame_0.png", "frame_1.png", "frame_2.png"]
    assert np.array_equal(read_clip(folder, 11), clip)                # frame_10 after frame_9, pixels exact
    assert np.array_equal(read_clip(folder, 2, stride=5, start=1), clip[[1, 6]])


def test_frame_folder_with_mixed_sizes(tmp_path):
    folder = write_frame_folder(tmp_path / "clip", grey_clip(3))
    Image.fromarray(grey_clip(1, 16, 24)[0]).save(folder / "frame_3.png")
    for call in (lambda: probe_clip(folder), lambda: read_clip(folder, 1)):
        with pytest.raises(VideoError, match=r"mixes frame sizes: 'frame_0.png' is 32x32 but 'frame_3.png' is "
                                             r"24x16"):
            call()


@needs_x264
def test_find_clips(tmp_path):
    write_video(tmp_path / "b" / "x.mp4", grey_clip(2), 24)
    write_video(tmp_path / "a.gif", grey_clip(2), 24)
    (tmp_path / "a.txt").write_text("caption\n")
    write_frame_folder(tmp_path / "b" / "frames", grey_clip(2))
    (tmp_path / "b" / "frames" / "sub").mkdir()
    write_video(tmp_path / "b" / "frames" / "sub" / "never.gif", grey_clip(1), 24)  # inside a clip: not listed
    write_video(tmp_path / ".hidden" / "h.gif", grey_clip(1), 24)
    (tmp_path / "empty").mkdir()
    assert find_clips(tmp_path) == [tmp_path / "a.gif", tmp_path / "b/frames", tmp_path / "b/x.mp4"]
    assert find_clips(tmp_path / "a.gif") == [tmp_path / "a.gif"]
    assert not is_clip(tmp_path / "a.txt") and not is_clip(tmp_path / "empty") and not is_clip(tmp_path)
    with pytest.raises(FileNotFoundError):
        find_clips(tmp_path / "missing")


@needs_x264
def test_corrupt_and_empty_clips(tmp_path):
    good = write_video(tmp_path / "good.mp4", grey_clip(9), 24).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(good[: len(good) // 2])
    (tmp_path / "noise.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 4000, np.uint8).tobytes())
    for name in ("cut.mp4", "noise.mp4"):
        for call in (probe_clip, lambda p: read_clip(p, 1)):
            with pytest.raises(VideoError, match=rf"clip '.*{name}' cannot be decoded .*corrupt, truncated"):
                call(tmp_path / name)
    empty = zero_frame_mp4(tmp_path / "empty.mp4")
    for call in (probe_clip, lambda p: read_clip(p, 1)):
        with pytest.raises(VideoError, match=r"empty.mp4' has no video frames"):
            call(empty)
    empty_folder = tmp_path / "frames"
    empty_folder.mkdir()
    with pytest.raises(VideoError, match="has no video frames"):
        probe_clip(empty_folder)


@needs_x264
def test_too_short_and_bad_requests(tmp_path):
    path = write_video(tmp_path / "short.mp4", grey_clip(7), 24)
    folder = write_frame_folder(tmp_path / "frames", grey_clip(7))
    for clip in (path, folder):
        with pytest.raises(VideoError, match=r"has 7 frames; 17 at stride 2 need 33$"):
            read_clip(clip, 17, stride=2)
        with pytest.raises(VideoError, match=r"has 7 frames; 2 at stride 3 from frame 4 need 8$"):
            read_clip(clip, 2, stride=3, start=4)
    assert frames_needed(17, 2) == 33 and frames_needed(1, 5, 6) == 7
    for kwargs in ({"frames": 0}, {"frames": 2, "stride": 0}, {"frames": 2, "start": -1}, {"frames": 1.5}):
        with pytest.raises(VideoError, match="allowed: an integer >= "):
            read_clip(path, **kwargs)
    with pytest.raises(FileNotFoundError):
        read_clip(tmp_path / "missing.mp4", 1)


def test_write_video_refuses_bad_frames(tmp_path):
    for frames in (np.zeros((2, 8, 8, 3), np.float32), np.zeros((8, 8, 3), np.uint8), np.zeros((0, 8, 8, 3), np.uint8)):
        with pytest.raises(VideoError, match=r"allowed: uint8 \(F, H, W, 3\)"):
            write_video(tmp_path / "x.mp4", frames, 24)
    with pytest.raises(VideoError, match="fps=0; allowed: a number > 0"):
        write_video(tmp_path / "x.mp4", grey_clip(1), 0)
    assert not list(tmp_path.iterdir())


def test_a_corrupt_clip_is_one_error_line(tmp_path):
    """FFmpeg's own log lines stay off: a program reading a bad clip prints only our line."""
    (tmp_path / "bad.mkv").write_bytes(b"\x1aE\xdf\xa3" + bytes(range(256)) * 8)
    code = ("import sys; from tread.cli.errors import user_errors; from tread.data.video import read_clip\n"
            "with user_errors():\n    read_clip(sys.argv[1], 1)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad.mkv")], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: clip '{tmp_path / 'bad.mkv'}'"), done.stderr
