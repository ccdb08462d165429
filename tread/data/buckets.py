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

from .meta import LatentDatasetError

CROP_COLUMNS = ("original_height", "original_width", "resized_height", "resized_width", "crop_top", "crop_left")
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


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
    """'768x512,512x512,...' (WIDTHxHEIGHT, comma-separated) -> distinct buckets in that order."""
    out: list[Bucket] = []
    for item in str(text).split(","):
        match = _SIZE.match(item)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise BucketError(f"{flag}={text!r} is not valid: {item.strip()!r} is not WIDTHxHEIGHT in pixels; "
                              f"expected a comma-separated list such as '768x512,512x512,512x768'")
        bucket = Bucket(height=int(match[2]), width=int(match[1]))
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
    """The buckets of each pixel budget (docs/buckets.md), sorted; one error if a budget gives none."""
    if max_aspect < 1:
        raise BucketError(f"--max-aspect={max_aspect} is not valid: a number >= 1 (the widest width/height allowed)")
    found: set[Bucket] = set()
    for budget in pixel_budgets:
        side = math.isqrt(budget) // stride * stride
        if side < stride:
            raise BucketError(f"--bucket-pixels={budget} is not valid: it must hold at least one {stride}x{stride} "
                              f"bucket (the bucket stride), e.g. {stride * stride * 64} ({stride * 8}x{stride * 8})")
        for width in range(stride, budget // stride + 1, stride):
            height = budget // width // stride * stride
            if height >= stride and 1 / max_aspect <= width / height <= max_aspect:
                found.add(Bucket(height, width))
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
    """'1,9,17' -> distinct positive frame counts, ascending; one error naming the flag otherwise."""
    items = [item.strip() for item in str(text).split(",")]
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise BucketError(f"{flag}={text!r} is not valid: expected comma-separated frame counts >= 1, e.g. '1,9,17'")
    counts = [int(item) for item in items]
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

