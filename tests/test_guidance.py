"""Sampling-time routing and guidance (tread/sampling/guidance.py): each wrapper's algebra and calls, the stack
Guidance builds, training-router semantics, per-seed determinism, sampled FLOPs, and the errors sample.py / fid.py
give for bad settings."""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn as nn

from tread.diffusion import EDM
from tread.sampling import generate, sampling_flops_per_image
from tread.sampling.guidance import (PATH_DROP, UNCOND, Guidance, GuidanceError, cfg, conditional, counted,
                                     interval, null_labels, path_drop, routed, tread_guidance)
from tread.schema import ConfigError, compose
from tread.schema.sampling import check_sampling
from tread.models import build_dit
from tread.routing import RoutingController, routing_from_config

PAPER = {"enabled": True, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]}


class RatioProbe(nn.Module):
    """A backbone whose output tells which branch ran: ratio of the active route (-1: dense) + 10 * label, + 100 on
    a path-dropped row; it records each call's (ratio, rows) and (labels, keywords, path-drop mask)."""

    def __init__(self):
        super().__init__()
        self.routing = RoutingController(routing_from_config(PAPER, 12), 12)
        self.calls: list[tuple[float, int]] = []
        self.seen: list[tuple[list[int], list[str], Optional[list[bool]]]] = []

    def forward(self, x, noise, labels, path_drop=None, **cond):
        routes = self.routing.active_routes(self.training)
        ratio = routes[0].selection_ratio if routes else -1.0
        self.calls.append((ratio, x.shape[0]))
        self.seen.append((labels.tolist(), sorted(cond), None if path_drop is None else path_drop.tolist()))
        dropped = 0.0 if path_drop is None else 100.0 * path_drop.float().view(-1, 1, 1, 1)
        return torch.zeros_like(x) + ratio + 10.0 * labels.float().view(-1, 1, 1, 1) + dropped


def probe_out(w, cfg=1.0, weak=0.75, selection_ratio=None, interval=None, sigma=1.0, stats=None):
    model = RatioProbe().eval()
    g = Guidance(cfg_scale=cfg, selection_ratio=selection_ratio, tread_scale=w, tread_weak_selection_ratio=weak,
                 interval=interval)
    x = torch.zeros(2, 1, 2, 2)
    out = g.denoiser(model, null_label=9, stats=stats)(x, torch.full((2,), sigma), torch.tensor([1, 2]))
    return out[:, 0, 0, 0], model.calls


def test_tread_guidance_algebra():
    labels = torch.tensor([10.0, 20.0])
    strong, weak = -1.0 + labels, 0.75 + labels
    assert torch.equal(probe_out(0.0)[0], weak)                 # w = 0: the weak branch
    assert torch.equal(probe_out(1.0)[0], strong)               # w = 1: the strong branch (weak not even run)
    assert probe_out(1.0)[1] == [(-1.0, 2)]
    assert torch.allclose(probe_out(0.5)[0], (strong + weak) / 2)
    assert torch.allclose(probe_out(2.0)[0], weak + 2.0 * (strong - weak))
    # Both branches are conditional: the weak branch saw the real labels, not the null class.
    assert torch.allclose(probe_out(0.0)[0] - 0.75, labels)
    # With a routed main branch (selection_ratio), the strong branch runs at that ratio.
    assert torch.allclose(probe_out(0.0, selection_ratio=0.25, weak=0.5)[0], 0.5 + labels)
    assert torch.allclose(probe_out(1.5, selection_ratio=0.25, weak=0.5)[0], 0.5 + labels + 1.5 * (0.25 - 0.5))


def test_tread_guidance_combines_with_cfg_and_interval():
    labels = torch.tensor([10.0, 20.0])
    strong, weak, uncond = -1.0 + labels, 0.75 + labels, torch.full((2,), -1.0 + 90.0)  # null label 9
    w, cfg = 1.5, 3.0
    tread = weak + w * (strong - weak)
    out, calls = probe_out(w, cfg=cfg)
    assert torch.allclose(out, uncond + cfg * (tread - uncond))
    assert calls == [(-1.0, 4), (0.75, 2)]          # [cond, uncond] batched at the strong ratio, then weak
    stats: dict = {}
    inside, _ = probe_out(w, cfg=cfg, interval=(0.5, 2.0), sigma=1.0, stats=stats)
    assert torch.allclose(inside, out) and stats == {None: 4, 0.75: 2}
    outside, calls = probe_out(w, cfg=cfg, interval=(0.5, 2.0), sigma=3.0)
    assert torch.equal(outside, strong) and calls == [(-1.0, 2)]   # no guidance, one evaluation


