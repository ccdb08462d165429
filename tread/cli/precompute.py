"""Encode an image folder (or clips: --videos) with a VAE into a latent dataset (docs/data.md, docs/video.md).

    python scripts/precompute_latents.py --images /data/imagenet/train --out /data/in256_sdvae
    accelerate launch --num_processes 8 scripts/precompute_latents.py --images /data/imagenet/train \\
        --out /data/in256_sdvae --flip --ref-out /data/in256_ref.npz --inception-weights /w/pt_inception.pth
    python scripts/precompute_latents.py --images imgs --captions caps.jsonl --text-family flux \\
        --text-encoders DIR --out ds     # DIR from `hf download <repo> --include 'text_encoder*/*' 'tokenizer*/*'`

An interrupted run resumes from <out>.parts/ with the same settings; docs/data.md "Precomputing latents" and
"Captions" describe the checks, captions, loss masks, Kontext references and REPA features.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from tread.data.buckets import MAX_ASPECT, MAX_BUCKETS, MAX_BUDGETS, MAX_PIXELS, MAX_SIDE
from tread.cli.args import Parser
from tread.data.precompute.encode import iter_images
from tread.data.precompute.plan import Plan
from tread.data.precompute.request import DEFAULT_VAE, DEFAULTS, PrecomputeError, PrecomputeRequest
from tread.data.precompute.run import Interrupted, collective, encode_dataset, prepare
from tread.runtime.preempt import EXIT_INTERRUPTED
from tread.utils.errors import UserError
from tread.utils.io import WriteError
from tread.encoders.text_families import TEXT_FAMILIES
from tread.evaluation.extractors import feature_extractor
from tread.encoders.videomae import build_video_features
from tread.evaluation.frechet import FeatureStats
from tread.evaluation.fvd import save_fvd_reference, video_stats
from tread.evaluation.reference import ReferenceBuilder


# ----------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    """The flags, in groups; the module doc is the description (first paragraph) and the epilog (the rest)."""
    p = Parser(prog="precompute_latents.py", description=__doc__.split("\n\n")[0],
               epilog="\n\n".join(__doc__.split("\n\n")[1:]), error_type=PrecomputeError)
    for add_group in (_io_args, _encoding_args, _execution_args, _conditioning_args, _repa_args, _reference_args):
        add_group(p)
    return p


def _io_args(p: argparse.ArgumentParser) -> None:
    """--images, --labels, --out, --max-images, and the clip flags (--videos, ...)."""
    io = p.add_argument_group("input and output")
    io.add_argument("--videos", metavar="DIR", help="clip folder instead of --images: video files or frame folders, "
                                                    "in class sub-folders or directly in it")
    io.add_argument("--frames", type=int, metavar="F", help="--videos: pixel frames per clip (1 + k * the VAE's "
                                                            "temporal factor, e.g. 17 for Wan)")
    io.add_argument("--frame-stride", type=int, metavar="S", help=f"--videos: read every S-th source frame "
                                                                  f"(default {DEFAULTS['frame_stride']})")
    io.add_argument("--frame-buckets", metavar="F1,F2,...", help="--videos: frame counts instead of --frames; each "
                                                                 "clip gets the most frames it has among them")
    io.add_argument("--first-frame", action="store_true", help="--videos: also store each clip's first frame "
                                                               "encoded alone (first_frame_latents.npy)")
    io.add_argument("--image-encoder", metavar="DIR", help="--first-frame: also store each first frame's image "
                                                           "embeddings (image_embeds.npy) by the image-to-video "
                                                           "pipeline's image_encoder/ and feature_extractor/ in DIR "
                                                           "(HunyuanVideo 1.5 I2V: SigLIP)")
    io.add_argument("--vae-class", metavar="NAME", help="the VAE's diffusers class when its config.json does not say "
                                                        "(e.g. AutoencoderKLFlux2; clips: AutoencoderKLWan); default: "
                                                        "its config.json's, else AutoencoderKL")
    io.add_argument("--images", metavar="DIR", help="image folder: one sub-folder per class, or flat with --labels "
                                                    "(required)")
    io.add_argument("--labels", metavar="FILE", help="labels of a flat image folder: CSV/TSV 'file name,label' "
                                                     "lines or a JSON object {file name: label}; integer labels "
                                                     "are class indices, others class names")
    io.add_argument("--out", metavar="DIR", help="latent dataset to write; must not exist (required)")
    io.add_argument("--max-images", type=int, metavar="N", help="encode only a fixed random subset of N images "
                                                                "(quick trials; default: all)")


def _encoding_args(p: argparse.ArgumentParser) -> None:
    """The VAE, the crop, the stored kind and dtypes."""
    enc = p.add_argument_group("encoding")
    enc.add_argument("--resolution", type=int, help=f"image side after the center crop; a multiple of the VAE's "
                                                    f"downsampling factor, at most {MAX_SIDE} (default "
                                                    f"{DEFAULTS['resolution']}; not with buckets)")
    enc.add_argument("--buckets", metavar="WxH,...", help="aspect-ratio / size buckets instead of one square "
                     "--resolution: each image goes to the bucket it fills without upscaling that is closest in "
                     "aspect ratio (then the largest), is resized minimally and center-cropped to it; e.g. "
                     f"'768x512,640x640,512x768' (width x height, multiples of --bucket-stride, sides at most "
                     f"{MAX_SIDE})")
    enc.add_argument("--bucket-pixels", metavar="A[,A...]", help="derive the buckets from pixel budgets: every "
                     "width (a multiple of --bucket-stride) with the tallest height inside the budget, aspect ratios "
                     f"up to --max-aspect; several budgets give mixed-area (multi-resolution) buckets, e.g. "
                     f"'65536,262144' (256^2 and 512^2); at most {MAX_BUDGETS} budgets of at most {MAX_PIXELS} "
                     f"({MAX_SIDE}^2), {MAX_BUCKETS} buckets")
    enc.add_argument("--bucket-stride", type=int, help=f"--buckets/--bucket-pixels: bucket sides are multiples of "
                     f"this: the VAE's downsampling factor times the model's patch side (default "
                     f"{DEFAULTS['bucket_stride']} = 8 x 2)")
    enc.add_argument("--max-aspect", type=float, help=f"--bucket-pixels: the widest width/height (and "
                     f"height/width) derived, in [1, {MAX_ASPECT}] (default {DEFAULTS['max_aspect']:g})")
    enc.add_argument("--vae", default=DEFAULT_VAE, help=f"VAE hub id or local diffusers AutoencoderKL directory "
                                                        f"(default {DEFAULT_VAE})")
    enc.add_argument("--vae-subfolder", metavar="NAME", help="folder of the VAE inside the model (e.g. 'vae' for a "
                                                             "full pipeline repo)")
    enc.add_argument("--kind", help="moments: store posterior (mean, logvar), training draws a latent each step "
                                     "(AutoencoderKL's default, as the paper); sample: store one draw per image; "
                                     "mean: the posterior mean (the other image VAEs' default, normalised as their "
                                     "pipelines do; clips: the only kind)")
    enc.add_argument("--flip", action="store_true", help="also store a horizontally flipped copy of every image")
    enc.add_argument("--seed", type=int, default=0, help="seed of the per-image draws of --kind sample and of the "
                                                         "--max-images subset (default 0)")
    enc.add_argument("--dtype", default="float16", help="storage dtype: float16 (default) | float32")
    enc.add_argument("--vae-dtype", default="float32", help="VAE weights/compute dtype: float32 (default) | "
                                                            "bfloat16 | float16")


def _execution_args(p: argparse.ArgumentParser) -> None:
    """Device, batch and shard sizes, reader threads."""
    run = p.add_argument_group("execution")
    run.add_argument("--device", default="auto", help="auto (each process's GPU if any, default) | cpu | cuda")
    run.add_argument("--batch-size", type=int, default=64, help="images per VAE call (default 64)")
    run.add_argument("--shard-size", type=int, default=1000, help="images per work shard: the unit of resuming "
                                                                  "and of splitting work across processes, held "
                                                                  "in memory while encoded (default 1000; "
                                                                  "--text-family hidream: 32 MiB of Llama states "
                                                                  "per image in float16, so e.g. 64)")
    run.add_argument("--workers", type=int, default=4, help="threads reading and cropping images (default 4; "
                                                            "0: in the main thread)")


def _conditioning_args(p: argparse.ArgumentParser) -> None:
    """Captions, text encoders and loss masks (optional)."""
    cond = p.add_argument_group("text conditioning and loss masks (optional)")
    cond.add_argument("--captions", metavar="FILE", help="captions manifest: CSV/TSV 'file name,caption' lines (a "
                                                         "file on several lines: several captions), a JSON object "
                                                         "{file name: caption or [captions]}, or .jsonl lines "
                                                         "{\"file\": ..., \"caption\": ...} / {\"file\": ..., "
                                                         "\"captions\": [...]}; names relative to --images")
    cond.add_argument("--caption-sidecars", action="store_true",
                      help="caption each image from <its folder>/<its stem>.txt, one caption per non-empty line "
                           "(first source; then --captions, then --caption-from-class)")
    cond.add_argument("--caption-from-class", metavar="TEMPLATE", help="caption the images --captions does not "
                                                                       "(or all) from their class name, e.g. "
                                                                       "'a photo of a {class}'")
    cond.add_argument("--trigger-word", metavar="WORD", help="prepend WORD to every caption ('WORD, caption'); "
                                                             "recorded in meta.json")
    cond.add_argument("--empty-prompt", action="store_true",
                      help="also encode the empty prompt \"\" once and store it (the last row of a caption table), "
                           "for train.caption_dropout_mode=empty")
    cond.add_argument("--text-family", metavar="NAME", help="encode captions as this model family's pipeline "
                                                            f"does: {' | '.join(TEXT_FAMILIES)} (hidream also "
                                                            "stores llama_embeds.npy: every Llama layer's hidden "
                                                            "states, 32 MiB per caption in float16)")
    cond.add_argument("--text-encoders", metavar="DIR", help="local diffusers pipeline folder with the family's "
                                                             "text_encoder*/ and tokenizer*/ sub-folders")
    cond.add_argument("--text-encoder-path", metavar="KEY=PATH", action="append", default=[],
                      help="folder of one encoder or tokenizer, overriding --text-encoders (repeatable; KEY: "
                           "text_encoder, tokenizer, text_encoder_2, tokenizer_2, ...)")
    cond.add_argument("--max-text-length", type=int, metavar="N",
                      help="text sequence length (default: the family pipeline's, e.g. flux 512, pixart 120, "
                           "sana 300, hidream 128)")
    cond.add_argument("--no-t5", action="store_true", help="sd3 only: encode without T5 (not loaded; its part of "
                                                           "the embeddings is zeros, as the pipeline with "
                                                           "text_encoder_3=None)")
    cond.add_argument("--text-encoder-dtype", default="float32", help="text encoder weights/compute dtype: float32 "
                                                                      "(default) | bfloat16 | float16")
    cond.add_argument("--loss-masks", metavar="DIR", help="folder of grayscale loss masks, one per image, at the "
                                                          "image's relative path and stem (e.g. cls/x.png)")
    cond.add_argument("--reference-images", metavar="DIR", help="FLUX Kontext edit pairs: folder of reference "
                                                                "images, one per image, at the image's relative "
                                                                "path and stem (e.g. cls/x.jpg)")


def _repa_args(p: argparse.ArgumentParser) -> None:
    """The optional REPA targets stored with the latents (tread/data/repa_features.py)."""
    repa = p.add_argument_group("REPA targets (docs/data.md, \"REPA features\")")
    repa.add_argument("--repa-encoder", metavar="NAME", help="also store this REPA encoder's patch features of every "
                                                             "image (and of its flip): dinov2 | toy | toy_fid | "
                                                             "toy_random; a run with the same encoder (model.repa) "
                                                             "aligns with them instead of decoding every batch")
    repa.add_argument("--repa-encoder-weights", metavar="DIR", help="dinov2: a local transformers Dinov2Model folder "
                                                                    "(the one model.repa.encoder_weights names)")


def _reference_args(p: argparse.ArgumentParser) -> None:
    """The optional reference statistics (FID) of the same images."""
    ref = p.add_argument_group("reference statistics (FID)")
    ref.add_argument("--ref-out", metavar="PATH", help="also write reference statistics (.npz: mu, sigma, ... and "
                                                       "up to --ref-store-images images) of the center-cropped images")
    ref.add_argument("--ref-features", default="inception", help="feature network: inception (default; comparable "
                                                                 "with the literature) | toy_classifier")
    ref.add_argument("--inception-weights", metavar="PATH", help="local Inception weights file (torch-fidelity "
                                                                 "format; offline machines)")
    ref.add_argument("--ref-store-images", type=int, default=10000, help="images kept in the reference as arr_0 "
                                                                         "(ADM: 10000)")
    ref.add_argument("--fvd-out", metavar="PATH", help="--videos: also write an FVD reference (.npz: mu, sigma of "
                                                       "VideoMAE features) of the clips as they are encoded")
    ref.add_argument("--videomae-weights", metavar="DIR", help="--fvd-out's network: a local transformers "
                                                               "VideoMAEModel folder (e.g. MCG-NJU/videomae-base)")
    ref.add_argument("--cache-dir", default=os.environ.get("TREAD_CACHE_DIR", ".cache"),
                     help="cache of the toy-classifier feature network (default $TREAD_CACHE_DIR or .cache)")


def request_of(args: argparse.Namespace) -> PrecomputeRequest:
    """The parsed flags as the request tread.data.precompute.run works from."""
    return PrecomputeRequest(**vars(args))


# ----------------------------------------------------------------------------- reference statistics

def run_reference(plan: Plan, state, device) -> Optional[Path]:
    """Reference statistics (tread.evaluation.reference.ReferenceBuilder) of the unflipped center-cropped images:
    every process adds the images of its shards, the statistics are reduced, the main process saves them."""
    req = plan.request

    def build():
        return feature_extractor(req.ref_features, inception_weights=req.inception_weights,
                                 cache_dir=req.cache_dir, device=device, resolution=req.resolution)

    # The main process first: it may train and cache the toy classifier, which the others then load.
    first = collective(lambda: build() if state.is_main_process else None)
    extractor = collective(lambda: first if state.is_main_process else build())
    builder = ReferenceBuilder(extractor, total=plan.num_images, store_images=req.ref_store_images)
    mine = plan.shards_of(state.process_index, state.num_processes)

    def add_mine():
        total = sum(stop - start for start, stop in map(plan.shard_range, mine))
        with tqdm(total=total, unit="img", desc=f"reference ({extractor.name})", dynamic_ncols=True,
                  disable=not state.is_main_process) as bar, \
                (ThreadPoolExecutor(req.workers) if req.workers else nullcontext()) as pool:
            for shard in mine:
                for idx, images, *_ in iter_images(plan, *plan.shard_range(shard), req.batch_size, pool):
                    builder.add(images, idx)
                    bar.update(len(idx))

    collective(add_mine)
    builder.all_reduce()
    out = Path(req.ref_out).expanduser().absolute()
    source = f"{plan.root} ({plan.num_images} images, center crop {req.resolution}px)"
    collective(lambda: builder.save(out, source=source) if state.is_main_process else None)
    if state.is_main_process:
        print(f"Wrote reference statistics ({extractor.name}, {plan.num_images} images) to {out}", flush=True)
    return out


def run_fvd_reference(plan: Plan, state, device) -> Path:
    """The FVD reference (tread.evaluation.fvd) of the clips exactly as they were encoded (frames, stride, crop):
    every process adds the clips of its shards, the statistics are reduced, the main process saves them."""
    req = plan.request
    extractor = build_video_features(req.videomae_weights, "--videomae-weights", device)
    stats = FeatureStats(extractor.dim, device)

    def add_mine():
        for shard in plan.shards_of(state.process_index, state.num_processes):
            clips = (clip for _, clip, *_ in iter_images(plan, *plan.shard_range(shard), req.batch_size, None))
            video_stats(extractor, clips, stats)

    collective(add_mine)
    stats.all_reduce()
    out = Path(req.fvd_out).expanduser().absolute()
    source = f"{plan.root} ({plan.num_images} clips as precomputed)"
    collective(lambda: save_fvd_reference(out, stats, extractor, source) if state.is_main_process else None)
    if state.is_main_process:
        print(f"Wrote the FVD reference ({extractor.name}, {plan.num_images} clips) to {out}", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the CLI; returns a summary. Bad arguments or inputs raise PrecomputeError / data.LatentDatasetError /
    encoders.EncoderError (a VAE or text encoder that cannot be loaded); a stop signal raises run.Interrupted, a
    failed write (a full disk) WriteError."""
    with prepare(request_of(build_parser().parse_args(argv))) as run:   # checks every flag before any work
        summary = encode_dataset(run)
        ref = run_reference(run.plan, run.state, run.device) if run.request.ref_out else None
        fvd = run_fvd_reference(run.plan, run.state, run.device) if run.request.fvd_out else None
    return {**summary, "ref_out": ref, "fvd_out": fvd}


