"""Encode an image folder with a VAE into a latent dataset (the project's format, see data/latents.py).

    python scripts/precompute_latents.py --images /data/imagenet/train --out /data/in256_sdvae
    accelerate launch --num_processes 8 scripts/precompute_latents.py --images /data/imagenet/train \\
        --out /data/in256_sdvae --flip --ref-out /data/in256_ref.npz --inception-weights /w/pt_inception.pth
    python scripts/precompute_latents.py --images imgs --labels labels.csv --out ds --vae /models/sd-vae-ft-ema \\
        --resolution 256 --max-images 1000          # a quick trial on a fixed subset

Images: one sub-folder per class (classes sorted by folder name), or a flat folder with --labels (a CSV/TSV of
`file name,label` lines or a JSON object; see data/images.py). Every image is center-cropped as ADM does
(data.images.center_crop_arr) to --resolution and encoded by the VAE (default stabilityai/sd-vae-ft-ema;
offline: --vae /path/to/a/local/copy). --kind moments (default) stores the posterior (mean, logvar) so that
training draws a fresh latent every step, as the TREAD paper does; --kind sample stores one draw per image
(per-image seeds: --seed). --flip adds a horizontally flipped copy of every image: samples [0, N) are the
images, [N, 2N) their mirror images, labels kept.

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
family's pipeline encodes prompts (data/text.py). Each image's caption is encoded once (its flipped copy reuses
it) into text_embeds.npy [+ text_mask.npy, pooled_embeds.npy]. --loss-masks DIR adds loss_mask.npy: one
grayscale mask per image at DIR/<the image's relative path with its stem>.png (any image extension; the image's
size; 255 = inside), center-cropped like its image to --resolution (flipped copies get flipped masks).
"""
from __future__ import annotations

import argparse
import hashlib
from collections import deque
from itertools import islice
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
KINDS = ("moments", "sample")
STORE_DTYPES = ("float16", "float32")
VAE_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
REF_FEATURES = ("inception", "toy_classifier")
TEXT_ENCODER_DTYPES = ("float32", "bfloat16", "float16")
SETTINGS_FILE = "settings.json"
PARTS_VERSION = 1


