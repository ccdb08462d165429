"""The on-disk latent dataset format: a directory with meta.json, latents.npy and labels.npy.

    meta.json    {"format": "tread-latents", "version": 1, "shape": [C, H, W], "dtype": "float16"|"float32",
                  "num_samples": N, "num_classes": K, "latent_scale": s, "decode": {"type": "identity"} or
                  {"type": "vae", "vae": "<hub id or path>", "subfolder": null|"vae", "scaling_factor": s,
                   "shift_factor": null|f}, "source": "...", "class_names": [...] | null,
                  "files": {"latents": "latents.npy", "labels": "labels.npy"},
                  "latent_kind": "sample" | "moments"   (optional, default "sample"), ...extra keys}
    latents.npy  (N, C, H, W) of `dtype`; model-space latents are stored values * latent_scale.
                 latent_kind "moments": (N, 2C, H, W) VAE posterior moments (mean, logvar) in raw VAE
                 units; every read draws one latent, mean + exp(logvar / 2) * eps, then shifts and scales it.
    labels.npy   (N,) int64 in [0, K)

VAE data: model space = (raw VAE latent - shift_factor) * latent_scale, so "sample" data stores
raw - shift_factor (shift_factor is null/0 for SD-VAE); decode.scaling_factor records the VAE config's
value (normally equal to latent_scale; decoding uses latent_scale). scripts/precompute_latents.py writes
such datasets from image folders, with extra keys "image_resolution", "flip", "num_source_images".

Optional per-sample conditioning and loss masks (text-to-image families, masked-loss training): each file
is listed in meta.json "files" under its key and described by a meta key; the file and its description
come together (one without the other is an error). Data without them is class-conditional as above.

    files.text_embeds    text_embeds.npy    (N, L, D) float16|float32: sequence text embeddings, model-ready
                                            (as the family's pipeline produces them: data/text.py)
    files.text_mask      text_mask.npy      (N, L) bool: their attention mask (True = real token)
    files.pooled_embeds  pooled_embeds.npy  (N, P) float16|float32: pooled text embeddings
    files.loss_mask      loss_mask.npy      (N, Hm, Wm) uint8: coverage 0..255 (255 = fully inside) at any
                                            resolution (image or latent); read as float (uint8 / 255)
    meta "conditioning"  {"text": {"seq_len": L, "dim": D, "mask": true|false, ...free keys, e.g. "family",
                          "encoders", "max_length"}, "pooled": {"dim": P, ...}}   (each part optional)
    meta "loss_mask"     {"shape": [Hm, Wm]}

LatentDataset items are (x, y) without such files and (x, y, extras) with them: extras is a dict with the
keys present among "text" float32 (L, D), "text_mask" bool (L,), "pooled" float32 (P,), "loss_mask" float32
(1, Hm, Wm) in [0, 1] (batched by __getitems__: a leading B). token_keep_mask / resize_loss_mask bring a
loss mask to the token grid / latent resolution.

Latents are memory-mapped, so random access never loads the whole array into RAM.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

FORMAT, VERSION = "tread-latents", 1
DTYPES = ("float16", "float32")
DECODE_TYPES = ("identity", "vae")
LATENT_KINDS = ("sample", "moments")
DEFAULT_FILES = {"latents": "latents.npy", "labels": "labels.npy"}
# Optional per-sample files: meta "files" key -> default file name.
EXTRA_FILES = {"text_embeds": "text_embeds.npy", "text_mask": "text_mask.npy", "pooled_embeds": "pooled_embeds.npy",
               "loss_mask": "loss_mask.npy"}
# Keys of an extras dict (writer input, reader output), in this order, and the files holding them.
EXTRA_KEYS = ("text", "text_mask", "pooled", "loss_mask")
EXTRA_FILE_OF = {"text": "text_embeds", "text_mask": "text_mask", "pooled": "pooled_embeds", "loss_mask": "loss_mask"}
# Top-level meta.json keys and the JSON types they must have (checked in detail in read_meta).
META_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "version": (int,), "shape": (list,), "dtype": (str,), "num_samples": (int,),
    "num_classes": (int,), "latent_scale": (int, float), "decode": (dict,), "source": (str,),
    "class_names": (list, type(None)), "files": (dict,),
}
REBUILD = "Rebuild the dataset (e.g. with data.write_latent_dataset)."
FIX_META = "Fix meta.json or rebuild the dataset (e.g. with data.write_latent_dataset)."
PathLike = Union[str, os.PathLike]


class LatentDatasetError(ValueError):
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
    if len(shape) != 3 or not all(_is_type(s, (int,)) and s > 0 for s in shape):
        raise fail("shape", "[C, H, W] with three positive integers")
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
    files = meta["files"]
    if not set(DEFAULT_FILES) <= set(files) <= set(DEFAULT_FILES) | set(EXTRA_FILES) or \
            not all(isinstance(f, str) and f for f in files.values()):
        raise fail("files", f"an object with file names for {sorted(DEFAULT_FILES)} and optionally any of "
                            f"{sorted(EXTRA_FILES)}")
    _validate_conditioning(meta, where, advice)
    return meta


def _pos_int(v: Any) -> bool:
    return _is_type(v, (int,)) and v > 0


def _validate_conditioning(meta: dict, where: str, advice: str) -> None:
    """The optional "conditioning" / "loss_mask" meta keys, and that they agree with the optional files."""
    def bad(key: str, value: Any, expected: str) -> LatentDatasetError:
        return LatentDatasetError(f"{where}: key '{key}' is {value!r} but must be {expected}. {advice}")

    cond = meta.get("conditioning")
    if cond is None:
        cond = {}
    elif not isinstance(cond, dict):
        raise bad("conditioning", cond, "an object {'text': {...}, 'pooled': {...}} or absent")
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
    if lm is not None:
        shape = lm.get("shape") if isinstance(lm, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(_pos_int(v) for v in shape)):
            raise bad("loss_mask", lm, "an object {'shape': [Hm, Wm]} with two positive integers (the mask "
                                       "resolution)")
    files = meta["files"]
    for key, described, what in (("text_embeds", text is not None, "conditioning.text"),
                                 ("text_mask", bool(text and text.get("mask")), "conditioning.text.mask=true"),
                                 ("pooled_embeds", pooled is not None, "conditioning.pooled"),
                                 ("loss_mask", lm is not None, "loss_mask")):
        if (key in files) != described:
            have, lack = (f"files.{key}", what) if key in files else (what, f"files.{key}")
            raise LatentDatasetError(f"{where}: meta has {have} but no {lack}; an optional file and its "
                                     f"description go together (both or neither). {advice}")


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
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LatentDatasetError(f"{meta_path}: invalid JSON ({err}). {FIX_META}") from None
    return validate_meta(meta, str(meta_path))


# ----------------------------------------------------------------------------- writing

def _exists_error(root: Path) -> LatentDatasetExistsError:
    return LatentDatasetExistsError(f"'{root}' already exists; refusing to overwrite it. Delete it or "
                                    f"choose another path.")


def _check_target(root: Path) -> None:
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):
        raise _exists_error(root)


# What each extras array holds, for error messages.
EXTRA_WHAT = {"text": "(n, L, D) float array of text embeddings", "text_mask": "(n, L) bool attention mask",
              "pooled": "(n, P) float array of pooled embeddings",
              "loss_mask": "(n, Hm, Wm) loss mask (uint8 0..255, or float in [0, 1])"}
_EXTRA_NDIM = {"text": 3, "text_mask": 2, "pooled": 2, "loss_mask": 3}
_RESERVED = {"text": ("seq_len", "dim", "mask"), "pooled": ("dim",)}  # conditioning keys the writer sets itself


def _dims(value: Any, n: int, name: str, what: str, root: Path) -> Optional[tuple[int, ...]]:
    """None, or `value` as a tuple of n positive Python ints (n=0: a single int, as a 1-tuple); numpy ints are
    converted (they are not JSON-serialisable)."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (tuple, list, np.ndarray)) else [value] if n == 0 else None
    if items is None or len(items) != max(n, 1) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v > 0 for v in items):
        raise LatentDatasetError(f"{name} for '{root}' is {value!r} but must be {what}, or None")
    return tuple(int(v) for v in items)


