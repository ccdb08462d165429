"""fid.py: ref / calc / bench modes, input validation before work, 1-process == 2-process benchmarking."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY, blob_images, compose_cfg, free_port, shared_cache
from pixel_checks import assert_pixels_close
from tread.evaluation.images import save_npz, save_png_folder

ALL = ["fid", "sfid", "is", "precision", "recall", "kid"]


def fid_cfg(**kw):
    """configs/fid.yaml composed without the command line, as tread.cli.fid.run() takes it."""
    return OmegaConf.merge(compose_cfg("fid"), {"device": "cpu", **kw})


def run_fid_cli(cache: Path, *overrides: str, launcher: list[str] | None = None, timeout: int = 900):
    env = {**os.environ, "TREAD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = (launcher or [sys.executable]) + ["fid.py", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """A tiny built-in-data run with checkpoints at steps 2 and 4, and a reference built from its dataset."""
    from tread.training.loop import train

    cache = shared_cache(tmp_path_factory)
    root = tmp_path_factory.mktemp("bench")
    cfg = compose_cfg("train", TINY + [f"paths.cache_dir={cache}", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, root / "run")
    import tread.cli.fid as fid

    ref = root / "ref.npz"
    fid.run(fid_cfg(mode="ref", source=cfg.data.path, out=str(ref), cache_dir=str(cache), store_images=200))
    return {"run": root / "run", "ref": ref, "cache": cache, "root": root, "data": Path(cfg.data.path)}


def bench_cfg(toy_run, out_dir, **kw):
    base = dict(mode="bench", checkpoints=str(toy_run["run"] / "checkpoints" / "step_*"), ref=str(toy_run["ref"]),
                cache_dir=str(toy_run["cache"]), out_dir=str(out_dir), num_samples=24, num_steps=2,
                sample_batch_size=10, kid_subset_size=10, kid_subsets=5)
    return fid_cfg(**{**base, **kw})


# ----------------------------------------------------------------------------- ref / calc


def test_ref_from_latent_dataset_stores_stats_and_images(toy_run):
    with np.load(toy_run["ref"]) as ref:
        assert {"mu", "sigma", "mu_s", "sigma_s", "arr_0", "feature", "num_images"} <= set(ref.files)
        assert ref["arr_0"].shape == (200, 16, 16, 3) and ref["arr_0"].dtype == np.uint8
        assert int(ref["num_images"]) == 400 and str(ref["feature"]) == "toy_classifier"


def test_calc_on_the_datasets_own_images_scores_well(toy_run, tmp_path):
    import tread.cli.fid as fid
    from tread.data.builtin.toy import generate_toy_shapes

    x, _ = generate_toy_shapes(20, 16, seed=7)  # new images of the training distribution (the data is seed 0)
    save_npz(((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1), tmp_path / "real.npz")
    save_npz(blob_images(200, 16, seed=3), tmp_path / "blobs.npz")
    common = dict(ref=str(toy_run["ref"]), cache_dir=str(toy_run["cache"]), kid_subset_size=50, kid_subsets=10)
    real = fid.run(fid_cfg(mode="calc", images=str(tmp_path / "real.npz"), out_json=str(tmp_path / "m.json"),
                           **common))
    blobs = fid.run(fid_cfg(mode="calc", images=str(tmp_path / "blobs.npz"), **common))
    saved = json.loads((tmp_path / "m.json").read_text())
    assert set(ALL) <= set(saved) and saved["num_images"] == 200
    assert all(np.isfinite(saved[m]) for m in ALL)
    assert real["fid"] < blobs["fid"] / 2 and real["sfid"] < blobs["sfid"]
    assert real["precision"] > blobs["precision"] and real["recall"] > blobs["recall"]
    assert real["is"] > blobs["is"] and real["kid"] < blobs["kid"]


def test_cli_ref_from_png_folder_and_calc(toy_run, tmp_path):
    save_png_folder(blob_images(40, 16, seed=1), tmp_path / "imgs")
    save_npz(blob_images(40, 16, seed=2), tmp_path / "samples.npz")
    ref = run_fid_cli(toy_run["cache"], "mode=ref", f"source={tmp_path / 'imgs'}", f"out={tmp_path / 'r.npz'}")
    assert ref.returncode == 0, ref.stderr
    calc = run_fid_cli(toy_run["cache"], "mode=calc", f"images={tmp_path / 'samples.npz'}", f"ref={tmp_path / 'r.npz'}",
                       "metrics=[fid,sfid,is,precision,recall]", f"out_json={tmp_path / 'm.json'}")
    assert calc.returncode == 0, calc.stderr
    assert "toy_classifier, 40 images vs r.npz" in calc.stdout
    assert json.loads((tmp_path / "m.json").read_text())["num_images"] == 40
    assert not (REPO / "outputs" / "fid").exists() and not (REPO / "fid.log").exists()


# ----------------------------------------------------------------------------- bench


def test_bench_two_checkpoints_table_npz_and_skip(toy_run, tmp_path):
    import tread.cli.fid as fid

    out = tmp_path / "bench"
    rows = fid.run(bench_cfg(toy_run, out))
    assert [r["step"] for r in rows] == [2, 4]
    table = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(table) == 2 and all(np.isfinite(r[m]) for r in table for m in ALL)
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"checkpoint", "step", *ALL, "npz", "images_per_sec"} <= set(header)
    with np.load(rows[0]["npz"]) as npz:
        assert npz["arr_0"].shape == (24, 16, 16, 3) and npz["arr_0"].dtype == np.uint8
        assert list(npz["arr_1"]) == [i % 10 for i in range(24)]
    assert not list(out.rglob(".arr_0.npy"))  # the shared buffer is removed
    # The same images as sample.py's for the same seeds (per-seed generators), up to float32 rounding: bench
    # sampled them 10 per batch, here 2 per batch (other matmul shapes).
    from tread.sampling import generate, load_for_inference
    from tread.data import decode_to_uint8

    net, diffusion, meta, _ = load_for_inference(toy_run["run"] / "checkpoints" / "step_0000002")
    _, _, x = next(generate(net, diffusion, [5, 6], meta["shape"], 10, torch.device("cpu"), batch_size=2,
                            num_steps=2))
    with np.load(rows[0]["npz"]) as npz:
        assert_pixels_close(decode_to_uint8(x, meta), npz["arr_0"][5:7], what="seeds 5-6: 2 per batch vs 10")
    # Re-running skips what is in the table; other settings add rows.
    assert fid.run(bench_cfg(toy_run, out)) == []
    again = fid.run(bench_cfg(toy_run, out, checkpoints=str(toy_run["run"]), cfg_scale=1.5, keep_npz=False,
                              metrics=["fid"]))
    assert len(again) == 1 and again[0]["step"] == 4 and again[0]["npz"] is None and "sfid" not in again[0]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_bench_with_inference_routing_and_tread_guidance(toy_run, tmp_path):
    """Guidance settings are table columns (skip_existing tells them apart) and every row reports the sampled
    forward passes and GFLOPs per image."""
    import tread.cli.fid as fid

    out = tmp_path / "bench"
    ckpt = str(toy_run["run"] / "checkpoints" / "step_0000004")
    dense = fid.run(bench_cfg(toy_run, out, checkpoints=ckpt, keep_npz=False))[0]
    routed = fid.run(bench_cfg(toy_run, out, checkpoints=ckpt, keep_npz=False, selection_ratio=0.5))[0]
    guided = fid.run(bench_cfg(toy_run, out, checkpoints=ckpt, keep_npz=False, tread_scale=1.5,
                               tread_weak_selection_ratio=0.5, guidance_interval=[0.05, 100.0]))[0]
    assert fid.run(bench_cfg(toy_run, out, checkpoints=ckpt, keep_npz=False, selection_ratio=0.5)) == []  # skipped
    assert dense["forward_passes_per_image"] == 3 and routed["forward_passes_per_image"] == 3
    assert routed["sample_gflops_per_image"] < dense["sample_gflops_per_image"] < guided["sample_gflops_per_image"]
    assert 3 < guided["forward_passes_per_image"] < 6          # the weak branch only inside the interval
    assert (routed["selection_ratio"], guided["tread_scale"], guided["guidance_interval"]) == (0.5, 1.5, [0.05, 100.0])
    assert dense["fid"] != routed["fid"]
    with pytest.raises(ValueError, match="tread_weak_selection_ratio=0.0 is not allowed"):  # fid.py: `error: ...`
        fid.run(bench_cfg(toy_run, out, checkpoints=ckpt, tread_scale=2.0, tread_weak_selection_ratio=0.0))


def test_rows_written_before_the_key_rename_are_the_same_measurement(tmp_path):
    """metrics.jsonl rows that say route_ratio / tread_weak_ratio (written before the rename) are read in today's
    names: skip_existing still tells a routed row from a dense one, and the CSV has one column per setting."""
    from tread.evaluation.checkpoint_fid import append_row, bench_settings, read_rows, settings_key
    from tread.sampling import Guidance

    new = bench_settings(Path("ckpt"), use_ema=True, seeds=range(4), num_steps=2, features="toy_classifier",
                         reference="ref.npz", metrics=["fid"],
                         guidance=Guidance(selection_ratio=0.5, tread_scale=1.5, tread_weak_selection_ratio=0.75))
    renames = {"selection_ratio": "route_ratio", "tread_weak_selection_ratio": "tread_weak_ratio"}
    old = {renames.get(k, k): v for k, v in new.items()}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({**old, "fid": 1.0}) + "\n")
    (row,) = read_rows(tmp_path)
    assert (row["selection_ratio"], row["tread_weak_selection_ratio"]) == (0.5, 0.75) and "route_ratio" not in row
    assert settings_key(row) == settings_key(new) != settings_key({**new, "selection_ratio": None})
    append_row(tmp_path, {**new, "fid": 2.0})
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "selection_ratio" in header and "route_ratio" not in header


def test_bench_two_processes_equal_one(toy_run, tmp_path):
    """`accelerate launch` with 2 processes (gloo on CPU) gives the metrics and images of 1 process."""
    common = [f"checkpoints={toy_run['run'] / 'checkpoints' / 'step_0000004'}", f"ref={toy_run['ref']}",
              "num_samples=24", "num_steps=2", "sample_batch_size=5", "kid_subset_size=10", "kid_subsets=5",
              "mode=bench", "device=cpu"]
    one = run_fid_cli(toy_run["cache"], *common, f"out_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    # accelerate 1.15's `launch --cpu --num_processes 2` starts ONE process; --multi_gpu on a machine without
    # GPUs runs torchrun with gloo on the CPU (device=cpu makes fid.py stay on the CPU).
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port())]
    two = run_fid_cli(toy_run["cache"], *common, f"out_dir={tmp_path / 'two'}", launcher=launcher, timeout=1200)
    assert two.returncode == 0, two.stderr[-3000:]
    r1, r2 = (json.loads((tmp_path / d / "metrics.jsonl").read_text()) for d in ("one", "two"))
    assert r1["world_size"] == 1 and r2["world_size"] == 2
    for m in ALL:
        assert r2[m] == pytest.approx(r1[m], rel=1e-6, abs=1e-9), m  # summation order only
    with np.load(r1["npz"]) as a, np.load(r2["npz"]) as b:
        # each rank samples its half in batches of 5 (5, 5, 2 against 5, 5, 5, 5, 4), on torchrun's own thread count
        assert_pixels_close(a["arr_0"], b["arr_0"], what="samples of 1 process vs 2")
        np.testing.assert_array_equal(a["arr_1"], b["arr_1"])


# ----------------------------------------------------------------------------- errors before work


def test_errors_before_any_work(toy_run, tmp_path):
    import tread.cli.fid as fid
    from tread.evaluation.checkpoint_fid import BenchError
    from tread.schema import ConfigError

    def fails(exc, match, **kw):
        with pytest.raises(exc, match=match):
            fid.run(bench_cfg(toy_run, tmp_path / "b", **kw))

    fails(FileNotFoundError, "does not exist", checkpoints=str(tmp_path / "nope"))
    fails(FileNotFoundError, "matches nothing", checkpoints=str(tmp_path / "nope" / "step_*"))
    fails(FileNotFoundError, "ref=", ref=str(tmp_path / "none.npz"))
    fails(BenchError, "too few for metrics", num_samples=3)
    fails(ConfigError, "metrics.*'lpips' is not allowed", metrics=["fid", "lpips"])
    fails(BenchError, "repeats seeds", seeds="1,1,2")
    fails(ConfigError, "vae_dtype", vae_dtype="int8")
    fails(FileNotFoundError, "inception_weights=", features="inception",
          inception_weights=str(tmp_path / "w.pth"))
    with pytest.raises(ConfigError, match="mode=ref.*mode=calc.*mode=bench"):
        fid.run(fid_cfg())  # mode is ??? (missing)
    # A reference for other images: found before sampling.
    save_npz(blob_images(10, size=32), tmp_path / "r32_src.npz")
    fid.run(fid_cfg(mode="ref", source=str(tmp_path / "r32_src.npz"), out=str(tmp_path / "r32.npz"),
                    cache_dir=str(toy_run["cache"])))
    fails(ValueError, "is for 32x32 images but the 'toy_classifier' features are for 16x16", ref=str(tmp_path / "r32.npz"))
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_missing_inception_weights_offline_says_how_to_provide_them(toy_run, tmp_path, monkeypatch):
    import tread.cli.fid as fid
    import tread.encoders.features as feats
    from tread.evaluation.checkpoint_fid import BenchError

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    monkeypatch.setattr(feats, "inception_cache_path", lambda: tmp_path / "hub" / "weights-inception.pth")
    with pytest.raises(BenchError, match="inception_weights=") as err:
        fid.run(bench_cfg(toy_run, tmp_path / "b", features="inception"))
    assert "Could not download" in str(err.value)


def test_cli_errors_exit_nonzero_without_traceback(toy_run, tmp_path):
    proc = run_fid_cli(toy_run["cache"], "mode=bench", f"checkpoints={tmp_path / 'missing'}", f"ref={toy_run['ref']}")
    assert proc.returncode == 1
    assert "error: checkpoints=" in proc.stderr and "Traceback" not in proc.stderr
    bad = run_fid_cli(toy_run["cache"], "mode=foo")
    assert bad.returncode == 1 and "mode=foo is not valid" in bad.stderr
