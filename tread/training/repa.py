"""REPA during training: the frozen encoder of model.repa, its patch features of each batch's clean images, and
the alignment loss added to the diffusion loss (tread/models/repa.py defines which tokens are aligned).

The clean images are the batch's latents decoded as evaluation decodes them (identity data directly, VAE data
with the data's VAE: on latent data that is one VAE decode per training batch, the price of aligning with an
image encoder without stored features).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
from omegaconf import open_dict

from tread.data import decode_to_uint8, ensure_toy_classifier
from tread.encoders.patch import REPA_TOY_SEED, build_patch_encoder
from tread.evaluation.evaluator import decode_options
from tread.models.errors import ModelConfigError
from tread.models.repa import alignment_loss, patch_targets


@dataclass
class Repa:
    """What the training step needs for REPA: the frozen encoder, the loss weight, the decode options and the
    model's patch (latents per token), from which each batch's token grid follows (bucketed data: per bucket)."""

    encoder: nn.Module
    weight: float
    decode: dict[str, Any]      # decode_to_uint8 options (eval.vae, vae_dtype, decode_batch_size)
    patch: Optional[tuple[int, int]] = None   # the model's (rows, cols) of latents per token; set once it is built

    def loss(self, projected: torch.Tensor, ids: Optional[torch.Tensor], x: torch.Tensor,
             meta: Mapping[str, Any]) -> torch.Tensor:
        """The alignment loss of a training forward's projected tokens (B, K or N, C) and their ids (B, K) or
        None (the backbone's auxiliary output under REPA_AUX) against the encoder's features of the clean
        latents x (B, C, H, W)."""
        with torch.no_grad():
            images = decode_to_uint8(x.detach(), meta, **self.decode).permute(0, 3, 1, 2).float() / 127.5 - 1
            grid = (x.shape[-2] // self.patch[0], x.shape[-1] // self.patch[1])
            targets = patch_targets(self.encoder(images), grid)
        return alignment_loss(projected, targets, ids)


def build_repa(cfg: Any, device: torch.device) -> Optional[Repa]:
    """The run's Repa (None without model.repa). Builds the encoder before the model, so a missing encoder fails
    in seconds, and fills model.repa.encoder_dim from it when null (the head is sized by it, and the saved config
    then rebuilds the same model in sample.py)."""
    spec = cfg.model.get("repa")
    if not spec:
        return None
    # The toy encoder is the toy classifier trained (once, cached) at the data's side with REPA's own seed.
    weights = ensure_toy_classifier(str(cfg.paths.cache_dir), resolution=int(cfg.data.resolution),
                                    seed=REPA_TOY_SEED) if spec.encoder == "toy" else spec.get("encoder_weights")
    encoder = build_patch_encoder(spec.encoder, weights=weights, device=device)
    if spec.get("encoder_dim") is None:
        with open_dict(cfg):
            cfg.model.repa.encoder_dim = int(encoder.dim)
    elif int(spec.encoder_dim) != int(encoder.dim):
        raise ModelConfigError(f"model.repa.encoder_dim={spec.encoder_dim} but the {spec.encoder} encoder's features "
                               f"are {encoder.dim} wide; allowed: {encoder.dim} or null (read from the encoder).")
    return Repa(encoder, float(spec.weight), decode_options(cfg.eval))