# ----------------------------------------------------------------------------- each wrapper

X, SIGMA, LABELS = torch.zeros(2, 1, 2, 2), torch.ones(2), torch.tensor([1, 2])


def first(out: torch.Tensor) -> torch.Tensor:
    return out[:, 0, 0, 0]


def dense(probe: RatioProbe):
    return routed(probe, probe, None)


def at(probe: RatioProbe, ratio: float):
    return routed(probe, probe, Guidance().routes(probe, ratio))


def test_routed_runs_the_branch_routes_and_keeps_wrapper_keywords_from_the_network():
    probe = RatioProbe().eval()
    assert torch.equal(first(at(probe, 0.25)(X, SIGMA, LABELS, cond_rows=1)), torch.tensor([10.25, 20.25]))
    assert torch.equal(first(dense(probe)(X, SIGMA, LABELS)), torch.tensor([9.0, 19.0]))
    assert probe.calls == [(0.25, 2), (-1.0, 2)] and probe.seen[0][1] == []      # cond_rows stopped at routed
    assert probe.routing.active_routes(False) == []                             # the override ends with the call


def test_cfg_is_one_batched_call_on_conditional_then_unconditional_rows():
    probe = RatioProbe().eval()
    out = cfg(dense(probe), 3.0, null_label=9)(X, SIGMA, LABELS)
    c, u = torch.tensor([9.0, 19.0]), torch.full((2,), 89.0)
    assert torch.equal(first(out), u + 3.0 * (c - u))
    assert probe.calls == [(-1.0, 4)] and probe.seen[0][0] == [1, 2, 9, 9]       # [conditional; null label]
    # Negative prompts: the unconditional rows keep their labels and get UNCOND's conditioning; UNCOND itself never
    # reaches the network, and without CFG (conditional) it is dropped.
    probe = RatioProbe().eval()
    text = {"cond": {"text": torch.ones(2, 1), UNCOND: {"text": torch.zeros(2, 1)}}}
    cfg(dense(probe), 3.0, null_label=9)(X, SIGMA, LABELS, **text)
    conditional(dense(probe))(X, SIGMA, LABELS, **text)
    assert [s[:2] for s in probe.seen] == [([1, 2, 1, 2], ["cond"]), ([1, 2], ["cond"])]


def test_tread_guidance_guides_the_conditional_rows_only():
    probe = RatioProbe().eval()
    out = cfg(tread_guidance(dense(probe), at(probe, 0.75), 1.5), 3.0, null_label=9)(X, SIGMA, LABELS)
    strong, weak, uncond = torch.tensor([9.0, 19.0]), torch.tensor([10.75, 20.75]), torch.full((2,), 89.0)
    tread = weak + 1.5 * (strong - weak)
    assert torch.equal(first(out), uncond + 3.0 * (tread - uncond))             # uncond: the strong branch, unguided
    assert probe.calls == [(-1.0, 4), (0.75, 2)]                               # strong first, then weak on 2 rows
    assert probe.seen[1][0] == [1, 2]                                          # the weak rows are the conditional ones
    # Without CFG every row is conditional.
    out = tread_guidance(dense(probe), at(probe, 0.75), 0.0)(X, SIGMA, LABELS)
    assert torch.equal(first(out), weak)


def test_null_labels_gives_every_row_the_null_label():
    probe = RatioProbe().eval()
    null_labels(tread_guidance(dense(probe), at(probe, 0.75), 2.0), null_label=9)(X, SIGMA, LABELS)
    assert [s[0] for s in probe.seen] == [[9, 9], [9, 9]]


