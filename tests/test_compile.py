"""train.compile: torch.compile of the backbone with routing inside, on CPU with the aot_eager backend
(no code generation). Same losses as eager, one graph per route shape without graph breaks (the router draws
outside the graph), and no recompiles after the first step."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import compose_cfg
from tread.schema import ConfigError
from tread.training.loop import train

COMMON = ["eval.every_steps=0", "eval.at_end=false", "train.max_steps=6", "train.log_every_steps=1",
          "checkpoint.every_steps=0"]


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tread", "flux"])
def test_compiled_training_matches_eager(model, tiny_cfg, tmp_path):
    import torch._dynamo
    extra = [f"model={model}"]
    train(tiny_cfg(*COMMON, *extra, "train.compile=false"), tmp_path / "eager")
    torch._dynamo.reset()
    train(tiny_cfg(*COMMON, *extra, "train.compile=true", "train.compile_backend=aot_eager"), tmp_path / "compiled")
    torch._dynamo.reset()
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-4


def compiled_routed_net(family: str):
    """(RectifiedFlow, its preconditioned tiny DiT-T/4 or FLUX with the paper route, compiled as train.compile does:
    RoutedBackbone.compile, aot_eager) after a dynamo reset and with its counters cleared."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from tread.diffusion import RectifiedFlow
    from tread.models import build_dit
    from tread.models.families import build_family
    routing = {"enabled": True, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]}
    torch.manual_seed(0)
    model = build_dit("DiT-T/4", 16, 3, 10, routing=routing) if family == "dit" else \
        build_family("flux", input_size=16, in_channels=3, num_classes=10, routing=routing)
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend="aot_eager")
    rf = RectifiedFlow()
    return rf, rf.precondition(model).train()


@pytest.mark.parametrize("family", ["dit", "flux"])
def test_one_graph_without_breaks_and_no_recompiles(family):
    """The router draws its scores before the compiled forward and keep counts are static: the routed step
    compiles into one graph with no graph breaks, and later steps compile nothing new."""
    from torch._dynamo.utils import counters
    rf, net = compiled_routed_net(family)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))

    def step():
        rf.loss(net, x, y).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    compiled = dict(counters["stats"])
    assert compiled.get("unique_graphs", 0) == 1, compiled
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for _ in range(3):
        step()
    assert dict(counters["stats"]) == compiled, (compiled, dict(counters["stats"]))
    torch._dynamo.reset()


@pytest.mark.parametrize("override,needle", [("train.compile=maybe", "train.compile='maybe' is not allowed"),
                                             ("train.compile_mode=fastest", "train.compile_mode='fastest'"),
                                             ("train.compile_backend=nope", "train.compile_backend='nope'")])
def test_bad_compile_settings_are_named(override, needle, tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        train(tiny_cfg(*COMMON, "train.compile=true", override) if "compile=" not in override.split(".")[1][:8]
              else tiny_cfg(*COMMON, override), tmp_path / "r")


def test_auto_compiles_with_cuda_and_on_a_cpu_that_can_build_kernels(monkeypatch):
    from tread.training import setup
    assert setup.compile_by_default(torch.device("cuda"))
    monkeypatch.setattr(setup.shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert setup.compile_by_default(torch.device("cpu"))
    monkeypatch.setattr(setup.shutil, "which", lambda name: None)     # no C++ compiler: inductor cannot build
    assert not setup.compile_by_default(torch.device("cpu"))


def test_short_cpu_runs_stay_eager_by_default():
    assert compose_cfg("train", []).train.compile is False             # experiment=toy (make train)
    assert compose_cfg("train", ["debug=tiny"]).train.compile is False
    assert compose_cfg("train", ["experiment=imagenet256_dit_b2"]).train.compile == "auto"
