"""Videos out: decoded videos (uint8 (F, H, W, 3) each) as one file per video (tread.data.video.write_video: mp4
through PyAV's libx264 when it is there, else an animated GIF), the first, middle and last frame of each as stills
for a grid, and a video file as animated-GIF bytes (what TensorBoard's image plugin plays). Shared by the
in-training validation prompts (tread/evaluation/validation.py), sample.py and the run's trackers."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from tread.data.video import probe_clip, read_clip, write_video
from tread.evaluation.images import save_captioned_grid, save_image_grid
from tread.utils.io import atomic_write

DEFAULT_FPS = 8.0                       # frames per second when the data's meta has no "video" fps
STILL_NAMES = ("first", "middle", "last")
SLUG_CHARS = 40                         # a file name's slug of its caption: at most this many characters

Frames = Union[torch.Tensor, np.ndarray]


def is_video(sample: Frames) -> bool:
    """Whether one decoded sample is a video of several frames (uint8 (F, H, W, 3), F > 1), not an image
    (H, W, 3) or a one-frame clip."""
    return sample.ndim == 4 and sample.shape[0] > 1


def video_fps(meta: Mapping[str, Any]) -> float:
    """The frame rate videos of this data are written at: meta "video" fps (the source's fps / frame_stride),
    else DEFAULT_FPS."""
    fps = (meta.get("video") or {}).get("fps")
    return float(fps) if fps else DEFAULT_FPS


def slug(text: str, limit: int = SLUG_CHARS) -> str:
    """A file-name-safe form of a caption: lower case, runs of other characters than a-z 0-9 as one "_", at most
    `limit` characters ("video" when nothing is left)."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:limit].rstrip("_") or "video"


def still_indices(frames: int) -> tuple[int, int, int]:
    """The first, middle and last frame of `frames` frames."""
    return 0, (frames - 1) // 2, frames - 1


def stills(video: Frames) -> torch.Tensor:
    """The first, middle and last frame of a uint8 (F, H, W, 3) video: uint8 (3, H, W, 3)."""
    video = torch.as_tensor(video)
    return video[list(still_indices(video.shape[0]))]


def still_captions(caption: str, frames: int) -> list[str]:
    """The captions of a video's three stills: `caption`, then which frame each is (1-based of `frames`)."""
    return [f"{caption} [{name} frame {i + 1}/{frames}]" for name, i in zip(STILL_NAMES, still_indices(frames))]


def save_videos(videos: Sequence[Frames], names: Sequence[str], folder: Path, fps: float) -> list[Path]:
    """Each uint8 (F, H, W, 3) video as `folder/<name>.mp4` at `fps` (write_video: a GIF, `<name>.gif`, where
    PyAV's libx264 encoder is missing); the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [write_video(folder / f"{name}.mp4", torch.as_tensor(v).cpu().numpy(), fps)
            for v, name in zip(videos, names)]


def gif_bytes(path: Path) -> bytes:
    """A video file as animated-GIF bytes: a GIF's own bytes; any other video decoded and written as a GIF
    (write_video) at its frame rate."""
    path = Path(path)
    if path.suffix.lower() == ".gif":
        return path.read_bytes()
    info = probe_clip(path)
    with tempfile.TemporaryDirectory() as tmp:
        return write_video(Path(tmp) / "video.gif", read_clip(path, info.num_frames), info.fps).read_bytes()


GRID_VIDEOS = 64   # sample.py's still grid shows the first this many videos (3 stills each)


def write_video_samples(videos: torch.Tensor, labels: torch.Tensor, out_dir: Path, fps: float,
                        captions: Optional[list[str]] = None) -> dict:
    """sample.py's outputs for uint8 (N, F, H, W, 3) videos under out_dir: videos/<index:06d>[_<slug>].mp4 (.gif
    without an mp4 encoder) at `fps`, grid.png (a row of first, middle and last frame per video; with `captions`,
    one per video, captioned) and samples.npz (arr_0 the frames uint8 (N, F, H, W, 3), arr_1 the labels)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f"{i:06d}" + (f"_{slug(captions[i])}" if captions is not None else "") for i in range(len(videos))]
    save_videos(videos, names, out_dir / "videos", fps)
    arrays = {"arr_0": videos.cpu().numpy(), "arr_1": labels.cpu().numpy()}
    atomic_write(out_dir / "samples.npz", lambda f: np.savez(f, **arrays))
    shown = videos[:GRID_VIDEOS]
    frames = torch.cat([stills(v) for v in shown])
    if captions is not None:
        texts = [t for v, c in zip(shown, captions) for t in still_captions(c, len(v))]
        save_captioned_grid(frames, texts, out_dir / "grid.png", nrow=len(STILL_NAMES))
    else:
        save_image_grid(frames, out_dir / "grid.png", nrow=len(STILL_NAMES), upscale=max(1, 64 // frames.shape[1]))
    return {"videos": str(out_dir / "videos"), "npz": str(out_dir / "samples.npz"), "grid": str(out_dir / "grid.png")}
