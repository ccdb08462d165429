"""tread/perf/video_memory.py: the bytes the real video training step saves for backward with gradient checkpointing,
routed and not, against the analytic figure and the per-token law; scripts/video_memory_gpu.py on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

from tread.cli.memory_table import main as table_main
from tread.cli.video_memory_gpu import main as gpu_main
from tread.perf.video_memory import (Saved, activation_rows, activation_table, extrapolate, per_token_fit,
                                     saved_bytes, video_families)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_rows():
    return activation_rows("wan", "tiny", frames=(1, 3, 5), latents=(8, 12))


def test_saved_bytes_counts_each_storage_once_without_parameters():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    # mul saves x twice (one storage), linear saves its input h and its weight (a parameter: left out)
    saved = saved_bytes(lambda: lin(x * x).sum().backward(), lin.parameters())
    assert saved == Saved(2 * 3 * 8 * 4, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):     # the bf16 cast of the weight is a weight copy
        copied = saved_bytes(lambda: lin(x).float().sum().backward(), lin.parameters())
    assert copied == Saved(3 * 8 * 2, 4 * 8 * 2)


def test_routed_saving_equals_the_analytic_figure(tiny_rows):
    """Checkpointed blocks keep their inputs: a routed block keeps K = N / 2 tokens' (the paper route over blocks
    2..4 of 8), its route start the N it gathers from and the K kept ids."""
    routed = [r for r in tiny_rows if r["route"] == "paper"]
    assert [r["routes"] for r in routed] == [[(2, 4, n // 2, n)] for n in (24, 72, 120)]
    dense = {r["frames"]: r["activations"] for r in tiny_rows if r["route"] == "none"}
    for r in routed:
        assert r["activations"] == r["expected"] < dense[r["frames"]]
        n, per = r["tokens"], r["token_bytes"]
        assert dense[r["frames"]] - r["activations"] == (3 * n // 2 - n) * per - n // 2 * 8
    assert "| wan tiny | 5 | 120 | 60 |" in activation_table(tiny_rows)


def test_saved_bytes_are_exactly_affine_in_tokens(tiny_rows):
    for route in ("none", "paper"):
        points = [(r["tokens"], r["activations"]) for r in tiny_rows if r["route"] == route]
        a, b, miss = per_token_fit(points)
        assert miss == 0 and b > 0
        assert extrapolate(tiny_rows, 216, route) == (float(a + 216 * b), 0)
    assert per_token_fit([(1, 10), (2, 20), (3, 31)])[2] == 1


def test_gpu_script_on_the_cpu(tiny_rows, tmp_path, capsys):
    """--device cpu --tiny: the same step's saved bytes after a warm-up step (the optimizer state exists)."""
    out = tmp_path / "v.json"
    assert gpu_main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    measured = {(r["route"], r["frames"]): r["activations"] for r in tiny_rows}
    assert [(r["route"], r["frames"]) for r in rows] == [("none", 1), ("none", 3), ("paper", 1), ("paper", 3)]
    assert all(r["activations"] == measured[r["route"], r["frames"]] and not r["oom"] for r in rows)
    assert "| wan tiny | paper | 3 | 72 | - | - | - |" in capsys.readouterr().out


def test_bad_inputs_name_the_flag():
    assert "wan" in video_families() and "flux" not in video_families()
    with pytest.raises(SystemExit, match="--latents '60by104' is not a latent size; allowed: HxW"):
        gpu_main(["--device", "cpu", "--latents", "60by104", "--out", "/dev/null"])
    with pytest.raises(SystemExit, match="--video flux:mid: 'flux' is not a video family; allowed: .*wan"):
        table_main(["--video", "flux:mid"])
    with pytest.raises(SystemExit, match="--frames \\[1\\] .* allowed: two or more distinct frame counts"):
        table_main(["--video", "wan:tiny", "--frames", "1"])
