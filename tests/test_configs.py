"""Every config group composes and instantiates; route overrides work as Hydra overrides."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import CONFIG_DIR, compose_cfg
from routing import RouteConfigError
from training.loop import build as instantiate

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in Path(CONFIG_DIR).iterdir() if g.is_dir()}


def test_default_is_tread_with_paper_route_on_builtin_data():
    cfg = compose_cfg()
    assert cfg.model._target_ == "models.build_dit" and cfg.routing.name == "paper" and cfg.routing.enabled
    assert cfg.data.builtin == "toy_shapes"
    assert OmegaConf.to_container(cfg.routing.routes) == [
        {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]


def test_model_dit_is_dense_and_routing_none_is_dense():
    assert not compose_cfg(overrides=["model=dit"]).routing.enabled
    assert not compose_cfg(overrides=["routing=none"]).routing.enabled
    assert compose_cfg(overrides=["model=dit", "routing=paper"]).routing.enabled  # explicit choice wins


@pytest.mark.parametrize("preset,route", [
    ("paper", (0.5, 2, -4)), ("balanced", (0.5, 2, -2)), ("aggressive", (0.7, 1, -1)),
    ("high-res", (0.6, 2, -3)), ("conservative", (0.4, 3, -4)),
])
def test_routing_presets_build(preset, route):
    cfg = compose_cfg(overrides=[f"routing={preset}"])
    r = cfg.routing.routes[0]
    assert (r.selection_ratio, r.start_layer_idx, r.end_layer_idx) == route
    model = instantiate(cfg.model)
    assert model.routing.routes[0].selection_ratio == route[0]


def test_route_list_overrides():
    cfg = compose_cfg(overrides=["routing.routes.0.selection_ratio=0.25"])
    assert instantiate(cfg.model).routing.routes[0].selection_ratio == 0.25
    cfg = compose_cfg(overrides=[
        "routing.routes=[{selection_ratio:0.5,start_layer_idx:1,end_layer_idx:3},"
        "{selection_ratio:0.25,start_layer_idx:5,end_layer_idx:-2}]"])
    routes = instantiate(cfg.model).routing.routes
    assert [(r.start_layer_idx, r.end_layer_idx) for r in routes] == [(1, 3), (5, 10)]
    with pytest.raises(RouteConfigError, match="TREAD training requires you to configure the routes"):
        instantiate(compose_cfg(overrides=["routing.routes=[]"]).model)


@pytest.mark.parametrize("name", GROUPS["diffusion"])
def test_diffusion_configs_instantiate(name):
    d = instantiate(compose_cfg(overrides=[f"diffusion={name}"]).diffusion)
    assert hasattr(d, "loss") and hasattr(d, "sample") and hasattr(d, "precondition")


@pytest.mark.parametrize("name", GROUPS["optimizer"])
def test_optimizer_configs_instantiate(name):
    cfg = compose_cfg(overrides=[f"optimizer={name}"])
    model = instantiate(cfg.model)
    opt = instantiate(cfg.optimizer)(params=model.parameters())
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr


@pytest.mark.parametrize("name", GROUPS["experiment"])
def test_experiment_presets_compose_and_build_on_meta(name):
    import torch

    overrides = [f"experiment={name}"]
    cfg = compose_cfg(overrides=overrides)
    if name.startswith("imagenet256"):
        assert OmegaConf.is_missing(cfg.data, "path")           # the data path is required
        assert cfg.train.batch_size == 256 and cfg.optimizer.lr == 1e-4 and cfg.ema.decay == 0.9999
        assert cfg.routing.enabled == name.endswith("tread")
    with torch.device("meta"):
        model = instantiate(cfg.model)
    if name.endswith("tread"):
        depth = model.depth
        assert [(r.start_layer_idx, r.end_layer_idx) for r in model.routing.routes] == [(2, depth - 4)]


@pytest.mark.parametrize("group", ["data", "eval", "paths", "model", "routing"])
def test_every_option_of_group_composes(group):
    for name in GROUPS[group]:
        cfg = compose_cfg(overrides=[f"{group}={name}"])
        assert group in cfg


def test_sample_and_fid_configs_compose():
    assert OmegaConf.is_missing(compose_cfg("sample"), "checkpoint")
    assert OmegaConf.is_missing(compose_cfg("fid"), "mode")
