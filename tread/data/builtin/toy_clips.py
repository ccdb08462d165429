"""Moving toy shapes for video training without downloads or a VAE: ensure_toy_clips builds the built-in
`toy_shapes_clips` (data=toy_clips), write_clip_files writes clip files with caption sidecars for --videos
(docs/video.md "Built-in clips")."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import numpy as np
from PIL import Image

from tread.utils.io import PathLike, atomic_write, atomic_write_text

from tread.data.buckets import Bucket
from tread.data.meta import LatentDatasetError
from tread.data.video import write_video
from tread.data.writer import write_latent_dataset

from .toy import TOY_COLOURS, TOY_SHAPES, TOY_CLASS_NAMES, ensure_builtin

DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "down": (0.0, 1.0), "up": (0.0, -1.0)}
DRIFT = 0.35            # half the track length, in short-side units (the short side spans [-1, 1])
TOY_CLIP_FPS = 8.0      # the frame rate the clips are written / recorded at
CAPTIONS = ("a {name} moving {direction}", "a video of a {name} moving {direction}")
CLIP_FORMATS = ("mp4", "gif", "frames")


def generate_toy_clips(num_per_class: int, frames: int, resolution: Union[int, tuple[int, int]] = 16,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic moving shapes: clips float32 (N, 3, F, H, W) in [-1, 1], labels int64 (N,) (shape classes,
    interleaved 0..9, 0..9, ...), directions int64 (N,) (indices into DIRECTIONS); N = 10 * num_per_class.
    `resolution` R (square) or (H, W); a one-frame clip shows the shape at the track's centre."""
    if num_per_class < 1 or frames < 1:
        raise LatentDatasetError(f"toy clips: num_per_class={num_per_class}, frames={frames}; both must be >= 1")
    rng = np.random.default_rng(seed)
    H, W = (resolution, resolution) if isinstance(resolution, int) else resolution
    k, R = len(TOY_SHAPES), min(H, W)
    n = num_per_class * k
    labels = np.tile(np.arange(k), num_per_class)
    direction = rng.integers(0, len(DIRECTIONS), n)
    offset = rng.uniform(-0.15, 0.15, (n, 2)).astype(np.float32)       # where the track runs
    size = rng.uniform(0.45, 0.6, (n, 1, 1)).astype(np.float32)
    colour = np.clip(TOY_COLOURS[labels] + rng.uniform(-0.08, 0.08, (n, 3)), 0, 1).astype(np.float32)
    background = (rng.uniform(0.04, 0.16, (n, 1)) + rng.uniform(-0.03, 0.03, (n, 3))).clip(0, 1).astype(np.float32)
    steps = np.linspace(-DRIFT, DRIFT, frames, dtype=np.float32) if frames > 1 else np.zeros(1, np.float32)
    heading = np.array(list(DIRECTIONS.values()), np.float32)[direction]              # (n, 2)
    centre = offset[:, None] + heading[:, None] * steps[None, :, None]                 # (n, F, 2)

    def coords(side: int) -> np.ndarray:  # pixel centres; the short side spans [-1, 1]
        return (np.arange(side, dtype=np.float32) + 0.5 - side / 2) / R * 2

    clips = np.empty((n, frames, 3, H, W), np.float32)
    for c, shape in enumerate(TOY_SHAPES):
        idx = np.flatnonzero(labels == c)
        x = coords(W)[None, None, None, :] - centre[idx, :, 0, None, None]        # (m, F, 1, W)
        y = coords(H)[None, None, :, None] - centre[idx, :, 1, None, None]        # (m, F, H, 1)
        alpha = shape(x, y, size[idx, None], 2 / R)[:, :, None]                   # (m, F, 1, H, W)
        bg, fg = background[idx, None, :, None, None], colour[idx, None, :, None, None]
        clips[idx] = bg + (fg - bg) * alpha
    return (clips.transpose(0, 2, 1, 3, 4) * 2 - 1).copy(), labels.astype(np.int64), direction.astype(np.int64)


def clip_captions(label: int, direction: int) -> list[str]:
    """The captions of a clip of class `label` moving in DIRECTIONS[direction]."""
    name, way = TOY_CLASS_NAMES[label], list(DIRECTIONS)[direction]
    return [c.format(name=name, direction=way) for c in CAPTIONS]


