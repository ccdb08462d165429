"""FDD (Fréchet distance on DINOv2 features, tread/evaluation/fdd.py): a tiny random Dinov2Model (conftest.dino_dir)
stands in for the real weights (nothing is downloaded). FDD equals an independent computation, vanishes for a set
against itself, grows with a shift, reports beside FID in training, and its missing weights are clear errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Dinov2Model

from conftest import compose_cfg
from tread.encoders.dinov2 import DINO_SIZE, IMAGENET_MEAN, IMAGENET_STD
from tread.encoders.errors import EncoderError
from tread.encoders.features import build_dino_features
from tread.evaluation.frechet import frechet_distance
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import ReferenceBuilder, load_reference_full
from tread.schema import ConfigError, check_fid, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics


def images(n, seed, shift=0):
    g = np.random.default_rng(seed)
    return np.clip(g.integers(0, 200, size=(n, 16, 16, 3)) + shift, 0, 255).astype(np.uint8)


def reference(extractor, imgs, path):
    builder = ReferenceBuilder(extractor, len(imgs), store_images=0)
    builder.add(imgs, range(len(imgs)))
    builder.save(path, "test")
    return load_reference_full(path, extractor, need=("fid",))


def fdd(extractor, ref, imgs):
    acc = FeatureAccumulator(extractor, ("fid",))
    acc.add(torch.from_numpy(imgs).permute(0, 3, 1, 2))
    return compute_metrics(acc, ref, ("fid",))["fid"]


def test_fdd_is_the_frechet_distance_of_dinov2_cls_features(dino_dir, tmp_path):
    extractor = build_dino_features(str(dino_dir), "eval.dinov2_weights")
    a, b = images(40, 0), images(40, 1, shift=50)
    ref = reference(extractor, a, tmp_path / "ref.npz")
    model = Dinov2Model.from_pretrained(dino_dir).eval()

    def cls(x):
        x = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255
        x = F.interpolate(x, size=(DINO_SIZE, DINO_SIZE), mode="bicubic", align_corners=False)
        x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        with torch.no_grad():
            return model(pixel_values=x).last_hidden_state[:, 0].double().numpy()
    fa, fb = cls(a), cls(b)
    expected = frechet_distance(fb.mean(0), np.cov(fb, rowvar=False), fa.mean(0), np.cov(fa, rowvar=False))
    assert fdd(extractor, ref, b) == pytest.approx(expected, rel=1e-4)
    assert abs(fdd(extractor, ref, a)) < 1e-6 * max(1.0, expected)
    assert fdd(extractor, ref, b) > 10 * abs(fdd(extractor, ref, a))
    assert extractor.name.startswith("dinov2_") and len(extractor.name) == len("dinov2_") + 10


def test_missing_weights_are_clear_errors(tiny_cfg):
    with pytest.raises(ConfigError, match=r"asks for fdd .* needs eval.dinov2_weights"):
        check_train(tiny_cfg("eval.metrics=[fid,fdd]"))
    with pytest.raises(EncoderError, match="eval.dinov2_weights='/nonexistent' is not a saved Dinov2Model folder"):
        build_dino_features("/nonexistent", "eval.dinov2_weights")
    with pytest.raises(ConfigError, match="fdd is computed by in-training evaluation"):
        check_fid(compose_cfg("fid", ["mode=bench", "metrics=[fid,fdd]", "dinov2_weights=/x"]))


def test_in_training_evaluation_reports_fdd_beside_fid(tiny_cfg, tmp_path, dino_dir):
    train(tiny_cfg("train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0", "eval.metrics=[fid,fdd]",
                   f"eval.dinov2_weights={dino_dir}", "eval.reference_max_images=100"), tmp_path / "run")
    record = [r for r in read_metrics(tmp_path / "run") if r["type"] == "eval"][-1]
    assert np.isfinite(record["fid"]) and np.isfinite(record["fdd"]) and record["fdd"] > 0
