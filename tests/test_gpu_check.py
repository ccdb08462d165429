"""make gpu-check (tread/cli/gpu_check.py) without a GPU: what it says about missing dependencies, and its steps at
--quick sizes, with the CUDA-only ones reported as skipped. Its GPU run is in docs/benchmarks.md."""
from __future__ import annotations

import json
import re

import pytest
import torch

import tread.cli.gpu_check as gpu_check


def test_missing_dependencies_are_named_with_how_to_bring_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.NEEDED, "no_such_module_here", "no-such-dist")
    assert gpu_check.main(["--out", str(tmp_path)]) == 1                       # no --wheels: stops at once
    out = capsys.readouterr().out
    assert "this Python lacks no-such-dist" in out and "--download-wheels" in out
    assert gpu_check.main(["--out", str(tmp_path), "--wheels", str(tmp_path / "none")]) == 1
    assert "holds no .whl files" in capsys.readouterr().out
    assert not (tmp_path / "report.md").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (CUDA-only steps skipped)")
def test_quick_run_reports_every_step(tmp_path):
    out = tmp_path / "check"
    rc = gpu_check.main(["--quick", "--out", str(out), "--only", "gpu tests", "DiT-XL/2 benchmark"])
    results = json.loads((out / "results.json").read_text())
    assert rc == 0, results
    status = {r["name"]: r["status"] for r in results["steps"]}
    assert status == {"gpu tests": "skipped: no CUDA device", "DiT-XL/2 benchmark": "passed"}
    report = (out / "report.md").read_text()
    assert report.startswith("# gpu-check on CPU, torch ") and "| DiT-S/2 | paper" in report
    assert json.loads((out / "dit_xl2.json").read_text())["sampling"]["images_per_s"] > 0


def test_an_unknown_step_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^error: --only nope is not a step; allowed: 'gpu tests', "):
        gpu_check.main(["--out", str(tmp_path), "--only", "nope"])


def test_bad_batches_and_budget_are_one_error_line(tmp_path):
    for flags, needle in ((["--xl-batches", "128", "0"], "--xl-batches: '0' is not allowed: an integer in [1, "),
                          (["--budget", "0"], "--budget: '0' is not allowed: a number in (0, 86400]"),
                          (["--budget", "nan"], "--budget: 'nan' is not allowed: a number in (0, 86400]")):
        with pytest.raises(SystemExit, match=r"^error: argument " + re.escape(needle)):
            gpu_check.main(["--out", str(tmp_path), *flags])
