"""DINOv2 from a local transformers folder (never downloaded), its input convention and a digest of its weights.
REPA's patch encoder (tread/encoders/patch.py) and FDD's feature network (tread/encoders/features.py) load it."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

import torch.nn as nn

from tread.encoders.errors import EncoderError

DINO_SIZE = 224                  # DINOv2's input side: images are resized to it (bicubic)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def weights_digest(folder: Union[str, Path]) -> str:
    """A short digest of a weights folder's files (names, sizes and modification times)."""
    files = sorted(p for p in Path(folder).expanduser().resolve().rglob("*") if p.is_file())
    text = "|".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in files)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def load_dinov2(weights: Optional[Union[str, Path]], key: str) -> nn.Module:
    """A local Dinov2Model (no download); one EncoderError naming `key` when it is missing or does not load."""
    how = ("save one on a machine with network: `from transformers import Dinov2Model; "
           "Dinov2Model.from_pretrained('facebook/dinov2-base').save_pretrained('DIR')`, copy DIR here and set "
           f"{key}=DIR")
    if not weights:
        raise EncoderError(f"{key} is not set; DINOv2 weights are read from a local folder only: {how}.")
    if not (Path(weights).expanduser() / "config.json").is_file():
        raise EncoderError(f"{key}={str(weights)!r} is not a saved Dinov2Model folder (no config.json there): {how}.")
    from transformers import Dinov2Model    # optional heavy import, only for DINOv2 runs
    try:
        return Dinov2Model.from_pretrained(str(Path(weights).expanduser()), local_files_only=True)
    except (OSError, ValueError) as err:
        raise EncoderError(f"{key}={str(weights)!r} does not load as a Dinov2Model ({err}): {how}.") from None