class PrecomputeError(ValueError):
    """A bad argument or an inconsistent input/parts folder; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precompute_latents.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    io = p.add_argument_group("input and output")
    io.add_argument("--images", metavar="DIR", help="image folder: one sub-folder per class, or flat with --labels "
                                                    "(required)")
    io.add_argument("--labels", metavar="FILE", help="labels of a flat image folder: CSV/TSV 'file name,label' "
                                                     "lines or a JSON object {file name: label}; integer labels "
                                                     "are class indices, others class names")
    io.add_argument("--out", metavar="DIR", help="latent dataset to write; must not exist (required)")
    io.add_argument("--max-images", type=int, metavar="N", help="encode only a fixed random subset of N images "
                                                                "(quick trials; default: all)")
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
    run = p.add_argument_group("execution")
    run.add_argument("--device", default="auto", help="auto (each process's GPU if any, default) | cpu | cuda")
    run.add_argument("--batch-size", type=int, default=64, help="images per VAE call (default 64)")
    run.add_argument("--shard-size", type=int, default=1000, help="images per work shard: the unit of resuming "
                                                                  "and of splitting work across processes "
                                                                  "(default 1000)")
    run.add_argument("--workers", type=int, default=4, help="threads reading and cropping images (default 4; "
                                                            "0: in the main thread)")
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
    cond.add_argument("--max-text-length", type=int, metavar="N", help="T5 sequence length (default: the family's "
                                                                       "pipeline default: flux 512, sd3 256, wan "
                                                                       "512, auraflow 256, pixart 120 / Sigma 300)")
    cond.add_argument("--text-encoder-dtype", default="float32", help="text encoder weights/compute dtype: float32 "
                                                                      "(default) | bfloat16 | float16")
    cond.add_argument("--loss-masks", metavar="DIR", help="folder of grayscale loss masks, one per image, at the "
                                                          "image's relative path and stem (e.g. cls/x.png)")
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
    return p


def _bad(flag: str, value: Any, allowed: str) -> PrecomputeError:
    return PrecomputeError(f"{flag}={value!r} is not valid: {allowed}")


def parts_dir_of(out: Path) -> Path:
    return out.parent / f"{out.name}.parts"


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


def text_encoder_paths(args: argparse.Namespace) -> dict[str, str]:
    """{"pipeline": --text-encoders, KEY: PATH for each --text-encoder-path KEY=PATH} (after validation)."""
    paths = {} if args.text_encoders is None else {"pipeline": args.text_encoders}
    for item in args.text_encoder_path:
        key, _, path = item.partition("=")
        paths[key.strip()] = path.strip()
    return paths


def validate_conditioning_args(args: argparse.Namespace) -> None:
    """The captions / text encoder / loss mask flags (cheap: finds the encoder folders, loads nothing)."""
    from data.text import TEXT_FAMILIES, TextEncoderError, encoder_keys, resolve_text_encoder_paths

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
    family = args.text_family
    if family is None:
        if captioned:
            raise PrecomputeError("--captions/--caption-from-class need --text-family (one of "
                                  f"{', '.join(TEXT_FAMILIES)}) and its text encoders (--text-encoders DIR) to "
                                  f"encode the captions")
        used = [f for f, v in (("--text-encoders", args.text_encoders), ("--text-encoder-path",
                                                                          args.text_encoder_path),
                               ("--max-text-length", args.max_text_length)) if v]
        if used:
            raise PrecomputeError(f"{'/'.join(used)} only apply with --text-family and captions")
    else:
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
            from data.text import FAMILIES

            raise PrecomputeError(f"--text-family {family} needs its text encoders: --text-encoders DIR, a local "
                                  f"diffusers pipeline folder with text_encoder*/ and tokenizer*/ (fetch one with "
                                  f"`hf download {FAMILIES[family].repo} --include 'text_encoder*/*' "
                                  f"'tokenizer*/*' --local-dir DIR`), or --text-encoder-path KEY=PATH per encoder")
        try:
            resolve_text_encoder_paths(family, text_encoder_paths(args))
        except TextEncoderError as err:
            raise PrecomputeError(str(err)) from None
        if args.max_text_length is not None and args.max_text_length < 1:
            raise _bad("--max-text-length", args.max_text_length, "an integer >= 1 (tokens), or leave it out for the "
                                                                  "family's default")
        if args.text_encoder_dtype not in TEXT_ENCODER_DTYPES:
            raise _bad("--text-encoder-dtype", args.text_encoder_dtype, f"one of {', '.join(TEXT_ENCODER_DTYPES)}")
    if args.loss_masks is not None and not Path(args.loss_masks).expanduser().is_dir():
        raise _bad("--loss-masks", args.loss_masks, "no such folder (a folder of grayscale masks, one per image, "
                                                    "with the image's relative path and stem)")


# ----------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """Everything every process agrees on before any work: images, labels, shards, settings."""
    root: Path
    out: Path
    parts: Path
    paths: list[Path]
    labels: np.ndarray
    class_names: Optional[list[str]]
    num_classes: int
    settings: dict
    shard_size: int
    args: argparse.Namespace = field(repr=False)
    captions: Optional[list[str]] = field(default=None, repr=False)    # per image, with --text-family
    mask_paths: Optional[list[Path]] = field(default=None, repr=False)  # per image, with --loss-masks
    text_paths: Optional[dict[str, str]] = None                         # resolved encoder / tokenizer folders

    @property
    def num_images(self) -> int:
        return len(self.paths)

    @property
    def num_shards(self) -> int:
        return -(-self.num_images // self.shard_size)

    def shard_range(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_size, min(self.num_images, (shard + 1) * self.shard_size)

    def shard_file(self, shard: int) -> Path:
        return self.parts / f"shard_{shard:05d}.npz"

    def shards_of(self, rank: int, world: int) -> list[int]:
        return list(range(rank, self.num_shards, world))


def make_plan(args: argparse.Namespace) -> Plan:
    """List the images (after validate_args) and fix the settings that finished shards must match."""
    from data.images import list_image_folder

    root = Path(args.images).expanduser().absolute()
    out = Path(args.out).expanduser().absolute()
    paths, labels, class_names = list_image_folder(root, args.labels)
    num_classes = len(class_names) if class_names is not None else int(labels.max()) + 1
    captions = plan_captions(args, root, paths, labels, class_names) if args.text_family else None
    mask_paths = plan_masks(args, root, paths) if args.loss_masks else None
    if args.max_images is not None and args.max_images < len(paths):
        # a fixed random subset (sorted): folders are stored class by class, so the first N would be one class
        keep = np.sort(np.random.default_rng(args.seed).choice(len(paths), size=args.max_images, replace=False))
        paths, labels = [paths[i] for i in keep], labels[keep]
        captions = None if captions is None else [captions[i] for i in keep]
        mask_paths = None if mask_paths is None else [mask_paths[i] for i in keep]
    digest = hashlib.sha256()
    for p, y in zip(paths, labels):
        digest.update(f"{p.relative_to(root).as_posix()}\t{y}\n".encode())
    vae_path = Path(args.vae).expanduser()
    settings = {
        "parts_version": PARTS_VERSION, "images": str(root), "num_images": len(paths),
        "images_sha256": digest.hexdigest(), "resolution": args.resolution,
        "vae": str(vae_path.absolute()) if vae_path.is_dir() else args.vae, "vae_subfolder": args.vae_subfolder,
        "vae_dtype": args.vae_dtype, "kind": args.kind, "flip": bool(args.flip), "dtype": args.dtype,
        "shard_size": args.shard_size, "seed": args.seed, "max_images": args.max_images,
    }
    text_paths = None
    if captions is not None:  # only with these options: settings of plain runs stay as they were
        from data.text import resolve_text_encoder_paths

        text_paths = {k: str(v) for k, v in resolve_text_encoder_paths(args.text_family,
                                                                        text_encoder_paths(args)).items()}
        settings["text"] = {"family": args.text_family, "encoders": text_paths, "max_length": args.max_text_length,
                            "encoder_dtype": args.text_encoder_dtype, "captions_sha256": _digest(captions)}
    if mask_paths is not None:
        settings["loss_masks"] = {"dir": str(Path(args.loss_masks).expanduser().absolute()),
                                  "sha256": _digest([p.as_posix() for p in mask_paths])}
    return Plan(root, out, parts_dir_of(out), paths, labels, class_names, num_classes, settings, args.shard_size,
                args, captions, mask_paths, text_paths)


def _digest(items: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def _short(items: Sequence[Any], n: int = 5) -> str:
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def plan_captions(args: argparse.Namespace, root: Path, paths: list[Path], labels: np.ndarray,
                  class_names: Optional[list[str]]) -> list[str]:
    """Every image's caption: from --captions (by path relative to --images), else --caption-from-class."""
    from data.text import TextEncoderError, read_captions_file

    try:
        table = read_captions_file(args.captions) if args.captions else {}
    except TextEncoderError as err:
        raise PrecomputeError(str(err)) from None
    rel = [p.relative_to(root).as_posix() for p in paths]
    unknown = sorted(set(table) - set(rel))
    if unknown:
        raise PrecomputeError(f"--captions '{args.captions}' names file(s) that are not images in '{root}': "
                              f"{_short(unknown)} (names are relative to --images, e.g. "
                              f"'{rel[0]}')")
    template = args.caption_from_class
    if template is not None and class_names is None:
        raise PrecomputeError(f"--caption-from-class needs class names, but the labels of '{root}' are class "
                              f"indices (integer labels); use class sub-folders or class-name labels, or caption "
                              f"every image with --captions")
    captions = [table.get(r) if r in table or template is None else template.format(**{"class": class_names[y]})
                for r, y in zip(rel, labels)]
    missing = [r for r, c in zip(rel, captions) if c is None]
    if missing:
        raise PrecomputeError(f"{len(missing)} of {len(rel)} image(s) have no caption in --captions "
                              f"'{args.captions}': {_short(missing)}. Add them, or caption the rest from their "
                              f"class with --caption-from-class 'a photo of a {{class}}'.")
    return captions


