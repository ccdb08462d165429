"""FDD (Fréchet distance on DINOv2 features, tread/evaluation/fdd.py): a tiny random Dinov2Model (conftest.dino_dir)
stands in for the real weights (nothing is downloaded). The preprocessing is dgm-eval's (torchvision's PIL bicubic
resize to 224 px, ImageNet normalisation), FDD equals an independent computation, its auto-built reference has a
cache file of its own (the FID reference is never rebuilt by it), fid.py builds an FDD reference from images and
scores FDD, training reports it beside FID, and missing weights or references are clear errors."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms as T
from transformers import Dinov2Model

from conftest import blob_images, compose_cfg
from tread.cli.fid import run as fid_run
from tread.encoders.dinov2 import fdd_pixels
from tread.encoders.errors import EncoderError
from tread.encoders.features import build_dino_features
from tread.evaluation.frechet import frechet_distance
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import ReferenceBuilder, load_reference_full
from tread.schema import ConfigError, check_fid, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
# dgm-eval's DINOv2 transform, written out here (not imported from the code under test): PIL bicubic to 224 x 224,
# ToTensor (/ 255), ImageNet mean and std.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
REFERENCE_TRANSFORM = T.Compose([T.Resize((224, 224), T.InterpolationMode.BICUBIC), T.ToTensor(),
                                 T.Normalize(MEAN, STD)])
LEVEL = 1 / 255 / min(STD)          # one uint8 level in normalised units


def images(n, seed, shift=0, side=16):
    g = np.random.default_rng(seed)
    return np.clip(g.integers(0, 200, size=(n, side, side, 3)) + shift, 0, 255).astype(np.uint8)


def reference_pixels(imgs):
    return torch.stack([REFERENCE_TRANSFORM(Image.fromarray(im)) for im in imgs])


@pytest.mark.parametrize("side", [256, 32, 224])
def test_preprocessing_is_dgm_evals_antialiased_resize(side):
    imgs = blob_images(3, side, seed=side)
    imgs = np.clip(imgs.astype(int) + np.random.default_rng(1).integers(-30, 30, imgs.shape), 0, 255).astype(np.uint8)
    ours = fdd_pixels(torch.from_numpy(imgs).permute(0, 3, 1, 2))
    delta = (ours - reference_pixels(imgs)).abs()
    assert ours.shape == (3, 3, 224, 224) and ours.dtype == torch.float32
    assert delta.max() <= LEVEL + 1e-5 and delta.mean() < 1e-3 and (delta > 1e-5).float().mean() < 0.005
    if side != 224:       # the former resize (bicubic without antialiasing, no rounding) was far off
        x = F.interpolate(torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255, size=(224, 224), mode="bicubic")
        old = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
        assert (old - reference_pixels(imgs)).abs().mean() > 10 * delta.mean() + 0.005
    else:                 # no resize: exactly (x / 255 - ImageNet mean) / ImageNet std
        x = torch.from_numpy(imgs).permute(0, 3, 1, 2).double() / 255
        pinned = (x - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / \
            torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
        torch.testing.assert_close(ours.double(), pinned, atol=1e-6, rtol=0)


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

    def cls(x):       # dgm-eval's pipeline: PIL resize, normalise, the model's CLS token after the final norm
        with torch.no_grad():
            return model(pixel_values=reference_pixels(x)).pooler_output.double().numpy()
    fa, fb = cls(a), cls(b)
    expected = frechet_distance(fb.mean(0), np.cov(fb, rowvar=False), fa.mean(0), np.cov(fa, rowvar=False))
    assert fdd(extractor, ref, b) == pytest.approx(expected, rel=1e-3)
    assert abs(fdd(extractor, ref, a)) < 1e-6 * max(1.0, expected)
    assert fdd(extractor, ref, b) > 10 * abs(fdd(extractor, ref, a))
    assert extractor.name.startswith("dinov2_") and len(extractor.name) == len("dinov2_") + 10


def test_missing_weights_and_references_are_clear_errors(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"asks for fdd .* needs eval.dinov2_weights.*dinov2-large"):
        check_train(tiny_cfg("eval.metrics=[fid,fdd]"))
    with pytest.raises(EncoderError, match=r"eval.dinov2_weights='/nonexistent' is not a saved Dinov2Model folder.*"
                                           r"from_pretrained\('facebook/dinov2-large'\).*eval.dinov2_weights=DIR"):
        build_dino_features("/nonexistent", "eval.dinov2_weights")
    with pytest.raises(ConfigError, match="mode=bench does not compute fdd.*mode=calc metrics=\\[fdd\\]"):
        check_fid(compose_cfg("fid", ["mode=bench", "metrics=[fid,fdd]", "dinov2_weights=/x", "checkpoints=c",
                                      "ref=r.npz"]))
    with pytest.raises(ConfigError, match=r"asks for fdd, which needs fdd_ref="):
        check_fid(compose_cfg("fid", ["mode=calc", "metrics=[fid,fdd]", "dinov2_weights=/x", "images=i", "ref=r"]))
    with pytest.raises(ConfigError, match=r"fdd_out='f.npz' writes an FDD reference, which needs dinov2_weights="):
        check_fid(compose_cfg("fid", ["mode=ref", "source=s", "fdd_out=f.npz"]))
    check_fid(compose_cfg("fid", ["mode=ref", "source=s", "fdd_out=f.npz", "dinov2_weights=/x"]))   # no `out`: fine
    check_fid(compose_cfg("fid", ["mode=calc", "metrics=[fdd]", "dinov2_weights=/x", "images=i", "fdd_ref=f"]))


def test_fid_py_builds_an_fdd_reference_from_images_and_scores_fdd(dino_dir, tmp_path, cache_dir):
    real, fake = blob_images(24, 16, seed=0), blob_images(24, 16, seed=1)
    np.savez(tmp_path / "real.npz", arr_0=real)
    np.savez(tmp_path / "fake.npz", arr_0=fake)
    common = [f"dinov2_weights={dino_dir}", f"cache_dir={cache_dir}", "device=cpu", "batch_size=10"]
    built = fid_run(compose_cfg("fid", ["mode=ref", f"source={tmp_path / 'real.npz'}", f"out={tmp_path / 'fid.npz'}",
                                        f"fdd_out={tmp_path / 'fdd.npz'}", *common]))
    with np.load(tmp_path / "fdd.npz") as saved:
        assert str(saved["feature"]).startswith("dinov2_") and int(saved["num_images"]) == 24
    assert built["fdd_features"] == str(np.load(tmp_path / "fdd.npz")["feature"]) != built["features"]
    scores = fid_run(compose_cfg("fid", ["mode=calc", f"images={tmp_path / 'fake.npz'}", f"ref={tmp_path / 'fid.npz'}",
                                         f"fdd_ref={tmp_path / 'fdd.npz'}", "metrics=[fid,fdd]", *common]))
    extractor = build_dino_features(str(dino_dir), "dinov2_weights")
    expected = fdd(extractor, load_reference_full(tmp_path / "fdd.npz", extractor), fake)
    assert scores["fdd"] == pytest.approx(expected, rel=1e-6) and scores["fdd"] > 0 and np.isfinite(scores["fid"])
    alone = fid_run(compose_cfg("fid", ["mode=calc", f"images={tmp_path / 'real.npz'}", "metrics=[fdd]",
                                        f"fdd_ref={tmp_path / 'fdd.npz'}", *common]))
    assert set(alone) >= {"fdd"} and "fid" not in alone and abs(alone["fdd"]) < 1e-6


def digest_and_mtime(path):
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_training_reports_fdd_and_its_reference_leaves_fids_alone(tiny_cfg, tmp_path, dino_dir, cache_dir, capsys):
    base = ["train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0"]
    train(tiny_cfg(*base, "eval.metrics=[fid]"), tmp_path / "run0")          # the FID reference, cached
    fid_refs = [p for p in (cache_dir / "references").glob("*.npz") if "_fdd_" not in p.name]
    before = {p: digest_and_mtime(p) for p in fid_refs}
    train(tiny_cfg(*base, "eval.metrics=[fid,fdd]", f"eval.dinov2_weights={dino_dir}",
                   "eval.fdd_reference_max_images=100"), tmp_path / "run")
    assert {p: digest_and_mtime(p) for p in fid_refs} == before and before
    fdd_refs = list((cache_dir / "references").glob("*_fdd_dinov2_*_100img.npz"))
    assert len(fdd_refs) == 1 and int(np.load(fdd_refs[0])["num_images"]) == 100
    assert "FDD reference is built from VAE reconstructions" in capsys.readouterr().out
    record = [r for r in read_metrics(tmp_path / "run") if r["type"] == "eval"][-1]
    assert np.isfinite(record["fid"]) and np.isfinite(record["fdd"]) and record["fdd"] > 0
