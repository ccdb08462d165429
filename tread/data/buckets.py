"""Aspect-ratio, size and frame buckets: the image (or clip) sizes a bucketed dataset is encoded at, which bucket
each image goes to, and the minimal resize and crop that brings it there, with its SDXL-style crop record
(docs/buckets.md "Precomputing buckets"; docs/video.md "Frame buckets")."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from tread.utils.numbers import MAX_FRAMES, MAX_SIDE, in_range, span

from .meta import LatentDatasetError

CROP_COLUMNS = ("original_height", "original_width", "resized_height", "resized_width", "crop_top", "crop_left")
# The ranges of the hand-parsed size flags (checked before anything is allocated or looped over).
MAX_PIXELS = MAX_SIDE * MAX_SIDE  # a --bucket-pixels budget
MAX_BUDGETS = 16                  # pixel budgets of one --bucket-pixels
MAX_BUCKETS = 1024                # buckets listed or derived (clips: sizes x frame counts)
MAX_ASPECT = 16                   # --max-aspect
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")


class BucketError(LatentDatasetError):
    """A bucket list, pixel budget or bucketed dataset that cannot be used."""


@dataclass(frozen=True, order=True)
class Bucket:
    """An image size in pixels (sorted by height, then width), or with frames > 0 a clip size: F pixel frames of
    that size (frames 0: an image bucket)."""

    height: int
    width: int
    frames: int = 0

    @property
    def name(self) -> str:
        """WIDTHxHEIGHT, as image sizes are written; a video bucket WIDTHxHEIGHTxFRAMES."""
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")

    @property
    def size(self) -> "Bucket":
        """The frame size alone (an image bucket)."""
        return Bucket(self.height, self.width)

    @property
    def area(self) -> int:
        return self.height * self.width

    @property
    def aspect(self) -> float:
        """width / height."""
        return self.width / self.height


def parse_buckets(text: str, flag: str = "--buckets") -> list[Bucket]:
    """'768x512,512x512,...' (WIDTHxHEIGHT, comma-separated; sides in [1, MAX_SIDE], at most MAX_BUCKETS) ->
    distinct buckets in that order."""
    items = str(text).split(",")
    if len(items) > MAX_BUCKETS:
        raise BucketError(f"{flag} lists {len(items)} sizes; at most {MAX_BUCKETS} are allowed")
    out: list[Bucket] = []
    for item in items:
        match = _SIZE.fullmatch(item)
        width, height = (in_range(match[k], 1, MAX_SIDE) for k in (1, 2)) if match else (None, None)
        if width is None or height is None:
            raise BucketError(f"{flag}={text!r} is not valid: {item.strip()!r} is not WIDTHxHEIGHT in pixels with "
                              f"each side {span(1, MAX_SIDE)}; expected a comma-separated list such as "
                              f"'768x512,512x512,512x768'")
        bucket = Bucket(height=height, width=width)
        if bucket in out:
            raise BucketError(f"{flag}={text!r} lists {bucket.name} twice; list each size once")
        out.append(bucket)
    return out


def check_stride(buckets: Sequence[Bucket], stride: int, flag: str, why: str) -> None:
    """Every bucket side a multiple of `stride` (`why` says where the stride comes from), else one error."""
    off = [b.name for b in buckets if b.height % stride or b.width % stride]
    if off:
        raise BucketError(f"{flag}: bucket(s) {', '.join(off)} are off the bucket stride {stride} ({why}); every "
                          f"side must be a multiple of {stride}, e.g. "
                          f"{_round_to(buckets[0].width, stride)}x{_round_to(buckets[0].height, stride)}")


def _round_to(value: int, stride: int) -> int:
    return max(stride, int(round(value / stride)) * stride)


def derive_buckets(pixel_budgets: Sequence[int], stride: int, max_aspect: float = 2.0) -> list[Bucket]:
    """The buckets of each pixel budget (docs/buckets.md), sorted; one error if a budget gives none, or the
    budgets, stride or aspect limit are out of range (MAX_PIXELS, MAX_SIDE, MAX_ASPECT, MAX_BUCKETS)."""
    if in_range(max_aspect, 1, MAX_ASPECT, whole=False) is None:
        raise BucketError(f"--max-aspect={max_aspect} is not valid: {span(1, MAX_ASPECT, False)} (the widest "
                          f"width/height allowed)")
    if in_range(stride, 1, MAX_SIDE) is None:
        raise BucketError(f"--bucket-stride={stride} is not valid: {span(1, MAX_SIDE)}")
    found: set[Bucket] = set()
    for budget in pixel_budgets:
        if in_range(budget, 1, MAX_PIXELS) is None:
            raise BucketError(f"--bucket-pixels={budget} is not valid: a pixel count (area) {span(1, MAX_PIXELS)} "
                              f"({MAX_SIDE}x{MAX_SIDE})")
        side = math.isqrt(budget) // stride * stride
        if side < stride:
            raise BucketError(f"--bucket-pixels={budget} is not valid: it must hold at least one {stride}x{stride} "
                              f"bucket (the bucket stride), e.g. {stride * stride * 64} ({stride * 8}x{stride * 8})")
        widest = min(MAX_SIDE, math.isqrt(int(budget * max_aspect)) + stride)   # wider is beyond the aspect limit
        for width in range(stride, widest + 1, stride):
            height = budget // width // stride * stride
            if stride <= height <= MAX_SIDE and 1 / max_aspect <= width / height <= max_aspect:
                found.add(Bucket(height, width))
    if len(found) > MAX_BUCKETS:
        raise BucketError(f"--bucket-pixels={','.join(map(str, pixel_budgets))} derives {len(found)} buckets at "
                          f"--bucket-stride {stride}, more than {MAX_BUCKETS}: raise --bucket-stride or lower "
                          f"--max-aspect")
    return sorted(found)


def assign_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> int:
    """The index in `buckets` of the bucket an image of this size goes to (docs/buckets.md)."""
    def aspect_gap(b: Bucket) -> float:
        return round(abs(math.log((width / height) / b.aspect)), 6)

    fits = [i for i, b in enumerate(buckets) if b.width <= width and b.height <= height]
    if fits:
        return min(fits, key=lambda i: (aspect_gap(buckets[i]), -buckets[i].area, i))
    return min(range(len(buckets)), key=lambda i: (aspect_gap(buckets[i]), buckets[i].area, i))


def parse_frame_buckets(text: str, flag: str = "--frame-buckets") -> list[int]:
    """'1,9,17' -> distinct frame counts in [1, MAX_FRAMES], ascending; one error naming the flag otherwise."""
    items = str(text).split(",")
    counts = [in_range(item, 1, MAX_FRAMES) for item in items[:MAX_BUCKETS + 1]]
    if len(items) > MAX_BUCKETS or None in counts:
        raise BucketError(f"{flag}={text!r} is not valid: expected comma-separated frame counts, each "
                          f"{span(1, MAX_FRAMES)}, e.g. '1,9,17'")
    if len(set(counts)) != len(counts):
        raise BucketError(f"{flag}={text!r} lists a frame count twice; list each once")
    return sorted(counts)


def check_frame_counts(counts: Sequence[int], temporal_factor: int, flag: str, why: str) -> None:
    """Every frame count 1 + k * temporal_factor (`why` says whose factor it is), else one error."""
    off = [f for f in counts if (f - 1) % temporal_factor]
    if off:
        fix = sorted({1 + max(0, round((f - 1) / temporal_factor)) * temporal_factor for f in off})
        raise BucketError(f"{flag}: frame count(s) {', '.join(map(str, off))} are not 1 + k * {temporal_factor} "
                          f"({why}); use e.g. {', '.join(map(str, fix))}")


def video_buckets(sizes: Sequence[Bucket], frame_counts: Sequence[int]) -> list[Bucket]:
    """Every aspect bucket at every frame count, sorted."""
    return sorted(Bucket(b.height, b.width, f) for b in sizes for f in frame_counts)


def frames_for(num_frames: int, stride: int, frame_counts: Sequence[int]) -> Optional[int]:
    """The largest of `frame_counts` a clip of `num_frames` fills at `stride` ((F - 1) * stride + 1 frames, none
    repeated); None when it is shorter than the smallest."""
    fits = [f for f in frame_counts if (f - 1) * stride + 1 <= num_frames]
    return max(fits) if fits else None


def assign_video_bucket(width: int, height: int, num_frames: int, stride: int, buckets: Sequence[Bucket]
                        ) -> Optional[int]:
    """The index in `buckets` (video buckets) of a clip's bucket: its aspect bucket by frame size (assign_bucket),
    then the largest frame count of that size it fills at `stride` (frames_for); None when it fills none."""
    sizes = sorted({b.size for b in buckets})
    size = sizes[assign_bucket(width, height, sizes)]
    counts = {b.frames: i for i, b in enumerate(buckets) if b.size == size}
    frames = frames_for(num_frames, stride, sorted(counts))
    return None if frames is None else counts[frames]


def fit_crop(pil_image: Image.Image, bucket: Bucket) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 (bucket.height, bucket.width, 3) RGB, int32 crop record (CROP_COLUMNS)) by docs/buckets.md's recipe."""
    image = pil_image.convert("RGB")
    original = image.size                                              # (W, H)
    while image.size[0] >= 2 * bucket.width and image.size[1] >= 2 * bucket.height:
        image = image.resize(tuple(side // 2 for side in image.size), resample=Image.BOX)
    scale = max(bucket.width / image.size[0], bucket.height / image.size[1])
    size = (max(bucket.width, round(image.size[0] * scale)), max(bucket.height, round(image.size[1] * scale)))
    image = image.resize(size, resample=Image.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - bucket.height) // 2, (arr.shape[1] - bucket.width) // 2
    crop = np.array([original[1], original[0], size[1], size[0], top, left], dtype=np.int32)
    return np.ascontiguousarray(arr[top:top + bucket.height, left:left + bucket.width]), crop


def mirrored_crop(crop: np.ndarray, bucket: Bucket) -> np.ndarray:
    """The crop record of the horizontally flipped copy: the crop's left edge measured from the other side."""
    out = np.array(crop, dtype=np.int32, copy=True)
    out[..., 5] = out[..., 3] - bucket.width - out[..., 5]
    return out


def histogram(counts: Sequence[int], buckets: Sequence[Bucket], width: int = 30) -> str:
    """One line per bucket: its name, its image count and a bar (for logs and notes)."""
    top = max(counts) or 1
    return "\n".join(f"  {b.name:>11}  {n:6d}  {'#' * max(1 if n else 0, round(width * n / top))}"
                     for b, n in zip(buckets, counts))