# A failed write's cause, for its error line (the writes keep what was finished, so a rerun resumes).
DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
               errno.EROFS: "the file system is read-only"}


def write_error_line(err: OSError) -> str:
    """The `error:` line of a write that failed (a WriteError names its file; a bare OSError its filename)."""
    head = str(err) if isinstance(err, WriteError) else f"cannot write '{err.filename}': {err.strerror or err}"
    cause = DISK_ERRORS.get(err.errno)
    return (f"error: {head}" + (f"; {cause}: free space (or choose another --out) and rerun the same command, "
                                f"which resumes from the finished shards" if cause else ""))


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: main(argv) with bad arguments or inputs and failed writes printed as one `error: ...` line
    (exit status 2); a stop signal (SIGINT, SIGTERM) ends it before the next shard with one line (130, 75)."""
    try:
        main(argv)
    except WriteError as err:       # a UserError too: said with the disk's state
        print(write_error_line(err), file=sys.stderr)
        return 2
    except UserError as err:        # PrecomputeError, LatentDatasetError, EncoderError, VideoError, ...
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        print(stop, file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:   # Ctrl-C outside the shards (listing the images, the reference statistics)
        print("stopped by SIGINT; rerun the same command to resume (finished shards are kept)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        if err.errno not in DISK_ERRORS:
            raise
        print(write_error_line(err), file=sys.stderr)
        return 2
    return 0
