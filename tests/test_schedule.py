"""Routing schedules (routing.schedule): phase semantics, validation, training follows the phase, exact resume
across a phase boundary, and the summary's phases and FLOPs."""
from __future__ import annotations

import json

import pytest

from tread.models.dit import build_dit
from tread.routing import Route, RouteConfigError, RoutingController
from tread.training.loop import train
from tread.training.run_log import read_metrics

ROUTING = {"enabled": True, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]}
QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]
SCHEDULE = "routing.schedule=[{start_step:0},{start_step:3,selection_ratio:[0.5,0.1]},{start_step:5,routes:[]}]"


def controller(schedule, depth=12):
    return RoutingController.from_config({**ROUTING, "schedule": schedule}, depth)


def records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r["type"] == "train"}


def test_phases_give_each_step_its_routes():
    c = controller([{"start_step": 0}, {"start_step": 10, "selection_ratio": [0.5, 0.0]},
                    {"start_step": 20, "selection_ratio": 0.25}, {"start_step": 30, "routes": []}])
    assert c.routes_at(0) == c.routes_at(9) == [Route(0.5, 2, 8)]
    assert c.routes_at(10) == [Route(0.5, 2, 8)]
    assert c.routes_at(15) == [Route(0.25, 2, 8)]                    # halfway through the ramp
    assert c.routes_at(19)[0].selection_ratio == pytest.approx(0.05)
    assert c.routes_at(20) == c.routes_at(29) == [Route(0.25, 2, 8)]
    assert c.routes_at(30) == c.routes_at(10 ** 6) == []             # dense to the end
    assert c.routes == [Route(0.5, 2, 8)]                            # inference spans stay the configured ones


def test_set_step_changes_training_routes_but_not_inference():
    c = controller([{"start_step": 0}, {"start_step": 4, "routes": []}])
    assert c.active_routes(training=True) == [Route(0.5, 2, 8)]
    c.set_step(4)
    assert c.active_routes(training=True) == [] and c.active_routes(training=False) == []
    c.set_step(3)                                                    # a resume before the boundary
    assert c.active_routes(training=True) == [Route(0.5, 2, 8)]


def test_explicit_routes_in_a_phase_are_resolved_against_the_depth():
    c = controller([{"start_step": 0, "routes": [{"selection_ratio": 0.75, "start_layer_idx": 1, "end_layer_idx": -2}]}])
    assert c.routes_at(0) == [Route(0.75, 1, 10)]


@pytest.mark.parametrize("schedule,match", [
    ([{"start_step": 2}], r"schedule\[0\]\.start_step=2 must be 0"),
    ([{"start_step": 0}, {"start_step": 0}], r"schedule\[1\]\.start_step=0 must be greater"),
    ([{"start_step": 0, "selection_ratio": [0.5, 0.2]}], r"ramps, but phase 0 is the last one"),
    ([{"start_step": 0, "selection_ratio": 1.0}], r"schedule\[0\]\.selection_ratio=1\.0 must be a selection ratio"),
    ([{"start_step": 0, "selection_ratio": [0.5]}], r"a ramp is a list of two"),
    ([{"start_step": 0, "routes": [], "selection_ratio": 0.5}], r"gives both routes and selection_ratio"),
    ([{"start_step": 0, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 40}]}],
     r"schedule\[0\]\.routes: .*end_layer_idx=40 is out of range"),
])
def test_bad_schedules_name_the_phase_and_field(schedule, match):
    with pytest.raises(RouteConfigError, match=match):
        controller(schedule)


def test_a_schedule_needs_routing_enabled():
    with pytest.raises(RouteConfigError, match="routing.schedule is set but routing is disabled"):
        RoutingController.from_config({"enabled": False, "routes": [], "schedule": [{"start_step": 0}]}, 12)


def test_the_model_builds_its_schedule():
    model = build_dit("DiT-T/2", 16, 3, 10, routing={**ROUTING, "schedule": [{"start_step": 0},
                                                                            {"start_step": 5, "routes": []}]})
    assert model.routing.routes_at(5) == [] and model.routing.routes_at(4) == [Route(0.5, 2, 8)]


def test_training_follows_the_phases_and_the_summary_counts_them(tiny_cfg, tmp_path):
    summary = train(tiny_cfg(*QUIET, "train.max_steps=7", SCHEDULE), tmp_path / "run")
    recs = records(tmp_path / "run")
    routed, dense = 1 - 0.5 * 7 / 12, 1.0                          # 16 tokens: keep 8 over 7 of 12 blocks
    assert [recs[s]["tokens_fraction"] for s in (1, 2, 3)] == pytest.approx([routed] * 3)
    assert recs[4]["tokens_fraction"] == pytest.approx(routed)      # ramp's first step: ratio 0.5
    assert routed < recs[5]["tokens_fraction"] < dense               # ratio 0.3: keep 12 of 16
    assert recs[6]["tokens_fraction"] == recs[7]["tokens_fraction"] == dense
    phases = summary["schedule"]
    assert [(p["start_step"], p["end_step"], p["routes"]) for p in phases] == [
        (0, 3, "0.5 @ 2..8"), (3, 5, "0.5→0.1 @ 2..8"), (5, None, "none (dense)")]
    per_step = [p["train_flops_per_step"] for p in phases]
    assert per_step[0] < per_step[2]
    middle = summary["train_flops_total"] - 3 * per_step[0] - 2 * per_step[2]
    assert per_step[0] < middle / 2 < per_step[2]                    # the two ramp steps, between routed and dense
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["schedule"] == phases


def test_a_dense_phase_equals_dense_training_exactly(tiny_cfg, tmp_path):
    train(tiny_cfg(*QUIET, "train.max_steps=4", "model=dit"), tmp_path / "dense")
    train(tiny_cfg(*QUIET, "train.max_steps=4", "routing.schedule=[{start_step:0,routes:[]}]"), tmp_path / "sched")
    a, b = records(tmp_path / "dense"), records(tmp_path / "sched")
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b]


def test_a_single_default_phase_equals_no_schedule(tiny_cfg, tmp_path):
    train(tiny_cfg(*QUIET, "train.max_steps=4"), tmp_path / "plain")
    train(tiny_cfg(*QUIET, "train.max_steps=4", "routing.schedule=[{start_step:0}]"), tmp_path / "sched")
    a, b = records(tmp_path / "plain"), records(tmp_path / "sched")
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b]


@pytest.mark.parametrize("stop", [4, 5])    # resume inside the ramp, and exactly at the dense phase's start
def test_resume_across_a_phase_boundary_is_exact(tiny_cfg, tmp_path, stop):
    common = [*QUIET, "train.lr_warmup_steps=2", SCHEDULE]
    train(tiny_cfg(*common, "train.max_steps=7"), tmp_path / "full")
    train(tiny_cfg(*common, f"train.max_steps={stop}"), tmp_path / "part")
    summary = train(tiny_cfg(*common, "train.max_steps=7", "resume=auto"), tmp_path / "part")
    a, b = records(tmp_path / "full"), records(tmp_path / "part")
    assert sorted(b) == list(range(1, 8))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b]
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["start_step"] == stop
    routed, dense = (p["train_flops_per_step"] for p in (full["schedule"][0], full["schedule"][2]))
    if stop == 5:
        assert summary["train_flops_per_step"] == dense
    else:                                   # step 4 is inside the ramp (ratio 0.3)
        assert routed < summary["train_flops_per_step"] < dense
    assert summary["train_flops_total"] == pytest.approx(full["train_flops_total"])   # the whole run, not the launch
