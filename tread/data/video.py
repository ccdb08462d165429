"""Video clips on disk (video files and frame folders): finding them, probing their size and length, decoding
frames with PyAV from the start of the file (exact indices, no seeking), and writing clips (docs/video.md "Reading
clips")."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import av
import numpy as np
from PIL import Image

from tread.utils.errors import UserError
from tread.utils.io import atomic_write
from tread.utils.readers import image_size, read_image

from .images import IMAGE_EXTS, broken_link_error, dangling, short_list, walk_folders

av.logging.set_level(None)  # FFmpeg's log lines off: a bad file is reported as one VideoError line

VIDEO_SUFFIXES = (".mp4", ".webm", ".gif", ".mov", ".mkv", ".avi")
FRAME_FOLDER_FPS = 24.0   # the frame rate a frame folder is taken to have (and a file whose header has none)
GIF_PALETTE_FRAMES = 16   # frames (evenly spaced) a GIF's one shared 256-colour palette is fitted to
PathLike = Union[str, os.PathLike]
_DIGITS = re.compile(r"(\d+)")
# What decoding a broken file raises: FFmpeg errors (InvalidDataError, EOFError, ...) and plain I/O errors.
_DECODE_ERRORS = (av.error.FFmpegError, OSError)


class VideoError(UserError):
    """A clip that cannot be used: the file, what is wrong, what is allowed (one line)."""


@dataclass(frozen=True)
class ClipInfo:
    """A clip's frame count, frame size (pixels) and frame rate (frames per second)."""
    path: Path
    num_frames: int
    height: int
    width: int
    fps: float


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in _DIGITS.split(name)]


def _visible_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()]


def _is_video_file(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES and not path.name.startswith(".")


def frame_files(folder: PathLike) -> list[Path]:
    """A frame folder's image files in natural name order (frame_2 before frame_10); [] if it has none."""
    files = [p for p in _visible_files(Path(folder)) if p.suffix.lower() in IMAGE_EXTS]
    return sorted(files, key=lambda p: _natural_key(p.name))


@dataclass
class _Folder:
    """What find_clips needs of a folder: its first image file (None: none), its video files, its sub-folders."""
    image: Optional[Path]
    videos: list[Path]
    dirs: list[Path]


def _scan(root: Path) -> dict[Path, _Folder]:
    """Every visible folder at or below `root` (walk_folders: links followed, each folder once; a loop, or a
    broken link named as a frame or a video, is a VideoError naming it)."""
    tree = {}
    for here, dirs, files in walk_folders(root, VideoError):
        used = [e for e in files if not e.name.startswith(".") and
                (_is_video_file(Path(e.name)) or Path(e.name).suffix.lower() in IMAGE_EXTS)]
        broken = next((e for e in used if dangling(e)), None)
        if broken is not None:
            raise broken_link_error(broken.path, VideoError)
        images = [Path(e.path) for e in used if Path(e.name).suffix.lower() in IMAGE_EXTS]
        tree[here] = _Folder(images[0] if images else None, [Path(e.path) for e in used if _is_video_file(
            Path(e.name))], dirs)
    return tree


def _kinds(tree: dict[Path, _Folder]) -> tuple[dict[Path, bool], dict[Path, bool]]:
    """Per folder (deepest first): whether it is a frame folder (images, no video files, no images in any folder
    below it), and whether it holds a clip at or below it."""
    images_below: dict[Path, bool] = {}
    frame: dict[Path, bool] = {}
    has_clip: dict[Path, bool] = {}
    for f in sorted(tree, key=lambda p: len(p.parts), reverse=True):
        node = tree[f]
        inner = any(images_below[d] for d in node.dirs)
        images_below[f] = node.image is not None or inner
        frame[f] = node.image is not None and not node.videos and not inner
        has_clip[f] = frame[f] or bool(node.videos) or any(has_clip[d] for d in node.dirs)
    return frame, has_clip


def _is_frame_folder(folder: Path) -> bool:
    return _kinds(_scan(folder))[0][folder]


def is_clip(path: PathLike) -> bool:
    """True for a video file (by suffix) and a frame folder (a directory of >= 1 images, no video files, and no
    images in any folder below it)."""
    path = Path(path)
    if path.is_dir():
        return _is_frame_folder(path)
    return path.is_file() and _is_video_file(path)


def _stray_images(folder: Path, node: _Folder, has_clip: dict[Path, bool]) -> VideoError:
    beside = [d.name for d in node.dirs if has_clip[d]]
    return VideoError(f"'{node.image}' lies beside clip folders in '{folder}' ({short_list(beside)}): a folder of "
                      f"images is one clip (a frame folder) only when no folder below it holds images too, so this "
                      f"one is neither a clip nor a class folder. Move its images (a cover or thumbnail) out of the "
                      f"clip folders, or into a clip folder of their own")


def clip_tree(root: PathLike) -> tuple[list[Path], list[Path]]:
    """(the clips at or under `root`, sorted by path: video files, and frame folders, each one clip, nothing below
    one looked at; the visible folders that hold no clip at or below them, the highest of each such branch).
    Hidden files and folders are skipped; images beside clip folders are one VideoError naming one. A missing root
    is FileNotFoundError."""
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"clip folder '{root}' does not exist")
    if not root.is_dir():
        return ([root] if _is_video_file(root) else []), []
    tree = _scan(root)
    frame, has_clip = _kinds(tree)
    clips, empty, pending = [], [], [root]
    while pending:
        folder = pending.pop()
        node = tree[folder]
        if frame[folder]:
            clips.append(folder)
            continue
        if node.image is not None and not node.videos:
            raise _stray_images(folder, node, has_clip)
        clips.extend(node.videos)
        empty.extend(d for d in node.dirs if not has_clip[d])
        pending.extend(d for d in node.dirs if has_clip[d])
    return sorted(clips, key=lambda p: p.relative_to(root).as_posix()), sorted(empty)


