"""Precomputing clips (--videos; docs/video.md "Precompute clips"): the checks of the video flags, the plan of the
clips (probed once, each given its frame count and bucket), reading and cropping a clip, and the video VAE encoder
(posterior mean, in model space). The rest (shards, resuming, captions, the merge) is the images' pipeline."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image

from tread.encoders.dinov2 import weights_digest
from tread.encoders.image_embeds import ImageEncoder, load_image_encoder
from tread.encoders.vae import encode_video, load_vae, to_model_space, video_vae_info

from tread.data.buckets import Bucket, BucketError, assign_bucket, check_frame_counts, fit_crop, frames_for, video_buckets
from tread.data.images import IMAGE_EXTS, short_list
from tread.data.video import VIDEO_SUFFIXES, VideoError, clip_tree, frames_needed, probe_clip, read_clip

from .request import PrecomputeError, PrecomputeRequest, bad_value, frame_counts, request_buckets
from .vae_class import video_vae_class

# ----------------------------------------------------------------------------- the plan

def list_clips(root: Path) -> tuple[list[Path], np.ndarray, Optional[list[str]]]:
    """(clips, int64 labels, class names or None): class sub-folders of clips, or clips directly under `root` (one
    class, no names); a mix, no clip at all, or a folder that holds no clip (an empty frame or class folder) is
    one error."""
    try:
        clips, empty = clip_tree(root)
    except VideoError as err:                # a link loop, images beside clip folders, an unreadable folder
        raise PrecomputeError(str(err)) from None
    if clips and empty:
        raise PrecomputeError(f"{len(empty)} folder(s) under --videos '{root}' hold no clip (no video file: "
                              f"{', '.join(VIDEO_SUFFIXES)}; no frame images: {', '.join(IMAGE_EXTS)}): "
                              f"{short_list([e.relative_to(root).as_posix() for e in empty])} (an empty frame "
                              f"folder or class folder?); fill or remove them")
    if not clips:
        raise PrecomputeError(f"no clips under --videos '{root}': expected video files (.mp4, .webm, .gif, .mov, "
                              f".mkv, .avi) or frame folders (folders of images), in class sub-folders or directly "
                              f"in it")
    rel = [c.relative_to(root).parts for c in clips]
    top, nested = [c for c, r in zip(clips, rel) if len(r) == 1], [c for c, r in zip(clips, rel) if len(r) > 1]
    if top and nested:
        raise PrecomputeError(f"--videos '{root}' mixes layouts: clips directly in it ({short_list([c.name for c in top])})"
                              f" and in sub-folders; use class sub-folders for all clips or none")
    if top:
        return clips, np.zeros(len(clips), np.int64), None
    names = sorted({r[0] for r in rel})
    return clips, np.asarray([names.index(r[0]) for r in rel], np.int64), names


def probe_all(root: Path, clips: list[Path], need: int, stride: int, smallest: int) -> list:
    """Every clip's ClipInfo; all the bad ones (corrupt, no frames, mixed frame sizes, fewer than `need` frames)
    in one error, before anything is encoded."""
    infos, bad = [], []
    for clip in clips:
        try:
            info = probe_clip(clip)
        except VideoError as err:
            bad.append(str(err))
            continue
        if info.num_frames < need:
            bad.append(f"clip '{clip}' has {info.num_frames} frames; {smallest} at stride {stride} need {need}")
        infos.append(info)
    if bad:
        raise PrecomputeError(f"{len(bad)} of {len(clips)} clip(s) under '{root}' cannot be used: "
                              f"{'; '.join(bad[:5])}{f' (and {len(bad) - 5} more)' if len(bad) > 5 else ''}. Fix or "
                              f"remove them, or lower --frames / --frame-buckets / --frame-stride; nothing was encoded.")
    return infos


def plan_clips(req: PrecomputeRequest, root: Path) -> dict[str, Any]:
    """The clips, their labels and, per clip, its target (a Bucket with frames): {"paths", "labels", "class_names",
    "buckets" (None: one shape), "clip_bucket", "settings"}."""
    paths, labels, class_names = list_clips(root)
    counts, stride = frame_counts(req), req.frame_stride
    infos = probe_all(root, paths, frames_needed(counts[0], stride), stride, counts[0])
    sizes = request_buckets(req)
    bucketed = sizes is not None or req.frame_buckets is not None
    sizes = sizes or [Bucket(req.resolution, req.resolution)]
    buckets = video_buckets(sizes, counts)
    clip_bucket = np.asarray([_bucket_of(info, stride, sizes, counts, buckets) for info in infos], np.int64)
    digest = hashlib.sha256()
    for info in infos:
        digest.update(f"{info.path.relative_to(root).as_posix()}\t{info.num_frames}\t{info.width}x{info.height}\n"
                      .encode("utf-8", "surrogateescape"))
    settings = {"frames": counts if req.frame_buckets is not None else counts[0], "frame_stride": stride,
                "first_frame": bool(req.first_frame), "vae_class": req.vae_class, "clips_sha256": digest.hexdigest(),
                "image_encoder": weights_digest(req.image_encoder) if req.image_encoder else None,
                "fps": sorted({round(info.fps / stride, 6) for info in infos})}
    return {"paths": paths, "labels": labels, "class_names": class_names, "buckets": buckets if bucketed else None,
            "clip_bucket": clip_bucket if bucketed else None, "target": buckets[0] if not bucketed else None,
            "settings": settings}


def _bucket_of(info, stride: int, sizes: list[Bucket], counts: list[int], buckets: list[Bucket]) -> int:
    size = sizes[assign_bucket(info.width, info.height, sizes)]
    return buckets.index(Bucket(size.height, size.width, frames_for(info.num_frames, stride, counts)))


# ----------------------------------------------------------------------------- reading and encoding

def load_clip(path: Path, target: Bucket, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """A clip's first target.frames frames at `stride`, each resized and center-cropped to the target size
    (fit_crop): (uint8 (F, h, w, 3), int32 crop record of its frames)."""
    try:
        frames = read_clip(path, target.frames, stride)
    except VideoError as err:      # probed sound, but its data breaks: one error line all the same
        raise PrecomputeError(f"{str(err).rstrip('.')}; fix or remove it and rerun (finished shards are kept)") from None
    cropped = [fit_crop(Image.fromarray(f), target.size) for f in frames]
    return np.stack([c for c, _ in cropped]), cropped[0][1]


@dataclass
class VideoEncoder:
    """Clips -> model-space latents of the posterior mean (encode_video, to_model_space); first frames alone."""
    vae: Any
    info: dict
    text: Optional[Any] = None     # precompute.TextEncoder with captions
    repa: None = None              # clips store no REPA features (precompute.Encoder.repa: images only)
    repa_meta: None = None
    image: Optional[ImageEncoder] = None   # --image-encoder: the first frame's image embeddings are stored too

    def _encode(self, clips: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
        return to_model_space(encode_video(self.vae, x, kind="mean"), self.info).cpu().numpy()

    def __call__(self, clips: np.ndarray, sample_indices: np.ndarray) -> np.ndarray:
        """uint8 (B, F, h, w, 3) -> float32 (B, C, T, h / s, w / s) model-space latents."""
        return self._encode(clips)

    def first_frame(self, clips: np.ndarray) -> np.ndarray:
        """uint8 (B, F, h, w, 3) -> float32 (B, C, 1, h / s, w / s): each clip's first frame encoded alone."""
        return self._encode(clips[:, :1])


