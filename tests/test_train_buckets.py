"""Training on bucketed data (data=toy_buckets: the toy shapes at 16x16, 24x16, 16x24, 32x32): every bucket trains
and is reported, resume mid-epoch is exact (one process and two), the resolution schedule draws small buckets
first, small buckets are dropped with a warning, buckets off the model's patch are refused."""
import json
import shutil
import sys

import pytest

from conftest import TINY, free_port
from test_train import run_cli
from tread.schema import ConfigError
from tread.training.loop import train

BUCKETS = ["data=toy_buckets", "data.builtin_args.num_per_class=8", "model.arch=DiT-T/2", "train.batch_size=8",
           "eval.every_steps=0", "eval.at_end=false", "train.log_every_steps=1"]


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_every_bucket_trains_and_is_reported(tiny_cfg, tmp_path):
    summary = train(tiny_cfg(*BUCKETS, "train.max_steps=12"), tmp_path / "run")
    table = {row["bucket"]: row for row in summary["buckets"]}
    assert set(table) == {"16x16", "24x16", "16x24", "32x32"}
    assert sum(row["steps"] for row in table.values()) == 12
    assert table["24x16"]["latent_hw"] == [16, 24] and table["32x32"]["latent_hw"] == [32, 32]
    assert all(row["first_step_sec"] > 0 and 0 < row["tokens_fraction"] <= 1 for row in table.values())
    assert all(row["sec_per_step"] is None or row["sec_per_step"] > 0 for row in table.values())
    flops = {name: row["train_flops_per_step"] for name, row in table.items()}
    assert flops["24x16"] == pytest.approx(flops["16x24"]) and flops["16x16"] < flops["24x16"] < flops["32x32"]
    assert flops["16x16"] < summary["train_flops_per_step"] < flops["32x32"]     # the buckets' weighted mean


def test_resume_mid_epoch_on_buckets_is_exact(tiny_cfg, tmp_path):
    common = [*BUCKETS, "checkpoint.every_steps=5"]           # 320 samples / 8: 40 batches an epoch
    train(tiny_cfg(*common, "train.max_steps=10"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=5"), tmp_path / "part")
    train(tiny_cfg(*common, "train.max_steps=10", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")


def test_resolution_schedule_trains_the_small_buckets_first(tiny_cfg, tmp_path):
    schedule = "data.resolution_schedule=[{until_step: 6, max_pixels: 256}, {until_step: null, min_pixels: 1024}]"
    summary = train(tiny_cfg(*BUCKETS, schedule, "train.max_steps=6"), tmp_path / "a")
    assert {row["bucket"] for row in summary["buckets"]} == {"16x16"}
    summary = train(tiny_cfg(*BUCKETS, schedule, "train.max_steps=9", "resume=auto", "checkpoint.every_steps=6"),
                    tmp_path / "b")
    assert {row["bucket"] for row in summary["buckets"]} == {"16x16", "32x32"}


def test_a_bucket_smaller_than_a_batch_is_dropped_with_a_warning(tiny_cfg, tmp_path):
    small = ["data.builtin_args.sizes=[16x16,24x16]", "data.builtin_args.num_per_class=[8,1]"]
    with pytest.warns(UserWarning, match=r"bucket\(s\) 24x16 \(10\) .* fewer samples than one batch .* dropped"):
        summary = train(tiny_cfg(*BUCKETS, *small, "train.batch_size=16",
                                 "train.max_steps=2"), tmp_path / "run")
    assert [row["bucket"] for row in summary["buckets"]] == ["16x16"]


def test_buckets_off_the_model_patch_are_refused_before_training(tiny_cfg, tmp_path):
    odd = "data.builtin_args.sizes=[16x16,17x16]"
    with pytest.raises(ConfigError, match=r"bucket\(s\) 17x16 \(latents 16x17\) .* not whole 2x2-latent patches"):
        train(tiny_cfg(*BUCKETS, odd), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_resolution_schedule_on_square_data_is_refused(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="data.resolution_schedule needs bucketed data"):
        train(tiny_cfg("data.resolution_schedule=[{until_step: null}]"), tmp_path / "run")


def test_a_family_trains_on_buckets_with_routing(tiny_cfg, tmp_path):
    summary = train(tiny_cfg(*BUCKETS[:2], "model=flux", "train.batch_size=8", "eval.every_steps=0",
                             "eval.at_end=false", "train.max_steps=8"), tmp_path / "flux")
    assert summary["final_step"] == 8 and len(summary["buckets"]) >= 2
    assert all(row["tokens_fraction"] < 1 for row in summary["buckets"])


def test_masked_loss_and_force_keep_at_every_bucket(tiny_cfg, tmp_path):
    summary = train(tiny_cfg(*BUCKETS, "+data.builtin_args.loss_masks=true", "train.masked_loss=true",
                             "train.max_steps=8"), tmp_path / "masked")
    assert len(summary["buckets"]) >= 2 and all(0.5 <= row["tokens_fraction"] <= 1 for row in summary["buckets"])
    train(tiny_cfg(*BUCKETS, "train.max_steps=8"), tmp_path / "plain")
    assert losses(tmp_path / "masked") != losses(tmp_path / "plain")          # the same batches, weighted losses


@pytest.mark.slow
def test_two_process_training_on_buckets_resumes_exactly(tmp_path, cache_dir):
    def launch(run, *extra):
        args = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", str(free_port()), "train.py", *TINY, *BUCKETS,
                "train.cpu=true", "checkpoint.every_steps=3", f"paths.cache_dir={cache_dir}", f"hydra.run.dir={run}",
                *extra]
        proc, _ = run_cli(args, cache_dir, timeout=1200, launcher=[sys.executable, "-m", "accelerate.commands.launch"])
        assert proc.returncode == 0, proc.stderr[-4000:]

    launch(tmp_path / "full", "train.max_steps=6")
    shutil.copytree(tmp_path / "full", tmp_path / "part")           # as if killed after the step-3 checkpoint
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step_0000006")
    launch(tmp_path / "part", "train.max_steps=6", "resume=auto")   # metrics.jsonl is cut back to step 3 first
    assert losses(tmp_path / "full") == losses(tmp_path / "part") and len(losses(tmp_path / "part")) == 6
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["buckets"]
