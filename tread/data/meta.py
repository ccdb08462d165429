"""The latent dataset directory format (meta.json, latents.npy, labels.npy and optional per-sample files): the
meta.json checks, and the latent kinds ("sample" | "moments") with the draw that turns stored items into latents.
Every key and file is described in docs/data.md, "The latent directory format"."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from tread.encoders.vae import VAE_CLASSES
from tread.utils.errors import UserError
from tread.utils.readers import read_json

FORMAT, VERSION = "tread-latents", 1
DTYPES = ("float16", "float32")
DECODE_TYPES = ("identity", "vae")
LATENT_KINDS = ("sample", "moments")
DEFAULT_FILES = {"latents": "latents.npy", "labels": "labels.npy"}
# Optional per-sample files: meta "files" key -> default file name.
EXTRA_FILES = {"text_embeds": "text_embeds.npy", "text_mask": "text_mask.npy", "pooled_embeds": "pooled_embeds.npy",
               "llama_embeds": "llama_embeds.npy", "glyph_embeds": "glyph_embeds.npy", "glyph_mask": "glyph_mask.npy",
               "loss_mask": "loss_mask.npy",
               "reference_latents": "reference_latents.npy", "first_frame_latents": "first_frame_latents.npy",
               "repa_features": "repa_features.npy", "image_embeds": "image_embeds.npy"}
# A caption table (several captions per sample, docs/data.md "Captions"): the offsets file, and the extras with one row
# per caption in it.
CAPTION_FILES = {"caption_offsets": "caption_offsets.npy"}
# glyph / glyph_mask: HunyuanVideo 1.5's ByT5 embeddings of a caption's quoted text (mask all False without any).
CAPTION_KEYS = ("text", "text_mask", "pooled", "llama", "glyph", "glyph_mask")
# Keys of an extras dict (writer input, reader output), in this order, and the files holding them.
# image_embeds: a clip's first frame through the image-to-video pipeline's image encoder (HunyuanVideo 1.5: SigLIP).
EXTRA_KEYS = ("text", "text_mask", "pooled", "llama", "glyph", "glyph_mask", "loss_mask", "reference", "first_frame",
              "image_embeds", "repa_features")
EXTRA_FILE_OF = {"text": "text_embeds", "text_mask": "text_mask", "pooled": "pooled_embeds", "llama": "llama_embeds",
                 "glyph": "glyph_embeds", "glyph_mask": "glyph_mask",
                 "loss_mask": "loss_mask", "reference": "reference_latents", "first_frame": "first_frame_latents",
                 "repa_features": "repa_features", "image_embeds": "image_embeds"}
# meta "repa_features" (REPA targets stored beside the latents): key -> what is allowed.
REPA_FEATURE_KEYS = {"encoder": "a non-empty string (model.repa.encoder's name)",
                     "digest": "a non-empty string (sha256 of the encoder's weights)",
                     "dim": "a positive integer (the feature width)",
                     "grid": "[h, w], two positive integers (the feature map)"}
# The optional meta key of each file's size, mtime, digest and non-finite samples (tread/data/integrity.py).
INTEGRITY_KEY = "integrity"
# The extras that are the model's per-sample conditioning (cond=...): text embeddings (HiDream's Llama states too),
# Kontext reference latents, a clip's first frame (image-to-video).
COND_KEYS = ("text", "text_mask", "pooled", "llama", "glyph", "glyph_mask", "reference", "first_frame", "image_embeds")
# meta "video" (video data only): key -> what is allowed.
VIDEO_KEYS = {"frames": "a positive integer (pixel frames per clip)",
              "frame_stride": "a positive integer (source frames between two frames read)",
              "fps": "null or a finite number > 0 (the source fps / frame_stride)",
              "temporal_factor": "a positive integer (the VAE's temporal compression; 1 for identity decoding)"}
# Top-level meta.json keys and the JSON types they must have (checked in detail in read_meta).
META_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "version": (int,), "shape": (list,), "dtype": (str,), "num_samples": (int,),
    "num_classes": (int,), "latent_scale": (int, float), "decode": (dict,), "source": (str,),
    "class_names": (list, type(None)), "files": (dict,),
}
REBUILD = "Rebuild the dataset (e.g. with data.write_latent_dataset)."
FIX_META = "Fix meta.json or rebuild the dataset (e.g. with data.write_latent_dataset)."
PathLike = Union[str, os.PathLike]


class LatentDatasetError(UserError):
    """A latent dataset (or its description) is missing, malformed or does not fit the model."""


class LatentDatasetExistsError(LatentDatasetError):
    """write_latent_dataset's target directory already exists (possibly written concurrently)."""


