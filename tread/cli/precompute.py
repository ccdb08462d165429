"""Encode an image folder with a VAE into a latent dataset (the project's format, see tread/data/meta.py).

    python scripts/precompute_latents.py --images /data/imagenet/train --out /data/in256_sdvae
    accelerate launch --num_processes 8 scripts/precompute_latents.py --images /data/imagenet/train \\
        --out /data/in256_sdvae --flip --ref-out /data/in256_ref.npz --inception-weights /w/pt_inception.pth
    python scripts/precompute_latents.py --images imgs --labels labels.csv --out ds --vae /models/sd-vae-ft-ema \\
        --resolution 256 --max-images 1000          # a quick trial on a fixed subset

Images: one sub-folder per class (classes sorted by folder name), or a flat folder with --labels (a CSV/TSV of
`file name,label` lines or a JSON object; see tread/data/images.py). Every image is center-cropped as ADM does
(tread.data.images.center_crop_arr) to --resolution and encoded by the VAE (default stabilityai/sd-vae-ft-ema;
offline: --vae /path/to/a/local/copy). --kind moments (default) stores the posterior (mean, logvar) so that
training draws a fresh latent every step, as the TREAD paper does; --kind sample stores one draw per image
(per-image seeds: --seed). --flip adds a horizontally flipped copy of every image: samples [0, N) are the
images, [N, 2N) their mirror images, labels kept.

Before any encoding every image is decoded once (corrupt or truncated files fail the run, naming them, with nothing
written; tread/data/images.py says why a full decode); files under --images that are not images are skipped with a note.
Work is split into shards of --shard-size images; with accelerate, shard i is encoded by process i mod P.
Finished shards are kept in <out>.parts/ so an interrupted run resumes where it stopped (same settings; a
parts folder from other settings is an error). When all are done the main process streams them, in image
order, into <out> (atomically), then deletes the parts folder. The result does not depend on the number of
processes. --ref-out also writes reference statistics (FID) of the same center-cropped, unflipped images.

Text-to-image data (optional): --captions FILE (CSV/TSV `file name,caption` lines, the caption being the rest of
the line, or a JSON object {file name: caption}; names relative to --images, e.g. cls/x.png for class folders)
and/or --caption-from-class 'a photo of a {class}' (captions the images the file does not, from their class
name), encoded with --text-family {flux,sd3,wan,auraflow,pixart} by the text encoders of a local diffusers
pipeline folder (--text-encoders DIR; `hf download <repo> --include 'text_encoder*/*' 'tokenizer*/*'
--local-dir DIR`) or per-encoder folders (--text-encoder-path text_encoder_2=/models/t5), exactly as that
family's pipeline encodes prompts (tread/data/text.py). Each image's caption is encoded once (its flipped copy reuses
it) into text_embeds.npy [+ text_mask.npy, pooled_embeds.npy]; --no-t5 (sd3) encodes without T5 (not loaded;
its part, after the 77 CLIP tokens, is zeros). --loss-masks DIR adds loss_mask.npy: one
grayscale mask per image at DIR/<the image's relative path with its stem>.png (any image extension; the image's
size; 255 = inside), center-cropped like its image to --resolution (flipped copies get flipped masks).

Edit pairs (FLUX Kontext, model=flux_kontext): --reference-images DIR adds reference_latents.npy: one reference
image per target image at DIR/<the image's relative path with its stem> (any image extension), center-cropped
to --resolution and encoded by the same VAE as the posterior mean (as FluxKontextPipeline encodes its image,
whatever --kind; flipped copies get flipped references). A target without a reference, or a reference without
a target, is an error naming them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

from tread.data.images import unreadable_images
from tread.data.meta import LatentDatasetError
from tread.data.precompute import Encoder, TextEncoder, dataset_meta, encode_shard, iter_images, merge_shards
from tread.data.precompute_plan import (Plan, PrecomputeError, check_parts_settings, make_plan, read_shard,
                                        skipped_note, text_encoder_paths, unfinished_images, unreadable_images_error,
                                        write_parts_settings)
from tread.data.text import (FAMILIES, TEXT_FAMILIES, TextEncoderError, encoder_keys, load_text_encoders,
                       resolve_text_encoder_paths)
from tread.data.vae import downsample_factor, load_vae
from tread.evaluation.features import build_feature_extractor
from tread.evaluation.reference import ReferenceBuilder
from tread.utils.distributed import any_rank

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
KINDS = ("moments", "sample")
STORE_DTYPES = ("float16", "float32")
VAE_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
REF_FEATURES = ("inception", "toy_classifier")
TEXT_ENCODER_DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------- arguments

class Parser(argparse.ArgumentParser):
    """argparse whose usage errors (an unknown flag, --batch-size abc) are PrecomputeErrors: one `error:` line."""

    def error(self, message: str):
        raise PrecomputeError(f"{message} (python {self.prog} --help lists the flags)")


def build_parser() -> argparse.ArgumentParser:
    """The flags, in groups; the module doc is the description (first paragraph) and the epilog (the rest)."""
    p = Parser(
        prog="precompute_latents.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    for add_group in (_io_args, _encoding_args, _execution_args, _conditioning_args, _reference_args):
        add_group(p)
    return p


def _io_args(p: argparse.ArgumentParser) -> None:
    """--images, --labels, --out, --max-images."""
    io = p.add_argument_group("input and output")
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
    enc.add_argument("--resolution", type=int, default=256, help="image side after the center crop; a multiple "
                                                                 "of the VAE's downsampling factor (default 256)")
    enc.add_argument("--vae", default=DEFAULT_VAE, help=f"VAE hub id or local diffusers AutoencoderKL directory "
                                                        f"(default {DEFAULT_VAE})")
    enc.add_argument("--vae-subfolder", metavar="NAME", help="folder of the VAE inside the model (e.g. 'vae' for a "
                                                             "full pipeline repo)")
    enc.add_argument("--kind", default="moments", help="moments: store posterior (mean, logvar), training draws a "
                                                       "latent each step (default, as the paper); sample: store "
                                                       "one draw per image")
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
                                                                  "and of splitting work across processes "
                                                                  "(default 1000)")
    run.add_argument("--workers", type=int, default=4, help="threads reading and cropping images (default 4; "
                                                            "0: in the main thread)")


def _conditioning_args(p: argparse.ArgumentParser) -> None:
    """Captions, text encoders and loss masks (optional)."""
    cond = p.add_argument_group("text conditioning and loss masks (optional)")
    cond.add_argument("--captions", metavar="FILE", help="captions: CSV/TSV 'file name,caption' lines or a JSON "
                                                         "object {file name: caption}; names relative to --images")
    cond.add_argument("--caption-from-class", metavar="TEMPLATE", help="caption the images --captions does not "
                                                                       "(or all) from their class name, e.g. "
                                                                       "'a photo of a {class}'")
    cond.add_argument("--text-family", metavar="NAME", help="encode captions as this model family's pipeline "
                                                            "does: flux | sd3 | wan | auraflow | pixart")
    cond.add_argument("--text-encoders", metavar="DIR", help="local diffusers pipeline folder with the family's "
                                                             "text_encoder*/ and tokenizer*/ sub-folders")
    cond.add_argument("--text-encoder-path", metavar="KEY=PATH", action="append", default=[],
                      help="folder of one encoder or tokenizer, overriding --text-encoders (repeatable; KEY: "
                           "text_encoder, tokenizer, text_encoder_2, tokenizer_2, ...)")
    cond.add_argument("--max-text-length", type=int, metavar="N",
                      help="T5 sequence length (default: the family pipeline's, e.g. flux 512, pixart 120)")
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
    ref.add_argument("--cache-dir", default=os.environ.get("TREAD_CACHE_DIR", ".cache"),
                     help="cache of the toy-classifier feature network (default $TREAD_CACHE_DIR or .cache)")


def _bad(flag: str, value: Any, allowed: str) -> PrecomputeError:
    return PrecomputeError(f"{flag}={value!r} is not valid: {allowed}")


def validate_args(args: argparse.Namespace) -> None:
    """Cheap checks of every argument (no VAE, no images read); errors name the flag, value and what is allowed."""
    if not args.images:
        raise PrecomputeError("--images DIR is required: a folder with one sub-folder of images per class, or a "
                              "flat folder of images with --labels FILE")
    if not Path(args.images).expanduser().is_dir():
        raise _bad("--images", args.images, "no such folder (expected a folder of class sub-folders, or of images "
                                             "with --labels)")
    if args.labels is not None and not Path(args.labels).expanduser().is_file():
        raise _bad("--labels", args.labels, "no such file (a CSV/TSV 'file name,label' or JSON labels file)")
    if not args.out:
        raise PrecomputeError("--out DIR is required: the latent dataset directory to write (must not exist)")
    out = Path(args.out).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise PrecomputeError(f"--out '{out}' already exists; refusing to overwrite it. Delete it or choose "
                              f"another path.")
    if args.resolution is None or args.resolution < 8:
        raise _bad("--resolution", args.resolution, "an integer >= 8 that is a multiple of the VAE's downsampling "
                                                    "factor (8 for SD-VAE), e.g. 256")
    if args.kind not in KINDS:
        raise _bad("--kind", args.kind, f"one of {', '.join(KINDS)}")
    if args.dtype not in STORE_DTYPES:
        raise _bad("--dtype", args.dtype, f"one of {', '.join(STORE_DTYPES)}")
    if args.vae_dtype not in VAE_DTYPES:
        raise _bad("--vae-dtype", args.vae_dtype, f"one of {', '.join(VAE_DTYPES)}")
    if args.device not in DEVICES:
        raise _bad("--device", args.device, f"one of {', '.join(DEVICES)} (with accelerate every process takes its "
                                            f"own GPU)")
    if not args.vae:
        raise _bad("--vae", args.vae, f"a hub id (e.g. {DEFAULT_VAE}) or a local AutoencoderKL directory")
    if args.vae_subfolder is not None and not args.vae_subfolder:
        raise _bad("--vae-subfolder", args.vae_subfolder, "a folder name such as 'vae', or leave it out")
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--shard-size", args.shard_size, 1),
                             ("--workers", args.workers, 0), ("--seed", args.seed, 0),
                             ("--ref-store-images", args.ref_store_images, 0)):
        if value < low:
            raise _bad(flag, value, f"an integer >= {low}")
    if args.seed >= 2 ** 31:
        raise _bad("--seed", args.seed, "an integer in [0, 2**31)")
    if args.max_images is not None and args.max_images < 1:
        raise _bad("--max-images", args.max_images, "an integer >= 1 (or leave it out for all images)")
    validate_conditioning_args(args)
    if args.ref_out is not None:
        ref = Path(args.ref_out).expanduser()
        if ref.exists():
            raise PrecomputeError(f"--ref-out '{ref.absolute()}' already exists; refusing to overwrite it. Delete "
                                  f"it or choose another path.")
        if args.ref_features not in REF_FEATURES:
            raise _bad("--ref-features", args.ref_features, f"one of {', '.join(REF_FEATURES)}")
        if args.inception_weights is not None and not Path(args.inception_weights).expanduser().is_file():
            raise _bad("--inception-weights", args.inception_weights, "no such file (a torch-fidelity Inception "
                                                                      "weights file)")


def validate_conditioning_args(args: argparse.Namespace) -> None:
    """The captions / text encoder / loss mask flags (cheap: finds the encoder folders, loads nothing)."""
    template = args.caption_from_class
    if template is not None:
        try:
            ok = "{class}" in template and template.format(**{"class": "x"}) is not None
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            raise _bad("--caption-from-class", template, "a template with {class} for the class name (other braces "
                                                          "doubled: {{ }}), e.g. 'a photo of a {class}'")
    if args.captions is not None and not Path(args.captions).expanduser().is_file():
        raise _bad("--captions", args.captions, "no such file (CSV/TSV 'file name,caption' lines or a JSON object "
                                                "{file name: caption})")
    captioned = args.captions is not None or template is not None
    if args.text_family is None:
        if captioned:
            raise PrecomputeError("--captions/--caption-from-class need --text-family (one of "
                                  f"{', '.join(TEXT_FAMILIES)}) and its text encoders (--text-encoders DIR) to "
                                  f"encode the captions")
        used = [f for f, v in (("--text-encoders", args.text_encoders), ("--text-encoder-path",
                                                                          args.text_encoder_path),
                               ("--max-text-length", args.max_text_length), ("--no-t5", args.no_t5)) if v]
        if used:
            raise PrecomputeError(f"{'/'.join(used)} only apply with --text-family and captions")
    else:
        _validate_text_family(args, captioned)
    if args.loss_masks is not None and not Path(args.loss_masks).expanduser().is_dir():
        raise _bad("--loss-masks", args.loss_masks, "no such folder (a folder of grayscale masks, one per image, "
                                                    "with the image's relative path and stem)")
    if args.reference_images is not None and not Path(args.reference_images).expanduser().is_dir():
        raise _bad("--reference-images", args.reference_images, "no such folder (a folder of reference images, one "
                                                                "per image, with the image's relative path and stem)")


def _validate_text_family(args: argparse.Namespace, captioned: bool) -> None:
    """--text-family and its encoder flags: a known family, captions to encode, encoder folders that exist."""
    family = args.text_family
    if family not in TEXT_FAMILIES:
        raise _bad("--text-family", family, f"one of {', '.join(TEXT_FAMILIES)}")
    if not captioned:
        raise PrecomputeError(f"--text-family {family} needs captions: --captions FILE and/or "
                              f"--caption-from-class 'a photo of a {{class}}'")
    allowed = [k for k in encoder_keys(family) if k != "pipeline"]
    for item in args.text_encoder_path:
        key, eq, path = item.partition("=")
        if not eq or key.strip() not in allowed or not path.strip():
            raise _bad("--text-encoder-path", item, f"KEY=PATH with KEY one of {', '.join(allowed)} ({family})")
    if args.text_encoders is None and not args.text_encoder_path:
        raise PrecomputeError(f"--text-family {family} needs its text encoders: --text-encoders DIR, a local "
                              f"diffusers pipeline folder with text_encoder*/ and tokenizer*/ (fetch one with "
                              f"`hf download {FAMILIES[family].repo} --include 'text_encoder*/*' "
                              f"'tokenizer*/*' --local-dir DIR`), or --text-encoder-path KEY=PATH per encoder")
    if args.no_t5 and family != "sd3":
        raise PrecomputeError(f"--no-t5 is for --text-family sd3 only (SD3 runs without T5); --text-family "
                              f"{family}'s text embeddings are its T5's output")
    try:
        resolve_text_encoder_paths(family, text_encoder_paths(args), t5=not args.no_t5)
    except TextEncoderError as err:
        raise PrecomputeError(str(err)) from None
    if args.max_text_length is not None and args.max_text_length < 1:
        raise _bad("--max-text-length", args.max_text_length, "an integer >= 1 (tokens), or leave it out for the "
                                                              "family's default")
    if args.text_encoder_dtype not in TEXT_ENCODER_DTYPES:
        raise _bad("--text-encoder-dtype", args.text_encoder_dtype, f"one of {', '.join(TEXT_ENCODER_DTYPES)}")


# ----------------------------------------------------------------------------- processes

def _collective(work: Callable[[], Any]) -> Any:
    """Run work() here, then agree across processes: an error anywhere stops every process (no one is left at a
    barrier)."""
    error = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other processes have been told
        error, result = err, None
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise PrecomputeError("another process failed (see its error above); nothing was merged")
    return result


def _device(state: PartialState, name: str) -> torch.device:
    """This process's device: its own GPU under accelerate (auto, cuda), else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise _bad("--device", name, "no CUDA device is available here; use auto or cpu")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return state.device if state.device.type == "cuda" else torch.device("cuda", state.local_process_index)


