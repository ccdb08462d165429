"""Sweeps: every job writes summary.json (schema below); a failed job is recorded and the others go on."""
from __future__ import annotations

import json

import pytest

from tread.cli import ablation_report
from conftest import TINY
from test_train import run_cli
from tread.training.loop import train

SUMMARY_KEYS = {
    "status": str, "run_dir": str, "overrides": list, "model": str, "routes": list, "start_step": int,
    "tokens_fraction": float, "train_flops_per_step": float, "final_step": int, "wall_sec": float,
    "train_sec": float, "steps_per_sec": float, "images_per_sec": float, "train_flops_total": float,
    "tokens_fraction_measured": float, "final_fid": (float, type(None)), "best_fid": (float, type(None)),
    "mixed_precision": str, "compiled": bool,
}


def check_summary(summary: dict) -> None:
    for key, types in SUMMARY_KEYS.items():
        assert key in summary, f"summary.json lacks {key!r}"
        assert isinstance(summary[key], types), f"summary[{key!r}] = {summary[key]!r} is not {types}"


def test_summary_schema_and_values(tiny_cfg, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg("train.max_steps=4", "eval.every_steps=2"), run, overrides=["routing=paper"])
    summary = json.loads((run / "summary.json").read_text())
    check_summary(summary)
    assert summary["status"] == "completed" and summary["overrides"] == ["routing=paper"]
    assert summary["final_fid"] == summary["fid"][-1][1] and summary["best_fid"] == min(f for _, f in summary["fid"])
    # DiT-T/4 at 16 tokens, paper route 2..8 of 12 (8 of 16 tokens kept): FLOPs from the model's own count.
    from tread.models import build_dit
    from tread.routing import routing_from_config
    m = build_dit("DiT-T/4", 16, 3, 10)
    routes = routing_from_config({"enabled": True, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2,
                                                               "end_layer_idx": -4}]}, 12)
    assert summary["train_flops_per_step"] == pytest.approx(3 * m.forward_flops(routes) * 8)
    assert summary["train_flops_total"] == pytest.approx(4 * summary["train_flops_per_step"])
    assert summary["tokens_fraction_measured"] == pytest.approx(summary["tokens_fraction"])
    assert summary["steps_per_sec"] > 0 and summary["images_per_sec"] == pytest.approx(8 * summary["steps_per_sec"])


def test_family_summary_counts_flops(tiny_cfg, tmp_path):
    """Families' FLOPs are counted on one sample (FlopCounterMode, router state restored); routed < dense."""
    common = ["model=flux", "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2"]
    dense = train(tiny_cfg(*common, "routing=none"), tmp_path / "dense")
    routed = train(tiny_cfg(*common), tmp_path / "routed")
    assert 0 < routed["train_flops_per_step"] < dense["train_flops_per_step"]


@pytest.mark.slow
def test_multirun_sweep_records_failed_jobs_and_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    overrides = [o for o in TINY if not o.startswith("eval.every")] + [
        "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2", "checkpoint.every_steps=0"]
    proc, _ = run_cli(["train.py", "-m", "routing.routes.0.selection_ratio=0.25,1.5,0.5", *overrides,
                       f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = {int(d.name): json.loads((d / "summary.json").read_text()) for d in sweep.iterdir()
                 if (d / "summary.json").is_file()}
    assert sorted(summaries) == [0, 1, 2]
    assert summaries[1]["status"] == "failed"
    assert "routing.routes[0].selection_ratio=1.5 is not allowed" in summaries[1]["error"]
    assert "routing.routes.0.selection_ratio=1.5" in summaries[1]["overrides"]
    for job in (0, 2):
        check_summary(summaries[job])
        assert summaries[job]["status"] == "completed"
    assert summaries[0]["train_flops_per_step"] > summaries[2]["train_flops_per_step"]
    # ... and the report reads the real sweep: two completed rows and the failed one.
    out = ablation_report.main([str(sweep), "--no-plots"])
    assert sorted((r["run"], r["status"]) for r in out["rows"]) == [("0", "completed"), ("1", "failed"),
                                                                  ("2", "completed")]


def test_time_budget_stops_training_and_resume_keeps_the_count(tiny_cfg, tmp_path):
    """train.time_budget_min: the run stops once training time reaches the budget, evaluates, checkpoints and
    says why in summary.json; a resume continues the count, so a spent budget trains no further."""
    run = tmp_path / "run"
    budget = 1e-5  # 0.6 ms: reached after the first step
    out = train(tiny_cfg("train.max_steps=1000", f"train.time_budget_min={budget}", "eval.every_steps=0"), run)
    assert out["stop_reason"] == "time_budget" and out["final_step"] == 1
    assert out["train_sec_total"] >= budget * 60 and out["final_fid"] is not None   # eval.at_end ran
    assert (run / "checkpoints" / "step_0000001" / "checkpoint.json").is_file()
    again = train(tiny_cfg("train.max_steps=1000", f"train.time_budget_min={budget}", "eval.every_steps=0",
                           "eval.at_end=false", "resume=auto"), run)
    assert again["final_step"] == 1 and again["stop_reason"] == "time_budget"
    assert again["train_sec_total"] == pytest.approx(out["train_sec_total"])
    full = train(tiny_cfg("train.max_steps=2", "train.time_budget_min=60", "eval.every_steps=0",
                          "eval.at_end=false"), tmp_path / "full")
    assert full["stop_reason"] == "max_steps" and full["final_step"] == 2


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_bad_time_budget_is_refused(tiny_cfg, tmp_path, value):
    from tread.schema import ConfigError
    with pytest.raises(ConfigError, match="train.time_budget_min"):
        train(tiny_cfg(f"train.time_budget_min={value}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
