"""The statistics of seeded comparisons (tread/analysis/stats.py) against scipy's own tests and textbook Holm,
and metrics read along a run at equal steps, measured time and FLOPs (tread/analysis/along_run.py), through
scripts/ablation_report.py on a synthetic sweep."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from tread.cli import ablation_report
from tread.analysis import stats
from tread.analysis.along_run import budget_key, common_budget, curve, interpolate, value_at
from tread.analysis.seed_groups import comparisons, seed_groups
from tread.analysis.sweep_report import ReportError, load_runs

A = [30.1, 31.4, 29.0, 30.6, 32.2]
B = [27.9, 30.0, 26.1, 28.8, 30.9]


def test_paired_and_welch_equal_scipys_tests_and_intervals():
    got = stats.compare(dict(enumerate(A)), dict(enumerate(B)))
    ref = scipy_stats.ttest_rel(B, A)
    assert got["test"] == "paired" and got["n"] == 5 and got["df"] == 4
    assert got["t"] == pytest.approx(ref.statistic) and got["p"] == pytest.approx(ref.pvalue)
    assert got["ci"] == pytest.approx(tuple(ref.confidence_interval(0.95)))
    unpaired = stats.compare({k: v for k, v in enumerate(A)}, {k + 10: v for k, v in enumerate(B)})
    ref = scipy_stats.ttest_ind(B, A, equal_var=False)
    assert unpaired["test"] == "Welch" and unpaired["p"] == pytest.approx(ref.pvalue)
    assert unpaired["ci"] == pytest.approx(tuple(ref.confidence_interval(0.95)))
    # Pairing removes the shared seed luck: the same values are far clearer paired than not.
    assert got["p"] < 0.01 < unpaired["p"]


def test_holm_step_down_verdicts_and_identical_runs_left_out():
    rows = [{"p": p, "n": 5, "se": 1.0, "df": 4} for p in (0.01, 0.04, 0.03, 0.005)]
    rows.append({**stats.paired([0.0] * 5), "n": 5})            # the same run prefix: not a comparison
    stats.holm(rows)
    assert [r["p_holm"] for r in rows[:4]] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [r["verdict"] for r in rows] == ["differs", "not shown", "not shown", "differs", "identical"]
    assert rows[4]["p_holm"] is None and {r["family"] for r in rows} == {4}
    few = stats.holm([{"p": 0.001, "n": 3, "se": 1.0, "df": 2}])
    assert few[0]["verdict"] == "too few seeds"                   # below MIN_SEEDS: reported, not claimed


def test_detectable_difference_has_the_stated_power():
    """Simulated paired experiments (5 seeds, per-seed sd 2) with the true difference set to the detectable
    one reject at the family level about 80% of the time."""
    sd, n, alpha = 2.0, 5, 0.05 / 6
    d = stats.detectable(sd / np.sqrt(n), n - 1, alpha)
    diffs = np.random.default_rng(0).normal(d, sd, (20000, n))
    p = scipy_stats.ttest_1samp(diffs, 0.0, axis=1).pvalue
    assert abs((p < alpha).mean() - stats.POWER) < 0.015


def test_interpolation_along_a_run_never_extrapolates():
    pts = [(10.0, 40.0), (20.0, 30.0), (40.0, 20.0)]
    assert interpolate(pts, 15.0) == 35.0 and interpolate(pts, 20.0) == 30.0 and interpolate(pts, 30.0) == 25.0
    assert interpolate(pts, 9.9) is None and interpolate(pts, 40.1) is None and interpolate([], 1.0) is None


def fake(d: Path, seed: int, fid_at_time, sec_per_step: float, flops: float, name: str):
    """A completed run: evaluations every 100 steps whose FID is fid_at_time(training seconds)."""
    d.mkdir(parents=True)
    steps = [100, 200, 300, 400]
    recs = [{"type": "eval", "step": s, "train_sec": s * sec_per_step, "fid": fid_at_time(s * sec_per_step),
             "class_acc": 0.5} for s in steps]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (d / "summary.json").write_text(json.dumps({
        "status": "completed", "overrides": [f"experiment={name}", f"train.seed={seed}"], "final_step": 400,
        "final_fid": recs[-1]["fid"], "train_sec": 400 * sec_per_step, "train_flops_per_step": flops}))


@pytest.fixture
def study(tmp_path):
    """Two arms over 5 seeds: 'fast' takes half the time per step at half the FLOPs; at equal time its FID is
    lower by 3 (plus a per-seed offset both arms share: the paired design cancels it)."""
    root = tmp_path / "study"
    for seed in range(5):
        luck = [0.0, 2.0, -1.5, 1.0, -0.5][seed]
        fake(root / "slow" / str(seed), seed, lambda t, l=luck: 50 - t / 4 + l, 0.2, 2e9, "slow")
        fake(root / "fast" / str(seed), seed, lambda t, l=luck, k=seed: 47 - t / 4 + l + 0.1 * k, 0.1, 1e9, "fast")
    return root


def test_equal_time_and_flops_are_measured_from_the_runs(study):
    runs = load_runs(study)
    fast = next(r for r in runs if r["run"] == "fast/0")
    assert curve(fast, "fid", "time") == [(10.0, 44.5), (20.0, 42.0), (30.0, 39.5), (40.0, 37.0)]
    assert common_budget(runs, "time") == 40.0            # the fast arm's last evaluation
    end = curve(fast, "fid", "time")[-1][0] + 1 / 3        # a budget with many digits stays inside the run
    assert value_at({**fast, "records": [*fast["records"], {"type": "eval", "step": 401, "train_sec": end,
                                                            "fid": 1.0}]}, budget_key("fid", "time", end)) == 1.0
    assert common_budget(runs, "flops") == 400 * 1e9
    assert value_at(fast, "fid@time=25") == pytest.approx(40.75) and value_at(fast, "fid@time=41") is None
    groups = seed_groups(runs)
    rows = {r["b"]: r for r in comparisons(groups, "fid@time=40", ["fast:slow"])}
    assert rows["fast"]["test"] == "paired" and rows["fast"]["diff"] == pytest.approx(-3 + 0.2)
    assert rows["fast"]["verdict"] == "differs"


def test_report_states_budgets_family_and_power(study, tmp_path):
    for seed in range(5):     # a third setting that stops at 30 s: the table's budget, not the fast:slow pair's
        fake(study / "short" / str(seed), seed, lambda t: 60 - t, 0.075, 1e9, "short")
    out = ablation_report.main([str(study), "--at-time", "auto", "--at-flops", "auto", "--metric", "class_acc",
                                "--compare", "fast:slow", "--no-plots", "--out", str(tmp_path / "r")])
    md = Path(out["markdown"]).read_text()
    assert "**Equal time** (FID at 30.0 s of training (each comparison" in md and "**Equal flops**" in md
    assert "| FID at 40.0 s of training | slow | fast | paired, 5 | -2.80 [" in md
    assert "class accuracy at 40.0 s of training" in md and "Power: with 5 seeds" in md
    with pytest.raises(ReportError, match="--compare 'fast:dense'"):
        ablation_report.main([str(study), "--compare", "fast:dense", "--no-plots", "--out", str(tmp_path / "r")])
    with pytest.raises(ReportError, match="--at-time='soon'"):
        ablation_report.main([str(study), "--at-time", "soon", "--no-plots"])
    assert np.isfinite(out["rows"][0]["final_fid"])
