"""An offline feature network for FID on the built-in toy_shapes data: a small CNN, its training loop and its
file. Trained on freshly generated images (seed 12345), not the training set; docs/evaluation.md gives its
accuracy and the FID it gives for real, noisy and collapsed sample sets.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.encoders.errors import EncoderError, missing_weights
from tread.utils.io import atomic_write, atomic_write_text

# 64-d features: FID estimates a DxD covariance, and in-training evaluation uses only
# ~500-1000 samples; with D=64 that is >= 8 samples per dimension, so the covariance is
# well conditioned and FID's small-sample bias stays low (128-d doubles both problems).
FEATURE_DIM = 64
DEFAULT_SEED = 12345
REBUILD = "python scripts/toy_classifier.py --cache-dir DIR --resolution R --seed S"


class ToyClassifier(nn.Module):
    """uint8 (B, 3, H, W) -> logits; `features()` gives the 64-d penultimate layer."""

    def __init__(self, num_classes: int = 10, resolution: int = 32, width: int = 32,
                 feature_dim: int = FEATURE_DIM):
        super().__init__()
        self.config = dict(num_classes=num_classes, resolution=resolution, width=width, feature_dim=feature_dim)
        self.resolution = resolution

        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        w = width
        self.trunk = nn.Sequential(*block(3, w, 1), *block(w, w, 2), *block(w, 2 * w, 1), *block(2 * w, 2 * w, 2),
                                   *block(2 * w, 4 * w, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embed = nn.Linear(4 * w, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"ToyClassifier expects uint8 (B, 3, H, W) images, got {x.dtype} {tuple(x.shape)}")
        x = x.float() / 127.5 - 1.0
        if x.shape[-2:] != (self.resolution, self.resolution):  # features are only meaningful at the trained size
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", antialias=True,
                              align_corners=False)
        return x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-activation embedding: no dead (constant-zero) dimensions, so the covariance stays full rank.
        return self.embed(self.trunk(self._normalise(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.features(x)))


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 500) -> float:
    model.eval()
    correct = sum((model(images[i:i + batch_size]).argmax(1) == labels[i:i + batch_size]).sum().item()
                  for i in range(0, len(images), batch_size))
    return correct / len(images)


def train_toy_classifier(images: torch.Tensor, labels: torch.Tensor, val_images: torch.Tensor,
                         val_labels: torch.Tensor, *, seed: int = DEFAULT_SEED, epochs: int = 4, batch_size: int = 64,
                         lr: float = 3e-3, verbose: bool = False) -> tuple[ToyClassifier, float]:
    """Train a ToyClassifier on uint8 (N, 3, R, R) `images` and int64 `labels`, torch seeded with `seed` first;
    return (model in eval mode, its accuracy on val_images / val_labels)."""
    torch.manual_seed(seed)
    x, y = images, labels
    model = ToyClassifier(num_classes=int(y.max()) + 1, resolution=int(x.shape[-1]))
    steps_per_epoch = -(-len(x) // batch_size)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    # One-cycle LR: reaches high accuracy in a few epochs without tuning.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if verbose:
            print(f"  toy classifier epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}", flush=True)
    acc = accuracy(model, val_images, val_labels)
    return model.eval(), acc


def cache_path(cache_dir: Union[str, Path], resolution: int = 32, seed: int = DEFAULT_SEED) -> Path:
    """Where the classifier trained at `resolution` with `seed` is cached under `cache_dir`."""
    return Path(cache_dir) / f"toy_classifier_r{resolution}_s{seed}.pt"


def save_toy_classifier(model: ToyClassifier, path: Union[str, Path], info: dict) -> Path:
    """Write the artefact (config + state_dict + info) and a human-readable .json of info, atomically."""
    path = Path(path)
    atomic_write(path, lambda f: torch.save({"config": model.config, "state_dict": model.state_dict(),
                                             "info": info}, f))
    atomic_write_text(path.with_suffix(".json"), json.dumps(info, indent=2))
    return path


def load_toy_classifier(path: Union[str, Path]) -> ToyClassifier:
    """The classifier saved at `path` (save_toy_classifier), in eval mode; EncoderError naming the path and how to
    build it when it is missing or unreadable."""
    path = Path(path).expanduser()
    how = (f"it is trained (a few seconds on a CPU) and cached on first use by training and fid.py with "
           f"features toy_classifier, or build it with `{REBUILD}` (the file is named "
           f"toy_classifier_r<resolution>_s<seed>.pt in the cache directory, paths.cache_dir)")
    if not path.is_file():
        raise missing_weights("toy-classifier weights", path, how)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = ToyClassifier(**ckpt["config"])
        model.load_state_dict(ckpt["state_dict"])
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file is reported the same way
        raise EncoderError(f"the toy-classifier weights at '{path}' do not load ({type(err).__name__}: "
                           f"{str(err).strip()[:200]}). Delete the file so that it is rebuilt: {how}") from None
    return model.eval()