def load_video_encoder(plan, device) -> VideoEncoder:
    """The video VAE, checked against the frame counts (temporal factor) and the frame sizes (spatial factor)."""
    req = plan.request
    vae = load_vae(req.vae, subfolder=req.vae_subfolder, device=device, dtype=req.vae_dtype, cls=video_vae_class(req))
    info = video_vae_info(vae)
    k, s = info["temporal_factor"], info["spatial_factor"]
    flag = "--frame-buckets" if req.frame_buckets is not None else "--frames"
    try:
        check_frame_counts(frame_counts(req), k, flag, f"the VAE '{req.vae}' compresses {k} frames into one latent "
                                                       f"frame after the first")
    except BucketError as err:
        raise PrecomputeError(str(err)) from None
    sides = {side for b in (plan.buckets or [plan.target(0)]) for side in (b.height, b.width)}
    if any(side % s for side in sides):
        flag = "--bucket-stride" if plan.buckets is not None and (req.buckets or req.bucket_pixels) else "--resolution"
        raise bad_value(flag, req.bucket_stride if flag == "--bucket-stride" else req.resolution,
                        f"a multiple of {s} (the VAE '{req.vae}' downsamples frames by {s})")
    image = load_image_encoder(req.image_encoder, "--image-encoder", device) if req.image_encoder else None
    return VideoEncoder(vae, info, image=image)


def video_meta(plan, vae, frames: int) -> dict:
    """meta "video" of a (bucket's) dataset of `frames`-frame clips."""
    fps = plan.settings["video"]["fps"]
    return {"frames": frames, "frame_stride": plan.request.frame_stride, "fps": fps[0] if len(fps) == 1 else None,
            "temporal_factor": video_vae_info(vae)["temporal_factor"]}


def video_dataset_meta(plan, vae) -> dict:
    """LatentDatasetWriter keyword arguments (less "video", which is per bucket) describing the VAE and clips."""
    s, info = plan.settings, video_vae_info(vae)
    v = s["video"]
    source = (f"scripts/precompute_latents.py: {s['num_images']} clips from {plan.root} ({v['frames']} frames at "
              f"stride {v['frame_stride']}), VAE {s['vae']} posterior mean")
    return {"latent_scale": 1.0, "source": source,
            "decode": {**info, "vae": s["vae"], "subfolder": s["vae_subfolder"]},
            "extra_meta": {"latent_kind": "sample", "encoding": "posterior mean, model space",
                           "num_source_clips": s["num_images"], "encode_vae_dtype": s["vae_dtype"],
                           "clips_sha256": v["clips_sha256"], "image_resolution": None}}

