"""The bookkeeping of precomputing latents (tread/data/precompute/run.py, scripts/precompute_latents.py): the plan
every process agrees on before any work (images, labels, captions, loss masks, shards, the settings finished
shards must match) and the parts folder of finished shards that lets an interrupted run resume."""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from tread.encoders.text import resolve_text_encoder_paths
from tread.utils.io import atomic_write_json
from tread.utils.readers import image_size, parse_json, read_json, read_npz

from tread.data.buckets import Bucket, assign_bucket
from tread.data.images import IMAGE_EXTS, ImageFolderError, images_under, list_image_folder, short_list
from tread.data.video import frame_files

from .captions import read_caption_manifest, read_sidecar, sidecar_of, with_trigger
from .request import PrecomputeError, PrecomputeRequest, request_buckets
from .vae_class import image_kind, image_vae_class
from .video import plan_clips

SETTINGS_FILE = "settings.json"
PARTS_VERSION = 1
DIGESTS = "input_digests"     # a shard's array: each sample's input_digest, (n, 32) uint8
DIGEST_CHUNK = 1 << 20        # bytes read at a time when hashing an input


def parts_dir_of(out: Path) -> Path:
    return out.parent / f"{out.name}.parts"


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
    request: PrecomputeRequest = field(repr=False)
    captions: Optional[list[list[str]]] = field(default=None, repr=False)   # per image its captions (--text-family)
    mask_paths: Optional[list[Path]] = field(default=None, repr=False)  # per image, with --loss-masks
    text_paths: Optional[dict[str, str]] = None                         # resolved encoder / tokenizer folders
    skipped: list[Path] = field(default_factory=list, repr=False)       # files under root that are not images
    reference_paths: Optional[list[Path]] = field(default=None, repr=False)  # per image, --reference-images
    buckets: Optional[list[Bucket]] = None                              # --buckets / --bucket-pixels
    image_bucket: Optional[np.ndarray] = field(default=None, repr=False)  # per image: its index in buckets
    clip_target: Optional[Bucket] = None                                # --videos of one shape: (res, res, frames)

    @property
    def video(self) -> bool:
        """Whether the inputs are clips (--videos): paths are clips, buckets video buckets (frames > 0)."""
        return "video" in self.settings

    @property
    def num_images(self) -> int:
        return len(self.paths)

    @property
    def caption_table(self) -> bool:
        """Whether the captions are stored as a caption table (several for an image, or --empty-prompt)."""
        return bool(self.settings.get("text", {}).get("caption_table"))

    @cached_property
    def ranges(self) -> list[tuple[int, int]]:
        """Each shard's images [start, stop): shard_size at a time; with buckets (images grouped by bucket),
        within each bucket, so a shard has one image size."""
        groups = [(0, self.num_images)] if self.buckets is None else \
            [tuple(int(v) for v in np.flatnonzero(self.image_bucket == b)[[0, -1]] + [0, 1])
             for b in range(len(self.buckets)) if (self.image_bucket == b).any()]
        return [(a, min(b, a + self.shard_size)) for lo, b in groups for a in range(lo, b, self.shard_size)]

    @property
    def num_shards(self) -> int:
        return len(self.ranges)

    def shard_range(self, shard: int) -> tuple[int, int]:
        return self.ranges[shard]

    def target(self, index: int) -> Bucket:
        """The size image `index` is cropped to: its bucket, or the --resolution square."""
        if self.buckets is None:
            return self.clip_target or Bucket(self.request.resolution, self.request.resolution)
        return self.buckets[int(self.image_bucket[index])]

    def shard_file(self, shard: int) -> Path:
        return self.parts / f"shard_{shard:05d}.npz"

    def shards_of(self, rank: int, world: int) -> list[int]:
        return list(range(rank, self.num_shards, world))


