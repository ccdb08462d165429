"""What precomputing latents is asked to do (scripts/precompute_latents.py's flags as plain values), and the cheap
checks of it that run before any work: no VAE loaded, no image read. tread/data/precompute/run.py does the work."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from tread.encoders.text import TextEncoderError, resolve_text_encoder_paths
from tread.encoders.text_families import FAMILIES, TEXT_FAMILIES, encoder_keys
from tread.encoders.patch import ENCODERS as REPA_ENCODERS
from tread.encoders.errors import EncoderError
from tread.encoders.image_embeds import check_image_encoder_folder
from tread.encoders.vae import VIDEO_VAE_CLASSES
from tread.encoders.videomae import check_videomae_folder
from tread.utils.errors import UserError
from tread.utils.numbers import in_range, span
from tread.utils.io import file_in_the_way, unwritable_dir

from tread.data.buckets import (MAX_BUCKETS, MAX_BUDGETS, MAX_FRAMES, MAX_PIXELS, MAX_SIDE, Bucket, BucketError,
                                check_stride, derive_buckets, parse_buckets, parse_frame_buckets)

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
KINDS = ("moments", "sample", "mean")   # which one a VAE class allows: vae_class.IMAGE_KINDS
STORE_DTYPES = ("float16", "float32")
VAE_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
REF_FEATURES = ("inception", "toy_classifier")
TEXT_ENCODER_DTYPES = ("float32", "bfloat16", "float16")
MAX_COUNT = 10 ** 12              # --max-images: a subset of at most this many
# The defaults of the flags whose absence matters (--max-aspect with --buckets does nothing, ...): their fields
# are None unless given, and take these values when the request is made (PrecomputeRequest.given tells them apart).
DEFAULTS = {"resolution": 256, "bucket_stride": 16, "max_aspect": 2.0, "frame_stride": 1}


class PrecomputeError(UserError):
    """A bad argument or an inconsistent input/parts folder; the message says what to change."""


@dataclass(frozen=True)
class PrecomputeRequest:
    """One field per flag of scripts/precompute_latents.py (--vae-dtype is vae_dtype), the same defaults;
    `python scripts/precompute_latents.py --help` says what each means. Checked by check_request, which
    precompute runs first (it looks at the file system, so it runs when the work starts, not when this is built).
    The fields of DEFAULTS left None take their default here; `given(name)` says whether one was set."""

    images: Optional[str] = None                  # image folder (required, or videos)
    videos: Optional[str] = None                  # clip folder instead of images (tread/data/precompute/video.py)
    frames: Optional[int] = None                  # pixel frames per clip (or frame_buckets)
    frame_stride: Optional[int] = None            # read every s-th source frame (None: 1)
    frame_buckets: Optional[str] = None           # frame counts 'F1,F2,...': each clip the most it fills
    first_frame: bool = False                     # also store each clip's first frame encoded alone
    image_encoder: Optional[str] = None           # and its image embeddings (an i2v pipeline's image encoder folder)
    vae_class: Optional[str] = None               # the VAE's diffusers class (default: its config.json's)
    labels: Optional[str] = None                  # labels file of a flat folder
    out: Optional[str] = None                     # latent dataset to write (required; must not exist)
    max_images: Optional[int] = None              # a fixed random subset of N images
    resolution: Optional[int] = None              # image side after the center crop (None: 256)
    buckets: Optional[str] = None                 # aspect/size buckets 'WxH,WxH,...' (instead of --resolution)
    bucket_pixels: Optional[str] = None           # buckets derived from pixel budgets 'A[,A...]'
    bucket_stride: Optional[int] = None           # bucket sides are multiples of this (VAE factor x patch; 16)
    max_aspect: Optional[float] = None            # derived buckets' widest width/height (and height/width; 2)
    vae: str = DEFAULT_VAE                        # VAE hub id or local AutoencoderKL folder
    vae_subfolder: Optional[str] = None           # folder of the VAE inside the model
    kind: Optional[str] = None                    # moments | sample | mean (None: the VAE class's default)
    flip: bool = False                            # also store a flipped copy of every image
    seed: int = 0                                 # per-image draws (kind sample) and the max_images subset
    dtype: str = "float16"                        # storage dtype
    vae_dtype: str = "float32"                    # VAE weights/compute dtype
    device: str = "auto"                          # auto (each process's GPU if any) | cpu | cuda
    batch_size: int = 64                          # images per VAE call
    shard_size: int = 1000                        # images per work shard (resuming, splitting over processes)
    workers: int = 4                              # threads reading and cropping images (0: the main thread)
    captions: Optional[str] = None                # captions manifest (CSV/TSV, JSON, JSONL)
    caption_sidecars: bool = False                # captions from <image stem>.txt beside each image
    caption_from_class: Optional[str] = None      # caption template with {class}
    trigger_word: Optional[str] = None            # prepended to every caption: "WORD, caption"
    empty_prompt: bool = False                    # also store the encoded empty prompt (caption dropout)
    text_family: Optional[str] = None             # encode captions as this family's pipeline does
    text_encoders: Optional[str] = None           # local pipeline folder with the family's text encoders
    text_encoder_path: tuple[str, ...] = ()       # KEY=PATH per encoder or tokenizer
    max_text_length: Optional[int] = None         # T5 sequence length (None: the family's)
    no_t5: bool = False                           # sd3 without T5
    text_encoder_dtype: str = "float32"           # text encoder weights/compute dtype
    loss_masks: Optional[str] = None              # folder of grayscale loss masks
    reference_images: Optional[str] = None        # folder of reference images (FLUX Kontext edit pairs)
    repa_encoder: Optional[str] = None            # also store this REPA encoder's features of every image
    repa_encoder_weights: Optional[str] = None    # its weights (dinov2: a local Dinov2Model folder)
    ref_out: Optional[str] = None                 # also write reference statistics (FID) here
    ref_features: str = "inception"               # inception | toy_classifier
    inception_weights: Optional[str] = None       # local Inception weights file
    ref_store_images: int = 10000                 # images kept in the reference as arr_0
    fvd_out: Optional[str] = None                 # also write an FVD reference of the clips here (--videos)
    videomae_weights: Optional[str] = None        # its VideoMAE network (a local VideoMAEModel folder)
    cache_dir: str = field(default_factory=lambda: os.environ.get("TREAD_CACHE_DIR", ".cache"))   # toy classifier
    explicit: frozenset = field(init=False, repr=False, compare=False)      # the DEFAULTS fields that were set

    def __post_init__(self):
        object.__setattr__(self, "text_encoder_path", tuple(self.text_encoder_path))
        object.__setattr__(self, "explicit", frozenset(k for k in DEFAULTS if getattr(self, k) is not None))
        for name, value in DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def given(self, name: str) -> bool:
        """Whether the field `name` of DEFAULTS was set (its flag given), not left to its default."""
        return name in self.explicit

    @property
    def bucketed(self) -> bool:
        """Whether images go to buckets (--buckets / --bucket-pixels) instead of the --resolution square."""
        return self.buckets is not None or self.bucket_pixels is not None

    def text_encoder_paths(self) -> dict[str, str]:
        """{"pipeline": text_encoders, KEY: PATH for each text_encoder_path KEY=PATH} (after the checks)."""
        paths = {} if self.text_encoders is None else {"pipeline": self.text_encoders}
        for item in self.text_encoder_path:
            key, _, path = item.partition("=")
            paths[key.strip()] = path.strip()
        return paths


def plain_counts(req: PrecomputeRequest) -> tuple[tuple[str, int, int, int], ...]:
    """(flag, value, low, high) of the plain counts: bounded so that a batch or shard held in memory, a thread
    pool or the stored reference images cannot be asked for more than a machine has."""
    return (("--batch-size", req.batch_size, 1, 1 << 16), ("--shard-size", req.shard_size, 1, 1 << 24),
            ("--workers", req.workers, 0, 1024), ("--seed", req.seed, 0, 2 ** 31 - 1),
            ("--ref-store-images", req.ref_store_images, 0, 10 ** 7))


def bad_value(flag: str, value: Any, allowed: str) -> PrecomputeError:
    return PrecomputeError(f"{flag}={value!r} is not valid: {allowed}")


def check_request(req: PrecomputeRequest) -> None:
    """Cheap checks of every argument (no VAE, no images read); errors name the flag, value and what is allowed."""
    if req.videos is not None:
        check_video_request(req)
    else:
        check_image_only_flags(req)
        check_images_flag(req)
    check_common(req)
    check_fvd_flags(req)


def check_fvd_flags(req: PrecomputeRequest) -> None:
    """--fvd-out and --videomae-weights (cheap: the folder's config.json and safetensors headers)."""
    if req.fvd_out is None:
        if req.videomae_weights is not None:
            raise PrecomputeError("--videomae-weights only applies with --fvd-out PATH (an FVD reference of the clips)")
        return
    if req.videos is None:
        raise PrecomputeError(f"--fvd-out '{req.fvd_out}' is an FVD reference of clips: it needs --videos (an image "
                              f"run writes FID references with --ref-out)")
    out = Path(req.fvd_out).expanduser().absolute()
    if out.exists():
        raise PrecomputeError(f"--fvd-out '{out}' already exists; refusing to overwrite it. Delete it or choose "
                              f"another path.")
    _check_writable("--fvd-out", out)
    _check_apart("--fvd-out", out, [("--videos", Path(req.videos).expanduser().absolute()),
                                    ("--out", Path(req.out).expanduser().absolute())])
    try:
        check_videomae_folder(req.videomae_weights, "--videomae-weights")
    except EncoderError as err:
        raise PrecomputeError(str(err)) from None


def check_images_flag(req: PrecomputeRequest) -> None:
    """--images (and --labels, --kind) of an image run."""
    if req.kind is not None and req.kind not in KINDS:
        raise bad_value("--kind", req.kind, f"one of {', '.join(KINDS)}")
    if not req.images:
        raise PrecomputeError("--images DIR is required: a folder with one sub-folder of images per class, or a "
                              "flat folder of images with --labels FILE (or --videos DIR, a folder of clips)")
    if not Path(req.images).expanduser().is_dir():
        raise bad_value("--images", req.images, "no such folder (expected a folder of class sub-folders, or of images "
                                                "with --labels)")
    if req.labels is not None and not Path(req.labels).expanduser().is_file():
        raise bad_value("--labels", req.labels, "no such file (a CSV/TSV 'file name,label' or JSON labels file)")


def check_common(req: PrecomputeRequest) -> None:
    """The flags images and clips share."""
    check_outputs(req)
    check_encoding(req)
    check_conditioning(req)
    check_repa_encoder(req)
    check_buckets(req)
    if req.ref_out is not None:
        if req.ref_features not in REF_FEATURES:
            raise bad_value("--ref-features", req.ref_features, f"one of {', '.join(REF_FEATURES)}")
        if req.inception_weights is not None and not Path(req.inception_weights).expanduser().is_file():
            raise bad_value("--inception-weights", req.inception_weights, "no such file (a torch-fidelity Inception "
                                                                          "weights file)")


def check_encoding(req: PrecomputeRequest) -> None:
    """--resolution, the dtypes, the device, the VAE and the sizes of the work."""
    if in_range(req.resolution, 8, MAX_SIDE) is None:
        raise bad_value("--resolution", req.resolution, f"{span(8, MAX_SIDE)} that is a multiple of the VAE's "
                                                        f"downsampling factor (8 for SD-VAE), e.g. 256")
    if req.dtype not in STORE_DTYPES:
        raise bad_value("--dtype", req.dtype, f"one of {', '.join(STORE_DTYPES)}")
    if req.vae_dtype not in VAE_DTYPES:
        raise bad_value("--vae-dtype", req.vae_dtype, f"one of {', '.join(VAE_DTYPES)}")
    if req.device not in DEVICES:
        raise bad_value("--device", req.device, f"one of {', '.join(DEVICES)} (with accelerate every process takes its "
                                                f"own GPU)")
    if not req.vae:
        raise bad_value("--vae", req.vae, f"a hub id (e.g. {DEFAULT_VAE}) or a local AutoencoderKL directory")
    if req.vae_subfolder is not None and not req.vae_subfolder:
        raise bad_value("--vae-subfolder", req.vae_subfolder, "a folder name such as 'vae', or leave it out")
    for flag, value, low, high in plain_counts(req):
        if in_range(value, low, high) is None:
            raise bad_value(flag, value, span(low, high))
    if req.max_images is not None and in_range(req.max_images, 1, MAX_COUNT) is None:
        raise bad_value("--max-images", req.max_images, f"{span(1, MAX_COUNT)} (or leave it out for all images)")


def request_buckets(req: PrecomputeRequest) -> Optional[list[Bucket]]:
    """The buckets --buckets lists or --bucket-pixels derives (None without either); errors name the flag."""
    if req.buckets is not None:
        return parse_buckets(req.buckets)
    if req.bucket_pixels is None:
        return None
    items = str(req.bucket_pixels).split(",")
    budgets = [in_range(item, 1, MAX_PIXELS) for item in items[:MAX_BUDGETS + 1]]
    if len(items) > MAX_BUDGETS or None in budgets:
        raise bad_value("--bucket-pixels", req.bucket_pixels,
                        f"at most {MAX_BUDGETS} comma-separated pixel counts (areas), each {span(1, MAX_PIXELS)} "
                        f"({MAX_SIDE}x{MAX_SIDE}), e.g. '262144' (512x512) or '65536,262144' (two sizes)")
    return derive_buckets(budgets, req.bucket_stride, req.max_aspect)


def check_bucket_flags(req: PrecomputeRequest) -> None:
    """The bucket flags that would do nothing (refused, so a typo'd command never silently runs another one)."""
    if req.buckets is not None and req.bucket_pixels is not None:
        raise PrecomputeError("--buckets and --bucket-pixels both given: list the buckets, or derive them from "
                              "pixel budgets, not both")
    if req.given("max_aspect") and req.bucket_pixels is None:
        raise PrecomputeError(f"--max-aspect={req.max_aspect} only applies with --bucket-pixels (it bounds the "
                              f"aspect ratios of the derived buckets)" + ("; --buckets lists the sizes itself: "
                                                                          "leave --max-aspect out" * req.bucketed))
    if req.given("bucket_stride") and not req.bucketed:
        raise PrecomputeError(f"--bucket-stride={req.bucket_stride} only applies with --buckets or --bucket-pixels "
                              f"(bucket sides are multiples of it); without them every image is the --resolution "
                              f"square")
    if req.given("resolution") and req.bucketed and req.repa_encoder is None:
        raise PrecomputeError(f"--resolution={req.resolution} does nothing with --buckets/--bucket-pixels: each "
                              f"image (clip) is cropped to its bucket's size; leave --resolution out")
    if in_range(req.bucket_stride, 1, MAX_SIDE) is None:
        raise bad_value("--bucket-stride", req.bucket_stride, f"{span(1, MAX_SIDE)} (the VAE's downsampling factor "
                                                              f"times the model's patch side, e.g. 16)")


def check_buckets(req: PrecomputeRequest) -> None:
    """--buckets / --bucket-pixels / --bucket-stride / --max-aspect (cheap: no image read)."""
    check_bucket_flags(req)
    try:
        buckets = request_buckets(req)
        if buckets is not None:
            check_stride(buckets, req.bucket_stride, "--buckets" if req.buckets else "--bucket-pixels",
                         "--bucket-stride: the VAE's downsampling factor times the model's patch side")
    except BucketError as err:
        raise PrecomputeError(str(err)) from None
    if buckets is not None and req.ref_out is not None:
        raise PrecomputeError("--ref-out needs one image size: reference statistics are computed from square "
                              "center crops; build them in a run without --buckets/--bucket-pixels")
    if buckets is not None and req.videos is not None and len(buckets) * len(frame_counts(req)) > MAX_BUCKETS:
        raise PrecomputeError(f"{len(buckets)} bucket sizes x {len(frame_counts(req))} frame counts "
                              f"(--frame-buckets) make more than {MAX_BUCKETS} clip buckets; use fewer of either")


def check_outputs(req: PrecomputeRequest) -> None:
    """--out and --ref-out (cheap): given, not there yet, below folders only, in a folder this process can write,
    and neither an input folder nor inside one (nor one inside the other)."""
    if not req.out:
        raise PrecomputeError("--out DIR is required: the latent dataset directory to write (must not exist)")
    out = Path(req.out).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise PrecomputeError(f"--out '{out}' already exists; refusing to overwrite it. Delete it or choose "
                              f"another path.")
    _check_writable("--out", out)
    inputs = [(flag, Path(v).expanduser().absolute()) for flag, v in (("--images", req.images),
                                                                       ("--videos", req.videos)) if v]
    _check_apart("--out", out, inputs)
    if req.ref_out is not None:
        ref = Path(req.ref_out).expanduser().absolute()
        if ref.exists():
            raise PrecomputeError(f"--ref-out '{ref}' already exists; refusing to overwrite it. Delete it or choose "
                                  f"another path.")
        _check_writable("--ref-out", ref)
        _check_apart("--ref-out", ref, [*inputs, ("--out", out)])


def _check_writable(flag: str, path: Path) -> None:
    """`path`'s folder can be made and written: no file where a folder must be, and a probe file can be made in
    the nearest existing folder above it (tread.utils.io.unwritable_dir)."""
    blocker = file_in_the_way(path.parent)
    if blocker is not None:
        raise PrecomputeError(f"{flag} '{path}' cannot be made: '{blocker}' is a file, not a folder; choose a path "
                              f"in a folder")
    found = unwritable_dir(path.parent)
    if found is not None:
        where, err = found
        code = errno.errorcode.get(err.errno or 0)
        raise PrecomputeError(f"{flag} '{path}' cannot be written: no file can be made in '{where}' "
                              f"({err.strerror or err}{f', {code}' if code else ''}); make it writable or choose "
                              f"another path")


def _check_apart(flag: str, path: Path, others: Sequence[tuple[str, Path]]) -> None:
    """`path` (of `flag`) is none of `others` ((flag, path)), not inside one, and holds none (symlinks resolved)."""
    real = path.resolve()
    for other_flag, other in others:
        if real == other.resolve() or other.resolve() in real.parents:
            where = "is" if real == other.resolve() else "is inside"
            raise PrecomputeError(f"{flag} '{path}' {where} {other_flag} '{other}': {flag} must lie outside it; "
                                  f"choose another {flag}")
        if real in other.resolve().parents:
            raise PrecomputeError(f"{other_flag} '{other}' is inside {flag} '{path}': {flag} must lie outside it; "
                                  f"choose another {flag}")


def check_conditioning(req: PrecomputeRequest) -> None:
    """The captions / text encoder / loss mask flags (cheap: finds the encoder folders, loads nothing)."""
    template = req.caption_from_class
    if template is not None:
        try:
            ok = "{class}" in template and template.format(**{"class": "x"}) is not None
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            raise bad_value("--caption-from-class", template,
                            "a template with {class} for the class name (other braces doubled: {{ }}), e.g. "
                            "'a photo of a {class}'")
    if req.captions is not None and not Path(req.captions).expanduser().is_file():
        raise bad_value("--captions", req.captions, "no such file (CSV/TSV 'file name,caption' lines, a JSON object "
                                                    "{file name: caption or [captions]} or JSONL lines)")
    _check_trigger_word(req.trigger_word)
    captioned = req.captions is not None or template is not None or req.caption_sidecars
    if req.text_family is None:
        if captioned:
            raise PrecomputeError(f"--captions/--caption-from-class{'/--caption-sidecars' * req.caption_sidecars} "
                                  f"need --text-family (one of {', '.join(TEXT_FAMILIES)}) and its text encoders "
                                  f"(--text-encoders DIR) to encode the captions")
        used = [f for f, v in (("--text-encoders", req.text_encoders), ("--text-encoder-path",
                                                                          req.text_encoder_path),
                               ("--max-text-length", req.max_text_length), ("--no-t5", req.no_t5),
                               ("--trigger-word", req.trigger_word), ("--empty-prompt", req.empty_prompt)) if v]
        if used:
            raise PrecomputeError(f"{'/'.join(used)} only apply with --text-family and captions")
    else:
        _check_text_family(req, captioned)
    if req.loss_masks is not None and not Path(req.loss_masks).expanduser().is_dir():
        raise bad_value("--loss-masks", req.loss_masks, "no such folder (a folder of grayscale masks, one per image, "
                                                        "with the image's relative path and stem)")
    if req.reference_images is not None and not Path(req.reference_images).expanduser().is_dir():
        raise bad_value("--reference-images", req.reference_images,
                        "no such folder (a folder of reference images, one per image, with the image's relative path "
                        "and stem)")


def _check_trigger_word(word: Optional[str]) -> None:
    """--trigger-word: one line of text, not blank (it is prepended to every caption as "WORD, caption")."""
    if word is not None and (not word.strip() or "\n" in word or "\r" in word or word != word.strip()):
        raise bad_value("--trigger-word", word, "a non-empty word or phrase on one line, without leading or "
                                                "trailing spaces (prepended to every caption as 'WORD, caption')")


def _check_text_family(req: PrecomputeRequest, captioned: bool) -> None:
    """--text-family and its encoder flags: a known family, captions to encode, encoder folders that exist."""
    family = req.text_family
    if family not in TEXT_FAMILIES:
        raise bad_value("--text-family", family, f"one of {', '.join(TEXT_FAMILIES)}")
    if not captioned:
        raise PrecomputeError(f"--text-family {family} needs captions: --captions FILE and/or "
                              f"--caption-from-class 'a photo of a {{class}}' (or --caption-sidecars: "
                              f"<image stem>.txt beside each image)")
    allowed = [k for k in encoder_keys(family) if k != "pipeline"]
    for item in req.text_encoder_path:
        key, eq, path = item.partition("=")
        if not eq or key.strip() not in allowed or not path.strip():
            raise bad_value("--text-encoder-path", item, f"KEY=PATH with KEY one of {', '.join(allowed)} ({family})")
    if req.text_encoders is None and not req.text_encoder_path:
        raise PrecomputeError(f"--text-family {family} needs its text encoders: --text-encoders DIR, a local "
                              f"diffusers pipeline folder with text_encoder*/ and tokenizer*/ (fetch one with "
                              f"`hf download {FAMILIES[family].repo} --include 'text_encoder*/*' "
                              f"'tokenizer*/*' --local-dir DIR`), or --text-encoder-path KEY=PATH per encoder"
                              + "".join(f". {s.model} ({s.what}): {s.download}"
                                        for s in FAMILIES[family].slots if s.download))
    if req.no_t5 and family != "sd3":
        raise PrecomputeError(f"--no-t5 is for --text-family sd3 only (SD3 runs without T5); --text-family "
                              f"{family}'s text embeddings are its T5's output")
    try:
        resolve_text_encoder_paths(family, req.text_encoder_paths(), t5=not req.no_t5)
    except TextEncoderError as err:
        raise PrecomputeError(str(err)) from None
    if req.max_text_length is not None and in_range(req.max_text_length, 1, 1 << 16) is None:
        raise bad_value("--max-text-length", req.max_text_length, f"{span(1, 1 << 16)} (tokens), or leave it out for "
                                                                  f"the family's default")
    if req.text_encoder_dtype not in TEXT_ENCODER_DTYPES:
        raise bad_value("--text-encoder-dtype", req.text_encoder_dtype, f"one of {', '.join(TEXT_ENCODER_DTYPES)}")


# Flags of image runs only (--images itself too).
IMAGE_ONLY = (("--flip", "flip"), ("--loss-masks", "loss_masks"), ("--reference-images", "reference_images"),
              ("--ref-out", "ref_out"), ("--labels", "labels"), ("--images", "images"),
              ("--max-images", "max_images"), ("--repa-encoder", "repa_encoder"))


def check_repa_encoder(req: PrecomputeRequest) -> None:
    """--repa-encoder and its weights (cheap: the folder exists; the encoder is loaded with the VAE)."""
    name, weights = req.repa_encoder, req.repa_encoder_weights
    if name is None:
        if weights is not None:
            raise PrecomputeError("--repa-encoder-weights only applies with --repa-encoder NAME")
        return
    if name not in REPA_ENCODERS:
        raise bad_value("--repa-encoder", name, f"one of {', '.join(REPA_ENCODERS)} (model.repa.encoder's names)")
    if name == "dinov2" and (weights is None or not Path(weights).expanduser().is_dir()):
        raise bad_value("--repa-encoder-weights", weights, "a local transformers Dinov2Model folder (save_pretrained) "
                                                           "for --repa-encoder dinov2")
    if name != "dinov2" and weights is not None:
        raise bad_value("--repa-encoder-weights", weights, f"left out for --repa-encoder {name} (toy, toy_fid: the "
                                                           f"toy classifier in --cache-dir; toy_random: no file)")


def frame_counts(req: PrecomputeRequest) -> list[int]:
    """The frame counts clips are read at: --frame-buckets, else [--frames]."""
    return parse_frame_buckets(req.frame_buckets) if req.frame_buckets is not None else [req.frames]


def check_video_request(req: PrecomputeRequest) -> None:
    """The --videos flags (cheap: nothing read); errors name the flag, value and what is allowed."""
    if not Path(req.videos).expanduser().is_dir():
        raise bad_value("--videos", req.videos, "no such folder (expected a folder of clips: video files or frame "
                                                "folders, in class sub-folders or directly in it)")
    used = [flag for flag, name in IMAGE_ONLY if getattr(req, name)]
    if used:
        raise PrecomputeError(f"{'/'.join(used)} cannot be used with --videos (images only); clips are labelled by "
                              f"their class sub-folder")
    if req.kind not in (None, "mean"):
        raise bad_value("--kind", req.kind, "'mean' or left out with --videos: clips store the VAE posterior mean "
                                            "(as the video pipelines encode), in model space")
    if (req.frames is None) == (req.frame_buckets is None):
        raise PrecomputeError("--videos needs --frames F (every clip F frames) or --frame-buckets F1,F2,... (each "
                              "clip the most frames it has), exactly one of them")
    if req.frames is not None and in_range(req.frames, 1, MAX_FRAMES) is None:
        raise bad_value("--frames", req.frames, f"{span(1, MAX_FRAMES)} (pixel frames per clip, 1 + k * the VAE's "
                                                f"temporal factor, e.g. 17 for Wan's 4)")
    if in_range(req.frame_stride, 1, MAX_FRAMES) is None:
        raise bad_value("--frame-stride", req.frame_stride, f"{span(1, MAX_FRAMES)} (read every s-th source frame)")
    if req.vae_class is not None and req.vae_class not in VIDEO_VAE_CLASSES:
        raise bad_value("--vae-class", req.vae_class, f"one of {', '.join(VIDEO_VAE_CLASSES)}")
    try:
        frame_counts(req)
    except BucketError as err:
        raise PrecomputeError(str(err)) from None
    if req.image_encoder is not None:
        if not req.first_frame:
            raise PrecomputeError(f"--image-encoder '{req.image_encoder}' embeds each clip's first frame, which needs "
                                  f"--first-frame (image-to-video data)")
        try:
            check_image_encoder_folder(req.image_encoder, "--image-encoder")
        except EncoderError as err:
            raise PrecomputeError(str(err)) from None


def check_image_only_flags(req: PrecomputeRequest) -> None:
    """The video flags without --videos: one error naming them."""
    used = [f for f, v in (("--frames", req.frames), ("--frame-buckets", req.frame_buckets),
                           ("--first-frame", req.first_frame),
                           ("--image-encoder", req.image_encoder),
                           ("--frame-stride", req.given("frame_stride"))) if v]
    if used:
        raise PrecomputeError(f"{'/'.join(used)} only apply with --videos DIR (a folder of clips)")
