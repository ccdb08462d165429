"""The independent evaluator's networks for the built-in toy_shapes data: a convolutional autoencoder (fd_ae
features) and a held-out pixel MLP classifier (class_acc), their training loops and their files.

They share neither architecture, objective nor seed with the toy FID's classifier (docs/evaluation.md,
"An independent evaluator for the built-in data").
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

AUTOENCODER_SEED = 31337     # not 0 (training data), 12345 (the toy classifier) or 777 (REPA's toy target)
MLP_SEED = 2718
BOTTLENECK = 32              # bottleneck channels; features: mean and max pooled, 2 x 32 = 64-d
MLP_SIDE = 8                 # the MLP sees 8x8 area-averaged pixels


def to_unit(x: torch.Tensor, resolution: int, who: str) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float (B, 3, R, R) in [-1, 1] (antialiased bilinear resize when H, W != R)."""
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"{who} expects uint8 (B, 3, H, W) images, got {x.dtype} {tuple(x.shape)}")
    x = x.float() / 127.5 - 1.0
    if x.shape[-2:] != (resolution, resolution):
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", antialias=True, align_corners=False)
    return x


class ToyAutoencoder(nn.Module):
    """uint8 (B, 3, R, R) -> reconstruction in [-1, 1]; features() gives the 64-d pooled bottleneck."""

    def __init__(self, resolution: int = 32, width: int = 16, bottleneck: int = BOTTLENECK):
        super().__init__()
        self.config = dict(resolution=resolution, width=width, bottleneck=bottleneck)
        self.resolution = resolution
        w = width
        self.encoder = nn.Sequential(nn.Conv2d(3, w, 4, 2, 1), nn.GELU(), nn.Conv2d(w, 2 * w, 4, 2, 1), nn.GELU(),
                                     nn.Conv2d(2 * w, bottleneck, 3, 1, 1))
        self.decoder = nn.Sequential(nn.GELU(), nn.ConvTranspose2d(bottleneck, 2 * w, 4, 2, 1), nn.GELU(),
                                     nn.ConvTranspose2d(2 * w, w, 4, 2, 1), nn.GELU(), nn.Conv2d(w, 3, 3, 1, 1),
                                     nn.Tanh())
        self.feature_dim = 2 * bottleneck

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images -> the bottleneck map (B, bottleneck, R/4, R/4)."""
        return self.encoder(to_unit(x, self.resolution, "ToyAutoencoder"))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 64) float32: the bottleneck's mean and max over positions."""
        z = self.encode(x).flatten(2)
        return torch.cat([z.mean(2), z.amax(2)], 1).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encode(x))


class ToyPixelMLP(nn.Module):
    """uint8 (B, 3, R, R) -> class logits, from MLP_SIDE x MLP_SIDE area-averaged pixels."""

    def __init__(self, num_classes: int = 10, resolution: int = 32, hidden: int = 128, side: int = MLP_SIDE):
        super().__init__()
        self.config = dict(num_classes=num_classes, resolution=resolution, hidden=hidden, side=side)
        self.resolution, self.side = resolution, side
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * side * side, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(F.adaptive_avg_pool2d(to_unit(x, self.resolution, "ToyPixelMLP"), self.side))


