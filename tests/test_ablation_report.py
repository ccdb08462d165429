"""scripts/ablation_report.py on a synthetic sweep directory (completed and failed runs)."""
from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_report():
    spec = importlib.util.spec_from_file_location("ablation_report", REPO / "scripts" / "ablation_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(d: Path, job: int, ratio, fids, flops, status="completed"):
    d.mkdir(parents=True)
    routes = [] if ratio == 0 else [{"selection_ratio": ratio, "start_layer_idx": 2, "end_layer_idx": 8}]
    summary = {"status": status, "overrides": [f"routing.routes.0.selection_ratio={ratio}"], "routes": routes,
               "tokens_fraction": 1 - ratio * 7 / 12, "train_flops_per_step": flops}
    if status == "completed":
        summary.update({"final_step": 300, "final_fid": fids[-1], "best_fid": min(fids), "steps_per_sec": 4.0,
                        "images_per_sec": 256.0, "train_flops_total": 300 * flops, "wall_sec": 90.0})
        records = [{"type": "train", "step": s, "loss": 1.0 / s, "elapsed_sec": s / 4} for s in (100, 200, 300)]
        records += [{"type": "eval", "step": s, "fid": f} for s, f in zip((100, 200, 300), fids)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{\"type\": \"tra")
    else:
        summary["error"] = "RouteConfigError: routing.routes[0].selection_ratio=1.5 is out of range"
    (d / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def sweep(tmp_path):
    s = tmp_path / "sweep"
    fake_run(s / "0", 0, 0, [40.0, 30.0, 25.0], 3e9)
    fake_run(s / "1", 1, 0.5, [45.0, 32.0, 24.0], 2e9)
    fake_run(s / "2", 2, 1.5, None, 1e9, status="failed")
    (s / "multirun.yaml").write_text("hydra: {}\n")
    return s


def test_report_tables_and_plots(sweep):
    out = load_report().main([str(sweep)])
    rows = {r["run"]: r for r in out["rows"]}
    assert set(rows) == {"0", "1", "2"}
    assert rows["0"]["selection_ratio"] == 0.0 and rows["1"]["selection_ratio"] == 0.5
    assert rows["2"]["status"] == "failed" and "selection_ratio=1.5" in rows["2"]["error"]
    md = Path(out["markdown"]).read_text()
    assert md.count("\n| ") == 3 and "Runs that did not complete" in md and "`2` (failed)" in md
    with open(out["csv"]) as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == ["0", "1", "2"] and table[1]["final_fid"] == "24.0"
    assert {Path(p).name for p in out["plots"]} == {"fid_vs_ratio.png", "fid_vs_time.png", "fid_vs_flops.png",
                                                   "loss.png"}
    assert all(Path(p).stat().st_size > 1000 for p in out["plots"])


def test_no_finished_runs_is_said_clearly(tmp_path, capsys):
    s = tmp_path / "sweep"
    fake_run(s / "0", 0, 1.5, None, 1e9, status="failed")
    out = load_report().main([str(s)])
    assert out["plots"] == [] and "No finished runs" in capsys.readouterr().err


def test_empty_or_missing_sweep_is_an_error(tmp_path):
    report = load_report()
    with pytest.raises(report.ReportError, match="no summary.json"):
        report.main([str(tmp_path)])
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "ablation_report.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "error: sweep directory" in proc.stderr