def plan_masks(args: argparse.Namespace, root: Path, paths: list[Path]) -> list[Path]:
    """Every image's loss mask: <--loss-masks>/<relative path, any image extension>."""
    from data.images import _images_under

    mask_root = Path(args.loss_masks).expanduser().absolute()
    found: dict[str, Path] = {}
    for m in _images_under(mask_root):
        key = m.relative_to(mask_root).with_suffix("").as_posix()
        if key in found:
            raise PrecomputeError(f"--loss-masks '{mask_root}' has two masks for '{key}': '{found[key].name}' and "
                                  f"'{m.name}'; keep one")
        found[key] = m
    stems = [p.relative_to(root).with_suffix("").as_posix() for p in paths]
    missing = [s for s in stems if s not in found]
    if missing:
        raise PrecomputeError(f"--loss-masks '{mask_root}' has no mask for {len(missing)} of {len(stems)} image(s): "
                              f"{_short(missing)} (expected e.g. '{mask_root / missing[0]}.png': the image's "
                              f"relative path and stem)")
    return [found[s] for s in stems]


def _settings_text(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


def _delete_parts_advice(plan: Plan) -> str:
    return (f"Delete '{plan.parts}' to start over with the new settings, or rerun with the settings it was made "
            f"with to resume")


def _diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def check_parts_settings(plan: Plan) -> None:
    """A parts folder from an earlier run must have been made with the same settings."""
    file = plan.parts / SETTINGS_FILE
    if not file.is_file() or not any(plan.parts.glob("shard_*.npz")):
        return  # nothing finished yet: nothing to lose, the settings file is simply rewritten
    try:
        old = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PrecomputeError(f"'{file}' is not valid JSON: the parts folder is damaged. "
                              f"{_delete_parts_advice(plan)}.") from None
    if _settings_text(old) != _settings_text(plan.settings):
        raise PrecomputeError(f"the unfinished run in '{plan.parts}' used other settings ({_diff(old, plan.settings)})."
                              f" {_delete_parts_advice(plan)}.")


def _atomic_save(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_parts_settings(plan: Plan) -> None:
    """Record the settings in the parts folder (after check_parts_settings: they are the same or no shard exists)."""
    plan.parts.mkdir(parents=True, exist_ok=True)
    _atomic_save(plan.parts / SETTINGS_FILE, lambda f: f.write((json.dumps(plan.settings, indent=2) + "\n").encode()))


def read_shard(plan: Plan, shard: int, arrays: bool = True) -> Optional[dict]:
    """A finished shard's contents (None if not written yet); one from other settings or damaged raises."""
    file = plan.shard_file(shard)
    if not file.is_file():
        return None
    start, stop = plan.shard_range(shard)
    try:
        with np.load(file, allow_pickle=False) as z:
            settings = json.loads(str(z["settings"]))
            indices = z["indices"]
            content = {k: z[k] for k in z.files} if arrays else {}
    except (OSError, ValueError, KeyError, EOFError) as err:
        raise PrecomputeError(f"shard file '{file}' is unreadable ({err}); delete it to encode that shard again"
                              ) from None
    if _settings_text(settings) != _settings_text(plan.settings):
        raise PrecomputeError(f"shard file '{file}' was written with other settings ({_diff(settings, plan.settings)})."
                              f" {_delete_parts_advice(plan)}.")
    if not np.array_equal(indices, np.arange(start, stop)):
        raise PrecomputeError(f"shard file '{file}' holds images {indices[:1].tolist()}..{indices[-1:].tolist()} but "
                              f"shard {shard} is images [{start}, {stop}). {_delete_parts_advice(plan)}.")
    return content


# ----------------------------------------------------------------------------- encoding

@dataclass
class TextEncoder:
    """Captions -> encode_prompts arrays with the loaded family encoders."""
    family: str
    encoders: Any
    max_length: Optional[int]
    device: Any
    dtype: Any

    def __call__(self, captions: list[str]) -> dict[str, np.ndarray]:
        from data.text import encode_prompts

        return encode_prompts(self.family, self.encoders, captions, max_length=self.max_length, device=self.device,
                              dtype=self.dtype)


@dataclass
class Encoder:
    vae: Any
    kind: str
    seed: int
    shift: float
    text: Optional[TextEncoder] = None

    def __call__(self, images: np.ndarray, sample_indices: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) -> stored values: raw (mean, logvar) for moments; raw draw - shift for sample.

        Draws use one numpy generator per dataset sample (seeded by [--seed, sample index]), so they do not
        depend on batching, device or the number of processes."""
        import torch

        from data.vae import encode

        moments = encode(self.vae, images, kind="moments")
        if self.kind == "moments":
            return moments.cpu().numpy()
        mean, logvar = moments.chunk(2, dim=1)
        eps = np.stack([np.random.default_rng([self.seed, int(i)]).standard_normal(mean.shape[1:], np.float32)
                        for i in sample_indices])
        eps = torch.from_numpy(eps).to(mean.device)
        return (mean + torch.exp(0.5 * logvar) * eps - self.shift).cpu().numpy()


def load_image_and_mask(image_path: Path, mask_path: Path, resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """An image and its loss mask, both center-cropped alike: uint8 (R, R, 3) and (R, R) (grayscale, 255 = in)."""
    from PIL import Image

    from data.images import center_crop_arr, load_image

    image = load_image(image_path, resolution)
    try:
        with Image.open(image_path) as im:
            size = im.size
        with Image.open(mask_path) as m:
            m.load()
            if m.size != size:
                raise PrecomputeError(f"loss mask '{mask_path}' is {m.size[0]}x{m.size[1]} but its image "
                                      f"'{image_path}' is {size[0]}x{size[1]}; a mask must have its image's size")
            # The RGB copy of the gray mask goes through the very same ADM crop; every channel equals the gray one.
            mask = center_crop_arr(m.convert("L"), resolution)[..., 0]
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise PrecomputeError(f"cannot read loss mask '{mask_path}': {err}") from None
    return image, np.ascontiguousarray(mask)


def iter_images(plan: Plan, start: int, stop: int, batch_size: int, pool: Optional[ThreadPoolExecutor],
                masks: bool = False):
    """(global indices, uint8 (B, R, R, 3)) batches of center-cropped images [start, stop), in order; with
    masks=True (global indices, images, uint8 (B, R, R) loss masks). With a thread pool the next batches are
    read while the caller encodes the current one."""
    from data.images import load_image

    res = plan.args.resolution
    load = (lambda i: load_image_and_mask(plan.paths[i], plan.mask_paths[i], res)) if masks else \
        (lambda i: load_image(plan.paths[i], res))

    def batch(idx, items):
        if not masks:
            return idx, np.stack(items)
        return idx, np.stack([im for im, _ in items]), np.stack([m for _, m in items])

    batches = iter([np.arange(b, min(stop, b + batch_size)) for b in range(start, stop, batch_size)])
    if pool is None:
        for idx in batches:
            yield batch(idx, [load(i) for i in idx])
        return
    submit = lambda idx: (idx, [pool.submit(load, i) for i in idx])  # noqa: E731
    pending = deque(submit(idx) for idx in islice(batches, 2))
    while pending:
        idx, futures = pending.popleft()
        following = next(batches, None)
        if following is not None:
            pending.append(submit(following))
        yield batch(idx, [f.result() for f in futures])


def encode_shard(plan: Plan, shard: int, encoder: Encoder, pool: Optional[ThreadPoolExecutor], progress=None) -> None:
    """Encode one shard's images and write <parts>/shard_XXXXX.npz atomically."""
    start, stop = plan.shard_range(shard)
    n = plan.num_images
    store = np.dtype(plan.settings["dtype"])
    with_masks = plan.mask_paths is not None
    lat, flipped, masks, text = [], [], [], {}
    for idx, images, *mask in iter_images(plan, start, stop, plan.args.batch_size, pool, masks=with_masks):
        lat.append(encoder(images, idx))
        if plan.settings["flip"]:
            flipped.append(encoder(np.ascontiguousarray(images[:, :, ::-1]), idx + n))
        if with_masks:
            masks.append(mask[0])
        if encoder.text is not None:  # once per image: flipped copies reuse it
            for key, value in encoder.text([plan.captions[i] for i in idx]).items():
                text.setdefault(key, []).append(value)
        if progress is not None:
            progress.update(len(idx))
    arrays = {"latents": np.concatenate(lat)}
    if flipped:
        arrays["flipped"] = np.concatenate(flipped)
    for key, value in arrays.items():
        with np.errstate(over="ignore"):
            arrays[key] = value.astype(store)
        bad = np.flatnonzero(~np.isfinite(arrays[key]).reshape(len(value), -1).all(axis=1))
        if len(bad):
            files = [str(plan.paths[start + i]) for i in bad[:3]]
            raise PrecomputeError(f"non-finite latents (NaN/inf) after casting to {store} for {len(bad)} image(s), "
                                  f"e.g. {files}" + (" (float16 overflows above 65504: try --dtype float32)"
                                                     if store == np.float16 else "") +
                                  (" (try --vae-dtype float32)" if plan.settings["vae_dtype"] != "float32" else ""))
    if masks:
        arrays["loss_mask"] = np.concatenate(masks).astype(np.uint8)
    for key, values in text.items():  # text (B, L, D), [text_mask (B, L) bool], [pooled (B, P)]
        value = np.concatenate(values)
        if key != "text_mask":
            with np.errstate(over="ignore"):
                value = value.astype(store)
            bad = np.flatnonzero(~np.isfinite(value).reshape(len(value), -1).all(axis=1))
            if len(bad):
                files = [str(plan.paths[start + i]) for i in bad[:3]]
                raise PrecomputeError(f"non-finite {key} embeddings (NaN/inf) after casting to {store} for the "
                                      f"captions of {len(bad)} image(s), e.g. {files}"
                                      + (" (float16 overflows above 65504: try --dtype float32)"
                                         if store == np.float16 else "")
                                      + (" (try --text-encoder-dtype float32)"
                                         if plan.settings["text"]["encoder_dtype"] != "float32" else ""))
        arrays[key] = value
    arrays.update(labels=plan.labels[start:stop].astype(np.int64), indices=np.arange(start, stop, dtype=np.int64),
                  settings=np.array(_settings_text(plan.settings)))
    _atomic_save(plan.shard_file(shard), lambda f: np.savez(f, **arrays))


def merge_shards(plan: Plan, meta: dict) -> Path:
    """Stream every shard, in image order, into the final dataset (LatentDatasetWriter: atomic, memory-mapped)."""
    from data.latents import LatentDatasetWriter

    missing = [s for s in range(plan.num_shards) if not plan.shard_file(s).is_file()]
    if missing:
        raise PrecomputeError(f"shard(s) {missing[:10]} are missing from '{plan.parts}' after all processes finished; "
                              f"rerun the same command to encode them")
    from data.latents import EXTRA_KEYS

    n, flip = plan.num_images, plan.settings["flip"]
    first = read_shard(plan, 0)
    keys = [k for k in EXTRA_KEYS if k in first]
    shapes = {k: first[k].shape[1:] for k in keys}
    with LatentDatasetWriter(plan.out, shape=first["latents"].shape[1:], num_samples=n * (2 if flip else 1),
                             num_classes=plan.num_classes, class_names=plan.class_names,
                             dtype=plan.settings["dtype"], text_shape=shapes.get("text"),
                             text_mask="text_mask" in shapes, pooled_dim=shapes["pooled"][0] if "pooled" in shapes
                             else None, loss_mask_shape=shapes.get("loss_mask"), **meta) as writer:
        for shard in range(plan.num_shards):
            z = first if shard == 0 else read_shard(plan, shard)
            start, _ = plan.shard_range(shard)
            extras = {k: z[k] for k in keys}
            writer.write(start, z["latents"], z["labels"], extras or None)
            if flip:  # the mirror image keeps its caption; its mask is mirrored too
                if "loss_mask" in extras:
                    extras["loss_mask"] = extras["loss_mask"][:, :, ::-1]
                writer.write(n + start, z["flipped"], z["labels"], extras or None)
            first = None
    return plan.out


def dataset_meta(plan: Plan, vae) -> dict:
    """LatentDatasetWriter keyword arguments describing the VAE, the images and the settings."""
    scale = float(vae.config.scaling_factor)
    shift = getattr(vae.config, "shift_factor", None)
    s = plan.settings
    source = (f"scripts/precompute_latents.py: {s['num_images']} images from {plan.root}"
              f"{' (+ horizontal flips)' if s['flip'] else ''} at {s['resolution']}px, VAE {s['vae']}")
    meta = {"latent_scale": scale, "source": source,
            "decode": {"type": "vae", "vae": s["vae"], "subfolder": s["vae_subfolder"], "scaling_factor": scale,
                       "shift_factor": None if shift is None else float(shift)},
            "extra_meta": {"latent_kind": s["kind"], "image_resolution": s["resolution"], "flip": s["flip"],
                           "num_source_images": s["num_images"], "encode_vae_dtype": s["vae_dtype"], "seed": s["seed"],
                           "labels_file": None if plan.args.labels is None
                           else str(Path(plan.args.labels).expanduser().absolute()),
                           "images_sha256": s["images_sha256"]}}
    if "text" in s:
        from data.text import default_max_length, family_spec

        t, args = s["text"], plan.args
        length = t["max_length"] or default_max_length(t["family"], text_encoder_paths(args))
        meta["conditioning_meta"] = {"text": {
            "family": t["family"], "encoders": [t["encoders"][slot.model] for slot in family_spec(t["family"]).slots],
            "max_length": length, "encoder_dtype": t["encoder_dtype"]}}
        meta["extra_meta"].update(
            captions_file=None if args.captions is None else str(Path(args.captions).expanduser().absolute()),
            caption_from_class=args.caption_from_class, captions_sha256=t["captions_sha256"])
    if "loss_masks" in s:
        meta["extra_meta"]["loss_masks_dir"] = s["loss_masks"]["dir"]
    return meta


# ----------------------------------------------------------------------------- processes

def _any_failed(state, failed: bool) -> bool:
    """True on every process if any process failed (a collective: also a barrier)."""
    if state.num_processes == 1:
        return failed
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(failed)], device=state.device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag)
    return bool(flag.item())