def check_images(plan: Plan, state) -> None:
    """Decode every image still to encode (tread.data.images.unreadable_images), each process every P-th one, before
    any encoding; all processes then hold the full list, and any unreadable image fails every one of them."""
    todo = unfinished_images(plan)
    mine = todo[state.process_index::state.num_processes]

    def work() -> list[tuple[int, str]]:
        with tqdm(total=len(mine), unit="img", desc="checking images", disable=not state.is_main_process,
                  dynamic_ncols=True) as bar, \
                (ThreadPoolExecutor(plan.args.workers) if plan.args.workers else nullcontext()) as pool:
            bad = unreadable_images([plan.paths[i] for i in mine], pool, bar.update)
        return [(int(mine[j]), why) for j, why in bad]

    bad = sorted(gather_object(_collective(work)))
    if bad:
        raise unreadable_images_error(plan, bad, len(todo))


def load_encoder(plan: Plan, device) -> Encoder:
    """The VAE (checked against --resolution) and, with captions, the text encoders."""
    args = plan.args
    vae = load_vae(args.vae, subfolder=args.vae_subfolder, device=device, dtype=args.vae_dtype)
    factor = downsample_factor(vae)
    if args.resolution % factor:
        raise _bad("--resolution", args.resolution, f"a multiple of {factor} (the VAE '{args.vae}' downsamples by "
                                                    f"{factor})")
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    text = None
    if plan.captions is not None:
        dtype = getattr(torch, args.text_encoder_dtype)
        encoders = load_text_encoders(args.text_family, text_encoder_paths(args), device=device, dtype=dtype,
                                      t5=not args.no_t5)
        text = TextEncoder(args.text_family, encoders, args.max_text_length, device, dtype)
    return Encoder(vae, args.kind, args.seed, shift, text)


