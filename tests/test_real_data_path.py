"""The real-data path end to end, on a tiny random VAE: class-folder images -> precompute_latents (moments,
flips, reference statistics) -> training with in-training evaluation decoded by the dataset's VAE ->
sample.py -> fid.py checkpoint benchmarking."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute
from conftest import TINY, compose_cfg, shared_cache

RES = 32  # image side; the tiny VAE downsamples by 2 -> 4x16x16 latents


@pytest.mark.slow
def test_images_to_latents_to_training_to_benchmark(tmp_path_factory):
    from diffusers import AutoencoderKL

    from tread.data import LatentDataset
    from tread.data.builtin.toy import generate_toy_shapes
    from tread.training.loop import train
    from tread.training.run_log import read_metrics

    cache = shared_cache(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("realpath")
    torch.manual_seed(0)
    vae_dir = tmp / "tiny-vae"
    AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                  norm_num_groups=4, sample_size=RES).save_pretrained(vae_dir)
    # An ImageNet-style folder: one sub-folder per class, images larger than RES and not square.
    x, y = generate_toy_shapes(4, 48, seed=3)
    pixels = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, (img, label) in enumerate(zip(pixels, y.tolist())):
        folder = tmp / "images" / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.concatenate([img, img[:, :8]], axis=1)).save(folder / f"{i:03d}.png")  # 48x56

    out, ref = tmp / "latents", tmp / "ref.npz"
    tread.cli.precompute.main(["--images", str(tmp / "images"), "--out", str(out), "--vae", str(vae_dir),
                            "--resolution", str(RES), "--flip", "--batch-size", "8", "--shard-size", "16",
                            "--device", "cpu", "--ref-out", str(ref), "--ref-features", "toy_classifier",
                            "--cache-dir", str(cache)])
    ds = LatentDataset(out)
    assert len(ds) == 80 and ds.latent_kind == "moments" and ds.shape == (4, 16, 16)
    assert ds.meta["decode"]["vae"] == str(vae_dir) and ds.meta["image_resolution"] == RES
    with np.load(ref) as r:
        assert r["arr_0"].shape == (40, RES, RES, 3) and {"mu", "sigma", "mu_s", "sigma_s"} <= set(r.files)

    # Training draws latents from the moments; evaluation decodes samples with the VAE and scores them.
    run = tmp / "run"
    data = ["data=imagenet256", f"data.path={out}", "data.channels=4", "data.resolution=16", "data.num_classes=10",
            f"eval.reference={ref}", "eval.decode_batch_size=7", "eval.metrics=[fid,sfid,is,precision,recall,kid]"]
    cfg = compose_cfg("train", TINY + ["~data.builtin_args", f"paths.cache_dir={cache}", *data])
    summary = train(cfg, run)
    evals = [r for r in read_metrics(run) if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and summary["final_fid"] == evals[-1]["fid"]
    assert all(np.isfinite(r[m]) for r in evals for m in ("fid", "sfid", "is", "precision", "recall", "kid"))
    grid = Image.open(run / "samples" / "step_0000004.png")
    assert grid.size[0] > 10 * RES  # decoded RES x RES images, one column per class

    # sample.py decodes with the VAE named in the checkpoint's data metadata (here overridden explicitly).
    import tread.cli.sample as sample

    sample_cfg = compose_cfg("sample", [f"checkpoint={run}", "num_samples=6", "num_steps=2", "device=cpu",
                                        f"out_dir={tmp / 'samples'}", f"vae={vae_dir}", "vae_dtype=bfloat16"])
    sample.run(sample_cfg)
    with np.load(tmp / "samples" / "samples.npz") as s:
        assert s["arr_0"].shape == (6, RES, RES, 3)

    # fid.py benchmarks the checkpoint against the precomputed reference.
    import tread.cli.fid as fid

    fid_cfg = compose_cfg("fid", ["mode=bench", f"checkpoints={run}", f"ref={ref}", f"cache_dir={cache}",
                                  "num_samples=12", "num_steps=2", "sample_batch_size=6", "device=cpu",
                                  f"out_dir={tmp / 'bench'}", "kid_subset_size=6", "kid_subsets=3"])
    rows = fid.run(fid_cfg)
    assert len(rows) == 1 and rows[0]["step"] == 4
    saved = json.loads((tmp / "bench" / "metrics.jsonl").read_text())
    assert saved["num_samples"] == 12 and np.isfinite(saved["fid"])
    with np.load(saved["npz"]) as s:
        assert s["arr_0"].shape == (12, RES, RES, 3)