def _conditioning_layout(root: Path, dtype: str, text_shape, text_mask: bool, pooled_dim, loss_mask_shape,
                         conditioning_meta: Optional[Mapping[str, Any]]) -> tuple[dict, dict]:
    """(meta keys to add, {extras key: (per-sample shape, storage dtype)}) for the writer's optional arrays."""
    text = _dims(text_shape, 2, "text_shape", "(L, D): two positive integers (sequence length, embedding size)",
                 root)
    pooled = _dims(pooled_dim, 0, "pooled_dim", "a positive integer (P, the pooled embedding size)", root)
    lm = _dims(loss_mask_shape, 2, "loss_mask_shape", "(Hm, Wm): two positive integers (the mask resolution)",
               root)
    if not isinstance(text_mask, (bool, np.bool_)):
        raise LatentDatasetError(f"text_mask for '{root}' is {text_mask!r} but must be True or False")
    if text_mask and text is None:
        raise LatentDatasetError(f"text_mask=True for '{root}' needs text_shape=(L, D): the attention mask belongs "
                                 f"to the sequence text embeddings")
    extra = dict(conditioning_meta or {})
    ours = {"text": None if text is None else {"seq_len": text[0], "dim": text[1], "mask": bool(text_mask)},
            "pooled": None if pooled is None else {"dim": pooled[0]}}
    cond: dict = {k: v for k, v in extra.items() if k not in ours}
    for part, described in ours.items():
        given = extra.get(part)
        if given is None:
            if described is not None:
                cond[part] = described
            continue
        arg = "text_shape" if part == "text" else "pooled_dim"
        if described is None or not isinstance(given, Mapping):
            raise LatentDatasetError(f"conditioning_meta['{part}'] for '{root}' is {given!r}, but " +
                                     (f"no {arg} was given (describe only stored arrays)" if described is None
                                      else "it must be a dict of descriptive keys (e.g. 'family', 'encoders')"))
        clash = {k: (given[k], described[k]) for k in _RESERVED[part] if k in given and given[k] != described[k]}
        if clash:
            raise LatentDatasetError(f"conditioning_meta['{part}'] for '{root}' contradicts the arrays: {clash} "
                                     f"(given, from {arg}/text_mask)")
        cond[part] = {**described, **{k: v for k, v in given.items() if k not in _RESERVED[part]}}
    meta: dict = {}
    if conditioning_meta is not None or text is not None or pooled is not None:
        meta["conditioning"] = cond
    if lm is not None:
        meta["loss_mask"] = {"shape": list(lm)}
    specs: dict = {}
    if text is not None:
        specs["text"] = (text, dtype)
        if text_mask:
            specs["text_mask"] = (text[:1], "bool")
    if pooled is not None:
        specs["pooled"] = (pooled, dtype)
    if lm is not None:
        specs["loss_mask"] = (lm, "uint8")
    return meta, specs


def _cast_finite(a: np.ndarray, dtype: str, what: str, start: int, stop: int, fix: str) -> np.ndarray:
    """`a` cast to the storage dtype; NaN/inf (float16 overflow included) is an error naming the samples."""
    with np.errstate(over="ignore"):  # overflow is reported below, with advice
        out = a.astype(dtype)
    if not np.isfinite(out).all():
        raise LatentDatasetError(f"{what} non-finite values (NaN/inf) in samples [{start}, {stop}) after casting to "
                                 f"{dtype}" + (f" (float16 overflows above 65504: {fix})" if dtype == "float16" else ""))
    return out