def make_plan(req: PrecomputeRequest) -> Plan:
    """List the images (after check_request) and fix the settings that finished shards must match."""
    if req.videos is not None:
        return make_video_plan(req)
    root = Path(req.images).expanduser().absolute()
    out = Path(req.out).expanduser().absolute()
    vae_class = image_vae_class(req)
    skipped: list[Path] = []
    paths, labels, class_names = list_image_folder(root, req.labels, skipped)
    num_classes = len(class_names) if class_names is not None else int(labels.max()) + 1
    captions = plan_captions(req, root, paths, labels, class_names) if req.text_family else None
    if req.caption_sidecars:   # the sidecars are captions, not files passed over
        sidecars = {sidecar_of(p) for p in paths}
        skipped = [p for p in skipped if p not in sidecars]
    mask_paths = plan_masks(req, root, paths) if req.loss_masks else None
    reference_paths = plan_references(req, root, paths) if req.reference_images else None
    if req.max_images is not None and req.max_images < len(paths):
        # a fixed random subset (sorted): folders are stored class by class, so the first N would be one class
        keep = np.sort(np.random.default_rng(req.seed).choice(len(paths), size=req.max_images, replace=False))
        paths, labels = [paths[i] for i in keep], labels[keep]
        captions = None if captions is None else [captions[i] for i in keep]
        mask_paths = None if mask_paths is None else [mask_paths[i] for i in keep]
        reference_paths = None if reference_paths is None else [reference_paths[i] for i in keep]
    buckets, image_bucket = request_buckets(req), None
    if buckets is not None:   # group the images by bucket (stable): every shard then has one image size
        image_bucket = assign_buckets(paths, buckets)
        order = np.argsort(image_bucket, kind="stable")
        paths, labels, image_bucket = [paths[i] for i in order], labels[order], image_bucket[order]
        captions, mask_paths, reference_paths = (None if v is None else [v[i] for i in order]
                                                 for v in (captions, mask_paths, reference_paths))
    digest = hashlib.sha256()
    for p, y in zip(paths, labels):
        digest.update(f"{p.relative_to(root).as_posix()}\t{y}\n".encode())
    settings = {
        "parts_version": PARTS_VERSION, "images": str(root), "num_images": len(paths),
        "images_sha256": digest.hexdigest(), "resolution": req.resolution, **_vae_settings(req),
        "kind": image_kind(req, vae_class), "flip": bool(req.flip), "dtype": req.dtype,
        "shard_size": req.shard_size, "seed": req.seed, "max_images": req.max_images,
    }
    if vae_class != "AutoencoderKL":   # only when used, so AutoencoderKL runs' settings (and resumes) stay as they were
        settings["vae_class"] = vae_class
    text_paths = _shared_settings(settings, req, buckets, image_bucket, captions)
    if mask_paths is not None:
        settings["loss_masks"] = {"dir": str(Path(req.loss_masks).expanduser().absolute()),
                                  "sha256": _digest([p.as_posix() for p in mask_paths])}
    if reference_paths is not None:
        settings["reference_images"] = {"dir": str(Path(req.reference_images).expanduser().absolute()),
                                        "sha256": _digest([p.as_posix() for p in reference_paths])}
    if req.repa_encoder is not None:     # each shard records the encoder's digest (checked when merging)
        settings["repa"] = {"encoder": req.repa_encoder, "weights": None if req.repa_encoder_weights is None
                            else str(Path(req.repa_encoder_weights).expanduser().absolute())}
    return Plan(root, out, parts_dir_of(out), paths, labels, class_names, num_classes, settings, req.shard_size,
                req, captions, mask_paths, text_paths, skipped, reference_paths=reference_paths, buckets=buckets,
                image_bucket=image_bucket)