def find_clips(root: PathLike) -> list[Path]:
    """The clips at or under `root` (clip_tree), sorted by path."""
    return clip_tree(root)[0]


def _corrupt(path: Path, err: Exception) -> VideoError:
    detail = " ".join(str(err).split()) or type(err).__name__
    return VideoError(f"clip '{path}' cannot be decoded ({detail}): it is corrupt, truncated or not a video; "
                      f"allowed: a video file PyAV/FFmpeg decodes ({', '.join(VIDEO_SUFFIXES)}) or a folder of "
                      f"frame images")


def _no_frames(path: Path, header: int = 0) -> VideoError:
    said = f" (its header says {header}, none decodes)" if header else ""
    return VideoError(f"clip '{path}' has no video frames{said} (an empty or truncated file, or no video stream); "
                      f"a clip needs at least 1 frame")


def _frame_folder_info(folder: Path) -> ClipInfo:
    files = frame_files(folder)
    if not files:
        raise _no_frames(folder)
    first = image_size(files[0], "frame", VideoError, verify=False)
    for f in files[1:]:
        size = image_size(f, "frame", VideoError, verify=False)
        if size != first:
            raise VideoError(f"frame folder '{folder}' mixes frame sizes: '{files[0].name}' is {first[0]}x{first[1]} "
                             f"but '{f.name}' is {size[0]}x{size[1]} (WIDTHxHEIGHT); all frames of a clip must "
                             f"have one size")
    return ClipInfo(folder, len(files), first[1], first[0], FRAME_FOLDER_FPS)