class LatentDatasetWriter:
    """Write a dataset piece by piece, never holding it in RAM; atomic like write_latent_dataset.

        with LatentDatasetWriter(path, shape=(C, H, W), num_samples=N, num_classes=K, ...) as writer:
            writer.write(start, latents, labels)   # stored values (N_i, C, H, W) and labels (N_i,), any order

    Optional per-sample arrays (see the module doc): text_shape=(L, D) (text_embeds.npy, in the dataset
    dtype), text_mask=True (text_mask.npy, needs text_shape), pooled_dim=P (pooled_embeds.npy, dataset
    dtype), loss_mask_shape=(Hm, Wm) (loss_mask.npy, uint8). Each one declared must then come with every
    write, as write(start, latents, labels, extras={"text": ..., "text_mask": ..., "pooled": ...,
    "loss_mask": ...}). conditioning_meta adds descriptive keys to meta "conditioning" (e.g. {"text":
    {"family": "flux", "encoders": [...], "max_length": 512}}); seq_len/dim/mask come from the arrays.

    Pieces go into memory-mapped files in a temporary sibling directory; leaving the block without an error
    checks that every sample was written and renames the directory into place (commit()); an error removes
    it (abort()). Raises LatentDatasetExistsError if `path` exists and is not an empty directory.
    """

    def __init__(self, path: PathLike, *, shape: Sequence[int], num_samples: int, num_classes: int,
                 latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                 class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                 extra_meta: Optional[Mapping[str, Any]] = None, text_shape: Optional[Sequence[int]] = None,
                 text_mask: bool = False, pooled_dim: Optional[int] = None,
                 loss_mask_shape: Optional[Sequence[int]] = None,
                 conditioning_meta: Optional[Mapping[str, Any]] = None):
        self.root = root = Path(path).expanduser().absolute()
        to_int = lambda v: int(v) if isinstance(v, np.integer) else v  # numpy ints are not JSON-serialisable
        self.meta = {"format": FORMAT, "version": VERSION, "shape": [to_int(s) for s in shape], "dtype": dtype,
                     "num_samples": to_int(num_samples), "num_classes": to_int(num_classes),
                     "latent_scale": float(latent_scale), "decode": dict(decode or {"type": "identity"}),
                     "source": source, "class_names": None if class_names is None else list(class_names),
                     "files": dict(DEFAULT_FILES), **(extra_meta or {})}
        clash = sorted({"conditioning", "loss_mask"} & set(extra_meta or {}))
        if clash:
            raise LatentDatasetError(f"extra_meta for '{root}' sets {clash}: describe conditioning and loss masks "
                                     f"with text_shape/text_mask/pooled_dim/loss_mask_shape/conditioning_meta")
        extra, self._specs = _conditioning_layout(root, dtype, text_shape, text_mask, pooled_dim, loss_mask_shape,
                                                  conditioning_meta)
        self.meta.update(extra)
        self.meta["files"].update({EXTRA_FILE_OF[k]: EXTRA_FILES[EXTRA_FILE_OF[k]] for k in self._specs})
        validate_meta(self.meta, f"meta for '{root}'", "Fix the write_latent_dataset() arguments.")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as err:
            raise LatentDatasetError(f"meta for '{root}' is not JSON-serialisable ({err}); pass plain "
                                     f"str/int/float/bool/list/dict values in extra_meta and conditioning_meta"
                                     ) from None
        _check_target(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        self._tmp: Optional[Path] = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        self._maps: dict[str, np.ndarray] = {}
        try:
            n, files = self.meta["num_samples"], self.meta["files"]
            layout = {"latents": (tuple(self.meta["shape"]), dtype), "labels": ((), np.int64), **self._specs}
            for key, (tail, dt) in layout.items():
                name = files[EXTRA_FILE_OF.get(key, key)]
                self._maps[key] = np.lib.format.open_memmap(self._tmp / name, mode="w+", dtype=dt, shape=(n, *tail))
            self._written = np.zeros(n, dtype=bool)
        except BaseException:
            self.abort()
            raise

    def _prepare_extras(self, extras: Optional[Mapping[str, Any]], n: int, start: int) -> dict[str, np.ndarray]:
        """Check one write's extras against the declared arrays; returns them cast for storage."""
        got, want, root = dict(extras or {}), self._specs, self.root
        unknown = sorted(set(got) - set(EXTRA_KEYS))
        if unknown:
            raise LatentDatasetError(f"extras for '{root}' have unknown key(s) {unknown}; allowed: {list(EXTRA_KEYS)}")
        missing, undeclared = [k for k in want if k not in got], [k for k in got if k not in want]
        if missing:
            raise LatentDatasetError(f"extras for '{root}' lack {missing}: the dataset stores {list(want)} (declared "
                                     f"by the writer's text_shape/text_mask/pooled_dim/loss_mask_shape), so every "
                                     f"write must give them")
        if undeclared:
            raise LatentDatasetError(f"extras for '{root}' include {undeclared}, which the dataset does not store: "
                                     f"declare them when creating the writer (text_shape=(L, D), text_mask=True, "
                                     f"pooled_dim=P, loss_mask_shape=(Hm, Wm))")
        out = {}
        for key, (tail, dtype) in want.items():
            a, head = np.asarray(got[key]), f"extras['{key}'] for '{root}'"
            if a.shape != (n, *tail):
                want = ", ".join(map(str, (n, *tail)))
                raise LatentDatasetError(f"{head} must be a {EXTRA_WHAT[key]} of shape ({want}) (one per latent), "
                                         f"got shape {a.shape}")
            if key in ("text", "pooled"):
                if not (np.issubdtype(a.dtype, np.floating) or a.size == 0):
                    raise LatentDatasetError(f"{head} must be a float array, got {a.dtype}")
                a = _cast_finite(a, dtype, f"{head} contains", start, start + n, "use dtype='float32'")
            elif key == "text_mask":
                if a.dtype != np.bool_:
                    if not (np.issubdtype(a.dtype, np.integer) and np.isin(a, (0, 1)).all()):
                        raise LatentDatasetError(f"{head} must be bool (True = real token) or 0/1 integers, got "
                                                 f"{a.dtype}" + (f" with values in [{a.min()}, {a.max()}]"
                                                                 if a.size else ""))
                    a = a.astype(bool)
                empty = np.flatnonzero(~a.any(axis=1)) if a.shape[1] else np.arange(n)
                if len(empty):
                    raise LatentDatasetError(f"{head}: sample(s) {(start + empty[:5]).tolist()} have no real token "
                                             f"(all False); attention over no tokens is undefined (a tokenized "
                                             f"prompt keeps at least its end-of-sequence token)")
            else:  # loss_mask
                if a.dtype == np.bool_:
                    a = a.astype(np.uint8) * 255
                elif np.issubdtype(a.dtype, np.floating):
                    if a.size and not (np.isfinite(a).all() and a.min() >= 0 and a.max() <= 1):
                        raise LatentDatasetError(f"{head} is a float mask, so it must lie in [0, 1] (coverage), "
                                                 f"got values in [{np.nanmin(a)}, {np.nanmax(a)}]"
                                                 f"{' with NaN/inf' if not np.isfinite(a).all() else ''}")
                    a = np.rint(a.astype(np.float64) * 255).astype(np.uint8)
                elif np.issubdtype(a.dtype, np.integer):
                    if a.size and (a.min() < 0 or a.max() > 255):
                        raise LatentDatasetError(f"{head} is an integer mask, so it must lie in [0, 255] (uint8 "
                                                 f"coverage), got values in [{a.min()}, {a.max()}]")
                    a = a.astype(np.uint8)
                else:
                    raise LatentDatasetError(f"{head} must be uint8 (0..255) or float (0..1), got {a.dtype}")
            out[key] = a
        return out

    def write(self, start: int, latents: np.ndarray, labels: np.ndarray,
              extras: Optional[Mapping[str, np.ndarray]] = None) -> None:
        """Store samples [start, start + len(latents)): stored values (cast to the dataset dtype), labels, and
        (exactly) the declared extras {"text", "text_mask", "pooled", "loss_mask"}: see the class doc."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        latents, labels = np.asarray(latents), np.asarray(labels)
        n, stop = self.meta["num_samples"], start + len(latents)
        if latents.shape[1:] != tuple(self.meta["shape"]) or latents.ndim != 4:
            want = ", ".join(map(str, self.meta["shape"]))
            raise LatentDatasetError(f"latents for '{self.root}' must be (n, {want}) arrays, got shape {latents.shape}")
        if labels.shape != (len(latents),) or not (np.issubdtype(labels.dtype, np.integer) or len(labels) == 0):
            raise LatentDatasetError(f"labels for '{self.root}' must be a 1-D integer array of length {len(latents)} "
                                     f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
        if not 0 <= start <= stop <= n:
            raise LatentDatasetError(f"samples [{start}, {stop}) lie outside [0, num_samples={n}) of '{self.root}'")
        prepared = self._prepare_extras(extras, len(latents), start)
        if len(latents) == 0:
            return
        k = self.meta["num_classes"]
        if labels.min() < 0 or labels.max() >= k:
            raise LatentDatasetError(f"labels for '{self.root}' range over [{labels.min()}, {labels.max()}] but must "
                                     f"lie in [0, num_classes={k}); pass the right num_classes or remap the labels")
        dtype = self.meta["dtype"]
        chunk = _cast_finite(latents, dtype, f"latents for '{self.root}' contain", start, stop,
                             "use dtype='float32' or a smaller scale")
        for key, value in {"latents": chunk, "labels": labels, **prepared}.items():
            self._maps[key][start:stop] = value
        self._written[start:stop] = True

    def commit(self) -> Path:
        """Check that every sample was written, flush, and rename the dataset into place."""
        if self._tmp is None:
            raise RuntimeError(f"writer for '{self.root}' is already closed")
        try:
            missing = np.flatnonzero(~self._written)
            if len(missing):
                raise LatentDatasetError(f"dataset '{self.root}' is incomplete: {len(missing)} of "
                                         f"{len(self._written)} samples were never written (first: "
                                         f"{missing[:5].tolist()})")
            tmp = self._tmp
            for array in self._maps.values():
                array.flush()
            self._maps.clear()
            (tmp / "meta.json").write_text(json.dumps(self.meta, indent=2) + "\n")
            for f in tmp.iterdir():  # data on disk before the rename publishes it
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            try:
                os.replace(tmp, self.root)  # atomic; also replaces an empty directory, fails on a non-empty one
            except OSError:
                if self.root.exists():  # another writer got there first
                    raise _exists_error(self.root) from None
                raise
            self._tmp = None
        except BaseException:
            self.abort()
            raise
        return self.root

    def abort(self) -> None:
        """Remove the temporary directory (nothing is published)."""
        self.__dict__.get("_maps", {}).clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "LatentDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_latent_dataset(path: PathLike, latents: np.ndarray, labels: np.ndarray, *, num_classes: int,
                         latent_scale: float = 1.0, decode: Optional[Mapping[str, Any]] = None, source: str = "",
                         class_names: Optional[Sequence[str]] = None, dtype: str = "float16",
                         extra_meta: Optional[Mapping[str, Any]] = None, chunk_size: int = 4096,
                         extras: Optional[Mapping[str, np.ndarray]] = None,
                         conditioning_meta: Optional[Mapping[str, Any]] = None) -> Path:
    """Write a dataset atomically: build it in a temporary sibling directory, then rename it into place.

    `latents` (N, C, H, W) are the *stored* values (model space / latent_scale). `extra_meta` adds keys to
    meta.json (e.g. "builtin"). `extras` optionally adds per-sample conditioning / loss masks as full arrays
    {"text": (N, L, D), "text_mask": (N, L) bool, "pooled": (N, P), "loss_mask": (N, Hm, Wm) uint8 or float
    in [0, 1]} (any subset; text_mask needs text), described further by `conditioning_meta` (see
    LatentDatasetWriter). Raises LatentDatasetExistsError if `path` exists and is not an empty directory.
    Datasets too big for RAM: LatentDatasetWriter.
    """
    root = Path(path).expanduser().absolute()
    latents, labels = np.asarray(latents), np.asarray(labels)
    if latents.ndim != 4 or min(latents.shape) < 1:
        raise LatentDatasetError(f"latents for '{root}' must be a non-empty (N, C, H, W) array, got shape "
                                 f"{latents.shape}")
    if labels.shape != (len(latents),) or not np.issubdtype(labels.dtype, np.integer):
        raise LatentDatasetError(f"labels for '{root}' must be a 1-D integer array of length N={len(latents)} "
                                 f"(one per latent), got {labels.dtype} array of shape {labels.shape}")
    extras = {k: np.asarray(v) for k, v in (extras or {}).items()}
    unknown = sorted(set(extras) - set(EXTRA_KEYS))
    if unknown:
        raise LatentDatasetError(f"extras for '{root}' have unknown key(s) {unknown}; allowed: {list(EXTRA_KEYS)}")
    for key, value in extras.items():
        if value.ndim != _EXTRA_NDIM[key] or len(value) != len(latents):
            raise LatentDatasetError(f"extras['{key}'] for '{root}' must be a {EXTRA_WHAT[key].replace('(n,', '(N,')} "
                                     f"with N={len(latents)} (one per latent), got shape {value.shape}")
    shape_of = lambda key: extras[key].shape[1:] if key in extras else None  # noqa: E731
    with LatentDatasetWriter(root, shape=latents.shape[1:], num_samples=len(latents), num_classes=num_classes,
                             latent_scale=latent_scale, decode=decode, source=source, class_names=class_names,
                             dtype=dtype, extra_meta=extra_meta, text_shape=shape_of("text"),
                             text_mask="text_mask" in extras,
                             pooled_dim=extras["pooled"].shape[1] if "pooled" in extras else None,
                             loss_mask_shape=shape_of("loss_mask"), conditioning_meta=conditioning_meta) as writer:
        if not (labels.min() >= 0 and labels.max() < writer.meta["num_classes"]):  # checked before any copying
            raise LatentDatasetError(f"labels for '{root}' range over [{labels.min()}, {labels.max()}] but must lie "
                                     f"in [0, num_classes={num_classes}); pass the right num_classes or remap the "
                                     f"labels")
        # Chunked copy into the memmap: casting never needs a second full copy of the array in RAM.
        for start in range(0, len(latents), chunk_size):
            part = slice(start, start + chunk_size)
            writer.write(start, latents[part], labels[part], {k: v[part] for k, v in extras.items()} or None)
    return root


# ----------------------------------------------------------------------------- reading

def _open_npy(file: Path, key: str) -> np.ndarray:
    """Memory-map one .npy file; missing or unreadable files raise LatentDatasetError naming it."""
    if not file.is_file():
        raise LatentDatasetError(f"missing {key} file '{file}' (meta.json files.{key}='{file.name}'): the "
                                 f"dataset is incomplete. {REBUILD}")
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise LatentDatasetError(f"cannot read {key} file '{file}' as a .npy array ({err}): it is corrupt or "
                                 f"truncated. {REBUILD}") from None


class LatentMeta:
    """What every dataset reader derives from its meta dict (`self._meta`, our meta.json format) and
    `self.root`: shapes, counts, and the checks against what the model expects."""

    _meta: dict
    root: Path
    _FIX = "Point data.path at matching data, or change the data/model config to match it."

    def _shape_source(self) -> str:
        """Where the shape comes from, for error messages."""
        return f"meta.json shape {list(model_shape(self._meta))}"

    def _check_expected(self, channels: Optional[int], resolution: Optional[int],
                        num_classes: Optional[int]) -> None:
        c, h, w = model_shape(self._meta)
        head, src, fix = f"data at '{self.root}'", self._shape_source(), self._FIX
        if channels is not None and c != channels:
            raise LatentDatasetError(f"{head} has {c} channels ({src}) but the model expects in_channels={channels} "
                                     f"(data.channels). {fix}")
        if resolution is not None and (h, w) != (resolution, resolution):
            raise LatentDatasetError(f"{head} is {h}x{w} ({src}) but the model expects input_size={resolution} "
                                     f"(data.resolution). {fix}")
        if num_classes is not None and self._meta["num_classes"] != num_classes:
            raise LatentDatasetError(f"{head} has {self._meta['num_classes']} classes (num_classes) but the model "
                                     f"expects num_classes={num_classes} (data.num_classes). {fix}")

    @property
    def meta(self) -> dict:
        """The validated meta (meta.json format; `shape` is the stored shape)."""
        return self._meta

    @property
    def shape(self) -> tuple[int, int, int]:
        """Model-space latent shape (C, H, W) (for moments data: half the stored channels)."""
        return model_shape(self._meta)

    @property
    def channels(self) -> int:
        """Model-space latent channels C."""
        return self.shape[0]

    @property
    def latent_kind(self) -> str:
        """"sample" (items are model-space latents) or "moments" (items are raw (mean, logvar): see draw_latents)."""
        return latent_kind(self._meta)

    @property
    def resolution(self) -> int:
        """Latent side H (= W); non-square data has no single resolution."""
        _, h, w = self._meta["shape"]
        if h != w:
            raise LatentDatasetError(f"data at '{self.root}' is {h}x{w}: not square, so it has no single "
                                     f"resolution (the models take square latents)")
        return h

    @property
    def num_classes(self) -> int:
        """Number of classes K (labels lie in [0, K))."""
        return self._meta["num_classes"]

    @property
    def latent_scale(self) -> float:
        """Stored (or drawn) values are multiplied by this to give model-space latents."""
        return float(self._meta["latent_scale"])

    @property
    def conditioning(self) -> dict[str, Any]:
        """The optional per-sample data: {"text": (L, D) or None, "text_mask": bool, "pooled": P or None,
        "loss_mask": (Hm, Wm) or None} (from meta "conditioning" and "loss_mask")."""
        cond = self._meta.get("conditioning") or {}
        text, pooled, lm = cond.get("text"), cond.get("pooled"), self._meta.get("loss_mask")
        return {"text": None if text is None else (text["seq_len"], text["dim"]),
                "text_mask": bool(text is not None and text.get("mask", False)),
                "pooled": None if pooled is None else pooled["dim"],
                "loss_mask": None if lm is None else tuple(lm["shape"])}

    @property
    def has_extras(self) -> bool:
        """True when items carry an extras dict (text / pooled embeddings, loss masks) after (x, y)."""
        c = self.conditioning
        return c["text"] is not None or c["pooled"] is not None or c["loss_mask"] is not None

    def __len__(self) -> int:
        return self._meta["num_samples"]


class LatentDataset(LatentMeta, torch.utils.data.Dataset):
    """Memory-mapped latent dataset; items are (float32 latent (C, H, W) * latent_scale, int64 label), or
    (latent, label, extras) when the dataset has per-sample conditioning / loss masks (has_extras; see the
    module doc)."""

    def __init__(self, path: PathLike, expected_channels: Optional[int] = None,
                 expected_resolution: Optional[int] = None, expected_num_classes: Optional[int] = None):
        self.root = Path(path).expanduser().absolute()
        self._meta = read_meta(self.root)
        self._latents: Optional[np.ndarray] = None
        self._labels: Optional[np.ndarray] = None
        self._extras: Optional[dict[str, np.ndarray]] = None
        self._validate_files()
        self._check_expected(expected_channels, expected_resolution, expected_num_classes)

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        """Open the memmaps on first use in each process (they are dropped when pickled to workers)."""
        if self._latents is None:
            files = self._meta["files"]
            self._latents = _open_npy(self.root / files["latents"], "latents")
            self._labels = _open_npy(self.root / files["labels"], "labels")
            self._extras = {key: _open_npy(self.root / files[EXTRA_FILE_OF[key]], EXTRA_FILE_OF[key])
                            for key in EXTRA_KEYS if EXTRA_FILE_OF[key] in files}
        return self._latents, self._labels

    def __getstate__(self) -> dict:
        # Pickle only the path and meta: a worker re-maps the files instead of receiving a copy of them.
        return {**self.__dict__, "_latents": None, "_labels": None, "_extras": None}

    def _validate_files(self) -> None:
        latents, labels = self._open()
        m, files = self._meta, self._meta["files"]
        lat_file, lab_file = self.root / files["latents"], self.root / files["labels"]
        want = (m["num_samples"], *m["shape"])
        if latents.shape != want or latents.dtype != np.dtype(m["dtype"]):
            raise LatentDatasetError(
                f"'{lat_file}' holds a {latents.dtype} array of shape {list(latents.shape)} but meta.json says "
                f"{m['dtype']} of shape {list(want)} (num_samples + shape). {REBUILD}")
        if labels.shape != (m["num_samples"],) or not np.issubdtype(labels.dtype, np.integer):
            raise LatentDatasetError(
                f"'{lab_file}' holds a {labels.dtype} array of shape {list(labels.shape)} but must be int64 of "
                f"shape [{m['num_samples']}] (meta.json num_samples). {REBUILD}")
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= m["num_classes"]:
            raise LatentDatasetError(f"'{lab_file}' has labels in [{lo}, {hi}] but meta.json num_classes="
                                     f"{m['num_classes']} allows only [0, {m['num_classes'] - 1}]. {REBUILD}")
        c, n = self.conditioning, m["num_samples"]
        expected = {"text": ((n, *(c["text"] or ())), DTYPES, "num_samples, conditioning.text seq_len and dim"),
                    "text_mask": ((n, (c["text"] or (0,))[0]), ("bool",), "num_samples, conditioning.text seq_len"),
                    "pooled": ((n, c["pooled"]), DTYPES, "num_samples, conditioning.pooled dim"),
                    "loss_mask": ((n, *(c["loss_mask"] or ())), ("uint8",), "num_samples, loss_mask.shape")}
        for key, array in (self._extras or {}).items():
            shape, dtypes, source = expected[key]
            if array.shape != shape or array.dtype.name not in dtypes:
                raise LatentDatasetError(
                    f"'{self.root / files[EXTRA_FILE_OF[key]]}' (files.{EXTRA_FILE_OF[key]}) holds a {array.dtype} "
                    f"array of shape {list(array.shape)} but must be {' or '.join(dtypes)} of shape {list(shape)} "
                    f"(meta.json {source}). {REBUILD}")

    def _scale(self) -> float:
        # Moments stay in raw VAE units (logvar must not be scaled); draw_latents scales the drawn latent.
        return 1.0 if self.latent_kind == "moments" else self.latent_scale

    def __getitem__(self, index: int) -> Union[tuple[torch.Tensor, torch.Tensor],
                                               tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        latents, labels = self._open()
        x = torch.from_numpy(np.array(latents[index], dtype=np.float32))  # (C, H, W), copied off the memmap
        x, y = x * self._scale(), torch.tensor(int(labels[index]), dtype=torch.int64)
        if not self._extras:
            return x, y
        return x, y, {key: _extra_tensor(key, np.array(array[index])[None])[0] for key, array in self._extras.items()}

    def __getitems__(self, indices: Sequence[int]) -> Union[tuple[torch.Tensor, torch.Tensor],
                                                            tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """Batched fetch, (x (B, C, H, W) float32, y (B,) int64), with one fancy-indexed read of each memmap;
        with extras (x, y, {"text": (B, L, D) float32, "text_mask": (B, L) bool, "pooled": (B, P) float32,
        "loss_mask": (B, 1, Hm, Wm) float32 in [0, 1]}), the keys the dataset has, in request order."""
        latents, labels = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")  # ascending reads are mostly sequential on disk
        x, y = np.empty((len(idx), *latents.shape[1:]), np.float32), np.empty(len(idx), np.int64)
        x[order], y[order] = latents[idx[order]], labels[idx[order]]  # read sorted, write back in request order
        x, y = torch.from_numpy(x) * self._scale(), torch.from_numpy(y)
        if not self._extras:
            return x, y
        extras = {}
        for key, array in self._extras.items():
            out = np.empty((len(idx), *array.shape[1:]), array.dtype)
            out[order] = array[idx[order]]
            extras[key] = _extra_tensor(key, out)
        return x, y, extras


def _extra_tensor(key: str, batch: np.ndarray) -> torch.Tensor:
    """A batch read from an extras file -> its tensor: float32 embeddings, bool mask, (B, 1, Hm, Wm) float
    loss mask in [0, 1] (uint8 / 255)."""
    t = torch.from_numpy(batch)
    if key == "text_mask":
        return t
    if key == "loss_mask":
        return t.unsqueeze(1).float().div_(255.0)
    return t.float()


# ----------------------------------------------------------------------------- loss masks and token grids

def _area_weights(src: int, dst: int) -> torch.Tensor:
    """(dst, src) float64 matrix: row i holds the fraction of target cell i covered by each source pixel.

    Cell i spans [i * src / dst, (i + 1) * src / dst) in source pixels; in units of 1 / dst pixel both the
    cell and pixel j ([j * dst, (j + 1) * dst)) have integer ends, so the overlaps are exact integers.
    """
    i = torch.arange(dst, dtype=torch.int64)[:, None]
    j = torch.arange(src, dtype=torch.int64)[None, :]
    overlap = (torch.minimum((i + 1) * src, (j + 1) * dst) - torch.maximum(i * src, j * dst)).clamp_min(0)
    return overlap.double() / src


def _area_resize(mask: torch.Tensor, hw: Sequence[int], name: str) -> torch.Tensor:
    """Exact area-weighted resize of a (B, 1, Hm, Wm) (or (B, Hm, Wm)) coverage mask to (B, 1, H, W), float64."""
    if not (isinstance(hw, (tuple, list, torch.Size)) and len(hw) == 2 and
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in hw)):
        raise ValueError(f"{name}: the target size is {hw!r} but must be (H, W) with two positive integers")
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] < 1 or mask.shape[3] < 1:
        raise ValueError(f"{name}: loss_mask must be a (B, 1, Hm, Wm) (or (B, Hm, Wm)) coverage mask in [0, 1], "
                         f"got shape {list(mask.shape)}")
    if mask.dtype == torch.uint8:
        raise ValueError(f"{name}: loss_mask is uint8; pass coverage in [0, 1] (uint8 / 255, as LatentDataset "
                         f"returns it)")
    (h, w), (hm, wm) = hw, mask.shape[2:]
    wh, ww = _area_weights(hm, h).to(mask.device), _area_weights(wm, w).to(mask.device)
    return torch.einsum("hi,bcij,wj->bchw", wh, mask.double(), ww)


def resize_loss_mask(loss_mask: torch.Tensor, hw: Sequence[int]) -> torch.Tensor:
    """Area-resize a (B, 1, Hm, Wm) coverage mask in [0, 1] to (B, 1, H, W) (e.g. the latent resolution).

    Every output value is the exact area-weighted mean of the mask over that output pixel (pixels cut by a
    non-divisible grid contribute their overlapping fraction; for divisible sizes this is F.interpolate(mode=
    "area")), so it stays in [0, 1]; the result has the mask's float dtype (float32 for a bool mask).
    Multiply the per-element loss by it to weight the loss.
    """
    out = _area_resize(loss_mask, hw, "resize_loss_mask")
    dtype = loss_mask.dtype if loss_mask.is_floating_point() else torch.float32
    return out.clamp_(0.0, 1.0).to(dtype)


def token_keep_mask(loss_mask: torch.Tensor, grid_hw: Sequence[int]) -> torch.Tensor:
    """(B, Ht * Wt) bool: True for the tokens of an (Ht, Wt) token grid of which MORE THAN HALF the area is covered.

    `loss_mask` is a (B, 1, Hm, Wm) coverage mask in [0, 1] at any resolution. A token's coverage is the
    exact area-weighted mean of the mask over its cell (resize_loss_mask to grid_hw, in float64); a token is
    kept when that exceeds 0.5 (+1e-6 so that rounding never keeps an exactly half-covered token). Tokens
    are in row-major order (h, then w), as a patch embedding flattens them.
    """
    return (_area_resize(loss_mask, grid_hw, "token_keep_mask") > 0.5 + 1e-6).flatten(1)


# ----------------------------------------------------------------------------- latent kinds

def latent_kind(meta: Mapping[str, Any]) -> str:
    """"sample" (stored values are latents) or "moments" (stored (mean, logvar) of the VAE posterior)."""
    return meta.get("latent_kind", "sample")


def shift_factor(meta: Mapping[str, Any]) -> float:
    """The VAE's shift_factor (decode.shift_factor; 0 when absent/null or not VAE data)."""
    decode = meta.get("decode") or {}
    return float(decode.get("shift_factor") or 0.0) if decode.get("type") == "vae" else 0.0


def model_shape(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """Shape (C, H, W) of the latents the model sees: the stored shape, halved in C for moments."""
    c, h, w = meta["shape"]
    return (c // 2, h, w) if latent_kind(meta) == "moments" else (c, h, w)


def draw_latents(x: torch.Tensor, meta: Mapping[str, Any], mode: str = "sample",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Dataset items -> model-space latents (B, C, H, W).

    "sample" data is returned as is (already scaled). "moments" data (B, 2C, H, W) = (mean, logvar) in raw
    VAE units gives latent_scale * (mean + exp(logvar / 2) * eps - shift) with eps ~ N(0, I) from `generator`
    (the device's global RNG if None; shift = decode.shift_factor, 0 for SD-VAE); mode="mean" returns
    latent_scale * (mean - shift) (no noise, e.g. for references).
    """
    if mode not in ("sample", "mean"):
        raise ValueError(f"draw_latents mode={mode!r}; allowed: 'sample', 'mean'")
    if latent_kind(meta) != "moments":
        return x
    if x.ndim != 4 or x.shape[1] % 2:
        raise LatentDatasetError(f"moments data needs (B, 2C, H, W) items, got shape {list(x.shape)}")
    mean, logvar = x.float().chunk(2, dim=1)
    if mode == "sample":
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))  # the clamp diffusers' DiagonalGaussianDistribution uses
        mean = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean - shift_factor(meta)) * float(meta["latent_scale"])


# ----------------------------------------------------------------------------- decoding

def _vae_location(decode: Mapping[str, Any], vae: Optional[str]) -> tuple[str, Optional[str]]:
    """(VAE name/path, subfolder) to load: meta's, or the `vae` override. An override directory that holds
    the VAE itself (config.json at its top) ignores meta's subfolder; a copy of a whole model repo keeps it."""
    subfolder = decode.get("subfolder") or None
    if vae is None:
        return decode["vae"], subfolder
    if subfolder and (Path(vae).expanduser() / "config.json").is_file():
        subfolder = None
    return str(vae), subfolder


def _load_decoder(meta: Mapping[str, Any], vae: Optional[str], vae_dtype: str, device: Any):
    from .vae import load_vae

    decode = meta["decode"]
    name, subfolder = _vae_location(decode, vae)
    try:
        return load_vae(name, subfolder=subfolder, device=device, dtype=vae_dtype)
    except LatentDatasetError as err:
        raise LatentDatasetError(f"data meta decode.type='vae', vae={decode.get('vae')!r}"
                                 f"{'' if vae is None else f' (overridden by vae={vae!r})'}: {err} Training needs "
                                 f"the VAE only for in-training evaluation: without it, turn that off with "
                                 f"eval.every_steps=0 eval.at_end=false.") from None


def decode_to_uint8(latents: torch.Tensor, meta: Mapping[str, Any], *, vae: Optional[str] = None,
                    vae_dtype: str = "float32", batch_size: int = 32) -> torch.Tensor:
    """Model-space latents (B, C, H, W) -> uint8 images (B, H', W', 3) on the latents' device, per meta["decode"].

    identity: pixels = latents / latent_scale in [-1, 1]. vae: raw = latents / latent_scale + shift_factor
    (decode.shift_factor, default 0) is decoded by the VAE named in decode.vae (or the local directory `vae`,
    e.g. on an offline machine) in `vae_dtype`, `batch_size` latents at a time; its [-1, 1] output is
    rounded to uint8 exactly as identity pixels are. The VAE is loaded once per process (data.vae.load_vae).
    """
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") == "vae":
        model = _load_decoder(meta, vae, vae_dtype, latents.device)
        from .vae import decode_raw_to_uint8

        raw = latents.float() / float(meta.get("latent_scale", 1.0)) + shift_factor(meta)
        return decode_raw_to_uint8(model, raw, batch_size=batch_size)
    if decode.get("type") != "identity":
        raise LatentDatasetError(f"meta decode.type={decode.get('type')!r} is unknown; allowed: {list(DECODE_TYPES)}")
    if latents.ndim != 4 or latents.shape[1] not in (1, 3):
        raise LatentDatasetError(f"identity decoding needs (B, C, H, W) latents with C = 1 or 3 (pixels), got shape "
                                 f"{list(latents.shape)}; data with other channel counts needs a decoder "
                                 f"(meta decode.type='vae')")
    x = latents.float() / float(meta.get("latent_scale", 1.0))
    images = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # [-1, 1] -> [0, 255]
    return images.expand(-1, -1, -1, 3).contiguous() if images.shape[-1] == 1 else images.contiguous()


def check_decodable(meta: Mapping[str, Any], *, vae: Optional[str] = None, vae_dtype: str = "float32",
                    batch_size: int = 32, device: Any = "cpu") -> None:
    """Raise LatentDatasetError now if samples of this data cannot be turned into pixels
    (so evaluation and sampling fail at start-up, not after hours of training).

    VAE data: loads the VAE (cached, so the later decode_to_uint8 on the same `device` reuses it) and checks
    that its latent channels match the data. Same keyword arguments as decode_to_uint8, plus `device`.
    """
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") != "vae":
        decode_to_uint8(torch.zeros(1, *model_shape(meta)), meta)
        return
    from .vae import vae_dtype as check_dtype

    check_dtype(vae_dtype)
    if batch_size < 1:
        raise LatentDatasetError(f"VAE decode batch size is {batch_size}; it must be >= 1")
    model = _load_decoder(meta, vae, vae_dtype, device)
    c = model_shape(meta)[0]
    if model.config.latent_channels != c:
        name, _ = _vae_location(decode, vae)
        raise LatentDatasetError(f"the data has {c}-channel latents (meta.json shape {meta['shape']}, latent_kind "
                                 f"{latent_kind(meta)!r}) but the VAE '{name}' takes {model.config.latent_channels} "
                                 f"channels: the data was encoded with another VAE")
