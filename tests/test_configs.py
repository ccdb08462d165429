"""Every config group composes, passes the schema and builds; route overrides work as Hydra overrides."""
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_cfg
from tread.schema.builders import build, build_diffusion, build_model
from tread.routing import RouteConfigError
from tread.schema import CONFIG_DIR, check_train

# Selectable options per group; files starting with "_" are bases other options build on.
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml") if not p.stem.startswith("_"))
          for g in Path(CONFIG_DIR).iterdir() if g.is_dir()}
# What options that need a machine path get in these tests.
REQUIRED = {"data": ["data.path=/data/x"], "eval": ["eval.reference=/data/ref.npz"],
            "experiment": ["data.path=/data/x", "eval.reference=/data/ref.npz"]}


def test_default_is_tread_with_paper_route_on_builtin_data():
    cfg = compose_cfg()
    assert cfg.model._target_ == "tread.models.build_dit" and cfg.routing.enabled
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
    model = build_model(cfg.model)
    assert model.routing.routes[0].selection_ratio == route[0]


def test_route_list_overrides():
    cfg = compose_cfg(overrides=["routing.routes.0.selection_ratio=0.25"])
    assert build_model(cfg.model).routing.routes[0].selection_ratio == 0.25
    cfg = compose_cfg(overrides=[
        "routing.routes=[{selection_ratio:0.5,start_layer_idx:1,end_layer_idx:3},"
        "{selection_ratio:0.25,start_layer_idx:5,end_layer_idx:-2}]"])
    routes = build_model(cfg.model).routing.routes
    assert [(r.start_layer_idx, r.end_layer_idx) for r in routes] == [(1, 3), (5, 10)]
    with pytest.raises(RouteConfigError, match="TREAD training requires you to configure the routes"):
        build_model(compose_cfg(overrides=["routing.routes=[]"]).model)


@pytest.mark.parametrize("name", GROUPS["diffusion"])
def test_diffusion_configs_build(name):
    d = build_diffusion(compose_cfg(overrides=[f"diffusion={name}"]).diffusion)
    assert hasattr(d, "loss") and hasattr(d, "sample") and hasattr(d, "precondition")


@pytest.mark.parametrize("name", GROUPS["optimizer"])
def test_optimizer_configs_build(name):
    cfg = compose_cfg(overrides=[f"optimizer={name}"])
    model = build_model(cfg.model)
    opt = build("optimizer", cfg.optimizer)(params=model.parameters())
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr


@pytest.mark.parametrize("name", GROUPS["experiment"])
def test_experiment_presets_compose_and_build_on_meta(name):
    cfg = compose_cfg(overrides=[f"experiment={name}"])
    if name.startswith("imagenet256"):
        assert OmegaConf.is_missing(cfg.data, "path")           # the data path is required
        assert cfg.train.batch_size == 256 and cfg.optimizer.lr == 1e-4 and cfg.ema.decay == 0.9999
        assert cfg.train.max_steps == 400000 and cfg.checkpoint.every_steps == 50000
        assert cfg.routing.enabled == name.endswith("tread")
    with torch.device("meta"):
        model = build_model(cfg.model)
    if name.endswith("tread"):
        depth = model.depth
        assert [(r.start_layer_idx, r.end_layer_idx) for r in model.routing.routes] == [(2, depth - 4)]


@pytest.mark.parametrize("group", ["data", "eval", "paths", "model", "routing", "diffusion", "optimizer",
                                   "experiment", "debug"])
def test_every_option_of_group_passes_the_schema(group):
    for name in GROUPS[group]:
        cfg = compose_cfg(overrides=[f"{group}={name}", *REQUIRED.get(group, [])])
        assert group in cfg or group in ("experiment", "debug")
        check_train(cfg)


def test_debug_preset_is_a_few_second_run():
    cfg = compose_cfg(overrides=["debug=tiny"])
    assert cfg.model.arch == "DiT-T/4" and cfg.train.max_steps == 4 and cfg.data.builtin_args.num_per_class == 40
    assert compose_cfg(overrides=["debug=tiny", "model=flux"]).model.arch == "flux-tiny"


