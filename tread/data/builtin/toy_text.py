"""The built-in text-conditioned dataset "toy_shapes_text" (data=toy_text): the toy_shapes images captioned from
their class and the ten captions encoded once by a family's own text encoders, stored in the latent format with its
text files (docs/data.md "Built-in text data")."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.text_families import TEXT_FAMILIES

from tread.data.meta import LatentDatasetError
from tread.data.writer import write_latent_dataset

from .toy import TOY_CLASS_NAMES, ensure_builtin, generate_toy_shapes

PathLike = Union[str, os.PathLike]


def class_captions(template: str) -> list[str]:
    """One caption per toy class from `template` ("a {class}" -> "a red disc", ...)."""
    if not isinstance(template, str) or "{class}" not in template:
        raise LatentDatasetError(f"data.builtin_args.caption={template!r} must be a string containing '{{class}}', "
                                 f"e.g. 'a {{class}}'")
    return [template.replace("{class}", name) for name in TOY_CLASS_NAMES]


def _check_args(family: str, text_encoders: Optional[PathLike], max_text_length: int) -> Path:
    if family not in TEXT_FAMILIES:
        raise LatentDatasetError(f"data.builtin_args.family={family!r} is not a text-to-image family; allowed: "
                                 f"{list(TEXT_FAMILIES)}")
    if not text_encoders:
        raise LatentDatasetError(
            "data.builtin_args.text_encoders is not set: toy_shapes_text encodes its captions with the family's text "
            "encoders. Pass a local pipeline folder (text_encoder*/, tokenizer*/), or write tiny random stand-ins "
            f"offline with `python scripts/tiny_text_encoders.py {family} DIR` and pass DIR.")
    if isinstance(max_text_length, bool) or not isinstance(max_text_length, int) or max_text_length < 1:
        raise LatentDatasetError(f"data.builtin_args.max_text_length={max_text_length!r} must be a positive integer "
                                 f"(text tokens per caption)")
    return Path(text_encoders).expanduser().absolute()


def ensure_toy_text_dataset(path: PathLike, num_per_class: int = 1000, resolution: int = 16, seed: int = 0, *,
                            family: str = "flux", text_encoders: Optional[PathLike] = None,
                            caption: str = "a {class}", max_text_length: int = 16) -> Path:
    """The dataset's directory, `path`/<digest of the parameters>, first writing toy_shapes_text there unless it
    exists: each set of encoders, captions and lengths gets its own dataset, so switching encoders never meets
    (or overwrites) data encoded by others."""
    encoders = _check_args(family, text_encoders, max_text_length)
    captions = class_captions(caption)
    params = {"name": "toy_shapes_text", "num_per_class": int(num_per_class), "resolution": int(resolution),
              "seed": int(seed), "family": family, "text_encoders": str(encoders), "caption": caption,
              "max_text_length": int(max_text_length)}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(path).expanduser().absolute() / digest

    def write() -> None:
        images, labels = generate_toy_shapes(num_per_class, resolution, seed)
        per_class = encode_prompts(family, load_text_encoders(family, encoders), captions, max_length=max_text_length)
        write_latent_dataset(
            root, images.numpy(), labels.numpy(), num_classes=len(TOY_CLASS_NAMES), class_names=TOY_CLASS_NAMES,
            source=f"built-in toy_shapes_text (tread/data/builtin/toy_text.py): toy_shapes {num_per_class} per class, "
                   f"{resolution}x{resolution}, seed {seed}; captions '{caption}' encoded by {family} encoders at "
                   f"{encoders}",
            dtype="float16", extra_meta={"builtin": params, "captions": captions},
            extras={key: np.ascontiguousarray(value[labels.numpy()]) for key, value in per_class.items()},
            conditioning_meta={"text": {"family": family, "encoders": str(encoders),
                                        "max_length": int(max_text_length)}})

    return ensure_builtin(root, params, write)