def test_interval_guides_inside_its_bounds_only():
    guided = lambda x, noise, labels: torch.ones(2)
    plain = lambda x, noise, labels: torch.zeros(2)
    step = interval(guided, plain, 0.5, 2.0)
    assert [float(step(X, torch.full((2,), s), LABELS)[0]) for s in (0.4, 0.5, 1.0, 2.0, 2.1)] == [0, 1, 1, 1, 0]


def test_counted_counts_rows_per_branch_and_path_dropped_rows_apart():
    probe, stats = RatioProbe().eval(), {}
    main = counted(dense(probe), stats, None)
    out = cfg(path_drop(main), 3.0, null_label=9)(X, SIGMA, LABELS)
    assert probe.seen[0][2] == [False, False, True, True]                      # the unconditional rows skip the span
    c, u = torch.tensor([9.0, 19.0]), torch.full((2,), 189.0)
    assert torch.equal(first(out), u + 3.0 * (c - u)) and stats == {None: 2, PATH_DROP: 2}
    path_drop(main)(X, SIGMA, LABELS)                                          # no CFG: nothing to drop
    counted(at(probe, 0.5), stats, 0.5)(X, SIGMA, LABELS)
    assert probe.seen[1][2] is None and stats == {None: 4, PATH_DROP: 2, 0.5: 2}


def test_the_built_stack_equals_a_hand_composed_one():
    """Guidance.denoiser composes the wrappers; on a routed DiT (the router drawing tokens from its generator in
    call order) it gives bit for bit the stack written by hand, with the same counts."""
    g = Guidance(cfg_scale=3.0, selection_ratio=0.25, tread_scale=1.5, tread_weak_selection_ratio=0.5,
                 interval=(0.5, 2.0))
    net = EDM(num_steps=3).precondition(tiny_dit().eval())
    model, x, labels = net.model, torch.randn(2, 3, 16, 16), torch.tensor([1, 2])

    def by_hand(stats: dict):
        branch = lambda r: counted(routed(net, model, g.routes(model, r)), stats, r)
        main = branch(0.25)
        return interval(cfg(tread_guidance(main, branch(0.5), 1.5), 3.0, 10), conditional(main), 0.5, 2.0)

    for sigma in (1.0, 3.0):                                                   # inside and outside the interval
        outs, counts = [], []
        for build in (lambda stats: g.denoiser(net, 10, stats), by_hand):
            counts.append({})
            model.routing.router.manual_seed(7)
            with torch.no_grad():
                outs.append(build(counts[-1])(x, torch.full((2,), sigma), labels))
        assert torch.equal(outs[0], outs[1]) and counts[0] == counts[1]
    assert counts[0] == {0.25: 2}                                              # outside: one plain pass
    assert Guidance().denoiser(net, 10) is net and Guidance().denoiser(net, 10, {}) is not net


def tiny_dit(routing=PAPER):
    torch.manual_seed(0)
    model = build_dit("DiT-T/4", 16, 3, 10, routing=routing)
    with torch.no_grad():   # DiT zero-initialises its adaLN and output layers: give every weight a value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_inference_routing_matches_the_training_router():
    """override(selection_ratio=r) at inference keeps the same tokens, counts and outputs as training with
    routes at ratio r and the same router state: one routing semantics."""
    model = tiny_dit()
    x, t, y = torch.randn(4, 3, 16, 16), torch.rand(4), torch.tensor([0, 1, 2, 3])
    model.train()
    model.routing.router.manual_seed(5)
    with torch.enable_grad():
        trained = model(x, t, y).detach()
    train_stats = model.last_route_stats
    model.eval()
    model.routing.router.manual_seed(5)
    with torch.no_grad():
        dense = model(x, t, y)
        assert model.last_route_stats == []             # no routes at inference by default
        with model.routing.override(selection_ratio=0.5):
            inferred = model(x, t, y)
        assert model.last_route_stats == train_stats
    torch.testing.assert_close(inferred, trained, rtol=0, atol=1e-6)
    assert not torch.allclose(inferred, dense, atol=1e-3)
    # Ratio 0 routes every token: dense up to float rounding.
    with torch.no_grad(), model.routing.override(selection_ratio=0.0):
        torch.testing.assert_close(model(x, t, y), dense, rtol=1e-5, atol=1e-5)


