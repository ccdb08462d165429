"""FVD's feature network: a VideoMAE video transformer from a local transformers folder (never downloaded), its input
convention, and its features of uint8 videos.

FVD is the Fréchet distance between clip features (Unterthiner et al. 2019, on I3D). Content-debiased FVD (Ge et al.
2024, `cd-fvd`) shows that I3D's Kinetics features reward per-frame content over motion and offers VideoMAE
features instead. We use VideoMAE through transformers' `VideoMAEModel` (a safetensors folder: no code is run from
the file, unlike I3D's TorchScript), so our FVD is a VideoMAE FVD: not comparable with published I3D numbers
(docs/evaluation.md, "FVD").
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from safetensors import SafetensorError

from tread.encoders.dinov2 import check_weights_folder, fdd_pixels, weights_digest
from tread.encoders.errors import EncoderError

FVD_VIDEOMAE = "MCG-NJU/videomae-base"   # self-supervised VideoMAE ViT-B (Kinetics-400), cd-fvd's kind of features


def how_to_provide(key: str, model_id: str = FVD_VIDEOMAE) -> str:
    """The offline steps that make VideoMAE weights loadable with `key`."""
    return (f"save one on a machine with network: `from transformers import VideoMAEModel; "
            f"VideoMAEModel.from_pretrained('{model_id}').save_pretrained('DIR')`, copy DIR here and set {key}=DIR")


def check_videomae_folder(weights: Optional[Union[str, Path]], key: str) -> None:
    """One EncoderError naming `key` unless `weights` is a saved VideoMAEModel folder (config.json, whole
    safetensors headers): cheap, so callers check before any work."""
    check_weights_folder(weights, key, "VideoMAE", "VideoMAEModel", how_to_provide(key))


def load_videomae(weights: Optional[Union[str, Path]], key: str) -> nn.Module:
    """A local VideoMAEModel (no download); one EncoderError naming `key` when it is missing or does not load."""
    check_videomae_folder(weights, key)
    from transformers import VideoMAEModel    # optional heavy import, only for FVD runs
    try:
        return VideoMAEModel.from_pretrained(str(Path(weights).expanduser()), local_files_only=True)
    except (OSError, ValueError, SafetensorError) as err:
        raise EncoderError(f"{key}={str(weights)!r} does not load as a VideoMAEModel ({err}): "
                           f"{how_to_provide(key)}.") from None


def frame_indices(frames: int, num: int) -> torch.Tensor:
    """`num` frame indices spread evenly over `frames` frames, first and last included (repeats when the clip is
    shorter than the network's input)."""
    return torch.linspace(0, frames - 1, num).round().long()


def fvd_pixels(videos: torch.Tensor, num_frames: int, side: int) -> torch.Tensor:
    """uint8 (B, F, H, W, 3) videos -> float32 (B, num_frames, 3, side, side) VideoMAE input: `num_frames` frames
    spread over each clip, each made as FDD's DINOv2 input is (antialiased bicubic resize, no crop, ImageNet mean
    and std: VideoMAE's image processor normalises with the same numbers)."""
    if videos.dtype != torch.uint8 or videos.dim() != 5 or videos.shape[-1] != 3:
        raise ValueError(f"FVD features need uint8 (B, F, H, W, 3) videos, got {videos.dtype} {tuple(videos.shape)}")
    picked = videos[:, frame_indices(videos.shape[1], num_frames).to(videos.device)]
    b = picked.shape[0]
    frames = fdd_pixels(picked.flatten(0, 1).permute(0, 3, 1, 2), side)
    return frames.unflatten(0, (b, num_frames))


class VideoFeatures(nn.Module):
    """FVD's features of uint8 (B, F, H, W, 3) videos: the mean of VideoMAE's last hidden states over every
    space-time token, float32 (B, dim). `name` carries a digest of the weights, so references never mix."""

    def __init__(self, model: nn.Module, weights: Union[str, Path]):
        super().__init__()
        self.model = model
        cfg = model.config
        self.dim = int(cfg.hidden_size)
        self.num_frames, self.side = int(cfg.num_frames), int(cfg.image_size)
        self.name = f"videomae_{weights_digest(weights)}"

    @torch.no_grad()
    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        device = next(self.model.parameters()).device
        pixels = fvd_pixels(torch.as_tensor(videos).to(device), self.num_frames, self.side)
        return self.model(pixel_values=pixels).last_hidden_state.float().mean(dim=1)


def build_video_features(weights: Optional[Union[str, Path]], key: str,
                         device: Union[str, torch.device] = "cpu") -> VideoFeatures:
    """FVD's frozen VideoMAE feature network from a local folder (`key` names the config key in errors)."""
    return VideoFeatures(load_videomae(weights, key), weights).eval().requires_grad_(False).to(device)


def save_tiny_videomae(out: Union[str, Path], *, side: int = 32, num_frames: int = 4, seed: int = 0) -> Path:
    """A RANDOM tiny VideoMAEModel folder (width 32, 2 layers, 8 px patches, tubelets of 2 frames): the offline
    stand-in for tests and the worked example; its FVD means nothing. Leaves the global RNG alone."""
    from transformers import VideoMAEConfig, VideoMAEModel

    config = VideoMAEConfig(image_size=side, patch_size=8, num_frames=num_frames, tubelet_size=2, hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        VideoMAEModel(config).eval().save_pretrained(str(out))
    return Path(out)
