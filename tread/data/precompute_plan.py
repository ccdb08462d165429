"""The bookkeeping of precomputing latents (tread/data/precompute_run.py, scripts/precompute_latents.py): the plan
every process agrees on before any work (images, labels, captions, loss masks, shards, the settings finished
shards must match) and the parts folder of finished shards that lets an interrupted run resume."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from tread.encoders.text import resolve_text_encoder_paths
from tread.utils.io import atomic_write_json
from tread.utils.readers import parse_json, read_json, read_npz

from .captions import read_captions_file
from .images import IMAGE_EXTS, ImageFolderError, images_under, list_image_folder, short_list
from .precompute_request import PrecomputeError, PrecomputeRequest

SETTINGS_FILE = "settings.json"
PARTS_VERSION = 1


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
    captions: Optional[list[str]] = field(default=None, repr=False)    # per image, with --text-family
    mask_paths: Optional[list[Path]] = field(default=None, repr=False)  # per image, with --loss-masks
    text_paths: Optional[dict[str, str]] = None                         # resolved encoder / tokenizer folders
    skipped: list[Path] = field(default_factory=list, repr=False)       # files under root that are not images
    reference_paths: Optional[list[Path]] = field(default=None, repr=False)  # per image, --reference-images

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


def make_plan(req: PrecomputeRequest) -> Plan:
    """List the images (after check_request) and fix the settings that finished shards must match."""
    root = Path(req.images).expanduser().absolute()
    out = Path(req.out).expanduser().absolute()
    skipped: list[Path] = []
    paths, labels, class_names = list_image_folder(root, req.labels, skipped)
    num_classes = len(class_names) if class_names is not None else int(labels.max()) + 1
    captions = plan_captions(req, root, paths, labels, class_names) if req.text_family else None
    mask_paths = plan_masks(req, root, paths) if req.loss_masks else None
    reference_paths = plan_references(req, root, paths) if req.reference_images else None
    if req.max_images is not None and req.max_images < len(paths):
        # a fixed random subset (sorted): folders are stored class by class, so the first N would be one class
        keep = np.sort(np.random.default_rng(req.seed).choice(len(paths), size=req.max_images, replace=False))
        paths, labels = [paths[i] for i in keep], labels[keep]
        captions = None if captions is None else [captions[i] for i in keep]
        mask_paths = None if mask_paths is None else [mask_paths[i] for i in keep]
        reference_paths = None if reference_paths is None else [reference_paths[i] for i in keep]
    digest = hashlib.sha256()
    for p, y in zip(paths, labels):
        digest.update(f"{p.relative_to(root).as_posix()}\t{y}\n".encode())
    vae_path = Path(req.vae).expanduser()
    settings = {
        "parts_version": PARTS_VERSION, "images": str(root), "num_images": len(paths),
        "images_sha256": digest.hexdigest(), "resolution": req.resolution,
        "vae": str(vae_path.absolute()) if vae_path.is_dir() else req.vae, "vae_subfolder": req.vae_subfolder,
        "vae_dtype": req.vae_dtype, "kind": req.kind, "flip": bool(req.flip), "dtype": req.dtype,
        "shard_size": req.shard_size, "seed": req.seed, "max_images": req.max_images,
    }
    text_paths = None
    if captions is not None:  # only with these options: settings of plain runs stay as they were
        text_paths = {k: str(v) for k, v in resolve_text_encoder_paths(req.text_family, req.text_encoder_paths(),
                                                                        t5=not req.no_t5).items()}
        settings["text"] = {"family": req.text_family, "encoders": text_paths, "max_length": req.max_text_length,
                            "encoder_dtype": req.text_encoder_dtype, "captions_sha256": _digest(captions)}
        if req.no_t5:  # only then: settings of runs with T5 stay as they were
            settings["text"]["t5"] = False
    if mask_paths is not None:
        settings["loss_masks"] = {"dir": str(Path(req.loss_masks).expanduser().absolute()),
                                  "sha256": _digest([p.as_posix() for p in mask_paths])}
    if reference_paths is not None:
        settings["reference_images"] = {"dir": str(Path(req.reference_images).expanduser().absolute()),
                                        "sha256": _digest([p.as_posix() for p in reference_paths])}
    return Plan(root, out, parts_dir_of(out), paths, labels, class_names, num_classes, settings, req.shard_size,
                req, captions, mask_paths, text_paths, skipped, reference_paths=reference_paths)


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


def plan_captions(req: PrecomputeRequest, root: Path, paths: list[Path], labels: np.ndarray,
                  class_names: Optional[list[str]]) -> list[str]:
    """Every image's caption: from --captions (by path relative to --images), else --caption-from-class."""
    try:
        table = read_captions_file(req.captions) if req.captions else {}
    except ImageFolderError as err:
        raise PrecomputeError(str(err)) from None
    rel = [p.relative_to(root).as_posix() for p in paths]
    unknown = sorted(set(table) - set(rel))
    if unknown:
        raise PrecomputeError(f"--captions '{req.captions}' names file(s) that are not images in '{root}': "
                              f"{short_list(unknown)} (names are relative to --images, e.g. "
                              f"'{rel[0]}')")
    template = req.caption_from_class
    if template is not None and class_names is None:
        raise PrecomputeError(f"--caption-from-class needs class names, but the labels of '{root}' are class "
                              f"indices (integer labels); use class sub-folders or class-name labels, or caption "
                              f"every image with --captions")
    captions = [table.get(r) if r in table or template is None else template.format(**{"class": class_names[y]})
                for r, y in zip(rel, labels)]
    missing = [r for r, c in zip(rel, captions) if c is None]
    if missing:
        raise PrecomputeError(f"{len(missing)} of {len(rel)} image(s) have no caption in --captions "
                              f"'{req.captions}': {short_list(missing)}. Add them, or caption the rest from their "
                              f"class with --caption-from-class 'a photo of a {{class}}'.")
    return captions


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


def read_shard(plan: Plan, shard: int, arrays: bool = True) -> Optional[dict]:
    """A finished shard's contents (None if not written yet); one from other settings or damaged raises."""
    file = plan.shard_file(shard)
    if not file.is_file():
        return None
    start, stop = plan.shard_range(shard)
    hint = "Delete it to encode that shard again."
    z = read_npz(file, "shard file", None if arrays else ("settings", "indices"), PrecomputeError, hint)
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
    return content
