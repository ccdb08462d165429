"""Which diffusers VAE class --vae is, and which --kind it stores: --vae-class, else the `_class_name` of the VAE's
config.json (a local folder's, or a hub id's in the local Hugging Face cache), else AutoencoderKL for images.
AutoencoderKL data stores the posterior (moments, the default) or one draw, scaled when drawn; the model-space
image VAEs (tread/encoders/image_vaes.py) and the video VAEs store the posterior mean (the default) or, where there
is a posterior, one draw, normalised as their pipelines feed the transformer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from huggingface_hub import try_to_load_from_cache

from tread.encoders.vae import IMAGE_VAE_CLASSES, VIDEO_VAE_CLASSES
from tread.encoders.image_vaes import NO_POSTERIOR

from .request import PrecomputeError, PrecomputeRequest, bad_value

# --kind each image VAE class allows, the first its default
IMAGE_KINDS = {name: ("moments", "sample") if name == "AutoencoderKL" else
               ("mean",) if name in NO_POSTERIOR else ("mean", "sample") for name in IMAGE_VAE_CLASSES}


def _config_json(req: PrecomputeRequest) -> Optional[Path]:
    """The VAE's config.json: in the local folder, or a hub id's in the local cache (nothing is downloaded)."""
    local = Path(req.vae).expanduser()
    if local.is_dir():
        return local / (req.vae_subfolder or "") / "config.json"
    try:
        found = try_to_load_from_cache(req.vae, "/".join(filter(None, [req.vae_subfolder, "config.json"])))
    except ValueError:           # not a valid repo id: load_vae says what --vae must be
        return None
    return Path(found) if isinstance(found, str) else None


def configured_class(req: PrecomputeRequest) -> Optional[str]:
    """--vae-class, else the `_class_name` of the VAE's config.json, else None."""
    if req.vae_class is not None:
        return req.vae_class
    path = _config_json(req)
    try:
        name = json.loads(path.read_text()).get("_class_name") if path is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def image_vae_class(req: PrecomputeRequest) -> str:
    """The image VAE's class (AutoencoderKL when nothing says); one error for a video VAE or an unknown class."""
    if req.vae_class is not None and req.vae_class not in IMAGE_VAE_CLASSES:
        raise bad_value("--vae-class", req.vae_class, f"one of {', '.join(IMAGE_VAE_CLASSES)} (images; video VAEs "
                                                      f"take --videos)")
    name = configured_class(req) or "AutoencoderKL"
    if name in VIDEO_VAE_CLASSES:
        raise PrecomputeError(f"--vae '{req.vae}' is a video VAE ({name}, its config.json): pass clips with --videos, "
                              f"or an image VAE, one of {', '.join(IMAGE_VAE_CLASSES)}")
    if name not in IMAGE_VAE_CLASSES:
        raise PrecomputeError(f"--vae '{req.vae}' is a {name} (its config.json), which this cannot encode with; "
                              f"allowed: {', '.join(IMAGE_VAE_CLASSES)} (or pass --vae-class)")
    return name


def image_kind(req: PrecomputeRequest, name: str) -> str:
    """--kind for images of VAE class `name` (its default when left out); one error naming what it allows."""
    allowed = IMAGE_KINDS[name]
    if req.kind is None:
        return allowed[0]
    if req.kind not in allowed:
        why = ("it stores the posterior (mean, logvar) and draws each step" if name == "AutoencoderKL" else
               "it is deterministic: mean, its encoding, is the only kind" if name in NO_POSTERIOR else
               "its pipelines feed normalised latents, so data stores the posterior mean (or one draw) normalised")
        raise bad_value("--kind", req.kind, f"{' or '.join(allowed)} with an {name} VAE ({why})")
    return req.kind


def video_vae_class(req: PrecomputeRequest) -> str:
    """The video VAE's class: --vae-class, else its config.json's; one error when neither gives a video VAE."""
    name = configured_class(req)
    if name not in VIDEO_VAE_CLASSES:
        found = f"its config.json says {name!r}" if name else "it has no readable config.json with _class_name"
        raise PrecomputeError(f"--vae '{req.vae}' is not a video VAE this can load ({found}); pass --vae-class, one "
                              f"of {', '.join(VIDEO_VAE_CLASSES)}, or a local VAE folder of such a class")
    return name
