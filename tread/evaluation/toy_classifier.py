"""An offline feature network for FID on the built-in toy_shapes data.

Inception weights need a download and say little about 32x32 coloured shapes, so the
built-in data is scored with the penultimate features of a small CNN trained once,
deterministically, to classify the shapes (300 images per class x 4 epochs of Adam: ~7 s on
2 CPU cores, held-out accuracy 1.0). It is trained on freshly generated images (seed 12345),
not on the training set (seed 0). Roughly, 500 samples against the dataset's reference give
FID ~0.1 for real images, ~1 with Gaussian noise (sd 20/255), ~5-7 after a 3x3 blur, ~50-90
with half the classes missing and ~200-260 for one class or pure noise: mode collapse and
wrong looks are penalised strongly, pixel noise mildly (the classes are easy to tell apart).

    python -m tread.evaluation.toy_classifier --cache-dir .cache     # (re)build the cached artefact
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.data.toy import generate_toy_shapes
from tread.utils.io import atomic_write, atomic_write_text

# 64-d features: FID estimates a DxD covariance, and in-training evaluation uses only
# ~500-1000 samples; with D=64 that is >= 8 samples per dimension, so the covariance is
# well conditioned and FID's small-sample bias stays low (128-d doubles both problems).
FEATURE_DIM = 64
DEFAULT_SEED = 12345


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


def _toy_uint8(num_per_class: int, resolution: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = generate_toy_shapes(num_per_class, resolution, seed)
    # The same [-1, 1] -> uint8 quantisation as decoding, so the net sees what it will be fed.
    return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8), labels.long()


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 500) -> float:
    model.eval()
    correct = sum((model(images[i:i + batch_size]).argmax(1) == labels[i:i + batch_size]).sum().item()
                  for i in range(0, len(images), batch_size))
    return correct / len(images)


def train_toy_classifier(resolution: int = 32, seed: int = DEFAULT_SEED, num_per_class: int = 300,
                         epochs: int = 4, batch_size: int = 64, lr: float = 3e-3,
                         verbose: bool = False) -> tuple[ToyClassifier, float]:
    """Train on fresh toy_shapes (generator seed `seed`); return (model in eval mode, held-out accuracy)."""
    torch.manual_seed(seed)
    x, y = _toy_uint8(num_per_class, resolution, seed)
    x_val, y_val = _toy_uint8(max(20, num_per_class // 4), resolution, seed + 1)  # held out: another seed
    model = ToyClassifier(num_classes=int(y.max()) + 1, resolution=resolution)
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
    acc = accuracy(model, x_val, y_val)
    return model.eval(), acc


def cache_path(cache_dir: Union[str, Path], resolution: int = 32, seed: int = DEFAULT_SEED) -> Path:
    return Path(cache_dir) / f"toy_classifier_r{resolution}_s{seed}.pt"


def load_or_train_toy_classifier(cache_dir: Union[str, Path], resolution: int = 32, seed: int = DEFAULT_SEED,
                                 verbose: bool = True) -> ToyClassifier:
    """The cached classifier, training and caching it first if needed (atomic writes, so concurrent
    processes at worst train it twice and never read a partial file)."""
    path = cache_path(cache_dir, resolution, seed)
    if path.is_file():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = ToyClassifier(**ckpt["config"])
        model.load_state_dict(ckpt["state_dict"])
        return model.eval()
    if verbose:
        print(f"Training the toy-classifier feature network (one-off, cached at {path}) ...", flush=True)
    start = time.time()
    model, acc = train_toy_classifier(resolution, seed, verbose=verbose)
    info = {"accuracy": acc, "train_seconds": round(time.time() - start, 1), "seed": seed,
            "resolution": resolution, **model.config, "torch": str(torch.__version__)}
    if verbose:
        print(f"Toy classifier: held-out accuracy {acc:.4f}, {info['train_seconds']} s", flush=True)
    if acc < 0.9:
        print(f"WARNING: toy classifier accuracy is only {acc:.3f}; its FID features may be weak.", flush=True)
    save_toy_classifier(model, path, info)
    return model


def save_toy_classifier(model: ToyClassifier, path: Union[str, Path], info: dict) -> Path:
    """Write the artefact (config + state_dict + info) and a human-readable .json of info, atomically."""
    path = Path(path)
    atomic_write(path, lambda f: torch.save({"config": model.config, "state_dict": model.state_dict(),
                                             "info": info}, f))
    atomic_write_text(path.with_suffix(".json"), json.dumps(info, indent=2))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Train and cache the toy-classifier FID feature network.")
    parser.add_argument("--cache-dir", default=".cache")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--force", action="store_true", help="retrain even if a cached artefact exists")
    args = parser.parse_args()
    path = cache_path(args.cache_dir, args.resolution, args.seed)
    if args.force and path.exists():
        path.unlink()
    load_or_train_toy_classifier(args.cache_dir, args.resolution, args.seed)
    print(f"Toy classifier at {path}")


if __name__ == "__main__":
    main()
