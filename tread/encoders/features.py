"""The metric feature networks (Inception for FID/sFID/IS/precision/recall/KID, the toy classifier, FDD's
DINOv2), frozen and built from explicit local files.

Every extractor takes uint8 (B, 3, H, W) images: forward -> float32 (B, dim) pool features, forward_all ->
{"pool", "spatial", "logits"} from one pass. Inception reproduces ADM's evaluator (docs/evaluation.md).
"""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from tread.encoders.dinov2 import FDD_DINOV2, fdd_architecture_note, fdd_pixels, load_dinov2, weights_digest
from tread.encoders.errors import EncoderError, missing_weights
from tread.encoders.toy_classifier import load_toy_classifier
from tread.utils.device import resolve_device
from tread.utils.io import atomic_write

FEATURE_NAMES = ("toy_classifier", "inception")
# The weights torch-fidelity's FeatureExtractorInceptionV3 downloads when given no path
# (TF Inception-v3 2015-12-05 converted to PyTorch; FID-compatible with the ADM/TF numbers).
INCEPTION_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                 "weights-inception-2015-12-05-6726825d.pth")
DOWNLOAD_TIMEOUT_S = 30


def inception_cache_path() -> Path:
    """Where torch-fidelity caches the weights: torch.hub's load_state_dict_from_url location,
    <torch hub dir>/checkpoints/ (default ~/.cache/torch/hub/checkpoints; moved by $TORCH_HOME)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(INCEPTION_URL)


def inception_how_to_provide() -> str:
    """The steps that make the Inception weights loadable on a machine without network."""
    name = os.path.basename(INCEPTION_URL)
    return (f"download {INCEPTION_URL} on a machine with network, then pass its path with "
            f"eval.inception_weights=/path/to/{name} (training; fid.py: inception_weights=..., "
            f"scripts/precompute_latents.py: --inception-weights ...), or copy it to {inception_cache_path()} (the "
            f"torch hub cache torch-fidelity uses; set TORCH_HOME to move it). For the built-in data, "
            f"features toy_classifier need no download.")


def inception_weights_file(weights_path: Optional[Union[str, Path]] = None) -> Path:
    """The Inception weights to load: `weights_path` (which must exist), else the torch hub cache's copy, downloaded
    there first when missing; without network it fails within DOWNLOAD_TIMEOUT_S with an EncoderError."""
    if weights_path is not None:
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise missing_weights("Inception weights file (eval.inception_weights / inception_weights)", path,
                                  inception_how_to_provide())
        return path
    path = inception_cache_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # fail fast instead of hanging on a dead network
    try:
        torch.hub.download_url_to_file(INCEPTION_URL, str(path), progress=False)
    except Exception as e:  # noqa: BLE001 - no network, a proxy, a full disk: all end the same way
        raise EncoderError(f"Could not download the Inception-v3 FID weights ({path.name}) from {INCEPTION_URL} "
                           f"({e!r}). To provide them: {inception_how_to_provide()}") from None
    finally:
        socket.setdefaulttimeout(old_timeout)
    return path


# ADM's sFID features: the first 7 channels of mixed_6/conv (17 x 17 at Inception's 299 px input).
SPATIAL_CHANNELS = 7
INCEPTION_SPATIAL_SIDE = 17


def _nhwc_flat(x: torch.Tensor, channels: int = SPATIAL_CHANNELS) -> torch.Tensor:
    """(B, C, H, W) -> (B, H * W * channels) float32: channels [:channels] in NHWC order, flattened, as ADM
    does with `spatial[..., :7]` on TF's NHWC tensor and `reshape([N, -1])`."""
    return x[:, :channels].permute(0, 2, 3, 1).reshape(x.shape[0], -1).float()


def _inception_class():
    # Lazy: torch-fidelity is a heavy optional dependency, needed only for Inception features.
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    return FeatureExtractorInceptionV3


