"""End to end: train, evaluate, checkpoint, resume, sample; bad input fails fast."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, free_port
from pixel_checks import assert_pixels_close
from tread.training.loop import train
from tread.training.run_log import read_metrics


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"}


def test_train_evaluate_checkpoint_end_to_end(tiny_cfg, tmp_path):
    run = tmp_path / "run"
    summary = train(tiny_cfg(), run)
    records = read_metrics(run)
    train_recs = [r for r in records if r["type"] == "train"]
    eval_recs = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    for r in train_recs:
        assert {"step", "loss", "steps_per_sec", "images_per_sec", "tokens_fraction"} <= set(r)
        assert np.isfinite(r["loss"]) and r["tokens_fraction"] < 1.0
    assert [r["step"] for r in eval_recs] == [2, 4] and all(np.isfinite(r["fid"]) for r in eval_recs)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0000002.png", "step_0000004.png"]
    assert (run / "config.yaml").is_file()
    saved = json.loads((run / "summary.json").read_text())
    assert saved["final_step"] == 4 and saved["final_fid"] == summary["final_fid"]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tiny_cfg, tmp_path):
    common = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.lr_warmup_steps=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(*common, "train.max_steps=20"), full)
    train(tiny_cfg(*common, "train.max_steps=10"), part)
    train(tiny_cfg(*common, "train.max_steps=20", "resume=auto"), part)
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, 21))
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    # resume=PATH: continue another run's checkpoint in a new run directory.
    other = tmp_path / "other"
    train(tiny_cfg(*common, "train.max_steps=20", f"resume={part}/checkpoints/step_0000010"), other)
    c = losses(other)
    assert sorted(c) == list(range(11, 21)) and all(c[s] == a[s] for s in c)


def test_ratio_zero_logs_the_same_losses_as_dense(tiny_cfg, tmp_path):
    common = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.max_steps=6"]
    train(tiny_cfg(*common, "model=dit"), tmp_path / "dense")
    train(tiny_cfg(*common, "model=tread", "routing.routes.0.selection_ratio=0"), tmp_path / "tread0")
    a, b = losses(tmp_path / "dense"), losses(tmp_path / "tread0")
    assert a.keys() == b.keys()
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (s, a[s], b[s])


def test_existing_run_is_never_overwritten(tiny_cfg, tmp_path):
    cfg = tiny_cfg("eval.every_steps=0", "eval.at_end=false", "train.max_steps=2")
    train(cfg, tmp_path / "run")
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="resume=auto"):
        train(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def run_cli(args: list[str], cache: Path, timeout: int = 900, launcher: list[str] | None = None):
    """(the finished process, its seconds). `timeout` only guards against a hang (many times a loaded machine's
    run); the seconds are for reading: no test asserts on them."""
    env = {**os.environ, "TREAD_CACHE_DIR": str(cache)}
    start = time.time()
    proc = subprocess.run((launcher or [sys.executable]) + args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.time() - start


def test_missing_data_path_is_a_clear_error(tmp_path):
    """Refused before the first training step: one error line naming the path, and the run dir holds none of
    what a step writes (metrics.jsonl, checkpoints/, summary.json)."""
    proc, _ = run_cli(["train.py", "data.builtin=null", f"data.path={tmp_path / 'nope'}",
                       f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and str(tmp_path / "nope") in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not any((tmp_path / "r" / name).exists()
                                                      for name in ("metrics.jsonl", "checkpoints", "summary.json"))


@pytest.mark.slow
def test_sample_cli_writes_pngs_grid_and_npz(tiny_cfg, tmp_path, cache_dir):
    run = tmp_path / "run"
    train(tiny_cfg("eval.every_steps=0", "eval.at_end=false", "train.max_steps=2"), run)
    out = tmp_path / "samples"
    proc, _ = run_cli(["sample.py", f"checkpoint={run}", "num_samples=12", "num_steps=2", f"out_dir={out}",
                       "device=cpu"], cache_dir)
    assert proc.returncode == 0, proc.stderr
    arr = np.load(out / "samples.npz")
    assert arr["arr_0"].shape == (12, 16, 16, 3) and arr["arr_0"].dtype == np.uint8
    assert list(arr["arr_1"]) == [i % 10 for i in range(12)]
    assert len(list((out / "images").glob("*.png"))) == 12 and (out / "grid.png").is_file()
    # Same seeds, different batch size: the same images (per-seed generators), up to float32 rounding (batches of 3
    # against 12 are other matmul shapes, which may order their sums differently).
    out2 = tmp_path / "samples2"
    proc, _ = run_cli(["sample.py", f"checkpoint={run}/checkpoints/step_0000002", "seeds=4-7", "num_steps=2",
                       "batch_size=3", f"out_dir={out2}", "device=cpu"], cache_dir)
    assert proc.returncode == 0, proc.stderr
    assert_pixels_close(np.load(out2 / "samples.npz")["arr_0"], arr["arr_0"][4:8],
                        what="seeds 4-7 sampled 3 per batch vs 12 per batch")


@pytest.mark.slow
def test_two_process_gloo_training(tmp_path, cache_dir):
    from conftest import TINY

    run = tmp_path / "ddp"
    # accelerate 1.15's `launch --cpu --num_processes 2` starts ONE process (multi-CPU needs an MPI hostfile);
    # `--multi_gpu` on a machine without GPUs, with train.cpu=true, runs torchrun + gloo on the CPU.
    args = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), "train.py", *TINY, "train.cpu=true", f"paths.cache_dir={cache_dir}",
            f"hydra.run.dir={run}"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    proc, _ = run_cli(args, cache_dir, timeout=1200, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = read_metrics(run)
    assert [r["step"] for r in recs if r["type"] == "eval"] == [2, 4]
    assert "world size 2" in proc.stdout + proc.stderr
    assert (run / "checkpoints" / "step_0000004" / "rng_rank1.safetensors").is_file()
    # Resume on two processes continues at the saved step.
    proc, _ = run_cli(args[:-1] + [f"hydra.run.dir={run}", "resume=auto", "train.max_steps=6"], cache_dir,
                      timeout=1200, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"][-2:] == [5, 6]


def test_rectified_flow_trains_and_evaluates(tiny_cfg, tmp_path):
    train(tiny_cfg("diffusion=rf"), tmp_path / "rf")
    evals = [r for r in read_metrics(tmp_path / "rf") if r["type"] == "eval"]
    assert len(evals) == 2 and all(np.isfinite(r["fid"]) for r in evals)


def test_undecodable_data_fails_before_training_unless_eval_is_off(tiny_cfg, tmp_path):
    from tread.data import LatentDatasetError, write_latent_dataset

    rng = np.random.default_rng(0)
    path = write_latent_dataset(tmp_path / "vae_latents", rng.standard_normal((32, 4, 8, 8)).astype(np.float32),
                                rng.integers(0, 10, 32), num_classes=10, latent_scale=0.18215,
                                decode={"type": "vae", "vae": "stabilityai/sd-vae-ft-ema"})
    data = ["data.builtin=null", f"data.path={path}", "data.channels=4", "data.resolution=8", "model.arch=DiT-T/2"]
    with pytest.raises(LatentDatasetError, match="eval.every_steps=0 eval.at_end=false"):
        train(tiny_cfg(*data), tmp_path / "run")
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
    summary = train(tiny_cfg(*data, "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2"), tmp_path / "run2")
    assert summary["final_step"] == 2


@pytest.mark.slow
def test_multirun_sweep_over_selection_ratio(tmp_path, cache_dir):
    from conftest import TINY

    sweep = tmp_path / "sweep"
    proc, _ = run_cli(["train.py", "-m", "routing.routes.0.selection_ratio=0,0.5", *TINY, "eval.every_steps=0",
                       "checkpoint.every_steps=0", "train.max_steps=2", f"paths.cache_dir={cache_dir}",
                       f"hydra.sweep.dir={sweep}"], cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = []
    for job in ("0", "1"):
        cfg = (sweep / job / "config.yaml").read_text()
        ratios.append(float(cfg.split("selection_ratio:")[1].split()[0]))
        assert json.loads((sweep / job / "summary.json").read_text())["final_step"] == 2
    assert ratios == [0.0, 0.5]


@pytest.mark.parametrize("extra", [["train.grad_accum_steps=2"], ["train.mixed_precision=bf16"]])
def test_accumulation_and_bf16_train(tiny_cfg, tmp_path, extra):
    summary = train(tiny_cfg(*extra, "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2"), tmp_path / "r")
    assert summary["final_step"] == 2
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "r"))


def test_batch_not_divisible_is_a_clear_error(tiny_cfg, tmp_path):
    from tread.schema import ConfigError

    with pytest.raises(ConfigError, match=r"train.batch_size=8 .* train.grad_accum_steps \(3\)"):
        train(tiny_cfg("train.grad_accum_steps=3"), tmp_path / "r")
