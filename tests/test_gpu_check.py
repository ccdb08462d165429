"""make gpu-check (tread/cli/gpu_check.py) without a GPU: what it says about missing dependencies, and its steps at
--quick sizes, with the CUDA-only ones reported as skipped. Its GPU run is in docs/benchmarks.md."""
from __future__ import annotations

import json
import re

import pytest
import torch

import tread.cli.gpu_check as gpu_check
import tread.cli.gpu_steps as gpu_check_steps
from tread.models.families import FAMILIES


def test_missing_dependencies_are_named_with_how_to_bring_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.NEEDED, "no_such_module_here", "no-such-dist")
    assert gpu_check.main(["--out", str(tmp_path)]) == 1                       # no --wheels: stops at once
    out = capsys.readouterr().out
    assert "this Python lacks no-such-dist" in out and "--download-wheels" in out
    assert gpu_check.main(["--out", str(tmp_path), "--wheels", str(tmp_path / "none")]) == 1
    assert "holds no .whl files" in capsys.readouterr().out
    assert not (tmp_path / "report.md").exists()


QUICK_GROUPS = {    # the --quick list in three parts, so that the suite's workers share it
    "flux and dit": ["gpu tests", "FLUX mid routed step", "FLUX LoRA bf16 base", "FLUX LoRA fp8 base",
                     "DiT-XL/2 benchmark"],
    "families": ["every family mid routed step"],
    "video and buckets": ["Wan mid long sequences", "compiled buckets"],
}


def test_the_groups_cover_the_whole_list(tmp_path):
    args = gpu_check.build_parser().parse_args(["--quick", "--out", str(tmp_path)])
    names = [s.name for s in gpu_check.steps(args, tmp_path)]
    assert sorted(names) == sorted(n for g in QUICK_GROUPS.values() for n in g)      # compare_paper: --paper-dir


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (CUDA-only steps skipped)")
@pytest.mark.parametrize("group", QUICK_GROUPS)
def test_quick_run_passes_every_step(tmp_path, group):
    """`gpu_check.py --quick`: every step of the GPU list at tiny sizes here, each judged by its JSON (losses
    finite, parameters moved, no recompile within a bucket, static bytes as the table counts them)."""
    out = tmp_path / "check"
    rc = gpu_check.main(["--quick", "--out", str(out), "--only", *QUICK_GROUPS[group]])
    results = json.loads((out / "results.json").read_text())
    status = {r["name"]: r["status"] for r in results["steps"]}
    assert rc == 0, status
    assert status == {n: "skipped: no CUDA device" if n == "gpu tests" else "passed" for n in QUICK_GROUPS[group]}
    report = (out / "report.md").read_text()
    assert report.startswith("# gpu-check on CPU, torch ")
    if group == "flux and dit":
        assert "| DiT-S/2 | paper" in report and "| flux:tiny | model.base_dtype=fp8" in report
        assert json.loads((out / "dit_xl2.json").read_text())["sampling"]["images_per_s"] > 0
    if group == "families":
        records = json.loads((out / "families_mid.json").read_text())["results"]
        assert {r["family"] for r in records} == set(FAMILIES) and all(len(r["losses"]) == 2 for r in records)
    if group == "video and buckets":
        buckets = json.loads((out / "buckets.json").read_text())["results"][0]["buckets"]
        assert [b["grid"] for b in buckets] == [[8, 12], [12, 8], [8, 12]] and buckets[0]["warmup"]["unique_graphs"]


def fake_step(tmp_path, name: str, code: str, **kw) -> gpu_check.Step:
    """A step whose command is `python -c code`, judged by out/<name>.json."""
    return gpu_check.Step(name, ["-c", code], 60, output=f"{name}.json", **kw)


