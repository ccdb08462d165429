"""Phase-aware summary.json: the whole-run keys (tokens_fraction_run, train_flops_run, tokens_fraction_measured_run)
against the hand sum over a schedule's phases, a resumed run against an uninterrupted one, a run without schedule,
the resume state's check, and the reports' fallback for summaries written before the whole-run keys."""
from __future__ import annotations

import json

import pytest

from tread.analysis.seed_groups import Group, group_table, run_tokens
from tread.analysis.sweep_report import row
from tread.training.loop import train
from tread.checkpoint.values import ResumeValueError, check_plain

QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]
TWO_PHASES = "routing.schedule=[{start_step:0},{start_step:3,routes:[]}]"
RAMP = "routing.schedule=[{start_step:0},{start_step:3,selection_ratio:[0.5,0.1]},{start_step:5,routes:[]}]"


def test_two_phases_whole_run_is_the_hand_sum(tiny_cfg, tmp_path):
    s = train(tiny_cfg(*QUIET, "train.max_steps=5", TWO_PHASES), tmp_path / "run")
    routed, dense = s["schedule"]
    assert routed["tokens_fraction"] < dense["tokens_fraction"] == 1.0
    hand_share = (3 * routed["tokens_fraction"] + 2 * dense["tokens_fraction"]) / 5
    hand_flops = 3 * routed["train_flops_per_step"] + 2 * dense["train_flops_per_step"]
    assert s["tokens_fraction_run"] == pytest.approx(hand_share) and s["train_flops_run"] == pytest.approx(hand_flops)
    assert s["train_flops_run"] == s["train_flops_total"]
    assert s["tokens_fraction"] == routed["tokens_fraction"]                     # the start phase, as before
    assert s["train_flops_per_step"] == routed["train_flops_per_step"]
    assert s["tokens_fraction_measured_run"] == s["tokens_fraction_measured"]        # one launch from step 0
    assert s["tokens_fraction_measured_run_steps"] == 5
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["tokens_fraction_run"] == s["tokens_fraction_run"]


def test_a_resumed_run_reports_the_uninterrupted_runs_whole_run_values(tiny_cfg, tmp_path):
    common = [*QUIET, "train.lr_warmup_steps=2", RAMP]
    full = train(tiny_cfg(*common, "train.max_steps=7"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=4"), tmp_path / "part")       # checkpoints at its last step
    resumed = train(tiny_cfg(*common, "train.max_steps=7", "resume=auto"), tmp_path / "part")
    assert resumed["start_step"] == 4
    assert resumed["tokens_fraction_measured_run"] == full["tokens_fraction_measured_run"]
    assert resumed["tokens_fraction_measured_run_steps"] == 7
    assert resumed["tokens_fraction_measured"] != full["tokens_fraction_measured"]   # per launch: steps 4..6 only
    assert resumed["tokens_fraction_run"] == pytest.approx(full["tokens_fraction_run"])
    assert resumed["train_flops_run"] == pytest.approx(full["train_flops_run"])
    assert resumed["tokens_fraction"] != full["tokens_fraction"]                    # start phase of each launch


def test_without_schedule_whole_run_equals_start_values(tiny_cfg, tmp_path):
    s = train(tiny_cfg(*QUIET, "train.max_steps=3"), tmp_path / "run")
    assert s["schedule"] is None and s["tokens_fraction"] < 1.0
    assert s["tokens_fraction_run"] == s["tokens_fraction"]
    assert s["train_flops_run"] == pytest.approx(3 * s["train_flops_per_step"])
    assert s["tokens_fraction_measured_run"] == s["tokens_fraction_measured"]


@pytest.mark.parametrize("values, key", [({"tokens_sum": 3.5, "tokens_steps": 3}, "tokens_sum=3.5"),
                                         ({"tokens_sum": float("nan"), "tokens_steps": 3}, "tokens_sum=nan"),
                                         ({"tokens_sum": 1.0, "tokens_steps": -1}, "tokens_steps=-1")])
def test_the_resume_state_refuses_a_wrong_measured_sum(values, key):
    train = {"train_sec": 1.0, "world_size": 1, "loader": {"epoch": 0, "batch": 0}, **values}
    with pytest.raises(ResumeValueError, match=key):
        check_plain(train)
    check_plain({**train, "tokens_sum": 1.5, "tokens_steps": 3})


SCHEDULE = [{"start_step": 0, "end_step": 3, "routes": "0.5 @ 2..8"},
            {"start_step": 3, "end_step": None, "routes": "none"}]


@pytest.mark.parametrize("summary, share, note", [
    ({"tokens_fraction_measured_run": 0.8, "tokens_fraction_run": 0.7, "tokens_fraction": 0.6}, 0.8, ""),
    ({"tokens_fraction_run": 0.7, "tokens_fraction": 0.6, "schedule": SCHEDULE}, 0.7, ""),
    ({"tokens_fraction_measured": 0.9, "start_step": 4, "tokens_fraction": 0.6}, 0.9, "one launch"),
    ({"tokens_fraction_measured": 0.9, "start_step": 0, "tokens_fraction": 0.6}, 0.9, ""),
    ({"tokens_fraction": 0.6, "schedule": SCHEDULE}, 0.6, "start phase"),
    ({"tokens_fraction": 0.6, "schedule": None}, 0.6, ""), ({}, None, "")])
def test_reports_read_whole_run_keys_and_say_what_a_fallback_covers(summary, share, note):
    assert run_tokens(summary) == (share, note)
    r = row({"run": "r", "summary": {"status": "completed", "train_flops_total": 5.0, **summary}})
    assert (r["tokens_fraction_run"], r["run_values"], r["train_flops_run"]) == (share, note, 5.0)
    table = group_table([Group(("a",), "a", [{"summary": summary, "records": []}])], [])
    expected = "-" if share is None else f"{100 * share:.1f}%" + (f" ({note})" if note else "")
    assert table[0].endswith("tokens processed (whole run) |") and table[2].endswith(f"| {expected} |")
