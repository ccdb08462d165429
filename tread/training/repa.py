"""REPA during training: the frozen encoder of model.repa, its patch features of each batch's clean images
(stored with the data when the same encoder made them, else of the batch's latents decoded), and the
alignment loss added to the diffusion loss (docs/data.md, "REPA features").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from tread.data import decode_to_uint8
from tread.data.builtin.toy import load_repa_encoder
from tread.data.repa_features import encoder_input, features_mismatch
from tread.models.errors import ModelConfigError
from tread.models.dit import parse_arch
from tread.models.repa import alignment_loss, patch_targets, resolve_repa_block


class TargetTimer:
    """Seconds spent on REPA targets since the last take(): host wall time, or on a GPU (cuda=True) CUDA events
    read at take() (the log record syncs there anyway), so timing adds no sync to the step."""

    def __init__(self, cuda: bool = False):
        self.cuda, self.sec, self.events, self._start = cuda, 0.0, [], None

    def __enter__(self) -> "TargetTimer":
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
        else:
            self.sec += time.perf_counter() - self._start

    def take(self) -> float:
        """The seconds summed since the previous take(); restarts the sum."""
        if self.events:
            self.events[-1][1].synchronize()
            self.sec += sum(a.elapsed_time(b) for a, b in self.events) / 1000.0
        sec, self.sec, self.events = self.sec, 0.0, []
        return sec


@dataclass
class Repa:
    """What the training step needs for REPA: the frozen encoder, the loss weight, the decode options and the
    model's patch (latents per token), from which each batch's token grid follows (bucketed data: per bucket)."""

    encoder: Optional[nn.Module]   # None once the targets are the stored features (use_stored_targets)
    weight: float
    decode: dict[str, Any]      # decode_to_uint8 options (eval.vae, vae_dtype, decode_batch_size)
    patch: Optional[tuple[int, int]] = None   # the model's (rows, cols) of latents per token; set once it is built
    encoder_flops: float = 0.0  # the encoder's forward FLOPs of one image (PatchEncoder.flops at the data's side)
    targets: str = "decoded"    # "decoded": encoded from the decoded latents each step; "precomputed": stored
    timer: TargetTimer = field(default_factory=TargetTimer)   # time spent on the targets (repa_target_sec)
    name: str = ""              # model.repa.encoder (which stored features are this encoder's)
    resolved: dict[str, Any] = field(default_factory=dict)   # model.repa's block and encoder_dim, nulls resolved

    def loss(self, projected: torch.Tensor, ids: Optional[torch.Tensor], x: torch.Tensor,
             meta: Mapping[str, Any], features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The alignment loss of projected tokens (B, K or N, C) with their ids (B, K) or None against the encoder's
        features of the clean latents x (B, C, H, W): `features` (B, dim, h, w) when stored, else of x decoded."""
        with torch.no_grad(), self.timer:
            if features is None:
                features = self.encoder(encoder_input(decode_to_uint8(x.detach(), meta, **self.decode)))
            grid = (x.shape[-2] // self.patch[0], x.shape[-1] // self.patch[1])
            targets = patch_targets(features.float(), grid)
        return alignment_loss(projected, targets, ids)


def dit_depth(model: Any) -> int:
    """The DiT's block count: model.depth, or model.arch's (REPA is for DiT models only; the schema checks it)."""
    return int(model.depth or parse_arch(model.arch)[0])


def build_repa(model: Any, resolution: int, cache_dir: str, decode: dict[str, Any], device: torch.device
               ) -> Optional[Repa]:
    """The run's Repa (None without model.repa) for data of latent side `resolution`, built before the model so a
    missing encoder fails early; also returns `resolved`, the encoder_dim and block filled in when null, which
    the saved config keeps so sample.py and a resume rebuild the same model."""
    spec = model.repa
    if spec is None:
        return None
    # The trained toy encoders are the toy classifier trained (once, cached) at the data's side with their seed
    # (toy: REPA's own, toy_fid: the FID network's); toy_random is built from its seed, no file.
    encoder, _ = load_repa_encoder(spec.encoder, spec.encoder_weights, cache_dir=cache_dir, resolution=resolution,
                                   device=device)
    if spec.encoder_dim is not None and int(spec.encoder_dim) != int(encoder.dim):
        raise ModelConfigError(f"model.repa.encoder_dim={spec.encoder_dim} but the {spec.encoder} encoder's features "
                               f"are {encoder.dim} wide; allowed: {encoder.dim} or null (read from the encoder).")
    resolved = {"block": resolve_repa_block(spec.block, dit_depth(model)), "encoder_dim": int(encoder.dim)}
    return Repa(encoder, float(spec.weight), decode, encoder_flops=encoder.flops(resolution),
                timer=TargetTimer(cuda=torch.device(device).type == "cuda"), name=str(spec.encoder),
                resolved=resolved)


def with_resolved(tree: dict[str, Any], repa: Optional[Repa]) -> dict[str, Any]:
    """A plain config holding a "model" section, with model.repa's resolved block and encoder width filled in;
    `tree` itself when there is no REPA."""
    if repa is None:
        return tree
    return {**tree, "model": {**tree["model"], "repa": {**tree["model"]["repa"], **repa.resolved}}}


def use_stored_targets(repa: Optional[Repa], dataset: Any, mode: str, where: str) -> Optional[str]:
    """Resolve model.repa.targets "auto"/"precomputed" against the features the data stores; "precomputed"
    without matching features raises ModelConfigError. Returns a note when "auto" falls back to decoding
    although (another encoder's) features are stored, else None."""
    if repa is None or mode == "decoded":
        return None
    stored = (dataset.meta or {}).get("repa_features")
    why = features_mismatch(stored, repa.name, repa.encoder) if dataset.stores_repa_features else \
        "the data's format (data.format=wds) stores no REPA features"
    if why is None:
        dataset.read_repa_features()
        repa.targets, repa.encoder = "precomputed", None    # never called again: its memory goes back
        return None
    if mode == "precomputed":
        raise ModelConfigError(f"model.repa.targets=precomputed but {why} at {where}; allowed: precompute them with "
                               f"scripts/precompute_latents.py --repa-encoder {repa.name}, or model.repa.targets="
                               f"auto|decoded (encode the decoded latents each step).")
    return f"note: REPA targets are decoded each step: {why} at {where}." if stored is not None else None
