"""The image encoder of an image-to-video pipeline, from local folders (never downloaded): HunyuanVideo 1.5's
SigLIP (`image_encoder`: SiglipVisionModel, `feature_extractor`: SiglipImageProcessor of its i2v pipeline folder), and
the image embeddings of first frames exactly as HunyuanVideo15ImageToVideoPipeline._get_image_embeds makes them
(the processor's resize and normalisation, the encoder's last hidden state: (B, 729, 1152) for the released one).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image

from tread.encoders.errors import EncoderError

PIPELINE_REPO = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v"
SUBFOLDERS = ("image_encoder", "feature_extractor")


def how_to_provide(flag: str) -> str:
    return (f"`hf download {PIPELINE_REPO} --include 'image_encoder/*' 'feature_extractor/*' --local-dir DIR` on a "
            f"machine with network, copy DIR here and pass {flag} DIR")


def check_image_encoder_folder(folder: Union[str, Path, None], flag: str) -> Path:
    """The folder holding image_encoder/config.json and feature_extractor/preprocessor_config.json, else one
    EncoderError naming `flag` and how to get them."""
    if not folder:
        raise EncoderError(f"{flag} is not set; the image encoder is read from a local folder only: "
                           f"{how_to_provide(flag)}")
    root = Path(folder).expanduser()
    for sub, name in zip(SUBFOLDERS, ("config.json", "preprocessor_config.json")):
        if not (root / sub / name).is_file():
            raise EncoderError(f"{flag} '{root}' has no {sub}/{name} (an image-to-video pipeline folder with "
                               f"{' and '.join(SUBFOLDERS)} is expected): {how_to_provide(flag)}")
    return root


@dataclass
class ImageEncoder:
    """A loaded SigLIP image encoder and its processor."""
    model: Any
    processor: Any

    @torch.no_grad()
    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) frames -> float32 (B, S, Di) image embeddings (the pipeline's _get_image_embeds)."""
        device = next(self.model.parameters()).device
        pixels = self.processor.preprocess(images=[Image.fromarray(f) for f in frames], do_resize=True,
                                           return_tensors="pt", do_convert_rgb=True)
        pixels = pixels.to(device=device, dtype=next(self.model.parameters()).dtype)
        return self.model(**pixels).last_hidden_state.float().cpu().numpy()


def load_image_encoder(folder: Union[str, Path], flag: str, device: Any = "cpu") -> ImageEncoder:
    """The SiglipVisionModel and SiglipImageProcessor under `folder` (check_image_encoder_folder), frozen."""
    from transformers import SiglipImageProcessor, SiglipVisionModel   # heavy: only runs that store image embeds

    root = check_image_encoder_folder(folder, flag)
    try:
        model = SiglipVisionModel.from_pretrained(str(root / "image_encoder"), local_files_only=True)
        processor = SiglipImageProcessor.from_pretrained(str(root / "feature_extractor"), local_files_only=True)
    except (OSError, ValueError) as err:
        raise EncoderError(f"{flag} '{root}' does not load as SiglipVisionModel + SiglipImageProcessor ({err}): "
                           f"{how_to_provide(flag)}") from None
    return ImageEncoder(model.eval().requires_grad_(False).to(device), processor)


def save_tiny_image_encoder(out: Union[str, Path], *, width: int = 32, side: int = 32, seed: int = 0) -> Path:
    """A RANDOM tiny SigLIP (16 tokens of `width`) and its processor at `out` (image_encoder/, feature_extractor/):
    the offline stand-in for tests; its embeddings mean nothing. Leaves the global RNG alone."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    out = Path(out)
    config = SiglipVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                                num_attention_heads=4, image_size=side, patch_size=side // 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        SiglipVisionModel(config).eval().save_pretrained(str(out / "image_encoder"))
    SiglipImageProcessor(size={"height": side, "width": side}).save_pretrained(str(out / "feature_extractor"))
    return out
