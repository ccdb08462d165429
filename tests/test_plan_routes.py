"""The route planner (tread/cli/plan_routes.py, tread/perf/planner.py, tread/perf/plan.py): FLOPs by hand,
candidates and flags, the geometry it plans for, target filtering, the recommendation rule on injected timings with
progress, a CLI smoke run with real timing of the training step, a pilot on the tiny toy data, one-line input errors."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tread.cli.plan_routes import main, parse_args
from tread.schema.builders import build_model
from tread.models.flops import model_forward_flops
from tread.perf.plan import RULE, PlanError, evaluate_candidates, generate_candidates, ratio_grid, rule_key
from tread.perf.planner import PlanRequest
from tread.perf.planner import plan as plan_request
from tread.routing.spec import Route
from tread.schema import compose
from conftest import TINY, compose_cfg

ROOT = Path(__file__).resolve().parents[1]
B2_32 = ["--arch", "DiT-B/2", "--resolution", "32", "--channels", "4"]


def no_timing(cand):  # time_fn for runs that must not time anything
    raise AssertionError(f"timed {cand['label']}")


def plan(argv, time_fn=no_timing):
    return main(list(argv), time_fn=time_fn)


def by_label(res):
    return {c["label"]: c for c in res["candidates"]}


def grid(argv):
    a = parse_args(argv)
    return ratio_grid(a.ratios, a.ratio_step, a.max_ratio)


# ----------------------------------------------------------------------------- FLOPs by hand
def hand_train_flops(D, depth, routed, keep, batch, N=256, p=2, C=4):
    """DiT on 32x32x4 latents with patch 2 (N = 256 tokens), MLP width 4D, multiply-add = 2 FLOPs.
    Per block with n tokens: 2 n (4 D^2 + 2 D * 4D) (qkv + proj + MLP) + 4 n^2 D (QK^T and AV);
    patch embed + final linear: 2 * (2 N D p^2 C); a training step: 3 x forward x batch."""
    forward = 0
    for i in range(depth):
        n = keep if i in routed else N
        forward += 2 * n * (4 * D * D + 2 * D * 4 * D) + 4 * n * n * D
    forward += 2 * (2 * N * D * p * p * C)
    return 3 * forward * batch


@pytest.mark.parametrize("arch,D,depth", [("DiT-B/2", 768, 12), ("DiT-XL/2", 1152, 28)])
def test_flops_match_hand_computation(arch, D, depth):
    batch = 2
    res = plan(["--arch", arch, "--resolution", "32", "--channels", "4", "--batch", str(batch),
                "--target-speedup", "1.01", "--measure", "0"])
    s = res["settings"]
    assert (s["tokens"], s["depth"], s["batch"]) == (256, depth, batch)
    dense = hand_train_flops(D, depth, range(0), 256, batch)
    assert res["dense"]["train_flops_per_step"] == dense
    rows = by_label(res)
    end = depth - 4
    paper = rows[f"0.5 @ 2..{end}"]   # half the tokens (keep 256 - 128 = 128) over blocks 2..depth-4, inclusive
    assert paper["train_flops_per_step"] == hand_train_flops(D, depth, range(2, end + 1), 128, batch)
    quarter = rows["0.25 @ 3..5"]     # keep 256 - 64 = 192 over blocks 3, 4, 5
    assert quarter["train_flops_per_step"] == hand_train_flops(D, depth, range(3, 6), 192, batch)
    assert paper["flops_ratio"] == paper["train_flops_per_step"] / dense
    assert paper["speedup_bound"] == dense / paper["train_flops_per_step"]
    assert paper["routed_token_blocks"] == (end - 1) * 128
    assert paper["tokens_fraction"] == pytest.approx(1 - (end - 1) * 128 / (depth * 256))
    if arch == "DiT-XL/2":  # the DiT paper's 118.6 GFLOPs (multiply-adds) per forward
        assert res["dense"]["forward_flops_per_sample"] / 2 == pytest.approx(118.6e9, rel=0.01)



def test_plans_from_a_request_without_the_cli():
    """The library takes a plain PlanRequest (the CLI only parses): the same plan as the flags, checked as it is
    built, on the request's threads with the caller's count given back."""
    threads = torch.get_num_threads()
    res = plan_request(PlanRequest(arch="DiT-B/2", resolution=32, channels=4, batch=2, target_speedup=1.2,
                                   ratios=[0.5], threads=1))
    assert res["settings"]["threads"] == 1 and torch.get_num_threads() == threads
    flags = plan(B2_32 + ["--batch", "2", "--target-speedup", "1.2", "--ratios", "0.5", "--threads", "1"])
    assert res["markdown"] == flags["markdown"] and res["candidates"] == flags["candidates"]
    with pytest.raises(PlanError, match="^no target given"):
        PlanRequest(arch="DiT-B/2")
    with pytest.raises(PlanError, match="^--precision fp8 is not allowed; allowed: fp32, bf16$"):
        PlanRequest(target_speedup=1.2, precision="fp8")

# ----------------------------------------------------------------------------- candidates and flags
def test_candidates_follow_the_guidelines_and_flags():
    default = generate_candidates(12, [0.25, 0.5])
    spans = {(r.start_layer_idx, r.end_layer_idx) for (r,) in default}
    assert all(len(c) == 1 for c in default)                       # single routes
    assert min(s for s, _ in spans) == 2 and max(e for _, e in spans) == 8   # start >= 2, end <= depth-4
    assert all(s <= e for s, e in spans) and len(spans) == 7 * 8 // 2 and len(default) == 2 * len(spans)
    relaxed = generate_candidates(12, [0.5], min_start=1, max_end=-2, min_blocks=3)
    assert {r.start_layer_idx for (r,) in relaxed} == set(range(1, 9))   # -2 is block 10; 3 blocks: start <= 8
    assert max(r.end_layer_idx for (r,) in relaxed) == 10
    assert min(r.num_blocks for (r,) in relaxed) == 3

    assert grid(["--target-speedup", "2"]) == [0.25, 0.5]
    assert grid(["--target-speedup", "2", "--ratio-step", "0.1", "--max-ratio", "0.3"]) == [0.1, 0.2, 0.3]
    assert grid(["--target-speedup", "2", "--ratios", "0.5", "0.3"]) == [0.3, 0.5]
    assert grid(["--target-speedup", "2", "--max-ratio", "0.75"]) == [0.25, 0.5, 0.75]

    res = plan(["--arch", "DiT-T/4", "--resolution", "16", "--channels", "3", "--batch", "2",
                "--target-speedup", "1.01", "--measure", "0", "--min-start", "3", "--max-end", "9",
                "--min-blocks", "2", "--ratios", "0.6", "--max-ratio", "0.6"])
    rts = [c["routes"][0] for c in res["candidates"]]
    assert {r["selection_ratio"] for r in rts} == {0.6}
    assert min(r["start_layer_idx"] for r in rts) == 3 and max(r["end_layer_idx"] for r in rts) == 9
    assert min(r["end_layer_idx"] - r["start_layer_idx"] + 1 for r in rts) == 2
    assert res["num_candidates"] == len(rts) == 6 * 7 // 2


def test_rule_order_and_paper_tie_break():
    """Fewest routed token-blocks first; ties: ratio nearest 0.5, then start nearest 2, then end nearest depth-4."""
    N, depth = 256, 12
    sets = [(Route(0.25, 2, 9),), (Route(0.5, 3, 6),), (Route(0.5, 2, 5),), (Route(0.5, 4, 8),),
            (Route(0.5, 2, 2),), (Route(0.25, 3, 10),)]
    flops = lambda routes: 1000.0 - sum(r.num_blocks * (N - r.num_keep(N)) for r in routes) / 10  # noqa: E731
    _, rows = evaluate_candidates(sets, flops, depth, N, 1, {"speedup": 1.01})
    assert [c["label"] for c in rows] == ["0.5 @ 2..2",                   # 128 token-blocks
                                          "0.5 @ 2..5", "0.5 @ 3..6",      # 512: start 2 before 3
                                          "0.25 @ 2..9", "0.25 @ 3..10",   # 512 too, ratio 0.25 after 0.5
                                          "0.5 @ 4..8"]                    # 640
    assert [c["rule_rank"] for c in rows] == [1, 2, 3, 4, 5, 6]
    assert rows == sorted(rows, key=lambda c: rule_key(c, depth))


def test_target_filtering():
    for target, keep in ((["--target-speedup", "1.3"], lambda c: c["speedup_bound"] >= 1.3),
                         (["--flops-fraction", "0.8"], lambda c: c["flops_ratio"] <= 0.8),
                         (["--gflops-per-sample", "120"], lambda c: c["train_gflops_per_sample"] <= 120),
                         (["--target-speedup", "1.2", "--flops-fraction", "0.8"],
                          lambda c: c["speedup_bound"] >= 1.2 and c["flops_ratio"] <= 0.8)):
        res = plan(B2_32 + ["--batch", "1", "--measure", "0"] + target)
        meets = {c["label"] for c in res["candidates"] if c["meets_theory"]}
        assert meets == {c["label"] for c in res["candidates"] if keep(c)}, target
        assert 0 < len(meets) < res["num_candidates"] and res["num_meet_theory"] == len(meets)
        rec = res["recommendation"]
        assert rec["basis"] == "theory" and rec["meets_target"] and rec["label"] in meets
        # nothing timed: the rule's first qualifying candidate, fewest routed token-blocks among them
        first = min((c for c in res["candidates"] if c["meets_theory"]), key=lambda c: c["routed_token_blocks"])
        assert by_label(res)[rec["label"]]["routed_token_blocks"] == first["routed_token_blocks"]
        assert rec["label"] == next(c["label"] for c in res["candidates"] if c["meets_theory"])


# ----------------------------------------------------------------------------- the geometry it plans for
@pytest.mark.parametrize("argv,shape,why", [
    (["--arch", "DiT-B/2"], (4, 32, 256), "the usual data of DiT-B/2, ImageNet-256 SD-VAE latents"),
    (["--arch", "DiT-XL/2", "--resolution", "16"], (4, 16, 64), "--resolution as named, the rest from the usual "
                                                                "data of DiT-XL/2"),
    (["--arch", "DiT-T/4"], (3, 16, 16), "the usual data of DiT-T/4, the built-in toy data (configs/data/toy.yaml)"),
    (["--arch", "DiT-B/2", "--resolution", "16", "--channels", "3"], (3, 16, 64), "as named by --resolution/--channels"),
    (["--arch", "DiT-B/2", "--data", "toy"], (3, 16, 64), "the data of the composed config (data=toy)"),
])
def test_plans_for_the_named_geometry_or_the_archs_usual_data(argv, shape, why):
    """The quickstart line plans for what a DiT-B/2 user trains on (256 tokens of 4x32x32 latents), says so on
    its first line, and times nothing by default (--measure 0: FLOPs only)."""
    res = plan(argv + ["--target-speedup", "1.05"])
    s, (c, r, n) = res["settings"], shape
    assert (s["channels"], s["resolution"], s["tokens"]) == (c, r, n) and res["num_measured"] == 0
    first = res["markdown"].splitlines()[0]
    assert first.startswith(f"planning for {c}x{r}x{r} latents ({n} tokens): {why}"), first
    named = why == "as named by --resolution/--channels"   # then there is no hint at other geometries
    assert first.endswith(why if named else "; --resolution/--channels plan for others")


def test_usual_data_train_command_names_the_data():
    rec = plan(["--arch", "DiT-B/2", "--target-speedup", "1.3"])["recommendation"]
    assert rec["train_command"].startswith("python train.py model=tread model.arch=DiT-B/2 data=imagenet256 ")


# ----------------------------------------------------------------------------- the rule on injected timings
def fake_timer(realised, log):
    """Each candidate realises `realised(row)` x its FLOPs bound; dense takes 100 ms."""
    def time_fn(c):
        log.append(c["label"])
        return {"dense_s": 0.1, "step_s": 0.1 / (realised(c) * c["speedup_bound"])}
    return time_fn


def test_recommendation_on_injected_timings(tmp_path):
    log = []
    res = plan(B2_32 + ["--batch", "1", "--target-speedup", "1.2", "--measure", "3", "--json",
                        str(tmp_path / "plan.json")], fake_timer(lambda c: 0.9, log))
    rows = by_label(res)
    qualifying = [c for c in res["candidates"] if c["meets_theory"]]
    # first timed: the rule's first candidate (bound >= 1.2); it realises 0.9 of its bound and misses
    assert log[0] == qualifying[0]["label"] and not rows[log[0]]["meets_measured"]
    # then only candidates predicted to make it (bound x 0.9 >= 1.2), in rule order, one per cost class
    predicted = [c for c in qualifying if c["speedup_bound"] * 0.9 >= 1.2]
    assert log[1] == predicted[0]["label"] and rows[log[1]]["meets_measured"] and len(log) == 3
    # it meets the target, so only candidates before it in rule order can change the pick: none is predicted to
    # make it any more, so the largest bound among them is timed (and misses)
    earlier = [c for c in qualifying if c["rule_rank"] < rows[log[1]]["rule_rank"] and c["label"] != log[0]
               and not c.get("same_cost_as")]
    assert log[2] == max(earlier, key=lambda c: c["speedup_bound"])["label"] and not rows[log[2]]["meets_measured"]
    rec = res["recommendation"]
    assert rec["basis"] == "measured" and rec["meets_target"] and rec["label"] == log[1]
    assert rows[rec["label"]]["speedup"] == pytest.approx(0.9 * rows[rec["label"]]["speedup_bound"])
    assert res["num_measured"] == 3 and res["settings"]["timing"] == "injected"
    md = res["markdown"]
    assert f"**{rec['label']}** (recommended)" in md and "not timed" in md and "3 timed (--measure 3)" in md
    assert json.loads((tmp_path / "plan.json").read_text())["recommendation"]["label"] == rec["label"]
    assert RULE in md


def test_timing_stops_when_nothing_can_change_the_pick():
    log = []
    res = plan(B2_32 + ["--batch", "1", "--target-speedup", "1.2", "--measure", "4"], fake_timer(lambda c: 1.0, log))
    first = next(c for c in res["candidates"] if c["meets_theory"])
    assert log == [first["label"]] and res["num_measured"] == 1   # the rule's first meets: nothing else is timed
    assert res["timing_stopped_early"] and "stopped early" in res["markdown"]
    assert res["recommendation"]["label"] == log[0] and res["recommendation"]["meets_target"]


def test_timing_reports_progress_with_an_estimate(capsys):
    plan(B2_32 + ["--batch", "1", "--target-speedup", "1.2", "--measure", "3"], fake_timer(lambda c: 0.9, []))
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("planning for 4x32x32 latents (256 tokens): as named")
    assert any(line.startswith("timing at most 3 candidates") for line in err)
    progress = [line for line in err if line.startswith("timed ")]
    assert progress[0].startswith("timed 1 of at most 3 candidates in ") and "s more" in progress[0]
    assert len(progress) == 3 and "nothing left to time" in progress[-1]


def test_recommendation_when_none_meets_the_target():
    log = []
    res = plan(B2_32 + ["--batch", "1", "--target-speedup", "1.3", "--measure", "2"],
               fake_timer(lambda c: 1.25 / c["speedup_bound"] - 0.01 * len(log), log))   # 1.24x, then 1.23x
    rec = res["recommendation"]
    assert not rec["meets_target"] and rec["basis"] == "measured"
    assert rec["label"] == log[0] and "none of the 2 timed candidates meets the target" in rec["reason"]
    assert "does NOT meet the target (closest)" in res["markdown"]


def test_flops_only_target_times_in_rule_order():
    log = []
    res = plan(B2_32 + ["--batch", "1", "--flops-fraction", "0.8", "--measure", "2"], fake_timer(lambda c: 0.5, log))
    qualifying = [c for c in res["candidates"] if c["meets_theory"]]
    # rule order, skipping candidates that do the same work as one already timed (same ratio, length, FLOPs)
    first = qualifying[0]
    same = [c["label"] for c in qualifying if c["routes"][0]["selection_ratio"] == first["routes"][0]["selection_ratio"]
            and c["train_flops_per_step"] == first["train_flops_per_step"]]
    second = next(c["label"] for c in qualifying if c["label"] not in same)
    assert log == [first["label"], second] and len(same) > 1
    rows = by_label(res)
    assert all(rows[x].get("same_cost_as") == first["label"] for x in same[1:])
    assert res["recommendation"]["label"] == first["label"] and res["recommendation"]["meets_target"]


# ----------------------------------------------------------------------------- real runs
def test_cli_smoke_real_timing(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "scripts/plan_routes.py", "--arch", "DiT-T/4", "--resolution", "16",
                           "--channels", "3", "--batch", "4", "--steps", "2", "--warmup", "1", "--measure", "2",
                           "--target-speedup", "1.05", "--threads", "1", "--json", str(out),
                           "--markdown", str(tmp_path / "plan.md")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "| # | route | tokens processed | train FLOPs/step |" in proc.stdout
    assert "Recommendation (measured)" in proc.stdout and "timing " in proc.stderr   # progress on stderr
    res = json.loads(out.read_text())
    timed = [c for c in res["candidates"] if c["measured"]]
    # with a speedup target timing stops early once the rule's pick is settled: 1 or 2 timed, by the machine
    assert 1 <= len(timed) <= 2 and res["dense"]["step_ms"] > 0 and res["settings"]["timing"] == "measured"
    for c in timed:
        assert c["step_ms"] > 0 and c["speedup"] > 0 and c["flops_match"]   # the training loop's own count
        assert c["counted_forward_flops"] == c["forward_flops_per_sample"]
    rec = res["recommendation"]
    assert rec["label"] in {c["label"] for c in timed}
    assert rec["train_command"].startswith("python train.py model=tread model.arch=DiT-T/4")
    assert (tmp_path / "plan.md").read_text().strip() == res["markdown"].strip()


def test_pilot_ranks_candidates_and_dense(tmp_path, cache_dir):
    sets = [x for s in TINY if not s.startswith(("model.arch", "train.batch_size"))
            for x in ("--set", s)] + ["--set", f"paths.cache_dir={cache_dir}"]
    res = plan(["--arch", "DiT-T/4", "--batch", "8", "--target-speedup", "1.05", "--measure", "0", "--threads", "1",
                "--pilot", "2", "--pilot-top", "2", "--out", str(tmp_path / "plan")] + sets)
    p = res["pilot"]
    assert len(p["runs"]) == 3 and sorted(r["rank"] for r in p["runs"]) == [1, 2, 3]
    assert sum(not r["routes"] for r in p["runs"]) == 1 and p["metric"] == "final_loss"
    losses = [r["final_loss"] for r in p["runs"]]
    assert all(math.isfinite(x) for x in losses) and losses == sorted(losses)
    for r in p["runs"]:
        assert r["steps"] == 2 and r["train_sec"] > 0 and r["flops_match"]
        assert (Path(r["run_dir"]) / "summary.json").is_file() and (Path(r["run_dir"]) / "metrics.jsonl").is_file()
    routed = [r for r in p["runs"] if r["routes"]]
    assert res["recommendation"]["basis"] == "pilot" and res["recommendation"]["label"] == routed[0]["label"]
    assert "rule_recommendation" in res and "| rank | route | steps | final loss |" in res["markdown"]


def test_pilot_at_equal_training_time(tmp_path, cache_dir):
    """--pilot-seconds: every run gets the same training time (train.time_budget_min), so the routed ones take
    more steps; ranked by loss, with throughput vs dense."""
    if "time_budget_min" not in compose_cfg("train").train:
        pytest.skip("this checkout's training loop has no train.time_budget_min")
    sets = [x for s in TINY if not s.startswith(("model.arch", "train.batch_size"))
            for x in ("--set", s)] + ["--set", f"paths.cache_dir={cache_dir}"]
    res = plan(["--arch", "DiT-T/4", "--batch", "8", "--flops-fraction", "0.8", "--measure", "0", "--threads", "1",
                "--pilot-seconds", "0.6", "--pilot-top", "1", "--out", str(tmp_path / "plan")] + sets)
    p = res["pilot"]
    assert p["seconds"] == 0.6 and p["steps"] is None and len(p["runs"]) == 2
    for r in p["runs"]:
        assert r["train_sec"] >= 0.6 and r["steps"] >= 1 and math.isfinite(r["final_loss"])
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["stop_reason"] == "time_budget"
    assert "0.6 s of training each, ranked by final loss" in res["markdown"]


# ----------------------------------------------------------------------------- bad inputs
T = ["--target-speedup", "1.2"]
BAD = [
    (["--model", "nope"] + T, "--model nope is not a model config; allowed: auraflow, chroma, cosmos, dit, "),
    (["--arch", "DiT-Q/2"] + T, "--arch DiT-Q/2 is not a known DiT; allowed: DiT-T/2"),
    (["--model", "flux", "--arch", "DiT-B/2"] + T, "--arch DiT-B/2 applies to model=tread|dit"),
    (["--preset", "tiny"] + T, "--preset tiny applies to the diffusers families"),
    (["--model", "flux", "--preset", "huge"] + T, "--preset huge is not a flux preset; allowed:"),
    (["--arch", "DiT-B/2", "--resolution", "15"] + T,
     "--resolution 15 is not divisible by the patch size 2 of DiT-B/2; allowed: multiples of 2"),
    (B2_32 + ["--ratios", "1.2"] + T, "--ratios 1.2 is out of range"),
    (B2_32 + ["--ratios", "0.7"] + T, "--ratios 0.7 exceeds --max-ratio 0.5"),
    (B2_32 + ["--max-ratio", "1"] + T, "--max-ratio 1 is out of range"),
    (B2_32 + ["--ratio-step", "0"] + T, "--ratio-step 0 is out of range"),
    (B2_32 + ["--target-speedup", "5"], "--target-speedup 5 is unreachable: the largest FLOPs-bound speedup is 1.4"),
    (B2_32 + ["--flops-fraction", "0.1"], "--flops-fraction 0.1 is unreachable"),
    (B2_32 + ["--gflops-per-sample", "1"], "--gflops-per-sample 1 is unreachable"),
    (B2_32, "no target given"),
    (B2_32 + ["--target-speedup", "0.9"], "--target-speedup 0.9 is not allowed; it must be > 1"),
    (B2_32 + ["--flops-fraction", "1.5"], "--flops-fraction 1.5 is not allowed"),
    (B2_32 + ["--min-start", "20"] + T, "--min-start 20 is out of range for depth 12; allowed: 0..11"),
    (B2_32 + ["--max-end", "1"] + T, "--max-end 1 (block 1) comes before --min-start 2"),
    (B2_32 + ["--min-blocks", "9"] + T, "--min-blocks 9 leaves no candidate"),
    (B2_32 + ["--batch", "0"] + T, "--batch 0 is not allowed"),
    (B2_32 + ["--set", "routing.routes=[]"] + T, "--set routing.routes=[] is not allowed"),
    (B2_32 + ["--set", "model.arch=DiT-S/2"] + T, "is set by --arch"),
    (B2_32 + ["--set", "oops"] + T, "--set 'oops' is not a Hydra override"),
    (B2_32 + ["--set", "train.no_such_key=3"] + T, "do not compose"),
    (B2_32 + ["--precision", "fp8"] + T, "argument --precision: invalid choice: 'fp8'"),
    (["--resolution", "abc"] + T, "argument --resolution: invalid int value: 'abc'"),
    (B2_32 + ["--device", "tpu"] + T, "--device tpu"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split(" ")[0] + "-" + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_inputs_give_one_line_errors(argv, message):
    with pytest.raises(SystemExit) as err:
        plan(argv + ["--measure", "2"])   # no_timing: every error comes before any timing
    text = str(err.value.code)
    assert text.startswith("error: ") and "\n" not in text
    assert message in text, text


def test_pilot_data_mismatch_is_an_error_before_timing(cache_dir):
    with pytest.raises(SystemExit) as err:
        plan(["--arch", "DiT-T/4", "--channels", "4", "--batch", "8", "--target-speedup", "1.05", "--pilot", "2",
              "--set", "data.builtin_args.num_per_class=40", "--set", f"paths.cache_dir={cache_dir}"])
    text = str(err.value.code)
    assert "\n" not in text and "--pilot trains on the data (toy_shapes), which does not fit the plan's " \
        "--channels 4 --resolution 16" in text and "has 3 channels" in text


def test_cli_error_is_one_line_on_stderr():
    proc = subprocess.run([sys.executable, "scripts/plan_routes.py", "--arch", "DiT-Q/2", "--target-speedup", "1.2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().startswith("error: --arch DiT-Q/2") and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow   # about 10 s on a 2-core CPU: diffusers import and four tiny FLUX builds
def test_family_flops_are_the_training_loops_count():
    """A diffusers family (tiny FLUX): each candidate's FLOPs are model_forward_flops of the model train.py builds
    with that route (torch's FlopCounterMode), here checked against freshly built routed models."""
    res = plan(["--model", "flux", "--target-speedup", "1.01", "--measure", "0", "--batch", "2"])
    s = res["settings"]
    assert s["family"] == "flux" and s["model_name"] == "flux-tiny" and res["num_candidates"] > 0
    rows = res["candidates"]
    for c in (rows[0], rows[-1]):
        cfg = compose(s["overrides"] + c["overrides"])
        model = build_model(cfg.model)
        assert [r.__dict__ for r in model.routing.routes] == c["routes"]
        assert model_forward_flops(model) == c["forward_flops_per_sample"]
        assert c["train_flops_per_step"] == 3 * c["forward_flops_per_sample"] * 2
    dense = build_model(compose(s["overrides"] + ["routing=none"]).model)
    assert model_forward_flops(dense) == res["dense"]["forward_flops_per_sample"]
    assert all(c["forward_flops_per_sample"] < res["dense"]["forward_flops_per_sample"] for c in rows)


def test_context_parallel_adds_what_a_process_sends():
    """--context-parallel D: per sample and step, one process sends (D - 1) / D of its query, key, value and output
    shards at every block's attention, three times (forward, checkpointed recompute, backward); a routed block
    sends its kept tokens' only. A degree that does not split the tokens is a flag error."""
    from tread.perf.context_memory import PASSES

    res = plan_request(PlanRequest(arch="DiT-B/2", resolution=32, channels=4, batch=2, target_speedup=1.2,
                                   context_parallel=4))
    tokens, depth, width = res["settings"]["tokens"], res["settings"]["depth"], 768
    per_block = 4 * tokens / 4 * width * 2 * 3 / 4
    assert res["dense"]["exchange_bytes"] == pytest.approx(PASSES * depth * per_block)
    row = res["candidates"][0]
    route = Route(**row["routes"][0]) if isinstance(row["routes"][0], dict) else row["routes"][0]
    span = route.end_layer_idx - route.start_layer_idx + 1
    kept = route.num_keep(tokens) / tokens
    assert row["exchange_bytes"] == pytest.approx(PASSES * per_block * (depth - span + span * kept))
    assert f"{tokens // 4} tokens per process" in res["markdown"]
    assert "all-to-all / process (GB) |" in res["markdown"].splitlines()[5]
    assert "all-to-all" not in plan_request(PlanRequest(arch="DiT-B/2", resolution=32, channels=4, batch=2,
                                                        target_speedup=1.2))["markdown"]
    with pytest.raises(PlanError, match=r"--context-parallel=3: the sequence has 256 routable tokens"):
        plan_request(PlanRequest(arch="DiT-B/2", resolution=32, channels=4, batch=2, target_speedup=1.2,
                                 context_parallel=3))
    with pytest.raises(PlanError, match="--context-parallel 0 is not allowed"):
        PlanRequest(target_speedup=1.2, context_parallel=0)
