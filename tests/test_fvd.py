"""FVD (Fréchet distance on VideoMAE clip features, tread/evaluation/fvd.py): a tiny random VideoMAEModel stands in for
the real weights (nothing is downloaded). The features equal VideoMAE's own forward on pixels made here independently;
FVD equals a direct Fréchet computation; precompute writes the reference of the clips as it encodes them; fid.py
builds and scores it; training reports it; missing weights, references and image data are one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import VideoMAEModel

from conftest import TINY, compose_cfg
from tread.cli.fid import run as fid_run
from tread.cli.precompute import cli as precompute_cli, main as precompute
from tread.data import Bucket, LatentDataset
from tread.data.builtin.toy_clips import write_clip_files
from tread.data.video import clip_tree, read_clip
from tread.encoders.errors import EncoderError
from tread.encoders.videomae import build_video_features, frame_indices, save_tiny_videomae
from tread.evaluation.frechet import FeatureStats, frechet_distance
from tread.evaluation.fvd import FvdScorer, load_fvd_reference, video_stats
from tread.evaluation.reference import ReferenceFileError
from tread.schema import ConfigError, check_fid, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics
from test_video_vae import tiny_wan

pytestmark = pytest.mark.usefixtures("one_thread")
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def videomae_dir(tmp_path_factory):
    return save_tiny_videomae(tmp_path_factory.mktemp("videomae") / "videomae", side=32, num_frames=4)


def clips(n, frames=9, seed=0, shift=0):
    g = np.random.default_rng(seed)
    return np.clip(g.integers(0, 200, size=(n, frames, 32, 32, 3)) + shift, 0, 255).astype(np.uint8)


def direct_features(folder, videos):
    """VideoMAE's own forward on pixels made here: 4 evenly spread frames (0, 3, 5, 8 of 9), / 255, ImageNet
    normalised (no resize at the network's 32 px), the mean of the last hidden states."""
    model = VideoMAEModel.from_pretrained(str(folder)).eval()
    idx = np.round(np.linspace(0, videos.shape[1] - 1, 4)).astype(int)
    x = (videos[:, idx].astype(np.float64) / 255 - MEAN) / STD                     # (B, 4, 32, 32, 3)
    pixels = torch.from_numpy(x).permute(0, 1, 4, 2, 3).float()
    with torch.no_grad():
        return model(pixel_values=pixels).last_hidden_state.mean(1).double().numpy()


def test_features_and_fvd_equal_a_direct_computation(videomae_dir):
    net = build_video_features(videomae_dir, "eval.videomae_weights")
    assert net.dim == 32 and net.name.startswith("videomae_")
    assert frame_indices(9, 4).tolist() == [0, 3, 5, 8] and frame_indices(2, 4).tolist() == [0, 0, 1, 1]
    real, fake = clips(12, seed=0), clips(10, seed=1, shift=40)
    ours = net(torch.from_numpy(real)).double().numpy()
    np.testing.assert_allclose(ours, direct_features(videomae_dir, real), rtol=1e-5, atol=1e-5)
    ref_stats = video_stats(net, [real[:5], real[5:]])                      # batches add up to one stream
    fake_stats = video_stats(net, [fake])
    a, b = direct_features(videomae_dir, real), direct_features(videomae_dir, fake)
    direct = frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
    ours_fvd = frechet_distance(ref_stats.mean(), ref_stats.cov(), fake_stats.mean(), fake_stats.cov())
    assert direct > 0 and abs(ours_fvd - direct) <= 1e-4 * direct
    with pytest.raises(ValueError, match=r"uint8 \(B, F, H, W, 3\)"):
        net(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))


def test_missing_weights_say_how_to_provide_them(tmp_path):
    for weights, needle in ((None, "is not set"), (tmp_path, "no config.json")):
        with pytest.raises(EncoderError, match=needle) as err:
            build_video_features(weights, "eval.videomae_weights")
        assert "VideoMAEModel.from_pretrained('MCG-NJU/videomae-base').save_pretrained" in str(err.value)
        assert "\n" not in str(err.value)


def write_clips(root, frames=9):
    write_clip_files(root / "clips", [Bucket(32, 32, frames)], num_per_class=1, captions=False)
    tiny_wan().save_pretrained(root / "vae")
    return root / "clips"


