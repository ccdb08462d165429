"""The benchmark (tread/cli/benchmark.py, tread/perf/benchmark_run.py, tread/perf/benchmark.py): FLOPs arithmetic
(tread/models/flops.py), flags as config overrides, output schema, the --family path, compile counts, and that it
times the training loop's own step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo

import tread.cli.benchmark as bench
from tread.perf.benchmark_run import (BenchError, BenchRequest, config_overrides, is_dense, route_configs,
                                      run_benchmark)
from tread.models import build_dit
from tread.models.flops import as_routes, dit_forward_flops, dit_train_flops, train_step_flops
from tread.perf.benchmark import StepBench, split_steps
from tread.perf.peaks import device_peak_flops, fraction_of_bound
from tread.schema import check_train, compose
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.training.setup import make_loader, open_dataset
from tread.checkpoint.files import list_checkpoints, load_model_file

ROOT = Path(__file__).resolve().parents[1]
PAPER = [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]


# ----------------------------------------------------------------------------- FLOPs by hand
def hand_forward_flops(D: int, depth: int, routed_blocks: range, n_tokens=256, patch=2, channels=4) -> int:
    """First principles, multiply-add = 2. Per block with n tokens: qkv (3 D^2) + proj (D^2) + MLP fc1/fc2
    (2 D H, H = 4D) matmuls = 2 n (4 D^2 + 2 D H); attention scores Q K^T and A V = 2 * 2 n^2 D. Routed blocks
    see n = N - int(0.5 N) tokens. Patch embed (p^2 C -> D) and final linear (D -> p^2 C) on all N tokens."""
    H = 4 * D
    total = 0
    for i in range(depth):
        n = n_tokens - int(n_tokens * 0.5) if i in routed_blocks else n_tokens
        total += 2 * n * (4 * D * D + 2 * D * H) + 4 * n * n * D
    total += 2 * (2 * n_tokens * D * patch * patch * channels)
    return total


@pytest.mark.parametrize("arch,D,depth", [("DiT-B/2", 768, 12), ("DiT-XL/2", 1152, 28)])
def test_dit_flops_match_hand_computation(arch, D, depth):
    dense = hand_forward_flops(D, depth, range(0))
    paper = hand_forward_flops(D, depth, range(2, depth - 4 + 1))     # blocks 2..-4, inclusive
    assert dit_forward_flops(arch, 32, 4) == dense
    assert dit_forward_flops(arch, 32, 4, PAPER) == paper
    assert dit_forward_flops(arch, 32, 4, {"enabled": True, "routes": PAPER}) == paper
    assert dit_forward_flops(arch, 32, 4, {"enabled": False, "routes": PAPER}) == dense
    for batch in (1, 64):
        assert dit_train_flops(arch, 32, 4, None, batch) == 3 * dense * batch
        assert dit_train_flops(arch, 32, 4, PAPER, batch) == 3 * paper * batch


def test_dit_xl2_numbers_match_the_papers():
    # DiT paper: DiT-XL/2 at 256 px (32x32 latents) is 118.6 GFLOPs counted as multiply-adds.
    dense = dit_forward_flops("DiT-XL/2", 32, 4)
    assert dense / 2 == pytest.approx(118.6e9, rel=0.01)
    # TREAD paper route: half the tokens skip 23 of 28 blocks, so about (5 + 23/2) / 28 = 0.589 of the
    # linear-layer cost; attention (quadratic in n) makes it slightly cheaper still.
    ratio = dit_forward_flops("DiT-XL/2", 32, 4, PAPER) / dense
    assert (5 + 23 / 2) / 28 - 0.015 < ratio < (5 + 23 / 2) / 28
    assert 1.69 < 1 / ratio < 1.75


def test_flops_functions_equal_the_models_own_count():
    for arch, res, ch in (("DiT-T/4", 16, 3), ("DiT-S/2", 8, 4)):
        model = build_dit(arch, res, ch, 10)
        routes = as_routes(PAPER, model.depth)
        assert dit_forward_flops(arch, res, ch) == model.forward_flops([])
        assert dit_forward_flops(arch, res, ch, PAPER) == model.forward_flops(routes)


def test_small_helpers():
    assert train_step_flops(10.0, 4) == 120.0
    assert fraction_of_bound(1.5, 100.0, 50.0) == pytest.approx(0.75)
    assert device_peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert device_peak_flops("NVIDIA H200")[0] == 989e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    peak, note = device_peak_flops("NVIDIA GeForce GTX 1080")
    assert peak is None and "unknown" in note
    with pytest.raises(ValueError):
        dit_forward_flops("DiT-B/2", 31, 4)


def test_route_configs_add_a_dense_baseline():
    labels = [label for label, _ in route_configs(["paper", "balanced"])]
    assert labels == ["dense", "paper", "balanced"]
    cfgs = route_configs(["paper", "dense", '{"selection_ratio": 0.25, "start_layer_idx": 1, '
                                                  '"end_layer_idx": 3}'])
    assert [is_dense(r) for _, r in cfgs] == [False, True, False]
    assert compose(cfgs[2][1]).routing.routes[0].selection_ratio == 0.25
    assert split_steps(5, 2) == [3, 2] and split_steps(1, 3) == [1]


def test_flags_are_training_config_overrides():
    """Every flag is an override of the config train.py composes; the rest (lr, clipping, EMA, ...) is the
    config's; a dense config is model=dit; the compile backend defaults to the config's (inductor)."""
    args = bench.request_of(bench.build_parser().parse_args(
        ["--arch", "DiT-B/2", "--tokens", "64", "--channels", "3", "--batch", "16", "--precision", "bf16",
         "--compile", "--gradient-checkpointing", "--unfused-adamw", "--device", "cpu", "--routes", "balanced",
         "--set", "train.grad_accum_steps=2", "--set", "train.grad_clip=0.5"]))
    configs, geometry, _ = config_overrides(args, None)
    assert [(label, dense) for label, _, dense in configs] == [("dense", True), ("balanced", False)]
    dense, routed = (compose(ov) for _, ov, _ in configs)
    assert dense.model.arch == routed.model.arch == "DiT-B/2" and "model=dit" in configs[0][1]
    assert not dense.routing.enabled and routed.routing.routes == compose(["routing=balanced"]).routing.routes
    for cfg in (dense, routed):
        t = cfg.train
        assert (cfg.data.resolution, cfg.data.channels, t.batch_size, t.mixed_precision) == (16, 3, 16, "bf16")
        assert (t.compile, t.compile_backend, t.cpu, t.grad_accum_steps, t.grad_clip) == \
            (True, "inductor", True, 2, 0.5)
        assert cfg.model.gradient_checkpointing and cfg.optimizer.fused is False
        assert cfg.optimizer.lr == compose([]).optimizer.lr   # no lr of the benchmark's own
    assert config_overrides(BenchRequest(arch="DiT-B/2"), None)[1].why.startswith("the usual data of DiT-B/2")
    with pytest.raises(SystemExit, match="error: --set routing.routes=.. is not allowed"):
        bench.main(["--set", "routing.routes=[]"])



def test_a_request_is_checked_when_built_and_runs_without_the_cli():
    """The library takes a plain BenchRequest (the CLI only parses); bad values fail as it is built."""
    with pytest.raises(BenchError, match="^--steps 0 is not allowed; it must be an integer >= 1$"):
        BenchRequest(steps=0)
    with pytest.raises(BenchError, match="^--family nope is not allowed; allowed: dit, all, flux, "):
        BenchRequest(family="nope")
    threads = torch.get_num_threads()
    out = run_benchmark(BenchRequest(arch="DiT-T/4", resolution=8, channels=3, batch=2, steps=1, warmup=0,
                                     rounds=1, routes=["paper"], threads=1))
    assert [(r["config"], r["dense"]) for r in out["results"]] == [("dense", True), ("paper", False)]
    assert out["settings"]["threads"] == 1 and torch.get_num_threads() == threads   # the caller's count is back

# ----------------------------------------------------------------------------- output schema
RESULT_KEYS = {
    "model": str, "family": str, "config": str, "dense": bool, "baseline": bool, "routes": list, "tokens": int,
    "batch": int, "step_ms": float, "step_ms_all": list, "images_per_s": float, "tokens_per_s": float,
    "peak_mem_bytes": int, "static_mem_bytes": int, "step_mem_bytes": int, "peak_mem_method": str,
    "forward_flops_per_sample": float, "train_flops_per_step": float, "flops_ratio": float, "speedup": float,
    "speedup_bound": float, "fraction_of_bound": float, "achieved_flops_per_s": float,
}
SETTINGS_KEYS = {
    "model": str, "tokens": int, "batch": int, "device": str, "device_name": str, "threads": int,
    "precision": str, "compile": bool, "torch": str, "resolution": int, "channels": int, "steps": int,
    "warmup": int, "rounds": int, "route_specs": list, "flops_source": str, "mfu_note": str,
    "peak_mem_method": str,
}


def check_schema(out: dict, n_configs: int) -> None:
    for key, typ in SETTINGS_KEYS.items():
        assert isinstance(out["settings"][key], typ), key
    assert len(out["results"]) == n_configs
    for r in out["results"]:
        for key, typ in RESULT_KEYS.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert "mfu" in r and (r["mfu"] is None or r["mfu"] > 0)
        assert r["step_ms"] > 0 and r["peak_mem_bytes"] >= r["static_mem_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["images_per_s"] * r["tokens"])
        assert r["speedup_bound"] == pytest.approx(1 / r["flops_ratio"])
        assert r["fraction_of_bound"] == pytest.approx(r["speedup"] / r["speedup_bound"])
        assert 0.05 < r["fraction_of_bound"] < 5
    base = out["results"][0]
    assert base["baseline"] and base["dense"] and base["speedup"] == 1.0 and base["flops_ratio"] == 1.0
    assert base["fraction_of_bound"] == 1.0
    assert sum(r["baseline"] for r in out["results"]) == 1


def test_dit_output_schema(tmp_path):
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    out = bench.main(["--arch", "DiT-T/4", "--resolution", "8", "--channels", "3", "--batch", "4", "--steps", "2",
                      "--warmup", "1", "--routes", "none", "paper", "--json", str(js), "--markdown", str(md),
                      "--sampling", "--sampling-steps", "2", "--eval-features", "--image-size", "16",
                      "--eval-batch", "8", "--eval-repeats", "1", "--threads", "1"])
    check_schema(out, 2)
    s = out["settings"]
    assert s["model"] == "DiT-T/4" and s["tokens"] == 4 and s["batch"] == 4 and s["compile"] is False
    assert s["route_specs"] == ["dense", "paper"]
    paper = out["results"][1]
    assert paper["routes"] == [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}]
    assert paper["forward_flops_per_sample"] == dit_forward_flops("DiT-T/4", 8, 3, PAPER)
    assert paper["train_flops_per_step"] == dit_train_flops("DiT-T/4", 8, 3, PAPER, 4)
    assert paper["flops_ratio"] < 1
    if s["device"] == "cpu":
        assert all(r["mfu"] is None for r in out["results"])
    sm = out["sampling"]
    assert sm["sampler"] == "edm_heun" and sm["num_steps"] == 2 and sm["nfe"] == 3 and sm["images_per_s"] > 0
    ev = out["eval"]
    assert ev["features"] == "toy_classifier" and ev["image_size"] == 16 and ev["images_per_s"] > 0
    assert json.loads(js.read_text()) == json.loads(json.dumps(out))
    rows = [line for line in md.read_text().splitlines() if line.startswith("| DiT-T/4 |")]
    assert len(rows) == 2 and "dense" in rows[0] and "paper" in rows[1]


def test_dense_baseline_added_and_tokens_flag():
    out = bench.main(["--arch", "DiT-T/4", "--tokens", "4", "--channels", "3", "--batch", "2", "--steps", "1",
                      "--warmup", "1", "--routes", '[{"selection_ratio":0.5,"start_layer_idx":1,"end_layer_idx":-2}]',
                      "--threads", "1"])
    check_schema(out, 2)
    assert out["settings"]["resolution"] == 8 and out["results"][0]["config"] == "dense"


def test_family_path_new_schema(tmp_path):
    out = bench.main(["--family", "flux", "--preset", "tiny", "--resolution", "8", "--channels", "3",
                      "--batch", "4", "--steps", "2", "--warmup", "1", "--threads", "1",
                      "--sampling", "--sampling-steps", "2", "--json", str(tmp_path / "f.json")])
    check_schema(out, 2)   # default --routes paper, plus the dense baseline
    assert out["settings"]["model"] == "flux/tiny" and out["results"][1]["family"] == "flux"
    assert out["results"][1]["flops_ratio"] < 1 and "FlopCounterMode" in out["settings"]["flops_source"]
    assert out["sampling"]["sampler"] == "rf_euler" and out["sampling"]["nfe"] == 2


def test_one_at_a_time_builds_times_and_frees_each_config_per_round(monkeypatch):
    """--one-at-a-time: per round each config is built afresh, timed and released (weights on the meta device)
    before the next is built (A B A B); the records are those of the interleaved run (FLOPs, routes, step count)."""
    built, live = [], []
    real_init = StepBench.__init__

    def spy(self, config, *a, **kw):
        live.append(sum(p.device.type != "meta" for b in built for p in b.model.parameters()) > 0)
        real_init(self, config, *a, **kw)
        built.append(self)
    monkeypatch.setattr(StepBench, "__init__", spy)
    args = ["--family", "flux", "--preset", "tiny", "--resolution", "8", "--channels", "3", "--batch", "2",
            "--steps", "4", "--warmup", "1", "--rounds", "2", "--threads", "1"]
    one = bench.main(args + ["--one-at-a-time"])
    assert len(built) == 4 and not any(live)   # 2 configs x 2 rounds, none alive while the next is built
    assert [b.routes() for b in built] == [[], one["results"][1]["routes"]] * 2
    check_schema(one, 2)
    assert one["settings"]["one_at_a_time"] and all(len(r["step_ms_all"]) == 4 for r in one["results"])
    both = bench.main(args)
    for a, b in zip(one["results"], both["results"]):
        assert (a["config"], a["routes"], a["forward_flops_per_sample"]) == (b["config"], b["routes"],
                                                                             b["forward_flops_per_sample"])


@pytest.mark.parametrize("routes,n", [("none", 1), ("paper", 2)])
def test_compile_reports_graphs(routes, n):
    """The compiled step (dense, and routed with the router drawing outside the graph) compiles in the warm-up,
    never again while timed, and has no graph breaks."""
    torch._dynamo.reset()   # graphs of earlier tests in this process would be reused
    out = bench.main(["--arch", "DiT-T/4", "--resolution", "8", "--channels", "3", "--batch", "2", "--steps", "1",
                      "--warmup", "2", "--routes", routes, "--compile", "--compile-backend", "aot_eager",
                      "--device", "cpu", "--threads", "1"])
    check_schema(out, n)
    s = out["settings"]
    assert s["compile"] is True and s["compile_backend"] == "aot_eager"
    for r in out["results"]:
        assert r["compile"]["warmup"]["unique_graphs"] >= 1
        assert r["compile"]["recompiles_timed"] == 0
        assert r["compile"]["graph_breaks"] == 0 and r["compile"]["backend"] == "aot_eager"
    assert out["results"][-1]["dense"] is (routes == "none")


def test_loader_and_checkpointing_options(tmp_path):
    """--data-loader times the training loader on the built-in data; --gradient-checkpointing is recorded."""
    out = bench.main(["--arch", "DiT-T/4", "--resolution", "8", "--channels", "3", "--batch", "4", "--steps", "2",
                      "--warmup", "1", "--routes", "none", "--data-loader", "--gradient-checkpointing",
                      "--cache-dir", str(tmp_path)])
    d = out["loader"]
    assert d["ms_per_batch"] > 0 and d["images_per_s"] > 0 and d["wait_ms_per_step"] >= 0 and d["workers"] == 0
    assert out["settings"]["gradient_checkpointing"] is True


# ----------------------------------------------------------------------------- the loop's own step
def test_benchmark_times_the_loops_step(tmp_path, cache_dir):
    """The benchmark's step is the training loop's: one step of train() and one StepBench step on the same first
    batch of the run's loader, with the same seeding, give the same loss and the same weights."""
    overrides = ["debug=tiny", f"paths.cache_dir={cache_dir}", "eval.every_steps=0", "eval.at_end=false",
                 "train.max_steps=1", "checkpoint.every_steps=0", "train.log_every_steps=1"]
    run_dir = tmp_path / "run"
    train(compose(overrides), run_dir)
    logged = [r for r in read_metrics(run_dir) if r["type"] == "train"]
    weights = load_model_file(list_checkpoints(run_dir)[-1])["model"]

    b = StepBench(check_train(compose(overrides)))
    assert b.model.routing.enabled   # debug=tiny trains with the paper route: the router's stream counts too
    batch = next(iter(make_loader(b.cfg, open_dataset(b.cfg.data, b.model, b.cfg.model.arch), b.accelerator)))
    stats = b.step(batch)
    assert len(logged) == 1 and stats.loss.item() == pytest.approx(logged[0]["loss"], abs=1e-6, rel=0)
    state = b.model.state_dict()
    assert state.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- --fit-batch
def test_fit_batch_takes_the_largest_candidate_that_does_not_run_out_of_memory():
    from tread.perf.fit import largest_fitting
    tried = []

    def try_batch(b):
        tried.append(b)
        if b > 96:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert largest_fitting([64, 256, 128, 96, 128], try_batch) == (96, [256, 128])
    assert tried == [256, 128, 96]
    assert largest_fitting([512], try_batch) == (None, [512])
    with pytest.raises(ValueError):       # only running out of memory means "does not fit"
        largest_fitting([8], lambda b: (_ for _ in ()).throw(ValueError("a real bug")))


def test_fit_batch_is_refused_without_cuda_and_checked_as_built():
    with pytest.raises(BenchError, match="^--fit-batch 64 0 is not allowed; each must be an integer >= 1$"):
        BenchRequest(fit_batch=(64, 0))
    if not torch.cuda.is_available():
        with pytest.raises(BenchError, match="^--fit-batch finds the largest batch .* no CUDA device; allowed here: "
                                             "--batch N$"):
            BenchRequest(fit_batch=(64, 128))