def make_video_plan(req: PrecomputeRequest) -> Plan:
    """The plan of a --videos run (tread/data/precompute/video.py plan_clips): clips probed and given their targets,
    grouped by bucket; captions as for images (a clip is named by its file or folder path)."""
    root, out = Path(req.videos).expanduser().absolute(), Path(req.out).expanduser().absolute()
    clips = plan_clips(req, root)
    paths, labels, buckets, clip_bucket = clips["paths"], clips["labels"], clips["buckets"], clips["clip_bucket"]
    captions = plan_captions(req, root, paths, labels, clips["class_names"]) if req.text_family else None
    if buckets is not None:   # grouped by bucket (stable): every shard has one clip shape
        order = np.argsort(clip_bucket, kind="stable")
        paths, labels, clip_bucket = [paths[i] for i in order], labels[order], clip_bucket[order]
        captions = None if captions is None else [captions[i] for i in order]
    settings = {
        "parts_version": PARTS_VERSION, "images": str(root), "num_images": len(paths),
        "images_sha256": _digest([f"{p.relative_to(root).as_posix()}\t{y}" for p, y in zip(paths, labels)]),
        "resolution": req.resolution, **_vae_settings(req), "kind": "mean", "flip": False,
        "dtype": req.dtype, "shard_size": req.shard_size, "seed": req.seed, "max_images": None,
        "video": clips["settings"]}
    text_paths = _shared_settings(settings, req, buckets, clip_bucket, captions)
    return Plan(root, out, parts_dir_of(out), paths, labels, clips["class_names"], int(labels.max()) + 1
                if clips["class_names"] is None else len(clips["class_names"]), settings, req.shard_size, req,
                captions, None, text_paths, buckets=buckets, image_bucket=clip_bucket, clip_target=clips["target"])


def _vae_settings(req: PrecomputeRequest) -> dict:
    vae_path = Path(req.vae).expanduser()
    return {"vae": str(vae_path.absolute()) if vae_path.is_dir() else req.vae, "vae_subfolder": req.vae_subfolder,
            "vae_dtype": req.vae_dtype}


def _shared_settings(settings: dict, req: PrecomputeRequest, buckets: Optional[Sequence[Bucket]],
                     assignment: Optional[np.ndarray], captions: Optional[list]) -> Optional[dict]:
    """Add the settings of images and clips alike, each only when used (so plain runs' settings stay as they
    were): the buckets and the assignment, the text encoders and captions. Returns the text encoders' paths."""
    if buckets is not None:
        settings["buckets"] = {"sizes": [b.name for b in buckets], "stride": req.bucket_stride,
                               "assignment_sha256": _digest([str(b) for b in assignment.tolist()])}
    if captions is None:
        return None
    text_paths = {k: str(v) for k, v in resolve_text_encoder_paths(req.text_family, req.text_encoder_paths(),
                                                                    t5=not req.no_t5).items()}
    settings["text"] = {"family": req.text_family, "encoders": text_paths, "max_length": req.max_text_length,
                        "encoder_dtype": req.text_encoder_dtype, "captions_sha256": captions_digest(captions),
                        **({"t5": False} if req.no_t5 else {}), **caption_settings(req, captions)}
    return text_paths


def assign_buckets(paths: Sequence[Path], buckets: Sequence[Bucket]) -> np.ndarray:
    """Each image's bucket index (assign_bucket on its size, read from the file header); an unreadable image is
    one error naming it."""
    sizes = [image_size(p, "cannot read image", ImageFolderError, verify=False) for p in paths]
    return np.asarray([assign_bucket(w, h, buckets) for w, h in sizes], dtype=np.int64)


def skipped_note(plan: Plan) -> Optional[str]:
    """The one line naming the files under --images that are not images (None when there are none)."""
    if not plan.skipped:
        return None
    names = [p.relative_to(plan.root).as_posix() for p in plan.skipped]
    return (f"note: skipped {len(names)} file(s) under '{plan.root}' that are not images ({' '.join(IMAGE_EXTS)}) "
            f"or are hidden: {short_list(names)}")


def unfinished_images(plan: Plan) -> np.ndarray:
    """Indices of the images of every shard not finished yet (all of them unless a run resumes)."""
    ranges = [np.arange(*plan.shard_range(s)) for s in range(plan.num_shards) if not plan.shard_file(s).is_file()]
    return np.concatenate(ranges) if ranges else np.zeros(0, np.int64)


