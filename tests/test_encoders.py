"""REPA's frozen patch encoders (tread/evaluation/encoders.py): DINOv2 from a local folder (conftest.dino_dir, a tiny
random model), the toy encoder, and the errors for missing weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Dinov2Model

from tread.evaluation.encoders import (DINO_SIZE, IMAGENET_MEAN, IMAGENET_STD, REPA_TOY_SEED, EncoderError,
                                 build_patch_encoder)
from tread.evaluation.toy_classifier import DEFAULT_SEED


def images(n=2, side=32, seed=0):
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


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


def test_encoders_are_frozen_and_deterministic(cache_dir):
    encoder = build_patch_encoder("toy", cache_dir=cache_dir, resolution=16)
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.train()                                      # stays in eval mode: batch norm does not update
    x = images(side=16)
    a, b = encoder(x), encoder(x)
    assert torch.equal(a, b) and a.shape == (2, encoder.dim, 4, 4) and not a.requires_grad


def test_the_toy_encoder_is_not_the_fid_feature_network(cache_dir):
    assert REPA_TOY_SEED != DEFAULT_SEED
    encoder = build_patch_encoder("toy", cache_dir=cache_dir, resolution=16)
    assert (cache_dir / f"toy_classifier_r16_s{REPA_TOY_SEED}.pt").is_file()
    assert encoder.classifier.trunk[0].weight.shape[0] > 0


@pytest.mark.parametrize("weights,match", [(None, "model.repa.encoder_weights is not set"),
                                           ("/nonexistent/dino", "is not a saved Dinov2Model folder")])
def test_missing_dinov2_weights_say_how_to_provide_them(weights, match):
    with pytest.raises(EncoderError, match=match) as err:
        build_patch_encoder("dinov2", weights=weights)
    assert "save_pretrained" in str(err.value)


def test_unknown_encoder_is_refused():
    with pytest.raises(EncoderError, match="model.repa.encoder='clip' is unknown; allowed: toy, dinov2"):
        build_patch_encoder("clip")