def run_encoding(plan: Plan, state, device, encoder: Optional[Encoder] = None) -> tuple[Any, int]:
    """Encode this process's unfinished shards with `encoder` (default: load_encoder(plan, device)); returns
    (vae, shards encoded here)."""
    args = plan.args
    encoder = load_encoder(plan, device) if encoder is None else encoder
    if state.is_main_process:  # only once the VAE and resolution are known to work
        write_parts_settings(plan)
    else:
        plan.parts.mkdir(parents=True, exist_ok=True)
    todo = [s for s in plan.shards_of(state.process_index, state.num_processes) if read_shard(plan, s, False) is None]
    per_image = 2 if plan.settings["flip"] else 1
    total = sum(stop - start for start, stop in map(plan.shard_range, todo))
    done = 0
    with tqdm(total=int(total), unit="img", desc=f"encoding (process {state.process_index})",
              disable=not state.is_main_process, dynamic_ncols=True) as bar, \
            (ThreadPoolExecutor(args.workers) if args.workers else nullcontext()) as pool:
        bar.set_postfix(shards=f"{len(todo)} to do", copies=per_image)
        for shard in todo:
            encode_shard(plan, shard, encoder, pool, bar)
            done += 1
    return encoder.vae, done


def run_reference(plan: Plan, state, device) -> Optional[Path]:
    """Reference statistics (tread.evaluation.reference.ReferenceBuilder) of the unflipped center-cropped images:
    every process adds the images of its shards, the statistics are reduced, the main process saves them."""
    args = plan.args

    def build():
        return build_feature_extractor(args.ref_features, inception_weights=args.inception_weights,
                                       cache_dir=args.cache_dir, device=device, resolution=args.resolution)

    # The main process first: it may train and cache the toy classifier, which the others then load.
    first = _collective(lambda: build() if state.is_main_process else None)
    extractor = _collective(lambda: first if state.is_main_process else build())
    builder = ReferenceBuilder(extractor, total=plan.num_images, store_images=args.ref_store_images)
    mine = plan.shards_of(state.process_index, state.num_processes)

    def add_mine():
        total = sum(stop - start for start, stop in map(plan.shard_range, mine))
        with tqdm(total=total, unit="img", desc=f"reference ({extractor.name})", dynamic_ncols=True,
                  disable=not state.is_main_process) as bar, \
                (ThreadPoolExecutor(args.workers) if args.workers else nullcontext()) as pool:
            for shard in mine:
                for idx, images in iter_images(plan, *plan.shard_range(shard), args.batch_size, pool):
                    builder.add(images, idx)
                    bar.update(len(idx))

    _collective(add_mine)
    builder.all_reduce()
    out = Path(args.ref_out).expanduser().absolute()
    source = f"{plan.root} ({plan.num_images} images, center crop {args.resolution}px)"
    _collective(lambda: builder.save(out, source=source) if state.is_main_process else None)
    if state.is_main_process:
        print(f"Wrote reference statistics ({extractor.name}, {plan.num_images} images) to {out}", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the CLI; returns a summary. Bad arguments or inputs raise PrecomputeError / data.LatentDatasetError."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    plan = make_plan(args)
    state = PartialState()
    device = _device(state, args.device)
    check_parts_settings(plan)                                    # every process, before any collective
    note = skipped_note(plan)
    if note and state.is_main_process:
        print(note, flush=True)
    encoder = _collective(lambda: load_encoder(plan, device))      # a bad VAE fails before the long image check
    check_images(plan, state)                                     # nothing is written before this
    vae, encoded = _collective(lambda: run_encoding(plan, state, device, encoder))
    out = _collective(lambda: merge_shards(plan, dataset_meta(plan, vae)) if state.is_main_process else None)
    if state.is_main_process:
        shutil.rmtree(plan.parts, ignore_errors=True)
        print(f"Wrote {plan.num_images * (2 if plan.settings['flip'] else 1)} latents "
              f"({plan.num_images} images{' + flips' if plan.settings['flip'] else ''}) to {out}", flush=True)
    ref = run_reference(plan, state, device) if args.ref_out else None
    return {"out": plan.out, "num_images": plan.num_images, "shards": plan.num_shards, "encoded_here": encoded,
            "ref_out": ref}


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: main(argv) with bad arguments or inputs printed as one `error: ...` line (exit status 2)."""
    try:
        main(argv)
    except (PrecomputeError, LatentDatasetError, TextEncoderError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