def _fps(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else FRAME_FOLDER_FPS


def _decoded(path: Path) -> Iterator:
    """The video frames of a file, decoded in order (first video stream); VideoError when it does not decode."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _no_frames(path)
            yield from container.decode(container.streams.video[0])
    except _DECODE_ERRORS as err:
        raise _corrupt(path, err) from None


def probe_clip(path: PathLike) -> ClipInfo:
    """A clip's ClipInfo from the container headers (counting frames by decoding when the header has no count);
    a frame folder's from every image's header (mixed sizes -> VideoError naming two files). VideoError for a
    corrupt file or one with no frames; FileNotFoundError for a missing one."""
    path = Path(path)
    if path.is_dir():
        return _frame_folder_info(path)
    if not path.is_file():
        raise FileNotFoundError(f"clip '{path}' does not exist")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _no_frames(path)
            stream = container.streams.video[0]
            count, fps = stream.frames, _fps(stream)
            height, width = stream.codec_context.height, stream.codec_context.width
    except _DECODE_ERRORS as err:
        raise _corrupt(path, err) from None
    if count <= 0 or not height or not width:
        count, frame = 0, None
        for frame in _decoded(path):
            count += 1
        if frame is not None:
            height, width = frame.height, frame.width
    elif not _first_frame_decodes(path):
        raise _no_frames(path, count)
    if count <= 0:
        raise _no_frames(path)
    return ClipInfo(path, int(count), int(height), int(width), fps)


def _first_frame_decodes(path: Path) -> bool:
    """Whether a video's first frame decodes (a header's frame count is not proof that any does); VideoError for
    data that does not decode."""
    frames = _decoded(path)
    try:
        return next(frames, None) is not None
    finally:
        frames.close()


def frames_needed(frames: int, stride: int = 1, start: int = 0) -> int:
    """How many frames a clip needs to give `frames` frames at `stride` from frame `start`."""
    return start + (frames - 1) * stride + 1


def _check_request(path: Path, frames: int, stride: int, start: int) -> None:
    for name, value, low in (("frames", frames, 1), ("stride", stride, 1), ("start", start, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise VideoError(f"reading clip '{path}': {name}={value!r}; allowed: an integer >= {low}")


def _too_short(path: Path, have: int, frames: int, stride: int, start: int) -> VideoError:
    at = f" from frame {start}" if start else ""
    return VideoError(f"clip '{path}' has {have} frames; {frames} at stride {stride}{at} need "
                      f"{frames_needed(frames, stride, start)}")


def read_clip(path: PathLike, frames: int, stride: int = 1, start: int = 0) -> np.ndarray:
    """Frames start, start + stride, ... (`frames` of them) of a clip as uint8 RGB (frames, H, W, 3).

    VideoError: a corrupt / undecodable file, a clip with no frames, one too short ("has 7 frames; 17 at stride 2
    need 33"), a frame folder with mixed sizes. A video whose frame size changes midway is scaled to its first
    frame's size."""
    path = Path(path)
    _check_request(path, frames, stride, start)
    wanted = range(start, frames_needed(frames, stride, start), stride)
    if path.is_dir():
        info = _frame_folder_info(path)
        if info.num_frames < wanted.stop:
            raise _too_short(path, info.num_frames, frames, stride, start)
        files = frame_files(path)
        return np.stack([np.asarray(read_image(files[i], "frame", error=VideoError)) for i in wanted])
    if not path.is_file():
        raise FileNotFoundError(f"clip '{path}' does not exist")
    out, count, size = [], 0, None
    for frame in _decoded(path):
        size = size or (frame.width, frame.height)
        if count in wanted:
            out.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
        count += 1
        if len(out) == frames:
            return np.stack(out)
    if count == 0:
        raise _no_frames(path)
    raise _too_short(path, count, frames, stride, start)


# ----------------------------------------------------------------------------- writing

def video_encoder_available() -> bool:
    """True when PyAV has the H.264 encoder (libx264) that write_video's mp4 needs."""
    try:
        av.codec.Codec("libx264", "w")
    except Exception:  # noqa: BLE001 - any failure means: no such encoder in this build
        return False
    return True


def _check_frames(path: Path, frames: np.ndarray, fps: float) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 \
            or min(frames.shape) < 1:
        got = f"{frames.dtype} {list(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
        raise VideoError(f"writing '{path}': frames are {got}; allowed: uint8 (F, H, W, 3) with F, H, W >= 1")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not np.isfinite(fps) or fps <= 0:
        raise VideoError(f"writing '{path}': fps={fps!r}; allowed: a number > 0")


def _mux(file, fmt: str, codec: str, pix_fmt: str, fps: float, frames) -> None:
    """Encode `frames` (av.VideoFrame) into the open binary `file` as container `fmt`."""
    from fractions import Fraction

    first = frames[0]
    with av.open(file, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = first.width, first.height, pix_fmt
        for frame in frames:
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def _even(frames: np.ndarray) -> np.ndarray:
    """Frames with odd sides padded by one edge row / column (yuv420p needs even sides)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge") if pad_h or pad_w else frames


def _gif_frames(frames: np.ndarray) -> list:
    """pal8 frames sharing one 256-colour palette fitted to a few evenly spaced frames (median cut, no dither)."""
    pick = np.unique(np.linspace(0, len(frames) - 1, min(len(frames), GIF_PALETTE_FRAMES)).round().astype(int))
    palette_image = Image.fromarray(np.concatenate(list(frames[pick]), axis=0)).quantize(
        256, method=Image.Quantize.MEDIANCUT)
    rgb = np.zeros((256, 3), np.uint8)
    used = np.asarray(palette_image.getpalette(), np.uint8).reshape(-1, 3)[:256]
    rgb[:len(used)] = used
    argb = np.ascontiguousarray(np.concatenate([np.full((256, 1), 255, np.uint8), rgb], axis=1))
    return [av.VideoFrame.from_ndarray(
        [np.asarray(Image.fromarray(f).quantize(palette=palette_image, dither=Image.Dither.NONE)), argb],
        format="pal8") for f in frames]


def write_video(path: PathLike, frames: np.ndarray, fps: float) -> Path:
    """Write uint8 RGB frames (F, H, W, 3) as a clip, atomically; returns the path written.

    `path` ending in .mp4 with libx264 available: H.264 mp4 (yuv420p; an odd side is padded by repeating its last
    row / column). Otherwise a GIF at `path` with suffix .gif (one shared 256-colour palette; GIF delays are in
    1/100 s, so the stored rate is the nearest such)."""
    path = Path(path).expanduser()
    _check_frames(path, frames, fps)
    if path.suffix.lower() == ".mp4" and video_encoder_available():
        video = [av.VideoFrame.from_ndarray(f, format="rgb24") for f in _even(frames)]
        return atomic_write(path, lambda f: _mux(f, "mp4", "libx264", "yuv420p", fps, video))
    path = path.with_suffix(".gif")
    return atomic_write(path, lambda f: _mux(f, "gif", "gif", "pal8", fps, _gif_frames(frames)))