def test_a_step_whose_json_shows_no_training_fails_naming_it(tmp_path):
    record = {"model": "flux/mid", "config": "paper", "losses": [1.0, float("nan")], "loss_finite": False,
              "params_moved": False, "compile": {"graph_breaks": 0},
              "buckets": [{"grid": [48, 80], "warmup": {"unique_graphs": 1}, "timed": {"unique_graphs": 1}},
                          {"grid": [48, 80], "revisit": True, "warmup": {"unique_graphs": 1},
                           "timed": {"unique_graphs": 0}}]}
    (tmp_path / "bad.json").write_text(json.dumps({"results": [record]}))     # as a benchmark run leaves it
    step = fake_step(tmp_path, "bad", "pass", check=gpu_check_steps.check_benchmark)
    result = gpu_check.run_step(step, gpu_check.environment(None), tmp_path, 60)
    assert result["rc"] == 1 and result["status"].startswith("failed: flux/mid paper: a loss was not finite")
    for needle in ("the trained parameters did not move", "bucket 48x80 recompiled while timed",
                   "bucket 48x80 compiled again when it came back"):
        assert needle in result["status"]
    missing = fake_step(tmp_path, "missing", "pass", check=gpu_check_steps.check_benchmark)
    result = gpu_check.run_step(missing, gpu_check.environment(None), tmp_path, 60)
    assert result["rc"] == 1 and "its output missing.json could not be judged (FileNotFoundError" in result["status"]


def test_the_measured_static_bytes_must_match_the_table(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"run": "flux:mid", "losses": [1.0, 0.9], "loss_finite": True,
                                                 "params_moved": True, "static": 110, "estimate": 100}))
    assert gpu_check_steps.check_measure(tmp_path / "m.json") == [
        "flux:mid: 110 static bytes held against the table's 100 (more than 5% apart)"]
    (tmp_path / "v.json").write_text(json.dumps({"rows": [
        {"family": "wan", "preset": "mid", "route": "none", "tokens": 32760, "oom": True},
        {"family": "wan", "preset": "mid", "route": "paper", "tokens": 32760, "oom": False, "loss_finite": True,
         "params_moved": True}]}))
    assert gpu_check_steps.check_video(tmp_path / "v.json") == ["wan mid none at 32760 tokens: out of memory"]


def test_a_failure_on_cuda_runs_again_with_launch_blocking(tmp_path):
    """The FLUX failure's cause is named where it happens only with CUDA_LAUNCH_BLOCKING=1: a step that asks for
    it runs again so, its log beside the first."""
    code = "import os, sys; print('blocking', os.environ.get('CUDA_LAUNCH_BLOCKING')); sys.exit(3)"
    step = gpu_check.Step("flaky", ["-c", code], 60, blocking_rerun=True)
    result = gpu_check.run_one(step, gpu_check.environment(None), tmp_path, cuda=True, left=120)
    assert result["status"] == "failed (exit status 3)"
    assert result["blocking_rerun"]["status"] == "failed (exit status 3)"
    assert (tmp_path / "flaky.log").read_text().strip() == "blocking None"
    assert (tmp_path / result["blocking_rerun"]["log"]).read_text().strip() == "blocking 1"
    section = "\n".join(gpu_check.step_section(result, step, tmp_path))
    assert "Again with CUDA_LAUNCH_BLOCKING=1: failed (exit status 3)" in section and "blocking 1" in section
    assert "blocking_rerun" not in gpu_check.run_one(step, gpu_check.environment(None), tmp_path, cuda=False,
                                                     left=120)


def test_an_unknown_step_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^error: --only nope is not a step; allowed: 'gpu tests', "):
        gpu_check.main(["--out", str(tmp_path), "--only", "nope"])


def test_bad_batches_and_budget_are_one_error_line(tmp_path):
    for flags, needle in ((["--xl-batches", "128", "0"], "--xl-batches: '0' is not allowed: an integer in [1, "),
                          (["--budget", "0"], "--budget: '0' is not allowed: a number in (0, 86400]"),
                          (["--budget", "nan"], "--budget: 'nan' is not allowed: a number in (0, 86400]")):
        with pytest.raises(SystemExit, match=r"^error: argument " + re.escape(needle)):
            gpu_check.main(["--out", str(tmp_path), *flags])