def test_per_sample_router_generators_make_routed_samples_batch_independent():

    model = tiny_dit().eval()
    edm = EDM(num_steps=3)
    net = edm.precondition(model)
    g = Guidance(cfg_scale=1.5, selection_ratio=0.25, tread_scale=1.5, tread_weak_selection_ratio=0.5)
    run = lambda bs: torch.cat([x for _, _, x in generate(net, edm, range(6), (3, 16, 16), 10, torch.device("cpu"),
                                                          batch_size=bs, guidance=g)])
    # The same tokens and noise per sample; float32 matmuls over batches of 6 and 4 round differently, and the
    # sampler amplifies that rounding from sigma = 80 down, so the samples agree to 1e-3, not bit for bit.
    torch.testing.assert_close(run(6)[2:4], run(4)[2:4], rtol=0, atol=1e-3)
    # Per-sample draws: generator i serves rows i, i + G, ... (the CFG halves route the same tokens).
    router = model.routing.router
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]
    with router.per_sample(gens()):
        ids = router.select(torch.zeros(4, 16, 8), 8)
    assert torch.equal(ids[:2].sort(1).values, ids[2:].sort(1).values)
    with router.per_sample(gens()), pytest.raises(ValueError, match="multiple"):
        router.select(torch.zeros(3, 16, 8), 8)


def test_sampled_flops_per_image_count_every_branch():

    model = tiny_dit().eval()
    edm = EDM(num_steps=3)                                      # Heun: 5 denoiser calls
    net = edm.precondition(model)
    routes = lambda r: routing_from_config({"enabled": True, "routes": [
        {"selection_ratio": r, "start_layer_idx": 2, "end_layer_idx": -4}]}, model.depth)
    dense, weak = model.forward_flops([]), model.forward_flops(routes(0.5))
    for g, expect_passes, expect_flops in [
            (Guidance(), 5, 5 * dense),
            (Guidance(cfg_scale=2.0, tread_scale=1.5, tread_weak_selection_ratio=0.5), 15, 5 * (2 * dense + weak)),
            (Guidance(selection_ratio=0.5), 5, 5 * weak)]:
        stats: dict = {}
        list(generate(net, edm, range(4), (3, 16, 16), 10, torch.device("cpu"), batch_size=2, guidance=g,
                      stats=stats))
        assert sum(stats.values()) == 4 * expect_passes
        assert sampling_flops_per_image(model, g, stats, 4) == pytest.approx(expect_flops)
    # A guidance interval covering only the noisiest steps: fewer passes, counted exactly.
    sigmas = edm.sigma_steps(3)                                  # 80, s1, 0.002, 0
    g = Guidance(cfg_scale=2.0, interval=(float(sigmas[1]) + 1e-3, 100.0))   # only sigma = 80 is inside
    stats = {}
    list(generate(net, edm, range(2), (3, 16, 16), 10, torch.device("cpu"), batch_size=2, guidance=g, stats=stats))
    assert stats == {None: 2 * (2 + 1 + 1 + 1 + 1)}             # the first call is guided: 2 passes, then 1 each


def test_family_sampled_flops_are_counted_per_branch():
    """Diffusers families have no analytic count: each branch's forward is counted (FlopCounterMode)."""
    from tread.models.flops import forward_flops_with_routes
    from tread.models.families import build_family

    torch.manual_seed(0)
    model = build_family("flux", preset="tiny", in_channels=3, input_size=16, num_classes=10, routing=PAPER)
    spec = [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]
    dense, routed = forward_flops_with_routes(model, None), forward_flops_with_routes(model, spec)
    assert 0 < routed < dense
    assert forward_flops_with_routes(model, [{**spec[0], "selection_ratio": 0.0}]) == pytest.approx(dense)