def test_shared_sampling_keys_in_sample_fid_and_eval():
    """sample.py, fid.py and in-training evaluation take the same sampling and decoding keys, from one file."""
    keys = set(compose_cfg("sample", ["checkpoint=x"]).keys())
    for name, node in (("fid", compose_cfg("fid", ["mode=calc"])), ("eval", compose_cfg().eval)):
        shared = {"num_steps", "cfg_scale", "selection_ratio", "route_spans", "tread_scale",
                  "tread_weak_selection_ratio", "guidance_interval", "vae", "vae_dtype", "decode_batch_size"}
        assert shared <= keys and shared <= set(node.keys()), name


def test_sample_and_fid_configs_compose():
    assert OmegaConf.is_missing(compose_cfg("sample"), "checkpoint")
    assert OmegaConf.is_missing(compose_cfg("fid"), "mode")


def test_compose_cache_hands_out_copies_and_follows_edits(tmp_path, monkeypatch):
    """Repeated compositions come from a cache (tread/schema/compose.py): each caller gets its own copy, and a
    config file edited since composes afresh (the key holds every file's size and mtime)."""
    import importlib
    import shutil

    composing = importlib.import_module("tread.schema.compose")   # the module: tread.schema.compose is the function

    shutil.copytree(CONFIG_DIR, tmp_path / "configs")
    monkeypatch.setattr(composing, "CONFIG_DIR", tmp_path / "configs")
    first = composing.compose(["debug=tiny"])
    first.train.max_steps = 999
    assert composing.compose(["debug=tiny"]).train.max_steps == 4
    tiny = tmp_path / "configs" / "debug" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("max_steps: 4", "max_steps: 7"))
    assert composing.compose(["debug=tiny"]).train.max_steps == 7


SPLIT_CASES = [   # (config name, overrides): every kind of override, alone and mixed with group choices
    ("train", ["debug=tiny", "train.max_steps=7", "train.seed=3", "train.max_steps=9"]),
    ("train", ["model=flux", "debug=tiny", "routing=paper", "optimizer.lr=0.001", "data.resolution=16"]),
    ("train", ["routing.routes=[{selection_ratio: 0.25, start_layer_idx: 1, end_layer_idx: 3}]", "routing=balanced"]),
    ("train", ["+foo.bar=1", "++train.seed=5", "++new.key=x", "~eval.num_steps", "debug=tiny"]),
    ("train", ["train.log_with=[tb,jsonl]", "paths.output_dir='/a b/c'", "data.path=null", "train.seed=${train.max_steps}"]),
    ("train", ["eval=toy", "eval.every_steps=0", "data.resolution=8"]),
    ("train", ["hydra.run.dir=/tmp/x", "train.seed=1", "model=tread"]),
    ("sample", ["checkpoint=x", "num_steps=4"]),
    ("fid", ["mode=calc", "+extra=1"]),
    # refusals: each must be the very error Hydra gives
    ("train", ["debug=tiny", "model.no_such_key=2"]),
    ("train", ["+train.seed=2"]),
    ("train", ["~train.no_such_key"]),
    ("train", ["model=no_such_model", "train.seed=1"]),
    ("train", ["train.seed=1,2"]),
    ("train", ["train.seed"]),
    ("train", ["train.seed=1", "train.=2"]),
]


@pytest.mark.parametrize("name,overrides", SPLIT_CASES)
def test_value_overrides_applied_to_a_kept_composition_equal_hydra(name, overrides):
    """compose() composes the group choices through Hydra once and applies value overrides to a copy
    (tread/schema/compose.py): the config, or the refusal, is exactly what one Hydra composition gives."""
    import importlib

    composing = importlib.import_module("tread.schema.compose")

    def outcome(fn):
        try:
            return OmegaConf.to_yaml(fn())
        except composing.COMPOSE_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"

    direct = outcome(lambda: composing._compose(list(overrides), name, False))
    assert outcome(lambda: composing.compose(overrides, name)) == direct
    assert outcome(lambda: composing.compose(overrides, name)) == direct     # again, from the kept part
    if direct.startswith("ConfigCompositionException: Could not override"):
        assert composing.split_overrides(overrides)[1], "a value refusal must come from the split's second part"