@pytest.mark.slow
def test_precompute_reference_fid_py_and_training(tmp_path, videomae_dir, cache_dir):
    """The reference precompute writes is the clips' own statistics: fid.py's reference of the same clip files
    equals it, and the FVD of those clips against it is 0; a routed Wan run reports FVD at its evaluation."""
    source = write_clips(tmp_path)
    argv = ["--videos", str(source), "--out", str(tmp_path / "data"), "--vae", str(tmp_path / "vae"), "--frames", "9",
            "--resolution", "32", "--device", "cpu", "--workers", "0", "--fvd-out", str(tmp_path / "fvd.npz"),
            "--videomae-weights", str(videomae_dir)]
    assert precompute(argv)["fvd_out"] == tmp_path / "fvd.npz"
    net = build_video_features(videomae_dir, "x")
    stored = load_fvd_reference(tmp_path / "fvd.npz", net)
    files, _ = clip_tree(source)
    videos = np.stack([read_clip(f, 9) for f in files])
    feats = direct_features(videomae_dir, videos)
    assert stored.num_clips == len(files) == 10
    np.testing.assert_allclose(stored.mu, feats.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored.sigma, np.cov(feats, rowvar=False), rtol=1e-4, atol=1e-7)
    base = [f"paths.cache_dir={cache_dir}", "device=cpu", f"videomae_weights={videomae_dir}"]
    fid_run(compose_cfg("fid", base + ["mode=ref", f"source={source}", f"fvd_out={tmp_path / 'fid_fvd.npz'}"]))
    again = load_fvd_reference(tmp_path / "fid_fvd.npz", net)
    np.testing.assert_allclose(again.mu, stored.mu, rtol=1e-6, atol=1e-7)
    out = fid_run(compose_cfg("fid", base + ["mode=calc", "metrics=[fvd]", f"images={source}",
                                             f"fvd_ref={tmp_path / 'fvd.npz'}", f"out_json={tmp_path / 'm.json'}"]))
    assert abs(out["fvd"]) < 1e-6 and json.loads((tmp_path / "m.json").read_text())["fvd"] == out["fvd"]
    data = LatentDataset(tmp_path / "data")
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={cache_dir}", "model=wan", "data=latents", f"data.path={data.root}",
        f"data.channels={data.shape[0]}", "data.resolution=8", f"data.frames={data.shape[1]}", "data.num_classes=10",
        "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 5}]", "train.max_steps=2",
        "train.batch_size=2", "eval.every_steps=0", "eval.at_end=true", "eval.num_samples=4", "eval.num_steps=2",
        "eval.metrics=[fid,fvd]", f"eval.videomae_weights={videomae_dir}", f"eval.fvd_reference={tmp_path / 'fvd.npz'}"])
    train(cfg, tmp_path / "run")
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("type") == "eval"]
    assert evals and np.isfinite(evals[-1]["fvd"]) and evals[-1]["fvd"] > 0 and np.isfinite(evals[-1]["fid"])


def test_bad_fvd_inputs_are_one_line_errors(tmp_path, videomae_dir, capsys):
    source = write_clips(tmp_path)
    common = ["--videos", str(source), "--out", str(tmp_path / "data"), "--vae", str(tmp_path / "vae"), "--frames", "9",
              "--resolution", "32", "--device", "cpu", "--workers", "0"]
    for extra, needle in ((["--fvd-out", str(tmp_path / "f.npz")], "--videomae-weights is not set"),
                          (["--videomae-weights", str(videomae_dir)], "only applies with --fvd-out"),
                          (["--fvd-out", str(source / "f.npz"), "--videomae-weights", str(videomae_dir)], "--fvd-out")):
        assert precompute_cli(common + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not (tmp_path / "data").exists()                      # nothing written before the checks
    with pytest.raises(ConfigError, match="fvd scores clips, so it runs alone"):
        check_fid(compose_cfg("fid", ["mode=calc", "metrics=[fid,fvd]", "images=x", "ref=y", "fvd_ref=z",
                                      f"videomae_weights={videomae_dir}"]))
    with pytest.raises(ConfigError, match="videomae_weights=<a local VideoMAEModel folder>"):
        check_fid(compose_cfg("fid", ["mode=calc", "metrics=[fvd]", "images=x", "fvd_ref=z"]))
    with pytest.raises(ConfigError, match="eval.videomae_weights=<a local VideoMAEModel folder>"):
        check_train(compose_cfg("train", TINY + ["eval.metrics=[fid,fvd]"]))
    with pytest.raises(ReferenceFileError, match="does not exist"):
        load_fvd_reference(tmp_path / "none.npz")


def test_fvd_on_image_data_is_refused(videomae_dir, tmp_path):
    settings = check_train(compose_cfg("train", TINY + ["eval.metrics=[fid,fvd]", f"eval.videomae_weights={videomae_dir}",
                                                        f"eval.fvd_reference={tmp_path}"])).eval
    with pytest.raises(ValueError, match=r"samples are images \(1 frame\)"):
        FvdScorer(settings, None, frames=1)