def _collective(state, work):
    """Run work() here, then agree across processes: an error anywhere stops every process (no one is left at a
    barrier)."""
    error = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other processes have been told
        error, result = err, None
    if _any_failed(state, error is not None):
        if error is not None:
            raise error
        raise PrecomputeError("another process failed (see its error above); nothing was merged")
    return result


def _device(state, name: str):
    """This process's device: its own GPU under accelerate (auto, cuda), else the CPU."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise _bad("--device", name, "no CUDA device is available here; use auto or cpu")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return state.device if state.device.type == "cuda" else torch.device("cuda", state.local_process_index)


def run_encoding(plan: Plan, state, device) -> tuple[Any, int]:
    """Load the VAE and encode this process's unfinished shards; returns (vae, shards encoded here)."""
    from tqdm import tqdm

    from data.vae import downsample_factor, load_vae

    args = plan.args
    vae = load_vae(args.vae, subfolder=args.vae_subfolder, device=device, dtype=args.vae_dtype)
    factor = downsample_factor(vae)
    if args.resolution % factor:
        raise _bad("--resolution", args.resolution, f"a multiple of {factor} (the VAE '{args.vae}' downsamples by "
                                                    f"{factor})")
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    text = None
    if plan.captions is not None:
        import torch

        from data.text import load_text_encoders

        dtype = getattr(torch, args.text_encoder_dtype)
        encoders = load_text_encoders(args.text_family, text_encoder_paths(args), device=device, dtype=dtype)
        text = TextEncoder(args.text_family, encoders, args.max_text_length, device, dtype)
    encoder = Encoder(vae, args.kind, args.seed, shift, text)
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
    return vae, done


