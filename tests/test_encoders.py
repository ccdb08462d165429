"""tread/encoders: the bottom-layer package of frozen networks. Its imports (tread.utils only), REPA's patch encoders
(tread/encoders/patch.py: DINOv2 from a local folder, conftest.dino_dir, a tiny random model; the toy encoder), and
the one-line EncoderError every loader gives for missing weights, naming the path and how to provide them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Dinov2Model

from tread.data import ensure_toy_classifier
from tread.encoders.dinov2 import DINO_SIZE, IMAGENET_MEAN, IMAGENET_STD
from tread.encoders.errors import EncoderError
from tread.encoders.features import InceptionFeatures, build_dino_features
from tread.encoders.patch import REPA_TOY_SEED, build_patch_encoder
from tread.encoders.toy_classifier import DEFAULT_SEED, load_toy_classifier
from tread.encoders.vae import load_vae

ENCODERS_DIR = Path(__file__).resolve().parents[1] / "tread" / "encoders"


def images(n=2, side=32, seed=0):
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def tread_imports(path: Path) -> set[str]:
    """The tread modules a file imports, anywhere in it (function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tread"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import (imports are absolute)"
            if node.module and node.module.split(".")[0] == "tread":
                found.add(node.module)
    return found


def test_encoders_import_only_utils_and_themselves():
    files = sorted(ENCODERS_DIR.glob("*.py"))
    assert {p.stem for p in files} >= {"errors", "vae", "text", "tiny_text", "toy_classifier", "features", "dinov2",
                                       "patch"}
    for path in files:
        for module in tread_imports(path):
            assert module.startswith(("tread.utils", "tread.encoders")), f"{path.name} imports {module}"


def test_dinov2_patch_features_are_the_models_patch_tokens(dino_dir):
    encoder = build_patch_encoder("dinov2", weights=str(dino_dir))
    x = images()
    feats = encoder(x)
    side = DINO_SIZE // 14
    assert feats.shape == (2, 32, side, side) and encoder.dim == 32
    model = Dinov2Model.from_pretrained(dino_dir).eval()
    pixels = F.interpolate((x + 1) / 2, size=(DINO_SIZE, DINO_SIZE), mode="bicubic", align_corners=False)
    pixels = (pixels - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        tokens = model(pixel_values=pixels).last_hidden_state[:, 1:]
    assert torch.allclose(feats, tokens.transpose(1, 2).reshape(2, 32, side, side), atol=1e-6)


def toy_encoder(cache_dir):
    """REPA's toy encoder as training builds it: the classifier ensured with REPA's seed, then loaded."""
    return build_patch_encoder("toy", weights=ensure_toy_classifier(cache_dir, resolution=16, seed=REPA_TOY_SEED))


def test_encoders_are_frozen_and_deterministic(cache_dir):
    encoder = toy_encoder(cache_dir)
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.train()                                      # stays in eval mode: batch norm does not update
    x = images(side=16)
    a, b = encoder(x), encoder(x)
    assert torch.equal(a, b) and a.shape == (2, encoder.dim, 4, 4) and not a.requires_grad


def test_the_toy_encoder_is_not_the_fid_feature_network(cache_dir):
    assert REPA_TOY_SEED != DEFAULT_SEED
    encoder = toy_encoder(cache_dir)
    assert (cache_dir / f"toy_classifier_r16_s{REPA_TOY_SEED}.pt").is_file()
    assert encoder.classifier.trunk[0].weight.shape[0] > 0


@pytest.mark.parametrize("weights,match", [(None, "model.repa.encoder_weights is not set"),
                                           ("/nonexistent/dino", "is not a saved Dinov2Model folder")])
def test_missing_dinov2_weights_say_how_to_provide_them(weights, match):
    with pytest.raises(EncoderError, match=match) as err:
        build_patch_encoder("dinov2", weights=weights)
    assert "save_pretrained" in str(err.value)


def test_unknown_encoder_is_refused():
    with pytest.raises(EncoderError, match="model.repa.encoder='clip' is unknown; allowed: toy, toy_random, toy_fid, dinov2"):
        build_patch_encoder("clip")
    with pytest.raises(EncoderError, match="model.repa.encoder=toy needs the toy classifier's file"):
        build_patch_encoder("toy")


def test_missing_weights_are_one_error_line_naming_the_path_and_how_to_provide_them(tmp_path):
    missing = tmp_path / "nowhere"
    cases = [
        (lambda: load_toy_classifier(missing / "toy_classifier_r16_s12345.pt"), "scripts/toy_classifier.py"),
        (lambda: build_patch_encoder("toy", weights=missing / "toy.pt"), "scripts/toy_classifier.py"),
        (lambda: InceptionFeatures(missing / "inception.pth"), "weights-inception-2015-12-05-6726825d.pth"),
        (lambda: build_dino_features(missing, "eval.dinov2_weights"), "save_pretrained"),
        (lambda: build_patch_encoder("dinov2", weights=missing), "save_pretrained"),
        (lambda: load_vae(str(missing)), "hf download"),
    ]
    for build, how in cases:
        with pytest.raises(EncoderError) as err:
            build()
        message = str(err.value)
        assert str(missing) in message and how in message and "\n" not in message, message


def test_an_unreadable_toy_classifier_file_says_how_to_rebuild_it(tmp_path):
    bad = tmp_path / "toy_classifier_r16_s12345.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(EncoderError, match=r"toy-classifier weights at '.*' do not load.*Delete the file"):
        load_toy_classifier(bad)
