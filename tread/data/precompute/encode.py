"""Encoding for precomputing latents (tread/data/precompute/run.py, scripts/precompute_latents.py): images (and
their loss masks) read and center-cropped in batches, encoded by the VAE (and captions by the text encoders) one
shard at a time into the parts folder (tread/data/precompute/plan.py), and the finished shards merged, in image
order, into one latent dataset."""
from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from tread.encoders.text import default_max_length, encode_prompts
from tread.encoders.text_families import family_slots
from tread.encoders.patch import PatchEncoder
from tread.encoders.image_vaes import encode_model_space, image_posterior, image_vae_info
from tread.encoders.vae import encode, to_model_space
from tread.utils.io import atomic_write
from tread.utils.readers import parse_json, read_image, read_npz

from tread.data.bucketed import BucketedWriter
from tread.data.buckets import fit_crop, mirrored_crop
from tread.data.images import ImageFolderError, short_list
from tread.data.meta import CAPTION_KEYS, EXTRA_KEYS
from tread.data.repa_features import image_features
from tread.data.writer import LatentDatasetWriter

from .plan import DIGESTS, Plan, digest_inputs, read_shard, settings_text
from .request import PrecomputeError
from .video import load_clip, video_dataset_meta, video_meta


@dataclass
class TextEncoder:
    """Captions -> encode_prompts arrays with the loaded family encoders."""
    family: str
    encoders: Any
    max_length: Optional[int]
    device: Any
    dtype: Any

    def __call__(self, captions: list[str]) -> dict[str, np.ndarray]:
        return encode_prompts(self.family, self.encoders, captions, max_length=self.max_length, device=self.device,
                              dtype=self.dtype)


@dataclass
class Encoder:
    """Images -> the values --kind stores (the VAE's posterior moments, or one seeded draw; with `info`, a model-space
    image VAE's (tread/encoders/image_vaes.py) posterior mean or one draw, normalised); captions: `text`."""
    vae: Any
    kind: str
    seed: int
    shift: float
    text: Optional[TextEncoder] = None
    repa: Optional[PatchEncoder] = None   # --repa-encoder: its features of each image are stored too
    repa_meta: Optional[dict] = None      # their meta "repa_features" but the grid (encoder, digest, dim, ...)
    image: None = None                    # image embeddings of first frames: clips only (VideoEncoder.image)
    info: Optional[dict] = None           # a model-space image VAE's image_vae_info; None: AutoencoderKL

    def __call__(self, images: np.ndarray, sample_indices: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) -> stored values: raw (mean, logvar) for moments; raw draw - shift for sample; model
        space (mean or draw) with `info`.

        Draws use one numpy generator per dataset sample (seeded by [--seed, sample index]), so they do not
        depend on batching, device or the number of processes."""
        if self.info is not None:
            mean, std = image_posterior(self.vae, images)
            draw = mean if self.kind == "mean" else mean + std * self._eps(sample_indices, mean)
            return to_model_space(draw, self.info).cpu().numpy()
        moments = encode(self.vae, images, kind="moments")
        if self.kind == "moments":
            return moments.cpu().numpy()
        mean, logvar = moments.chunk(2, dim=1)
        return (mean + torch.exp(0.5 * logvar) * self._eps(sample_indices, mean) - self.shift).cpu().numpy()

    def _eps(self, sample_indices: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        eps = np.stack([np.random.default_rng([self.seed, int(i)]).standard_normal(like.shape[1:], np.float32)
                        for i in sample_indices])
        return torch.from_numpy(eps).to(like.device)

    def reference(self, images: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) reference images -> stored reference latents: the posterior mean - shift, as
        FluxKontextPipeline encodes its image (sample_mode "argmax"), whatever --kind the targets use; with `info`
        the posterior mean in model space (Flux2Pipeline's _encode_vae_image)."""
        if self.info is not None:
            return encode_model_space(self.vae, images, self.info).cpu().numpy()
        mean, _ = encode(self.vae, images, kind="moments").chunk(2, dim=1)
        return (mean - self.shift).cpu().numpy()