@pytest.mark.parametrize("key,value,match", [
    ("tread_weak_selection_ratio", 1.0,
     "tread_weak_selection_ratio=1.0 is not allowed; allowed: a selection ratio in \\(0, 1\\)"),
    ("tread_weak_selection_ratio", 0.25, "must be above the main branch's ratio"),
    ("selection_ratio", 1.2, "selection_ratio=1.2 is not allowed; allowed: null \\(dense sampling\\)"),
    ("route_ratio", 0.25, "route_ratio was renamed: use selection_ratio=0.25 \\(the fraction of tokens dropped"),
    ("tread_weak_ratio", 0.5, "tread_weak_ratio was renamed: use tread_weak_selection_ratio=0.5"),
    ("cfg_scale", -1, "cfg_scale=-1 is not allowed; allowed: a number >= 0"),
    ("guidance_interval", [2, 1], "guidance_interval=\\[2.0, 1.0\\] is not allowed; allowed: \\[lo, hi\\] with 0 <= lo < hi"),
    ("guidance_interval", "soon", "guidance_interval='soon' is not allowed; allowed: null or \\[lo, hi\\]"),
    ("route_spans", [[2]], "route_spans\\[0\\]=\\[2\\] is not allowed; allowed: null .* \\[start, end\\]"),
    ("tread_scale", "big", "tread_scale='big' is not allowed; allowed: a number"),
])
def test_bad_guidance_settings_name_the_key(key, value, match):
    """The schema checks sample.py's / fid.py's / eval's guidance keys (configs/sampling/default.yaml)."""
    defaults = {k: v for k, v in compose(["checkpoint=x"], "sample").items() if k in SAMPLING_KEYS}
    base = {**defaults, "tread_scale": 2.0, "tread_weak_selection_ratio": 0.5, "selection_ratio": 0.25}
    with pytest.raises(ConfigError, match=match):
        check_sampling({**base, key: value})


SAMPLING_KEYS = ("num_steps", "cfg_scale", "selection_ratio", "route_spans", "tread_scale",
                 "tread_weak_selection_ratio", "guidance_interval")


def test_spans_are_checked_against_the_model():
    with pytest.raises(GuidanceError, match="route_spans at ratio 0.5: .*out of range"):
        Guidance(selection_ratio=0.5, route_spans=((2, 40),)).check(tiny_dit())
    with pytest.raises(GuidanceError, match="trained without routes.*route_spans"):
        Guidance(selection_ratio=0.5).check(tiny_dit(routing={"enabled": False, "routes": []}))
    Guidance(selection_ratio=0.5, route_spans=((1, 3),)).check(tiny_dit(routing={"enabled": False, "routes": []}))


@pytest.mark.slow
def test_sample_cli_routes_guides_and_reports_flops(tiny_cfg, tmp_path, cache_dir):
    from test_train import run_cli
    from tread.cli.sample import run as sample_run
    from tread.training.loop import train

    run = tmp_path / "run"
    train(tiny_cfg("eval.every_steps=0", "eval.at_end=false", "train.max_steps=2"), run)
    common = [f"checkpoint={run}", "num_samples=6", "num_steps=2", "device=cpu", "batch_size=6"]
    proc, _ = run_cli(["sample.py", *common, f"out_dir={tmp_path / 'dense'}"], cache_dir)   # the program itself
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GFLOPs per image" in proc.stdout
    for name, extra in {"routed": ["selection_ratio=0.5"],   # the same run() in this process: no second start-up
                        "guided": ["tread_scale=1.5", "tread_weak_selection_ratio=0.5", "cfg_scale=1.5"]}.items():
        sample_run(compose([*common, f"out_dir={tmp_path / name}", *extra], "sample"))
    infos = {name: json.loads((tmp_path / name / "sampling.json").read_text()) for name in ("dense", "routed", "guided")}
    assert infos["dense"]["forward_passes_per_image"] == 3 and infos["guided"]["forward_passes_per_image"] == 9
    assert infos["routed"]["sample_gflops_per_image"] < infos["dense"]["sample_gflops_per_image"] \
        < infos["guided"]["sample_gflops_per_image"]
    assert infos["guided"]["tread_scale"] == 1.5 and infos["routed"]["selection_ratio"] == 0.5
    a, b = (np.load(tmp_path / n / "samples.npz")["arr_0"] for n in ("dense", "routed"))
    assert a.shape == b.shape and not np.array_equal(a, b)
    # Bad settings (one error line before work): tests/test_bad_inputs.py, sample/route_spans_beyond_depth ...
