"""The toy shapes as an image folder with caption sidecars (`<class>/<WIDTHxHEIGHT>_<i>.png` and `.txt` of two
captions), as a practitioner's dataset looks on disk: for the bucketed worked example (docs/buckets.md) and tests;
scripts/toy_images.py writes one."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from tread.utils.io import PathLike, atomic_write, atomic_write_text

from tread.data.buckets import Bucket

from .toy import TOY_CLASS_NAMES, generate_toy_shapes

CAPTIONS = ("a {name}", "a picture of a {name}")


def write_toy_image_folder(root: PathLike, sizes: Sequence[Bucket], num_per_class: int, seed: int = 0,
                           captions: bool = True) -> dict[str, int]:
    """Write `num_per_class` images per class at every size (its own seed: seed + its position) under `root`;
    returns {size name: images written}. `root` must not hold images already (one error)."""
    root = Path(root).expanduser().absolute()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"'{root}' already exists and is not empty; choose a new folder")
    written = {}
    for k, size in enumerate(sizes):
        images, labels = generate_toy_shapes(num_per_class, (size.height, size.width), seed + k)
        pixels = ((images.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().clip(0, 255).astype(np.uint8)
        for i, (image, label) in enumerate(zip(pixels, labels.tolist())):
            name = TOY_CLASS_NAMES[label]
            stem = root / name.replace(" ", "_") / f"{size.name}_{i:04d}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(stem.with_suffix(".png"), lambda f, im=image: Image.fromarray(im).save(f, format="PNG"))
            if captions:
                atomic_write_text(stem.with_suffix(".txt"), "\n".join(c.format(name=name) for c in CAPTIONS) + "\n")
        written[size.name] = len(labels)
    return written