def _fit(model: nn.Module, loss_of, n: int, *, seed: int, epochs: int, batch_size: int, lr: float) -> nn.Module:
    """Adam with a one-cycle LR over `epochs` passes of shuffled batches (order from a generator seeded with
    `seed`); loss_of(index tensor) -> scalar loss. Returns the model in eval mode."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * -(-n // batch_size))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            loss = loss_of(perm[i:i + batch_size])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def train_toy_autoencoder(images: torch.Tensor, val_images: torch.Tensor, *, seed: int = AUTOENCODER_SEED,
                          epochs: int = 4, batch_size: int = 64, lr: float = 3e-3, width: int = 16
                          ) -> tuple[ToyAutoencoder, float]:
    """Train a ToyAutoencoder to reconstruct uint8 (N, 3, R, R) `images` (torch seeded with `seed` first);
    return (model in eval mode, its mean squared error on val_images, in [-1, 1] units)."""
    torch.manual_seed(seed)
    model = ToyAutoencoder(resolution=int(images.shape[-1]), width=width)
    target = to_unit(images, model.resolution, "ToyAutoencoder")
    _fit(model, lambda idx: F.mse_loss(model(images[idx]), target[idx]), len(images), seed=seed, epochs=epochs,
         batch_size=batch_size, lr=lr)
    with torch.no_grad():
        mse = F.mse_loss(model(val_images), to_unit(val_images, model.resolution, "ToyAutoencoder")).item()
    return model, mse


def train_toy_pixel_mlp(images: torch.Tensor, labels: torch.Tensor, val_images: torch.Tensor,
                        val_labels: torch.Tensor, *, seed: int = MLP_SEED, epochs: int = 8, batch_size: int = 64,
                        lr: float = 3e-3) -> tuple[ToyPixelMLP, float]:
    """Train a ToyPixelMLP on uint8 `images` and int64 `labels` (torch seeded with `seed` first); return (model in
    eval mode, its accuracy on val_images / val_labels)."""
    torch.manual_seed(seed)
    model = ToyPixelMLP(num_classes=int(labels.max()) + 1, resolution=int(images.shape[-1]))
    _fit(model, lambda idx: F.cross_entropy(model(images[idx]), labels[idx]), len(images), seed=seed,
         epochs=epochs, batch_size=batch_size, lr=lr)
    with torch.no_grad():
        acc = (model(val_images).argmax(1) == val_labels).double().mean().item()
    return model, acc


# ----------------------------------------------------------------------------- files

NETS = {"toy_autoencoder": ToyAutoencoder, "toy_pixel_mlp": ToyPixelMLP}


def net_path(kind: str, cache_dir: Union[str, Path], resolution: int, seed: int) -> Path:
    """<cache_dir>/<kind>_r<resolution>_s<seed>.pt (kind: toy_autoencoder | toy_pixel_mlp)."""
    return Path(cache_dir) / f"{kind}_r{resolution}_s{seed}.pt"


def save_net(model: nn.Module, path: Union[str, Path], info: dict) -> Path:
    """Write config + state_dict + info, and info as a readable .json beside it, atomically."""
    path = Path(path)
    atomic_write(path, lambda f: torch.save({"config": model.config, "state_dict": model.state_dict(),
                                             "info": info}, f))
    atomic_write_text(path.with_suffix(".json"), json.dumps(info, indent=2))
    return path


def load_net(kind: str, path: Union[str, Path]) -> nn.Module:
    """The `kind` network saved at `path` (save_net), in eval mode; EncoderError naming the path when it is
    missing or does not load."""
    path = Path(path).expanduser()
    how = (f"it is trained (seconds on a CPU) and cached on first use by evaluation with eval.metrics including "
           f"fd_ae or class_acc on the built-in data (the file is named {kind}_r<resolution>_s<seed>.pt in "
           f"paths.cache_dir)")
    if not path.is_file():
        raise missing_weights(f"{kind} weights", path, how)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = NETS[kind](**ckpt["config"])
        model.load_state_dict(ckpt["state_dict"])
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file is reported the same way
        raise EncoderError(f"the {kind} weights at '{path}' do not load ({type(err).__name__}: "
                           f"{str(err).strip()[:200]}). Delete the file so that it is rebuilt: {how}") from None
    return model.eval()


class AutoencoderFeatures(nn.Module):
    """The autoencoder as a metric feature network (fd_ae): pool = spatial = its 64-d pooled bottleneck; `name`
    carries the seed, so a cached reference of another autoencoder is never reused."""

    def __init__(self, autoencoder: ToyAutoencoder, seed: int):
        super().__init__()
        self.autoencoder = autoencoder
        self.name = f"toy_autoencoder_s{seed}"
        self.dim = self.spatial_dim = autoencoder.feature_dim
        self.resolution = autoencoder.resolution

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.autoencoder.features(images)

    def forward_all(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        pool = self.autoencoder.features(images)
        return {"pool": pool, "spatial": pool}