def load_item(plan: Plan, index: int, masks: bool) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
    """Image `index` resized and cropped to its target (plan.target: its bucket, or the --resolution square, where
    fit_crop is ADM's center crop), with masks=True its loss mask cropped alike (grayscale, 255 = in), and the
    crop record: (uint8 (h, w, 3), uint8 (h, w) or None, int32 (6,)). A clip (--videos): its frames (uint8 (F, h, w,
    3)), None, its frames' crop record."""
    target, path = plan.target(index), plan.paths[index]
    if plan.video:
        clip, crop = load_clip(path, target, plan.request.frame_stride)
        return clip, None, crop
    pil = read_image(path, "cannot read image", error=ImageFolderError)
    image, crop = fit_crop(pil, target)
    if not masks:
        return image, None, crop
    mask_path = plan.mask_paths[index]
    m = read_image(mask_path, "cannot read loss mask", mode="L", error=PrecomputeError)
    if m.size != pil.size:
        raise PrecomputeError(f"loss mask '{mask_path}' is {m.size[0]}x{m.size[1]} but its image "
                              f"'{path}' is {pil.size[0]}x{pil.size[1]}; a mask must have its image's size")
    # The RGB copy of the gray mask goes through the very same crop; every channel equals the gray one.
    return image, np.ascontiguousarray(fit_crop(m, target)[0][..., 0]), crop


def iter_images(plan: Plan, start: int, stop: int, batch_size: int, pool: Optional[ThreadPoolExecutor],
                masks: bool = False):
    """(global indices, uint8 (B, h, w, 3) images, uint8 (B, h, w) loss masks or None, int32 (B, 6) crop records)
    batches of images [start, stop) (one shard: one image size), in order, each cropped by load_item. With a
    thread pool the next batches are read while the caller encodes the current one."""
    load = lambda i: load_item(plan, i, masks)  # noqa: E731

    def batch(idx, items):
        images, mask, crops = zip(*items)
        return idx, np.stack(images), np.stack(mask) if masks else None, np.stack(crops)

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
    digests = digest_inputs(plan, range(start, stop), pool)     # of the bytes about to be encoded
    lat, flipped, masks, text, refs, crops = _encode_images(plan, start, stop, encoder, pool, progress)
    store = np.dtype(plan.settings["dtype"])
    f16 = " (float16 overflows above 65504: try --dtype float32)" if store == np.float16 else ""
    vae_advice = " (try --vae-dtype float32)" if plan.settings["vae_dtype"] != "float32" else ""
    arrays = {"latents": np.concatenate(lat)}
    if flipped:
        arrays["flipped"] = np.concatenate(flipped)
    arrays.update({key: np.concatenate(values) for key, values in refs.items()})   # reference[, flipped_reference]
    for key, value in arrays.items():
        ref, repa = "reference" in key or key == "first_frame", "repa_features" in key or key == "image_embeds"
        what = "image embeddings" if key == "image_embeds" else "REPA features" if repa else \
            "reference latents" if ref else "latents"
        arrays[key] = _cast_stored(value, store, plan, start, what, "the references of " if ref else "", f16 + ("" if repa else
                                                                                               vae_advice))
    if masks:
        arrays["loss_mask"] = np.concatenate(masks).astype(np.uint8)
    if plan.buckets is not None:
        arrays["crops"] = np.concatenate(crops)
    # text (B, L, D), [text_mask (B, L) bool], [pooled (B, P)], [llama (B, n, L, Dl)]: already in the stored dtype
    arrays.update({key: np.concatenate(values) for key, values in text.items()})
    if shard == 0 and plan.caption_table and plan.settings["text"]["empty_prompt"]:   # encoded once, with shard 0
        arrays.update({f"empty_{key}": value for key, value in _encode_empty_prompt(plan, encoder.text).items()})
    if encoder.repa_meta is not None:
        arrays["repa_meta"] = np.array(json.dumps(encoder.repa_meta, sort_keys=True))
    arrays.update(labels=plan.labels[start:stop].astype(np.int64), indices=np.arange(start, stop, dtype=np.int64),
                  settings=np.array(settings_text(plan.settings)), **{DIGESTS: digests})
    atomic_write(plan.shard_file(shard), lambda f: np.savez(f, **arrays), fsync=True)