def unreadable_images_error(plan: Plan, bad: Sequence[tuple[int, str]], checked: int) -> ImageFolderError:
    """The error naming the images (index into plan.paths, reason) that do not decode, the first few with why."""
    named = [f"{plan.paths[i].relative_to(plan.root).as_posix()} ({why})" for i, why in bad]
    return ImageFolderError(f"{len(bad)} of {checked} image(s) under '{plan.root}' cannot be read (corrupt, truncated "
                            f"or not an image): {short_list(named, 3)}. Fix or remove them; nothing was encoded.")


def _digest(items: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def captions_digest(captions: Sequence[Sequence[str]]) -> str:
    """The digest of every image's captions (one caption each: of the captions themselves, as before several
    were allowed)."""
    if all(len(c) == 1 for c in captions):
        return _digest([c[0] for c in captions])
    return _digest([json.dumps(list(c)) for c in captions])


def caption_settings(req: PrecomputeRequest, captions: Sequence[Sequence[str]]) -> dict:
    """The caption settings beyond the captions themselves, each only when used (settings of plain runs stay as
    they were): sidecars, the trigger word, and a caption table (several captions for an image, or the empty
    prompt)."""
    out: dict = {}
    if req.caption_sidecars:
        out["caption_sidecars"] = True
    if req.trigger_word:
        out["trigger_word"] = req.trigger_word
    if req.empty_prompt or any(len(c) > 1 for c in captions):
        out["caption_table"] = True
        out["empty_prompt"] = bool(req.empty_prompt)
    return out


def plan_captions(req: PrecomputeRequest, root: Path, paths: list[Path], labels: np.ndarray,
                  class_names: Optional[list[str]]) -> list[list[str]]:
    """Every image's captions, from the first source that has any for it: its sidecar (--caption-sidecars), the
    manifest (--captions, by path relative to --images), the class template (--caption-from-class); each with
    --trigger-word in front. An image no source captions, or a manifest entry that is not an image, is an error."""
    rel = [p.relative_to(root).as_posix() for p in paths]
    table = _manifest_captions(req, root, rel)
    template = req.caption_from_class
    if template is not None and class_names is None:
        raise PrecomputeError(f"--caption-from-class needs class names, but the labels of '{root}' are class "
                              f"indices (integer labels); use class sub-folders or class-name labels, or caption "
                              f"every image with --captions")
    captions: list[Optional[list[str]]] = []
    sidecar_state: dict[str, str] = {}      # image -> "missing" | "empty": its sidecar gave no caption
    for path, r, y in zip(paths, rel, labels):
        found = read_sidecar(sidecar_of(path)) if req.caption_sidecars else None
        if req.caption_sidecars and not found:
            sidecar_state[r] = "missing" if found is None else "empty"
        if not found:
            found = table.get(r) or ([template.format(**{"class": class_names[y]})] if template is not None else None)
        captions.append(found)
    _check_captioned(req, rel, captions, sidecar_state)
    return [[with_trigger(c, req.trigger_word) for c in found] for found in captions]


def _manifest_captions(req: PrecomputeRequest, root: Path, rel: list[str]) -> dict[str, list[str]]:
    """--captions' captions by file ({} without one); entries naming no image under --images are one error
    naming their lines."""
    if not req.captions:
        return {}
    try:
        manifest = read_caption_manifest(req.captions)
    except ImageFolderError as err:
        raise PrecomputeError(str(err)) from None
    unknown = sorted(set(manifest.captions) - set(rel))
    if unknown:
        raise PrecomputeError(f"--captions '{req.captions}' names file(s) that are not images in '{root}': "
                              f"{short_list([f'{u} ({manifest.where[u]})' for u in unknown])} (names are relative "
                              f"to --images, e.g. '{rel[0]}')")
    return manifest.captions


def _check_captioned(req: PrecomputeRequest, rel: list[str], captions: list[Optional[list[str]]],
                     sidecar_state: dict[str, str]) -> None:
    """One error naming the images no source captions (with --caption-sidecars: their sidecars and why)."""
    missing = [r for r, c in zip(rel, captions) if c is None]
    if not missing:
        return
    advice = "Add them, or caption the rest from their class with --caption-from-class 'a photo of a {class}'."
    if not req.caption_sidecars:
        raise PrecomputeError(f"{len(missing)} of {len(rel)} image(s) have no caption in --captions "
                              f"'{req.captions}': {short_list(missing)}. {advice}")
    named = [f"{Path(r).with_suffix('.txt').as_posix()} ({sidecar_state[r]})" for r in missing]
    also = f" and --captions '{req.captions}' does not list them" if req.captions else ""
    raise PrecomputeError(f"{len(missing)} of {len(rel)} image(s) have no caption: their caption sidecars (the "
                          f"image's folder and stem, .txt, one caption per line) are missing or empty{also}: "
                          f"{short_list(named)}. {advice}")


def images_by_stem(folder: Path, flag: str, what: str) -> dict[str, Path]:
    """The images under `folder` by relative path without extension; two images for one stem are an error."""
    found: dict[str, Path] = {}
    for image in images_under(folder):
        key = image.relative_to(folder).with_suffix("").as_posix()
        if key in found:
            raise PrecomputeError(f"{flag} '{folder}' has two {what} for '{key}': '{found[key].name}' and "
                                  f"'{image.name}'; keep one")
        found[key] = image
    return found


def plan_masks(req: PrecomputeRequest, root: Path, paths: list[Path]) -> list[Path]:
    """Every image's loss mask: <--loss-masks>/<relative path, any image extension>."""
    mask_root = Path(req.loss_masks).expanduser().absolute()
    found = images_by_stem(mask_root, "--loss-masks", "masks")
    stems = [p.relative_to(root).with_suffix("").as_posix() for p in paths]
    missing = [s for s in stems if s not in found]
    if missing:
        raise PrecomputeError(f"--loss-masks '{mask_root}' has no mask for {len(missing)} of {len(stems)} image(s): "
                              f"{short_list(missing)} (expected e.g. '{mask_root / missing[0]}.png': the image's "
                              f"relative path and stem)")
    return [found[s] for s in stems]


def plan_references(req: PrecomputeRequest, root: Path, paths: list[Path]) -> list[Path]:
    """Every image's reference image (FLUX Kontext edit pairs): <--reference-images>/<relative path, any image
    extension>. Targets without a reference and references without a target are both errors naming them."""
    ref_root = Path(req.reference_images).expanduser().absolute()
    found = images_by_stem(ref_root, "--reference-images", "references")
    stems = [p.relative_to(root).with_suffix("").as_posix() for p in paths]
    missing, extra = [s for s in stems if s not in found], sorted(set(found) - set(stems))
    unmatched = []
    if missing:
        unmatched.append(f"no reference for {len(missing)} of {len(stems)} image(s): {short_list(missing)}")
    if extra:
        unmatched.append(f"{len(extra)} reference(s) with no image in '{root}': {short_list(extra)}")
    if unmatched:
        raise PrecomputeError(f"--reference-images '{ref_root}' does not pair up with --images: "
                              f"{'; '.join(unmatched)} (a reference has its target image's relative path and stem, "
                              f"any image extension)")
    return [found[s] for s in stems]


def settings_text(settings: dict) -> str:
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
    old = read_json(file, "", "the settings JSON an earlier run wrote", PrecomputeError,
                    f"The parts folder is damaged. {_delete_parts_advice(plan)}.")
    if settings_text(old) != settings_text(plan.settings):
        raise PrecomputeError(f"the unfinished run in '{plan.parts}' used other settings ({_diff(old, plan.settings)})."
                              f" {_delete_parts_advice(plan)}.")


def write_parts_settings(plan: Plan) -> None:
    """Record the settings in the parts folder (after check_parts_settings: they are the same or no shard exists)."""
    plan.parts.mkdir(parents=True, exist_ok=True)
    atomic_write_json(plan.parts / SETTINGS_FILE, plan.settings, fsync=True)


def read_shard(plan: Plan, shard: int, arrays: bool = True, inputs: Optional[bool] = None) -> Optional[dict]:
    """A finished shard's contents (None if not written yet); one from other settings or damaged raises. With
    `inputs` (default: not arrays, the question resuming asks) its inputs are hashed again (digest_inputs): a shard
    whose inputs changed since it was written (same names and settings, other bytes) is one note line and None,
    so it is encoded again."""
    file = plan.shard_file(shard)
    if not file.is_file():
        return None
    start, stop = plan.shard_range(shard)
    hint = "Delete it to encode that shard again."
    z = read_npz(file, "shard file", None if arrays else ("settings", "indices", DIGESTS), PrecomputeError, hint)
    lacking = [k for k in ("settings", "indices") if k not in z]
    if lacking:
        raise PrecomputeError(f"shard file '{file}' has no {lacking} array(s): it was not written by this program. "
                              f"{hint}")
    settings = parse_json(str(z["settings"]), f"shard file '{file}' settings", "the settings JSON", PrecomputeError,
                          hint)
    indices, content = z["indices"], z if arrays else {}
    if settings_text(settings) != settings_text(plan.settings):
        raise PrecomputeError(f"shard file '{file}' was written with other settings ({_diff(settings, plan.settings)})."
                              f" {_delete_parts_advice(plan)}.")
    if not np.array_equal(indices, np.arange(start, stop)):
        raise PrecomputeError(f"shard file '{file}' holds images {indices[:1].tolist()}..{indices[-1:].tolist()} but "
                              f"shard {shard} is images [{start}, {stop}). {_delete_parts_advice(plan)}.")
    if (not arrays if inputs is None else inputs) and _inputs_changed(plan, shard, z.get(DIGESTS)):
        return None
    return content


# ----------------------------------------------------------------------------- input digests

def input_files(plan: Plan, index: int) -> list[Path]:
    """The files sample `index` is made of: its image (a clip: its video file, or its frame folder's frames), and
    its loss mask and reference image when used."""
    path = plan.paths[index]
    files = frame_files(path) if plan.video and path.is_dir() else [path]
    files += [extra[index] for extra in (plan.mask_paths, plan.reference_paths) if extra is not None]
    return files


def input_digest(plan: Plan, index: int) -> bytes:
    """SHA-256 over the size and bytes of each of input_files(plan, index), in order; an unreadable file is a
    PrecomputeError naming it."""
    digest, buffer = hashlib.sha256(), bytearray(DIGEST_CHUNK)
    for file in input_files(plan, index):
        try:
            with open(file, "rb", buffering=0) as f:
                digest.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
                while n := f.readinto(buffer):
                    digest.update(memoryview(buffer)[:n])
        except OSError as err:
            raise PrecomputeError(f"cannot read '{file}' ({err.strerror or err}); make it readable or remove it") \
                from None
    return digest.digest()


def digest_inputs(plan: Plan, indices: Sequence[int], pool: Optional[Executor] = None) -> np.ndarray:
    """uint8 (len(indices), 32): each sample's input_digest, read by `pool` (default: --workers threads of its
    own; 0: this thread). A shard stores its samples' (DIGESTS) when written; resuming compares them."""
    own = ThreadPoolExecutor(plan.request.workers) if pool is None and plan.request.workers else None
    with own or nullcontext():
        threads = pool or own
        rows = list(threads.map(lambda i: input_digest(plan, int(i)), indices)) if threads else \
            [input_digest(plan, int(i)) for i in indices]
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1)


def _inputs_changed(plan: Plan, shard: int, stored: Optional[np.ndarray]) -> bool:
    """Whether a finished shard's inputs differ from those it was encoded from (or it records none: written by an
    older version); if so, one note line naming how many and the first few."""
    start, stop = plan.shard_range(shard)
    now = digest_inputs(plan, range(start, stop))
    if stored is not None and stored.shape == now.shape and np.array_equal(stored, now):
        return False
    if stored is None or stored.shape != now.shape:
        why = "it records no digests of its inputs (written by an older version)"
    else:
        changed = start + np.flatnonzero((stored != now).any(axis=1))
        names = [plan.paths[i].relative_to(plan.root).as_posix() for i in changed]
        why = f"{len(changed)} of {stop - start} input(s) changed since it was encoded ({short_list(names, 3)})"
    print(f"note: shard {shard} in '{plan.parts}': {why}; encoding it again", flush=True)
    return True