def to_uint8(clips: np.ndarray) -> np.ndarray:
    """float (N, 3, F, H, W) in [-1, 1] -> uint8 (N, F, H, W, 3), the rounding identity decoding uses."""
    return ((clips.transpose(0, 2, 3, 4, 1) + 1) * 127.5).round().clip(0, 255).astype(np.uint8)


def ensure_toy_clips(path: PathLike, num_per_class: int = 100, frames: int = 9, resolution: int = 16, seed: int = 0,
                     first_frame: bool = False) -> Path:
    """Return `path`, first writing the built-in toy_shapes_clips there unless it already holds these parameters:
    identity-decoded video latents (N, 3, frames, R, R), labels, meta "video" {frames, frame_stride 1, fps
    TOY_CLIP_FPS, temporal_factor 1}; first_frame=True also stores first_frame_latents (each clip's frame 0)."""
    root = Path(path).expanduser().absolute()
    if not isinstance(first_frame, (bool, np.bool_)):
        raise LatentDatasetError(f"data.builtin_args.first_frame={first_frame!r} must be true or false")
    params = {"name": "toy_shapes_clips", "num_per_class": int(num_per_class), "frames": int(frames),
              "resolution": int(resolution), "seed": int(seed), **({"first_frame": True} if first_frame else {})}

    def write() -> None:
        clips, labels, _ = generate_toy_clips(num_per_class, frames, resolution, seed)
        write_latent_dataset(
            root, clips, labels, num_classes=len(TOY_CLASS_NAMES), class_names=TOY_CLASS_NAMES, dtype="float16",
            source=f"built-in toy_shapes_clips (tread/data/builtin/toy_clips.py): {num_per_class} per class x "
                   f"{len(TOY_CLASS_NAMES)} classes, {frames} frames of {resolution}x{resolution} RGB in [-1, 1], "
                   f"seed {seed}", extra_meta={"builtin": params},
            video={"frames": int(frames), "frame_stride": 1, "fps": TOY_CLIP_FPS, "temporal_factor": 1},
            extras={"first_frame": clips[:, :, :1]} if first_frame else None)

    return ensure_builtin(root, params, write)


def _write_frames(folder: Path, frames: np.ndarray) -> Path:
    """A frame folder: frame_0000.png, frame_0001.png, ... (written atomically each)."""
    for i, frame in enumerate(frames):
        atomic_write(folder / f"frame_{i:04d}.png", lambda f, im=frame: Image.fromarray(im).save(f, format="PNG"))
    return folder


def write_clip_files(out: PathLike, sizes: Sequence[Bucket], num_per_class: int, seed: int = 0,
                     formats: Sequence[str] = CLIP_FORMATS, fps: float = TOY_CLIP_FPS,
                     captions: bool = True) -> dict[str, int]:
    """Write toy clips as files under `out`: per clip size (a video Bucket: frames > 0; its own seed, seed + its
    position) `num_per_class` clips per class as `<class>/<WxHxF>_<i>.<mp4|gif>` or the frame folder
    `<class>/<WxHxF>_<i>/`, the format cycling through `formats` clip by clip (mp4 falls back to gif without
    libx264: tread.data.video.write_video), each with a `<stem>.txt` sidecar of two captions, one per line.
    Returns {size name: clips written}. `out` must be new or empty (one error)."""
    out = Path(out).expanduser().absolute()
    bad = [f for f in formats if f not in CLIP_FORMATS]
    if bad or not formats:
        raise LatentDatasetError(f"clip formats {list(formats)}; allowed: a non-empty list of {list(CLIP_FORMATS)}")
    if any(b.frames < 1 for b in sizes):
        raise LatentDatasetError(f"clip sizes {[b.name for b in sizes]} need a frame count each (WxHxF, e.g. 16x16x9)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"'{out}' already exists and is not empty; choose a new folder")
    written = {}
    for k, size in enumerate(sizes):
        clips, labels, direction = generate_toy_clips(num_per_class, size.frames, (size.height, size.width), seed + k)
        for i, (clip, label, way) in enumerate(zip(to_uint8(clips), labels.tolist(), direction.tolist())):
            stem = out / TOY_CLASS_NAMES[label].replace(" ", "_") / f"{size.name}_{i:04d}"
            fmt = formats[i % len(formats)]
            if fmt == "frames":
                _write_frames(stem, clip)
            else:
                write_video(stem.with_suffix(f".{fmt}"), clip, fps)
            if captions:
                atomic_write_text(stem.with_suffix(".txt"), "\n".join(clip_captions(label, way)) + "\n")
        written[size.name] = len(labels)
    return written