def _encode_images(plan: Plan, start: int, stop: int, encoder: Encoder, pool: Optional[ThreadPoolExecutor],
                   progress=None) -> tuple[list, list, list, dict[str, list], dict[str, list], list]:
    """Images [start, stop) encoded batch by batch: (latents, latents of the flipped copies, loss masks,
    {text key: arrays}, {"reference", "flipped_reference": reference latents; "first_frame": a clip's first frame},
    crop records), each a list of per-batch arrays (empty lists / dicts where not stored)."""
    n, with_masks = plan.num_images, plan.mask_paths is not None
    lat, flipped, masks, text, refs, crops = [], [], [], {}, {}, []
    for idx, images, mask, crop in iter_images(plan, start, stop, plan.request.batch_size, pool, masks=with_masks):
        crops.append(crop)
        lat.append(_finite(encoder(images, idx), plan, idx, ""))
        if plan.settings["flip"]:
            flipped.append(_finite(encoder(np.ascontiguousarray(images[:, :, ::-1]), idx + n), plan, idx, "flipped "))
        if with_masks:
            masks.append(mask)
        if plan.reference_paths is not None:
            for key, value in _encode_references(plan, idx, encoder, pool).items():
                refs.setdefault(key, []).append(value)
        if plan.video and plan.settings["video"]["first_frame"]:   # each clip's first frame encoded alone
            refs.setdefault("first_frame", []).append(_finite(encoder.first_frame(images), plan, idx, "first frame "))
        if encoder.image is not None:   # --image-encoder: the first frame's image embeddings (HunyuanVideo 1.5 I2V)
            refs.setdefault("image_embeds", []).append(_finite(encoder.image(images[:, 0]), plan, idx,
                                                               "first-frame image embeddings of "))
        if encoder.repa is not None:  # the REPA encoder's features of the images (and of the flipped images)
            for key, value in _repa_features(plan, encoder.repa, images).items():
                refs.setdefault(key, []).append(value)
        if encoder.text is not None:  # each caption once: flipped copies reuse them
            for key, value in _encode_captions(plan, encoder.text, idx).items():
                text.setdefault(key, []).append(value)
        if progress is not None:
            progress.update(len(idx))
    return lat, flipped, masks, text, refs, crops


