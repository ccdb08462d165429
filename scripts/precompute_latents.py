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
    if args.max_images is not None and args.max_images < len(paths):
        # a fixed random subset (sorted): folders are stored class by class, so the first N would be one class
        keep = np.sort(np.random.default_rng(args.seed).choice(len(paths), size=args.max_images, replace=False))
        paths, labels = [paths[i] for i in keep], labels[keep]
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
    return Plan(root, out, parts_dir_of(out), paths, labels, class_names, num_classes, settings, args.shard_size,
                args)


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
class Encoder:
    vae: Any
    kind: str
    seed: int
    shift: float

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


def iter_images(plan: Plan, start: int, stop: int, batch_size: int, pool: Optional[ThreadPoolExecutor]):
    """(global indices, uint8 (B, R, R, 3)) batches of center-cropped images [start, stop), in order. With a
    thread pool the next batches are read while the caller encodes the current one."""
    from data.images import load_image

    res = plan.args.resolution
    batches = iter([np.arange(b, min(stop, b + batch_size)) for b in range(start, stop, batch_size)])
    if pool is None:
        for idx in batches:
            yield idx, np.stack([load_image(plan.paths[i], res) for i in idx])
        return
    submit = lambda idx: (idx, [pool.submit(load_image, plan.paths[i], res) for i in idx])  # noqa: E731
    pending = deque(submit(idx) for idx in islice(batches, 2))
    while pending:
        idx, futures = pending.popleft()
        following = next(batches, None)
        if following is not None:
            pending.append(submit(following))
        yield idx, np.stack([f.result() for f in futures])


def encode_shard(plan: Plan, shard: int, encoder: Encoder, pool: Optional[ThreadPoolExecutor], progress=None) -> None:
    """Encode one shard's images and write <parts>/shard_XXXXX.npz atomically."""
    start, stop = plan.shard_range(shard)
    n = plan.num_images
    store = np.dtype(plan.settings["dtype"])
    lat, flipped = [], []
    for idx, images in iter_images(plan, start, stop, plan.args.batch_size, pool):
        lat.append(encoder(images, idx))
        if plan.settings["flip"]:
            flipped.append(encoder(np.ascontiguousarray(images[:, :, ::-1]), idx + n))
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
    n, flip = plan.num_images, plan.settings["flip"]
    first = read_shard(plan, 0)
    with LatentDatasetWriter(plan.out, shape=first["latents"].shape[1:], num_samples=n * (2 if flip else 1),
                             num_classes=plan.num_classes, class_names=plan.class_names,
                             dtype=plan.settings["dtype"], **meta) as writer:
        for shard in range(plan.num_shards):
            z = first if shard == 0 else read_shard(plan, shard)
            start, _ = plan.shard_range(shard)
            writer.write(start, z["latents"], z["labels"])
            if flip:
                writer.write(n + start, z["flipped"], z["labels"])
            first = None
    return plan.out


def dataset_meta(plan: Plan, vae) -> dict:
    """LatentDatasetWriter keyword arguments describing the VAE, the images and the settings."""
    scale = float(vae.config.scaling_factor)
    shift = getattr(vae.config, "shift_factor", None)
    s = plan.settings
    source = (f"scripts/precompute_latents.py: {s['num_images']} images from {plan.root}"
              f"{' (+ horizontal flips)' if s['flip'] else ''} at {s['resolution']}px, VAE {s['vae']}")
    return {"latent_scale": scale, "source": source,
            "decode": {"type": "vae", "vae": s["vae"], "subfolder": s["vae_subfolder"], "scaling_factor": scale,
                       "shift_factor": None if shift is None else float(shift)},
            "extra_meta": {"latent_kind": s["kind"], "image_resolution": s["resolution"], "flip": s["flip"],
                           "num_source_images": s["num_images"], "encode_vae_dtype": s["vae_dtype"], "seed": s["seed"],
                           "labels_file": None if plan.args.labels is None
                           else str(Path(plan.args.labels).expanduser().absolute()),
                           "images_sha256": s["images_sha256"]}}


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
    encoder = Encoder(vae, args.kind, args.seed, shift)
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

    try:
        main(argv)
    except (PrecomputeError, LatentDatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