class InceptionFeatures(nn.Module):
    """torch-fidelity's TF-compatible Inception-v3 (resizes to 299 inside): 2048-d pool_3 features,
    2023-d mixed_6/conv spatial features and 1008 bias-free logits (see the module docstring)."""

    name = "inception"
    dim = 2048
    spatial_dim = INCEPTION_SPATIAL_SIDE ** 2 * SPATIAL_CHANNELS  # 2023
    num_logits = 1008

    def __init__(self, weights_path: Optional[Union[str, Path]] = None):  # None: the torch hub cache's copy
        super().__init__()
        weights_path = inception_weights_file(weights_path)
        try:
            self.net = _inception_class()("inception-v3-compat", ["2048", "logits_unbiased"],
                                          feature_extractor_weights_path=str(weights_path))
        except Exception as e:  # noqa: BLE001 - unreadable file, or a state_dict of another architecture
            raise EncoderError(f"'{weights_path}' is not usable as torch-fidelity Inception-v3 weights (expected "
                               f"{os.path.basename(INCEPTION_URL)} from {INCEPTION_URL}: "
                               f"{type(e).__name__}: {str(e).strip()[:300]}). To provide them: "
                               f"{inception_how_to_provide()}") from None
        self._spatial: Optional[torch.Tensor] = None
        self._capture = False
        self.net.Mixed_6d.branch1x1.register_forward_hook(self._spatial_hook)

    def _spatial_hook(self, module: nn.Module, inputs, output: torch.Tensor) -> None:
        if self._capture:
            self._spatial = _nhwc_flat(output)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)[0]

    def forward_all(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        self._capture, self._spatial = True, None
        try:
            pool, logits = self.net(images)
            spatial = self._spatial
        finally:
            self._capture, self._spatial = False, None
        return {"pool": pool.float(), "spatial": spatial, "logits": logits.float()}


def save_random_inception_weights(path: Union[str, Path], seed: int = 0) -> Path:
    """Write a RANDOM-weight 'inception-v3-compat' state_dict to `path`, for tests and offline smoke runs only (its
    metrics mean nothing). Deterministic in `seed`; the global RNG state is left untouched."""
    class _RandomInception(_inception_class()):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # keep the random initialisation
            return None

    with tempfile.TemporaryDirectory() as tmp, torch.random.fork_rng(devices=[]):
        empty = Path(tmp) / "empty.pth"
        torch.save({}, empty)
        torch.manual_seed(seed)
        net = _RandomInception("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(empty))
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        nn.init.normal_(net.fc.weight, std=net.fc.in_features ** -0.5)
        nn.init.zeros_(net.fc.bias)
        state = net.state_dict()
    return atomic_write(path, lambda f: torch.save(state, f))


class ToyClassifierFeatures(nn.Module):
    """Features of the offline toy-shapes classifier: pool = the 64-d penultimate embedding, logits = its 10-class
    head, spatial = the first 7 channels of the 4th conv block, NHWC-flattened like ADM's sFID (448-d at 32 px)."""

    name = "toy_classifier"
    SPATIAL_LAYER = 11  # index in classifier.trunk of the ReLU ending block 4 (the second stride-2 block)

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier
        self.dim = classifier.embed.out_features
        self.num_logits = classifier.head.out_features
        self.resolution = int(classifier.resolution)
        side = self.resolution
        for _ in range(2):  # two 3x3 stride-2 padding-1 convolutions before SPATIAL_LAYER
            side = (side - 1) // 2 + 1
        channels = min(SPATIAL_CHANNELS, classifier.trunk[self.SPATIAL_LAYER - 2].out_channels)
        self.spatial_dim = side * side * channels

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(images).float()

    def forward_all(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.classifier._normalise(images)
        spatial = None
        for i, layer in enumerate(self.classifier.trunk):
            x = layer(x)
            if i == self.SPATIAL_LAYER:
                spatial = _nhwc_flat(x)
        pool = self.classifier.embed(x)
        logits = self.classifier.head(torch.relu(pool))
        return {"pool": pool.float(), "spatial": spatial, "logits": logits.float()}


def forward_features(extractor: nn.Module, images: torch.Tensor, spatial: bool = True,
                     logits: bool = True) -> dict[str, torch.Tensor]:
    """extractor.forward_all(images); for a pool-only extractor (no forward_all) {"pool": extractor(images)},
    which is enough when neither spatial features nor logits are needed."""
    if hasattr(extractor, "forward_all"):
        return extractor.forward_all(images)
    if spatial or logits:
        what = " and ".join(w for w, on in (("spatial features (sfid)", spatial), ("logits (is)", logits)) if on)
        raise TypeError(f"feature extractor '{getattr(extractor, 'name', type(extractor).__name__)}' has no "
                        f"forward_all(), so it gives no {what}")
    return {"pool": extractor(images).float()}


def check_feature_name(name: str) -> str:
    """`name` if it is a metric feature network (FEATURE_NAMES); else EncoderError saying which are."""
    if name not in FEATURE_NAMES:
        raise EncoderError(f"Unknown feature extractor eval.features={name!r}; choose one of {FEATURE_NAMES}")
    return name


def build_feature_extractor(name: str, *, inception_weights: Optional[Union[str, Path]] = None,
                            toy_classifier: Optional[Union[str, Path]] = None,
                            device: Union[str, torch.device] = "cpu") -> nn.Module:
    """The frozen extractor `name` ("inception" from `inception_weights`, None: the hub cache; "toy_classifier" from
    the file `toy_classifier`) in eval mode on `device` ("auto": CUDA if available)."""
    if check_feature_name(name) == "inception":
        extractor: nn.Module = InceptionFeatures(inception_weights)
    elif toy_classifier is None:
        raise EncoderError("features toy_classifier need the classifier's file (toy_classifier=PATH); "
                           "tread.evaluation.extractors.feature_extractor finds or builds it in the cache directory")
    else:
        extractor = ToyClassifierFeatures(load_toy_classifier(toy_classifier))
    return extractor.to(resolve_device(device)).eval().requires_grad_(False)


def extractor_device(extractor: nn.Module) -> torch.device:
    return next(extractor.parameters()).device


class DinoFeatures(nn.Module):
    """FDD's feature network: the DINOv2 CLS token (after the final layer norm) of uint8 (B, 3, H, W) images,
    preprocessed by dinov2.fdd_pixels. `name` carries a digest of the weights, so cached references never mix."""

    def __init__(self, model: nn.Module, weights: Union[str, Path]):
        super().__init__()
        self.model = model
        self.dim = self.spatial_dim = int(model.config.hidden_size)
        self.skip = 1 + int(getattr(model.config, "num_register_tokens", 0) or 0)   # CLS (+ registers)
        self.name = f"dinov2_{weights_digest(weights)}"

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_all(images)["pool"]

    @torch.no_grad()
    def forward_all(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """pool: the CLS token (FDD's features); spatial: the mean patch token (what a cached reference keeps
        beside it; no metric reads it). Both float32 (B, dim)."""
        tokens = self.model(pixel_values=fdd_pixels(images)).last_hidden_state.float()
        return {"pool": tokens[:, 0], "spatial": tokens[:, self.skip:].mean(dim=1)}


def build_dino_features(weights: Optional[Union[str, Path]], key: str, device: Union[str, torch.device] = "cpu"
                        ) -> DinoFeatures:
    """FDD's frozen DINOv2 feature network from a local folder (`key` names the config key in errors; the
    how-to names ViT-L/14, FDD's network). Prints a one-line note when the weights are not ViT-L/14."""
    model = load_dinov2(weights, key, model_id=FDD_DINOV2)
    note = fdd_architecture_note(model)
    if note:
        print(note, flush=True)
    return DinoFeatures(model, weights).eval().requires_grad_(False).to(device)