# ----------------------------------------------------------------------------- metadata

def _is_type(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int subclass, but true/false is never a valid count or scale.
    return isinstance(value, types) and not isinstance(value, bool)


def _number(v: Any) -> bool:
    return _is_type(v, (int, float)) and math.isfinite(v)


# Optional keys of a {"type": "vae", ...} decode object: (key, check, what is allowed).
DECODE_VAE_KEYS = (
    ("subfolder", lambda v: v is None or (isinstance(v, str) and bool(v)),
     "null or a non-empty string (the VAE's folder inside a model repo, e.g. 'vae')"),
    ("scaling_factor", lambda v: v is None or (_number(v) and v > 0),
     "null or a finite number > 0 (the VAE config's scaling_factor, e.g. 0.18215)"),
    ("shift_factor", lambda v: v is None or _number(v),
     "null or a finite number (the VAE config's shift_factor; null/absent means 0)"),
    # video VAEs (tread/encoders/vae.py video_vae_info; docs/video.md "Video VAEs")
    ("class", lambda v: v is None or v in VAE_CLASSES, f"null or one of {list(VAE_CLASSES)} (the diffusers class)"),
    ("latents_mean", lambda v: v is None or (isinstance(v, list) and all(_number(x) for x in v)),
     "null or a list of finite numbers (per-channel latent mean)"),
    ("latents_std", lambda v: v is None or (isinstance(v, list) and all(_number(x) and x > 0 for x in v)),
     "null or a list of finite numbers > 0 (per-channel latent std)"),
    # model-space image VAEs (tread/encoders/image_vaes.py image_vae_info; docs/data.md "Other image VAEs")
    ("patch_size", lambda v: v is None or _pos_int(v),
     "null or a positive integer (latents_mean / latents_std are per channel of the p x p patchified latents)"),
    ("temporal_factor", lambda v: _pos_int(v), "a positive integer (pixel frames per latent frame)"),
    ("spatial_factor", lambda v: _pos_int(v), "a positive integer (pixels per latent along each side)"),
)


def validate_meta(meta: Any, where: str, advice: str = FIX_META) -> dict:
    """Check every meta key and value; errors start with `where` (the meta.json path) and end with `advice`."""
    def fail(key: str, expected: str) -> LatentDatasetError:
        return LatentDatasetError(f"{where}: key '{key}' is {meta.get(key)!r} but must be {expected}. {advice}")

    if not isinstance(meta, dict):
        raise LatentDatasetError(f"{where}: expected a JSON object, got {type(meta).__name__}. {advice}")
    if meta.get("format") != FORMAT:
        raise fail("format", f"'{FORMAT}' (is this a tread latent dataset?)")
    missing = [k for k in META_TYPES if k not in meta]
    if missing:
        raise LatentDatasetError(f"{where}: missing key(s) {missing}; a v{VERSION} dataset needs all of "
                                 f"{list(META_TYPES)}. {advice}")
    for key, types in META_TYPES.items():
        if not _is_type(meta[key], types):
            raise fail(key, "of JSON type " + " or ".join("null" if t is type(None) else t.__name__ for t in types))
    if meta["version"] != VERSION:
        raise fail("version", f"{VERSION} (the only version this code reads)")
    shape = meta["shape"]
    if len(shape) not in (3, 4) or not all(_is_type(s, (int,)) and s > 0 for s in shape):
        raise fail("shape", "[C, H, W] (images) or [C, T, H, W] (video) with positive integers")
    if meta["dtype"] not in DTYPES:
        raise fail("dtype", f"one of {list(DTYPES)}")
    if meta["num_samples"] < 1:
        raise fail("num_samples", "a positive integer")
    if meta["num_classes"] < 1:
        raise fail("num_classes", "a positive integer")
    if not (math.isfinite(meta["latent_scale"]) and meta["latent_scale"] > 0):
        raise fail("latent_scale", "a finite number > 0 (1.0 for identity)")
    decode = meta["decode"]
    if decode.get("type") not in DECODE_TYPES:
        raise fail("decode", f"an object with 'type' in {list(DECODE_TYPES)}")
    if decode["type"] == "vae":
        if not isinstance(decode.get("vae"), str) or not decode["vae"]:
            raise fail("decode", "{'type': 'vae', 'vae': '<hub id or path>'} (the VAE name is missing)")
        for key, ok, expected in DECODE_VAE_KEYS:
            if key in decode and not ok(decode[key]):
                raise LatentDatasetError(f"{where}: key 'decode.{key}' is {decode[key]!r} but must be {expected}. "
                                         f"{advice}")
    names = meta["class_names"]
    if names is not None and (len(names) != meta["num_classes"] or not all(isinstance(n, str) for n in names)):
        raise fail("class_names", f"null or a list of {meta['num_classes']} strings (one per class)")
    kind = meta.get("latent_kind", "sample")
    if kind not in LATENT_KINDS:
        raise fail("latent_kind", f"one of {list(LATENT_KINDS)} (absent means 'sample')")
    if kind == "moments" and shape[0] % 2:
        raise fail("shape", "[2C, H, W] with an even channel count for latent_kind 'moments' (mean and logvar)")
    _validate_video(meta, where, advice)
    files = meta["files"]
    if not set(DEFAULT_FILES) <= set(files) <= set(DEFAULT_FILES) | set(EXTRA_FILES) | set(CAPTION_FILES) or \
            not all(isinstance(f, str) and f for f in files.values()):
        raise fail("files", f"an object with file names for {sorted(DEFAULT_FILES)} and optionally any of "
                            f"{sorted(EXTRA_FILES)} (and {sorted(CAPTION_FILES)} with conditioning.captions)")
    _validate_conditioning(meta, where, advice)
    _validate_repa_features(meta, where, advice)
    return meta


def _validate_repa_features(meta: dict, where: str, advice: str) -> None:
    """meta "repa_features" as REPA_FEATURE_KEYS says, with files.repa_features (both or neither); images only."""
    repa, stored = meta.get("repa_features"), "repa_features" in meta["files"]
    if (repa is not None) != stored:
        have, lack = ("files.repa_features", "'repa_features'") if stored else ("'repa_features'",
                                                                               "files.repa_features")
        raise LatentDatasetError(f"{where}: meta has {have} but no {lack}; an optional file and its description go "
                                 f"together (both or neither). {advice}")
    if repa is None:
        return
    if not isinstance(repa, dict):
        raise LatentDatasetError(f"{where}: key 'repa_features' is {repa!r} but must be an object "
                                 f"{{{', '.join(REPA_FEATURE_KEYS)}}}. {advice}")
    grid, text = repa.get("grid"), lambda v: isinstance(v, str) and bool(v)
    ok = {"encoder": text(repa.get("encoder")), "digest": text(repa.get("digest")), "dim": _pos_int(repa.get("dim")),
          "grid": isinstance(grid, list) and len(grid) == 2 and all(map(_pos_int, grid))}
    for key, expected in REPA_FEATURE_KEYS.items():
        if not ok[key]:
            raise LatentDatasetError(f"{where}: key 'repa_features.{key}' is {repa.get(key)!r} but must be "
                                     f"{expected}. {advice}")
    if len(meta["shape"]) != 3:
        raise LatentDatasetError(f"{where}: meta has 'repa_features' but is video data (shape {meta['shape']}): REPA "
                                 f"features are stored for images. {advice}")


def repa_features_shape(meta: Mapping[str, Any]) -> Optional[tuple[int, int, int]]:
    """The (dim, h, w) of each sample's stored REPA features (meta "repa_features"), None without them."""
    repa = meta.get("repa_features")
    return None if repa is None else (int(repa["dim"]), *map(int, repa["grid"]))


def _validate_video(meta: dict, where: str, advice: str) -> None:
    """meta "video" goes with a [C, T, H, W] shape (both or neither), its keys as VIDEO_KEYS say, and T = 1 + (F - 1)
    / temporal_factor; first_frame_latents only with video data."""
    video, shape = meta.get("video"), meta["shape"]
    if (video is not None) != (len(shape) == 4):
        raise LatentDatasetError(f"{where}: key 'shape' is {shape} but meta " + (
            "has a 'video' key: video data has shape [C, T, H, W]" if video is not None else
            "has no 'video' key: [C, T, H, W] data needs 'video': {frames, frame_stride, fps, temporal_factor}")
            + f". {advice}")
    if video is None:
        if "first_frame_latents" in meta["files"]:
            raise LatentDatasetError(f"{where}: meta has files.first_frame_latents but is not video data (shape "
                                     f"{shape}, no 'video' key): a first frame belongs to a clip. {advice}")
        return
    if not isinstance(video, dict):
        raise LatentDatasetError(f"{where}: key 'video' is {video!r} but must be an object {{{', '.join(VIDEO_KEYS)}}}. "
                                 f"{advice}")
    for key, expected in VIDEO_KEYS.items():
        v = video.get(key)
        ok = (v is None or (_number(v) and v > 0)) if key == "fps" else _pos_int(v)
        if key not in video or not ok:
            raise LatentDatasetError(f"{where}: key 'video.{key}' is {v!r} but must be {expected}. {advice}")
    frames, k = video["frames"], video["temporal_factor"]
    if (frames - 1) % k or shape[1] != 1 + (frames - 1) // k:
        raise LatentDatasetError(f"{where}: key 'video' says {frames} frames at temporal_factor {k}, which is not "
                                 f"shape[1] = {shape[1]} latent frames: F must be 1 + T' * k, T = 1 + (F - 1) / k "
                                 f"(e.g. {1 + (shape[1] - 1) * k} frames for T = {shape[1]}). {advice}")


LLAMA_KEYS = ("layers", "seq_len", "dim")   # conditioning.llama: the (n, L, Dl) of each sample's Llama states
GLYPH_KEYS = ("seq_len", "dim")            # conditioning.glyph: the (Lg, Dg) of each caption's ByT5 glyph rows
IMAGE_EMBEDS_KEYS = ("seq_len", "dim")     # conditioning.image_embeds: the (S, Di) of each clip's image embeddings


def _pos_int(v: Any) -> bool:
    return _is_type(v, (int,)) and v > 0


def _validate_conditioning(meta: dict, where: str, advice: str) -> None:
    """The optional "conditioning" / "loss_mask" meta keys, and that they agree with the optional files."""
    def bad(key: str, value: Any, expected: str) -> LatentDatasetError:
        return LatentDatasetError(f"{where}: key '{key}' is {value!r} but must be {expected}. {advice}")

    text, pooled, llama, lm = _described_parts(meta, bad)
    glyph = _glyph_part(meta, bad, text)
    image = _image_embeds_part(meta, bad)
    captions = caption_table(meta, bad)
    files = meta["files"]
    if captions is not None and text is None:
        raise bad("conditioning.captions", captions, "absent without conditioning.text: a caption table holds "
                                                     "text embeddings")
    for key, described, what in (("text_embeds", text is not None, "conditioning.text"),
                                 ("caption_offsets", captions is not None, "conditioning.captions"),
                                 ("text_mask", bool(text and text.get("mask")), "conditioning.text.mask=true"),
                                 ("pooled_embeds", pooled is not None, "conditioning.pooled"),
                                 ("llama_embeds", llama is not None, "conditioning.llama"),
                                 ("glyph_embeds", glyph is not None, "conditioning.glyph"),
                                 ("glyph_mask", glyph is not None, "conditioning.glyph"),
                                 ("image_embeds", image is not None, "conditioning.image_embeds"),
                                 ("loss_mask", lm is not None, "loss_mask")):
        if (key in files) != described:
            have, lack = (f"files.{key}", what) if key in files else (what, f"files.{key}")
            raise LatentDatasetError(f"{where}: meta has {have} but no {lack}; an optional file and its "
                                     f"description go together (both or neither). {advice}")


def _glyph_part(meta: dict, bad: Any, text: Any) -> Optional[dict]:
    """The meta's conditioning.glyph (None, or checked): HunyuanVideo 1.5's glyph rows go with its text."""
    glyph = (meta.get("conditioning") or {}).get("glyph")
    if glyph is None:
        return None
    if not isinstance(glyph, dict) or not all(_pos_int(glyph.get(k)) for k in GLYPH_KEYS):
        raise bad("conditioning.glyph", glyph, "an object with positive integers 'seq_len' (Lg) and 'dim' (Dg) (the "
                                               "shape of each caption's glyph embeddings)")
    if text is None:
        raise bad("conditioning.glyph", glyph, "absent without conditioning.text: the glyph embeddings go with the "
                                               "text embeddings (HunyuanVideo 1.5), so text_embeds.npy is needed too")
    return glyph


def _image_embeds_part(meta: dict, bad: Any) -> Optional[dict]:
    """The meta's conditioning.image_embeds (None, or checked): they embed each clip's first frame, which is stored."""
    image = (meta.get("conditioning") or {}).get("image_embeds")
    if image is None:
        return None
    if not isinstance(image, dict) or not all(_pos_int(image.get(k)) for k in IMAGE_EMBEDS_KEYS):
        raise bad("conditioning.image_embeds", image, "an object with positive integers 'seq_len' (S) and 'dim' (Di) "
                                                      "(the shape of each clip's first-frame image embeddings)")
    if "first_frame_latents" not in meta["files"]:
        raise bad("conditioning.image_embeds", image, "absent without files.first_frame_latents: the image "
                                                      "embeddings are of each clip's first frame")
    return image


def _described_parts(meta: dict, bad: Any) -> tuple[Any, Any, Any, Any]:
    """The meta's (conditioning.text, .pooled, .llama, loss_mask), each None or checked; bad(key, value,
    expected) makes the error."""
    cond = meta.get("conditioning")
    if cond is None:
        cond = {}
    elif not isinstance(cond, dict):
        raise bad("conditioning", cond, "an object {'text': {...}, 'pooled': {...}, 'llama': {...}} or absent")
    text, pooled, lm = cond.get("text"), cond.get("pooled"), meta.get("loss_mask")
    if text is not None:
        if not isinstance(text, dict) or not (_pos_int(text.get("seq_len")) and _pos_int(text.get("dim"))):
            raise bad("conditioning.text", text, "an object with positive integers 'seq_len' (L) and 'dim' (D) "
                                                 "(the shape of each sample's text embeddings) and 'mask': true|false")
        if not isinstance(text.get("mask", False), bool):
            raise bad("conditioning.text.mask", text["mask"], "true or false (whether text_mask.npy exists)")
    if pooled is not None and (not isinstance(pooled, dict) or not _pos_int(pooled.get("dim"))):
        raise bad("conditioning.pooled", pooled, "an object with a positive integer 'dim' (P, the pooled "
                                                 "embedding size)")
    llama = cond.get("llama")
    if llama is not None and (not isinstance(llama, dict) or not all(_pos_int(llama.get(k)) for k in LLAMA_KEYS)):
        raise bad("conditioning.llama", llama, "an object with positive integers 'layers' (n), 'seq_len' (L) and "
                                               "'dim' (Dl) (the shape of each sample's Llama hidden states)")
    if llama is not None and text is None:
        raise bad("conditioning.llama", llama, "absent without conditioning.text: the Llama hidden states go with "
                                               "the T5 text embeddings (HiDream), so text_embeds.npy is needed too")
    if lm is not None:
        shape = lm.get("shape") if isinstance(lm, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(_pos_int(v) for v in shape)):
            raise bad("loss_mask", lm, "an object {'shape': [Hm, Wm]} with two positive integers (the mask "
                                       "resolution)")
    return text, pooled, llama, lm


def caption_table(meta: Mapping[str, Any], bad: Any) -> Optional[dict]:
    """The meta's conditioning.captions (None: one caption per sample), checked: {"rows": M >= 1, "empty_prompt":
    bool}; bad(key, value, expected) makes the error."""
    cond = meta.get("conditioning")
    captions = cond.get("captions") if isinstance(cond, dict) else None
    if captions is None:
        return None
    if not (isinstance(captions, dict) and _pos_int(captions.get("rows"))
            and isinstance(captions.get("empty_prompt"), bool)):
        raise bad("conditioning.captions", captions, "an object with a positive integer 'rows' (M, the rows of the "
                                                     "text files) and 'empty_prompt': true|false")
    return captions


def has_model_conditioning(conditioning: Mapping[str, Any]) -> bool:
    """Whether a reader's `conditioning` ({"text": ..., "reference": ..., ...}) holds per-sample conditioning
    the model takes (COND_KEYS: text embeddings, reference latents or first frames), so it is passed on as
    cond=...."""
    return any(conditioning.get(k) is not None for k in ("text", "reference", "first_frame"))


def read_meta(path: PathLike) -> dict:
    """Read and validate `path`/meta.json; errors name the path, the key and the bad value."""
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "not found"
        raise LatentDatasetError(
            f"Latent dataset {what} at '{root}': expected a directory with meta.json, latents.npy, labels.npy. "
            f"Set data.path=... to such a directory, write one with data.write_latent_dataset(), "
            f"or use the built-in data (data=toy).")
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise LatentDatasetError(f"Latent dataset at '{root}' has no meta.json (expected '{meta_path}'). "
                                 f"The directory is not a latent dataset or was not written completely. {REBUILD}")
    meta = read_json(meta_path, "", "a JSON object (the dataset's description)", LatentDatasetError, FIX_META)
    return validate_meta(meta, str(meta_path))


# ----------------------------------------------------------------------------- latent kinds

def latent_kind(meta: Mapping[str, Any]) -> str:
    """"sample" (stored values are latents) or "moments" (stored (mean, logvar) of the VAE posterior)."""
    return meta.get("latent_kind", "sample")


def shift_factor(meta: Mapping[str, Any]) -> float:
    """The VAE's shift_factor (decode.shift_factor; 0 when absent/null or not VAE data)."""
    decode = meta.get("decode") or {}
    return float(decode.get("shift_factor") or 0.0) if decode.get("type") == "vae" else 0.0


def model_shape(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """Shape (C, H, W) (images) or (C, T, H, W) (video) of the latents the model sees: the stored shape, halved in
    C for moments."""
    c, *rest = meta["shape"]
    return (c // 2 if latent_kind(meta) == "moments" else c, *rest)


def first_frame_shape(meta: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """Shape (C, 1, H, W) of a video sample's first-frame latents (model space, as model_shape)."""
    c, _, h, w = model_shape(meta)
    return c, 1, h, w


def draw_latents(x: torch.Tensor, meta: Mapping[str, Any], mode: str = "sample",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Dataset items -> model-space latents (B, C, H, W) (video: (B, C, T, H, W)). "sample" data is returned as is;
    "moments" (B, 2C, ...) = (mean, logvar) gives latent_scale * (mean + exp(logvar / 2) * eps - shift_factor), eps
    from `generator` (None: the device's global RNG), or latent_scale * (mean - shift_factor) for mode="mean".
    """
    if mode not in ("sample", "mean"):
        raise ValueError(f"draw_latents mode={mode!r}; allowed: 'sample', 'mean'")
    if latent_kind(meta) != "moments":
        return x
    if x.ndim not in (4, 5) or x.shape[1] % 2:
        raise LatentDatasetError(f"moments data needs (B, 2C, H, W) or (B, 2C, T, H, W) items, got shape "
                                 f"{list(x.shape)}")
    mean, logvar = x.float().chunk(2, dim=1)
    if mode == "sample":
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))  # the clamp diffusers' DiagonalGaussianDistribution uses
        mean = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean - shift_factor(meta)) * float(meta["latent_scale"])


def caption_offsets(root: Path, counts: Optional[Sequence[int]], empty_prompt: bool, num_samples: int
                    ) -> Optional[np.ndarray]:
    """A caption table's (N + 1,) int64 offsets from the captions per sample (`counts`; all 1 when None and
    `empty_prompt`), or None without a table (no counts, no empty prompt)."""
    if not isinstance(empty_prompt, (bool, np.bool_)):
        raise LatentDatasetError(f"empty_prompt for '{root}' is {empty_prompt!r} but must be True or False")
    if counts is None and not empty_prompt:
        return None
    counts = np.ones(num_samples, np.int64) if counts is None else np.asarray(counts)
    if counts.shape != (num_samples,) or not np.issubdtype(counts.dtype, np.integer) or \
            (counts.size and counts.min() < 1):
        raise LatentDatasetError(f"caption_counts for '{root}' must be {num_samples} integers >= 1 (captions per "
                                 f"sample), got {counts.dtype} array of shape {counts.shape}"
                                 + (f" with values in [{counts.min()}, {counts.max()}]" if counts.size else ""))
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