def run_reference(plan: Plan, state, device) -> Optional[Path]:
    """Reference statistics (evaluation.reference.ReferenceBuilder) of the unflipped center-cropped images:
    every process adds the images of its shards, the statistics are reduced, the main process saves them."""
    from tqdm import tqdm

    from evaluation.features import build_feature_extractor
    from evaluation.reference import ReferenceBuilder

    args = plan.args

    def build():
        return build_feature_extractor(args.ref_features, inception_weights=args.inception_weights,
                                       cache_dir=args.cache_dir, device=device, resolution=args.resolution)

    # The main process first: it may train and cache the toy classifier, which the others then load.
    first = _collective(state, lambda: build() if state.is_main_process else None)
    extractor = _collective(state, lambda: first if state.is_main_process else build())
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

    _collective(state, add_mine)
    builder.all_reduce()
    out = Path(args.ref_out).expanduser().absolute()
    source = f"{plan.root} ({plan.num_images} images, center crop {args.resolution}px)"
    _collective(state, lambda: builder.save(out, source=source) if state.is_main_process else None)
    if state.is_main_process:
        print(f"Wrote reference statistics ({extractor.name}, {plan.num_images} images) to {out}", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the CLI; returns a summary. Bad arguments or inputs raise PrecomputeError / data.LatentDatasetError."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    from accelerate import PartialState

    plan = make_plan(args)
    state = PartialState()
    device = _device(state, args.device)
    check_parts_settings(plan)                                    # every process, before any collective

    vae, encoded = _collective(state, lambda: run_encoding(plan, state, device))
    out = _collective(state, lambda: merge_shards(plan, dataset_meta(plan, vae)) if state.is_main_process else None)
    if state.is_main_process:
        shutil.rmtree(plan.parts, ignore_errors=True)
        print(f"Wrote {plan.num_images * (2 if plan.settings['flip'] else 1)} latents "
              f"({plan.num_images} images{' + flips' if plan.settings['flip'] else ''}) to {out}", flush=True)
    ref = run_reference(plan, state, device) if args.ref_out else None
    return {"out": plan.out, "num_images": plan.num_images, "shards": plan.num_shards, "encoded_here": encoded,
            "ref_out": ref}


def cli(argv: Optional[Sequence[str]] = None) -> int:
    from data.latents import LatentDatasetError
    from data.text import TextEncoderError

    try:
        main(argv)
    except (PrecomputeError, LatentDatasetError, TextEncoderError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
