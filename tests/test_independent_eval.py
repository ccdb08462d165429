"""The independent evaluator of the built-in data (tread/evaluation/toy_checks.py, tread/encoders/toy_autoencoder.py):
shape/colour checks are ~1 on real toy images and drop for wrong labels, swapped colours and noise; the autoencoder
and pixel MLP train deterministically and round-trip through their files; training reports fd_ae and the checks;
a toy metric elsewhere is one clear error at start-up."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import compose_cfg
from tread.cli.fid import run as fid_run
from tread.data.builtin.toy import TOY_COLOURS, _toy_uint8, ensure_toy_autoencoder, ensure_toy_pixel_mlp
from tread.encoders.errors import EncoderError
from tread.encoders.toy_autoencoder import (AUTOENCODER_SEED, AutoencoderFeatures, load_net, net_path,
                                            train_toy_autoencoder)
from tread.evaluation.checkpoint_fid import BenchError
from tread.evaluation.frechet import frechet_distance
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.toy_checks import ToyMetricError, check_toy_metrics, colour_predictions, shape_predictions
from tread.training.loop import train
from tread.training.run_log import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
TOY_META = {"builtin": {"name": "toy_shapes"}}


def acc(pred: torch.Tensor, labels: torch.Tensor) -> float:
    return (pred == labels).double().mean().item()


@pytest.mark.parametrize("side", [16, 32])
def test_shape_and_colour_checks_pass_real_images_and_fail_wrong_ones(side):
    x, y = _toy_uint8(20, side, seed=99)
    assert acc(shape_predictions(x), y) == 1.0 and acc(colour_predictions(x), y) == 1.0
    wrong = (y + 1) % 10
    assert acc(shape_predictions(x), wrong) == 0.0 and acc(colour_predictions(x), wrong) == 0.0
    noise = torch.randint(0, 256, x.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert acc(shape_predictions(noise), y) < 0.3 and acc(colour_predictions(noise), y) < 0.3


def test_a_swapped_colour_fails_colour_but_not_shape():
    x, y = _toy_uint8(20, 32, seed=5)
    fg = (x.float().max(1).values > 128)[:, None]                  # the bright shape pixels
    other = torch.from_numpy(TOY_COLOURS[(y.numpy() + 3) % 10] * 255).round().to(torch.uint8)[..., None, None]
    swapped = torch.where(fg, other.expand_as(x), x)
    assert acc(colour_predictions(swapped), y) < 0.1 and acc(shape_predictions(swapped), y) > 0.9


def test_autoencoder_trains_deterministically_and_round_trips(tmp_path):
    x, _ = _toy_uint8(4, 16, seed=1)
    a, mse_a = train_toy_autoencoder(x, x[:10], seed=3, epochs=1, batch_size=20)
    b, mse_b = train_toy_autoencoder(x, x[:10], seed=3, epochs=1, batch_size=20)
    assert mse_a == mse_b and all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                                     b.state_dict().values()))
    path = ensure_toy_autoencoder(tmp_path, 16, seed=3, images_per_class=4, epochs=1)
    assert path == net_path("toy_autoencoder", tmp_path, 16, 3) and ensure_toy_autoencoder(tmp_path, 16, seed=3) == path
    feats = AutoencoderFeatures(load_net("toy_autoencoder", path), 3)
    same, _ = train_toy_autoencoder(_toy_uint8(4, 16, seed=3)[0], x[:2], seed=3, epochs=1)   # as ensure_ does
    with torch.no_grad():
        assert feats(x).shape == (40, 64) and torch.equal(feats(x), AutoencoderFeatures(same, 3)(x))
    path.write_bytes(b"junk")
    with pytest.raises(EncoderError, match="do not load.*Delete the file"):
        load_net("toy_autoencoder", path)


def test_fd_ae_is_the_frechet_distance_of_the_pooled_bottleneck(tmp_path):
    feats = AutoencoderFeatures(load_net("toy_autoencoder", ensure_toy_autoencoder(
        tmp_path, 16, seed=3, images_per_class=4, epochs=1)), 3)
    real, fake = _toy_uint8(6, 16, seed=7)[0], _toy_uint8(6, 16, seed=8)[0]
    with torch.no_grad():
        r, f = feats(real).double().numpy(), feats(fake).double().numpy()
    ref = FeatureAccumulator(feats, ("fid",)).add(real)
    acc_ = FeatureAccumulator(feats, ("fid",)).add(fake)
    ref.gather()

    class Ref:
        feature, mu, sigma = feats.name, ref.pool_stats.mean(), ref.pool_stats.cov()
    got = compute_metrics(acc_, Ref, ("fid",))["fid"]
    assert got == pytest.approx(frechet_distance(f.mean(0), np.cov(f.T), r.mean(0), np.cov(r.T)), rel=1e-6)
    with pytest.raises(ValueError, match=r"\['fd_ae'\] are not computed from .*toy_checks.py"):
        compute_metrics(acc_, Ref, ("fid", "fd_ae"))


def test_toy_metrics_elsewhere_are_one_clear_error():
    check_toy_metrics(["fid", "class_acc"], "toy_classifier", TOY_META)
    check_toy_metrics(["fid"], "inception", {})                                   # no toy metric: nothing to check
    with pytest.raises(ToyMetricError, match=r"eval.metrics=\['fid', 'fd_ae'\]: \['fd_ae'\] .* features=inception"):
        check_toy_metrics(["fid", "fd_ae"], "inception", TOY_META)
    with pytest.raises(ToyMetricError, match="got data 'toy_shapes_text'"):
        check_toy_metrics(["shape_acc"], "toy_classifier", {"builtin": {"name": "toy_shapes_text"}})
    with pytest.raises(ToyMetricError, match="got decode type 'vae'"):
        check_toy_metrics(["colour_acc"], "toy_classifier", {**TOY_META, "decode": {"type": "vae"}})
    with pytest.raises(ToyMetricError, match="got data 'toy_shapes'"):
        check_toy_metrics(["colour_acc"], "toy_classifier", TOY_META, bucketed=True)


def test_training_reports_the_independent_metrics(tiny_cfg, tmp_path, cache_dir):
    # Tiny nets under the real file names (their defaults would train for seconds): the scorer finds them cached.
    ensure_toy_autoencoder(cache_dir, 32, images_per_class=4, epochs=1)
    ensure_toy_pixel_mlp(cache_dir, 32, images_per_class=10, epochs=1)
    names = ["fid", "fd_ae", "class_acc", "shape_acc", "colour_acc"]
    train(tiny_cfg("train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0",
                   f"eval.metrics=[{','.join(names)}]"), tmp_path / "run")
    record = [r for r in read_metrics(tmp_path / "run") if r["type"] == "eval"][-1]
    assert np.isfinite(record["fd_ae"]) and record["fd_ae"] > 0
    assert all(0.0 <= record[m] <= 1.0 for m in names[2:])
    assert list((cache_dir / "references").glob(f"*_toy_autoencoder_s{AUTOENCODER_SEED}_*img.npz"))
    with pytest.raises(ToyMetricError, match="features=inception"):
        train(tiny_cfg("eval.features=inception", "eval.metrics=[fid,shape_acc]"), tmp_path / "run2")


def test_fid_py_refuses_the_toy_metrics_before_any_work():
    with pytest.raises(BenchError, match=r"\['fd_ae'\] are computed by in-training evaluation only"):
        fid_run(compose_cfg("fid", ["mode=calc", "metrics=[fid,fd_ae]", "images=/nonexistent", "ref=/nonexistent"]))