def _encode_captions(plan: Plan, text: TextEncoder, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Every caption of images `idx`, each encoded once, in order (all of the first image's, then the next's: one
    row per caption), at most --batch-size captions per text encoder call, as stored (_stored_text)."""
    captions = [c for i in idx for c in plan.captions[i]]
    rows = np.repeat(idx, [len(plan.captions[i]) for i in idx])      # the image of each row
    size = plan.request.batch_size
    parts = [text(captions[a:a + size]) for a in range(0, len(captions), size)]
    return {key: _stored_text(plan, key, np.concatenate([part[key] for part in parts]), rows) for key in parts[0]}


def _encode_empty_prompt(plan: Plan, text: TextEncoder) -> dict[str, np.ndarray]:
    """The empty prompt "" encoded like the captions (one row per text part), as stored."""
    return {key: _stored_text(plan, key, value, np.zeros(1, np.int64)) for key, value in text([""]).items()}


def read_empty_prompt(plan: Plan) -> Optional[dict[str, np.ndarray]]:
    """The encoded empty prompt shard 0 holds ({text part: (1, ...)}), None unless --empty-prompt."""
    if not (plan.caption_table and plan.settings["text"]["empty_prompt"]):
        return None
    read_shard(plan, 0, arrays=False, inputs=False)  # its settings checked
    names = [f"empty_{key}" for key in CAPTION_KEYS]
    z = read_npz(plan.shard_file(0), "shard file", names, PrecomputeError, "Delete it to encode that shard again.")
    return {key[len("empty_"):]: value for key, value in z.items()}


def _stored_text(plan: Plan, key: str, value: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """One batch's text array (`rows`: the image of each row, for errors) as stored: embeddings cast to --dtype
    at once, so a shard never holds float32 copies (HiDream's Llama states are 32 layers x L x 4096 per caption);
    masks as they are."""
    if key in ("text_mask", "glyph_mask"):
        return value
    store = np.dtype(plan.settings["dtype"])
    advice = (" (float16 overflows above 65504: try --dtype float32)" if store == np.float16 else "") + \
        (" (try --text-encoder-dtype float32)" if plan.settings["text"]["encoder_dtype"] != "float32" else "")
    return _cast_stored(value, store, plan, rows, f"{key} embeddings", "the captions of ", advice)


def _encode_references(plan: Plan, idx: np.ndarray, encoder: Encoder, pool: Optional[ThreadPoolExecutor]
                       ) -> dict[str, np.ndarray]:
    """The reference images of images `idx`, cropped to their targets like them and encoded (Encoder.reference):
    {"reference": (B, C, h, w)} and, with --flip, "flipped_reference" (the mirrored references)."""
    def load(i: int) -> np.ndarray:
        return fit_crop(read_image(plan.reference_paths[i], "cannot read image", error=ImageFolderError),
                        plan.target(i))[0]

    images = np.stack(list(pool.map(load, idx)) if pool is not None else [load(i) for i in idx])
    out = {"reference": _finite(encoder.reference(images), plan, idx, "reference ", plan.reference_paths)}
    if plan.settings["flip"]:
        mirrored = encoder.reference(np.ascontiguousarray(images[:, :, ::-1]))
        out["flipped_reference"] = _finite(mirrored, plan, idx, "flipped reference ", plan.reference_paths)
    return out


def _repa_features(plan: Plan, encoder: PatchEncoder, images: np.ndarray) -> dict[str, np.ndarray]:
    """{"repa_features": the encoder's features (B, dim, h, w) of uint8 images (B, H, W, 3)} and, with --flip,
    "flipped_repa_features" (of the mirrored images: a flipped copy aligns with its own image's features)."""
    out = {"repa_features": image_features(encoder, images)}
    if plan.settings["flip"]:
        out["flipped_repa_features"] = image_features(encoder, images[:, :, ::-1])
    return out


def repa_meta(plan: Plan, shards: list[int], first: dict) -> Optional[dict]:
    """meta "repa_features" of the stored features (None without them): the encoder every shard records, the grid
    of the first's features; shards encoded by other weights of the same name (a resumed run) are refused."""
    if "repa_features" not in first:
        return None
    metas = {s: str(read_npz(plan.shard_file(s), "shard file", ("repa_meta",), PrecomputeError)["repa_meta"])
             for s in shards}
    if len(set(metas.values())) > 1:
        raise PrecomputeError(f"the shards in '{plan.parts}' hold the features of different REPA encoders (other "
                              f"weights under one name); delete '{plan.parts}' to encode them all again")
    meta = parse_json(metas[shards[0]], "shard file repa_meta", "the encoder's JSON", PrecomputeError)
    return {**meta, "grid": list(first["repa_features"].shape[-2:])}


def _finite(values: np.ndarray, plan: Plan, idx: np.ndarray, which: str,
            paths: Optional[list[Path]] = None) -> np.ndarray:
    """The VAE's values for images `idx` (--kind's moments or draws) of `paths` (default: the images),
    refused when any is NaN/inf."""
    bad = np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))
    if len(bad):
        files = short_list([str((paths or plan.paths)[int(idx[i])]) for i in bad], 3)
        advice = " (try --vae-dtype float32)" if plan.settings["vae_dtype"] != "float32" else \
            " (check the VAE weights, or leave those images out)"
        raise PrecomputeError(f"the VAE '{plan.settings['vae']}' gave non-finite latents (NaN/inf) for {len(bad)} "
                              f"{which}image(s): {files}{advice}")
    return values


def _cast_stored(value: np.ndarray, store: np.dtype, plan: Plan, start: Any, what: str, whose: str,
                 advice: str) -> np.ndarray:
    """`value` (one row per image of the shard from `start`, or per entry of the image index array `start`) cast
    to the storage dtype; NaN/inf (float16 overflow included) is an error naming the first images."""
    with np.errstate(over="ignore"):
        out = value.astype(store)
    bad = np.flatnonzero(~np.isfinite(out).reshape(len(value), -1).all(axis=1))
    if len(bad):
        images = np.arange(start, start + len(value)) if isinstance(start, (int, np.integer)) else start
        files = [str(plan.paths[int(images[i])]) for i in bad[:3]]
        raise PrecomputeError(f"non-finite {what} (NaN/inf) after casting to {store} for {whose}{len(bad)} image(s), "
                              f"e.g. {files}" + advice)
    return out


def merge_shards(plan: Plan, meta: dict, vae_factor: int = 1, vae: Any = None) -> Path:
    """Stream every shard, in image order, into the final dataset (LatentDatasetWriter: atomic, memory-mapped);
    with buckets, one latent dataset per bucket inside a bucketed dataset (BucketedWriter: atomic too)."""
    missing = [s for s in range(plan.num_shards) if not plan.shard_file(s).is_file()]
    if missing:
        raise PrecomputeError(f"shard(s) {missing[:10]} are missing from '{plan.parts}' after all processes finished; "
                              f"rerun the same command to encode them")
    empty = read_empty_prompt(plan)
    if plan.buckets is None:
        _merge(plan, plan.out, list(range(plan.num_shards)), meta, empty, vae)
        return plan.out
    by_bucket: dict[int, list[int]] = {}
    for shard in range(plan.num_shards):
        by_bucket.setdefault(int(plan.image_bucket[plan.shard_range(shard)[0]]), []).append(shard)
    with BucketedWriter(plan.out, vae_factor, plan.request.bucket_stride,
                        source=meta["source"], flip=plan.settings["flip"]) as writer:
        for b, shards in sorted(by_bucket.items()):
            bucket = plan.buckets[b]
            crops = _merge(plan, writer.bucket_dir(bucket), shards, meta, empty, vae)
            writer.add(bucket, np.concatenate([crops, mirrored_crop(crops, bucket)]) if plan.settings["flip"]
                       else crops)
    return plan.out


def _merge(plan: Plan, out: Path, shards: list[int], meta: dict, empty: Optional[dict] = None, vae: Any = None
           ) -> Optional[np.ndarray]:
    """The consecutive `shards` as one latent dataset at `out` (flipped copies after the originals; with a caption
    table, the flipped copies' caption rows after the originals' too, then `empty`, the empty prompt's row);
    returns their crop records (with buckets), in order. Clips: meta "video" from `vae` and the shards' frames."""
    n, flip = sum(stop - start for start, stop in map(plan.shard_range, shards)), plan.settings["flip"]
    first, base = read_shard(plan, shards[0]), plan.shard_range(shards[0])[0]
    keys = [k for k in EXTRA_KEYS if k in first]
    shapes = {k: first[k].shape[1:] for k in keys}
    counts = np.array([len(plan.captions[i]) for s in shards for i in range(*plan.shard_range(s))], np.int64) \
        if plan.caption_table else None
    crops, rows = [], 0          # rows: the caption rows of the shards written so far (a caption table)
    with LatentDatasetWriter(out, shape=first["latents"].shape[1:], num_samples=n * (2 if flip else 1),
                             num_classes=plan.num_classes, class_names=plan.class_names,
                             dtype=plan.settings["dtype"], text_shape=shapes.get("text"),
                             text_mask="text_mask" in shapes, pooled_dim=shapes["pooled"][0] if "pooled" in shapes
                             else None, llama_shape=shapes.get("llama"), glyph_shape=shapes.get("glyph"),
                             loss_mask_shape=shapes.get("loss_mask"), image_embeds_shape=shapes.get("image_embeds"),
                             reference_latents="reference" in shapes, empty_prompt=empty is not None,
                             first_frame_latents="first_frame" in shapes,
                             video=video_meta(plan, vae, plan.target(plan.shard_range(shards[0])[0]).frames)
                             if plan.video else None,
                             caption_counts=None if counts is None else np.tile(counts, 2 if flip else 1),
                             repa_features=repa_meta(plan, shards, first), **meta) as writer:
        for shard in shards:
            z = first if shard == shards[0] else read_shard(plan, shard)
            start = plan.shard_range(shard)[0] - base
            extras = {k: z[k] for k in keys}
            text = {k: extras.pop(k) for k in CAPTION_KEYS if k in extras} if counts is not None else {}
            writer.write(start, z["latents"], z["labels"], extras or None)
            if text:
                writer.write_captions(rows, text)
            if flip:  # the mirror image keeps its captions; its mask and reference are mirrored too
                if "loss_mask" in extras:
                    extras["loss_mask"] = extras["loss_mask"][:, :, ::-1]
                for key in ("reference", "repa_features"):
                    if key in extras:
                        extras[key] = z[f"flipped_{key}"]
                writer.write(n + start, z["flipped"], z["labels"], extras or None)
                if text:
                    writer.write_captions(int(counts.sum()) + rows, text)
            rows += len(next(iter(text.values()))) if text else 0
            if "crops" in z:
                crops.append(z["crops"])
            first = None
        if empty is not None:
            writer.write_captions(writer.empty_row, empty)
    return np.concatenate(crops) if crops else None


def dataset_meta(plan: Plan, vae) -> dict:
    """LatentDatasetWriter keyword arguments describing the VAE, the images (clips: video_dataset_meta) and the
    settings."""
    meta = video_dataset_meta(plan, vae) if plan.video else _image_meta(plan, vae)
    s = plan.settings
    if "text" in s:
        t, req = s["text"], plan.request
        length = t["max_length"] or default_max_length(t["family"], req.text_encoder_paths())
        meta["conditioning_meta"] = {"text": {
            "family": t["family"], "encoders": [t["encoders"][slot.model]
                                                for slot in family_slots(t["family"], t.get("t5", True))],
            "max_length": length, "encoder_dtype": t["encoder_dtype"], **({} if t.get("t5", True) else {"t5": False})}}
        meta["extra_meta"].update(
            captions_file=None if req.captions is None else str(Path(req.captions).expanduser().absolute()),
            caption_from_class=req.caption_from_class, captions_sha256=t["captions_sha256"],
            **{k: t[k] for k in ("caption_sidecars", "trigger_word") if k in t})   # only when used
    if "loss_masks" in s:
        meta["extra_meta"]["loss_masks_dir"] = s["loss_masks"]["dir"]
    if "reference_images" in s:
        meta["extra_meta"]["reference_images_dir"] = s["reference_images"]["dir"]
    return meta


def _image_meta(plan: Plan, vae) -> dict:
    """dataset_meta's VAE and image part: AutoencoderKL data is scaled when drawn (latent_scale, decode shift_factor);
    a model-space image VAE's data is stored normalised (latent_scale 1, decode its image_vae_info)."""
    s = plan.settings
    size = f"{s['resolution']}px" if "buckets" not in s else f"{len(s['buckets']['sizes'])} bucket sizes"
    source = (f"scripts/precompute_latents.py: {s['num_images']} images from {plan.root}"
              f"{' (+ horizontal flips)' if s['flip'] else ''} at {size}, VAE {s['vae']}")
    where = {"vae": s["vae"], "subfolder": s["vae_subfolder"]}
    if "vae_class" in s:
        scale, kind = 1.0, "sample"
        decode = {**image_vae_info(vae), **where}
        encoding = {"encoding": f"{'posterior mean' if s['kind'] == 'mean' else 'one posterior draw'}, model space"}
    else:
        scale, kind, encoding = float(vae.config.scaling_factor), s["kind"], {}
        shift = vae.config.get("shift_factor", None)
        decode = {"type": "vae", **where, "scaling_factor": scale,
                  "shift_factor": None if shift is None else float(shift)}
    return {"latent_scale": scale, "source": source, "decode": decode,
            "extra_meta": {**encoding, "latent_kind": kind,
                           "image_resolution": None if "buckets" in s else s["resolution"], "flip": s["flip"],
                           "num_source_images": s["num_images"], "encode_vae_dtype": s["vae_dtype"], "seed": s["seed"],
                           "labels_file": None if plan.request.labels is None
                           else str(Path(plan.request.labels).expanduser().absolute()),
                           "images_sha256": s["images_sha256"]}}
