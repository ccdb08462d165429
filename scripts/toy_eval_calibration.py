"""Calibrate the built-in data's metrics (docs/evaluation.md, "An independent evaluator for the built-in data"):
fid (toy classifier), fd_ae, class_acc, shape_acc and colour_acc of 500 held-out toy images, as they are and
degraded, against 5000 training-seed images. Usage: python scripts/toy_eval_calibration.py [CACHE_DIR]"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tread.data.builtin.toy import _toy_uint8, ensure_toy_autoencoder, ensure_toy_classifier, ensure_toy_pixel_mlp
from tread.encoders.features import build_feature_extractor
from tread.encoders.toy_autoencoder import AUTOENCODER_SEED, AutoencoderFeatures, load_net
from tread.evaluation.frechet import frechet_distance
from tread.evaluation.extractors import extract_features
from tread.evaluation.toy_checks import colour_predictions, shape_predictions


def cases(x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    f = x.float()
    noisy = (f + torch.randn(f.shape, generator=g) * 20).round().clamp(0, 255).to(torch.uint8)
    blur = F.avg_pool2d(F.pad(f, (1, 1, 1, 1), mode="replicate"), 3, 1).round().to(torch.uint8)
    half = torch.cat([x[y < 5]] * 2), torch.cat([y[y < 5]] * 2)
    return {"real held-out images": (x, y), "Gaussian noise sd 20/255": (noisy, y), "3x3 blur": (blur, y),
            "half the classes missing": half, "labels shuffled": (x, y[torch.randperm(len(y), generator=g)])}


def main(cache: str) -> None:
    ref, _ = _toy_uint8(500, 32, seed=0)                       # the training data's generator seed
    x, y = _toy_uint8(50, 32, seed=424242)                     # 500 held-out images
    nets = {"fid": build_feature_extractor("toy_classifier", toy_classifier=ensure_toy_classifier(cache)),
            "fd_ae": AutoencoderFeatures(load_net("toy_autoencoder", ensure_toy_autoencoder(cache)), AUTOENCODER_SEED)}
    mlp = load_net("toy_pixel_mlp", ensure_toy_pixel_mlp(cache))
    refs = {k: extract_features(n, ref) for k, n in nets.items()}
    print("| images | fid | fd_ae | class_acc | shape_acc | colour_acc |\n|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, (im, lab) in cases(x, y).items():
            fd = {k: frechet_distance(*(lambda s: (s.mean(), s.cov()))(extract_features(n, im)), refs[k].mean(),
                                      refs[k].cov()) for k, n in nets.items()}
            accs = [(p == lab).double().mean().item() for p in (mlp(im).argmax(1), shape_predictions(im),
                                                                colour_predictions(im))]
            print(f"| {name} | {fd['fid']:.2f} | {fd['fd_ae']:.3f} | " + " | ".join(f"{a:.3f}" for a in accs) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cache")
