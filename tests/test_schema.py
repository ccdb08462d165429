"""The config schema: every bad value is refused before any work, as one line naming the key, the value and
what is allowed (schema/). The command-line programs print it as `error: ...` without a traceback."""
from __future__ import annotations

import json
import os

import pytest

from conftest import compose_cfg
from tread.schema import ConfigError, check_fid, check_sample, check_train, check_train_files

BAD_TRAIN = [
    ("train.seed=abc", "train.seed='abc' is not allowed; allowed: an integer"),
    ("ema.decay=high", "ema.decay='high' is not allowed; allowed: a number in [0, 1)"),
    ("ema.decay=1.0", "ema.decay=1.0 is not allowed; allowed: a number in [0, 1)"),
    ("optimizer.lr=fast", "optimizer.lr='fast' is not allowed; allowed: a number > 0"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas=[0.9, 1.5] is not allowed"),
    ("train.grad_clip=-1", "train.grad_clip=-1 is not allowed; allowed: null (no clipping) or a max gradient norm > 0"),
    ("train.lr_warmup_steps=-100", "train.lr_warmup_steps=-100 is not allowed; allowed: an integer >= 0"),
    ("train.batch_size=0", "train.batch_size=0 is not allowed; allowed: a positive integer"),
    ("train.max_steps=2.5", "train.max_steps=2.5 is not allowed; allowed: a positive integer"),
    ("train.label_dropout=1", "train.label_dropout=1 is not allowed; allowed: a probability in [0, 1)"),
    ("train.time_budget_min=0", "train.time_budget_min=0 is not allowed"),
    ("train.mixed_precision=fp8", "train.mixed_precision='fp8' is not allowed; allowed: one of auto, no, bf16, fp16"),
    ("train.masked_loss=maybe", "train.masked_loss='maybe' is not allowed"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 is not allowed; allowed: null (keep all) or an integer >= 1"),
    ("checkpoint.every_steps=-5", "checkpoint.every_steps=-5 is not allowed"),
    ("checkpoint.adapter_only=true", "checkpoint.adapter_only=true needs LoRA adapters"),
    ("diffusion.sigma_data=0", "diffusion.sigma_data=0 is not allowed; allowed: a number > 0"),
    ("diffusion.sigma_min=100", "diffusion.sigma_min=100.0 and diffusion.sigma_max=80.0 are not allowed"),
    ("eval.batch_size=0", "eval.batch_size=0 is not allowed; allowed: a positive integer"),
    ("eval.num_samples=1", "eval.num_samples=1 is not allowed; allowed: an integer >= 2"),
    ("eval.metrics=[fid,lpips]", "eval.metrics[1]='lpips' is not allowed"),
    ("eval.metrics=[fid,fid]", "eval.metrics=['fid', 'fid'] repeats a metric"),
    ("eval.features=clip", "eval.features='clip' is not allowed; allowed: one of toy_classifier, inception"),
    ("eval.vae_dtype=int8", "eval.vae_dtype='int8' is not allowed; allowed: one of float32, bfloat16, float16"),
    ("+train.foo=1", "train.foo is not a known key; train takes ["),
    ("routing.routes.0.selection_ratio=1.5", "routing.routes[0].selection_ratio=1.5 is not allowed"),
    ("routing.selection.mode=topk", "routing.selection.mode='topk' is not allowed; allowed: one of random, importance, structured"),
    ("routing.selection.importance_weight=1.5", "routing.selection.importance_weight=1.5 is not allowed"),
    ("routing.fp32_after_route=yes", "routing.fp32_after_route='yes' is not allowed; allowed: true or false"),
    ("model.arch=DiT-M/2", "model.arch='DiT-M/2' is not allowed; allowed: one of DiT-T/2"),
    ("data.format=zip", "data.format='zip' is not allowed; allowed: latents or wds"),
    ("data.builtin=mnist", "data.builtin='mnist' is not allowed; allowed: null (use data.path as is) or one of toy_shapes, toy_shapes_text, toy_shapes_buckets, toy_shapes_clips."),
    ("train.compile=maybe", "train.compile='maybe' is not allowed; allowed: auto (on with CUDA, or on CPU with a C++ compiler), true or false"),
    ("wandb.mode=loud", "wandb.mode='loud' is not allowed; allowed: one of disabled, offline, online"),
    ("resume=5", "resume=5 is not allowed"),
    ("train.seed=-1", "train.seed=-1 is not allowed; allowed: an integer in [0, 2**32)"),
    ("train.seed=true", "train.seed=true is not allowed; allowed: an integer"),
    ("routing.seed=4294967296", "routing.seed=4294967296 is not allowed; allowed: an integer in [0, 2**32)"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 is not allowed; allowed: a number >= 0"),
    ("train.num_workers=-1", "train.num_workers=-1 is not allowed; allowed: an integer >= 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0 is not allowed; allowed: null (keep all) or an integer >= 1"),
    ("train.nonfinite=maybe", "train.nonfinite='maybe' is not allowed; allowed: skip (skip the update"),
    ("train.max_nonfinite_skips=0", "train.max_nonfinite_skips=0 is not allowed; allowed: a positive integer"),
    ("train.collective_timeout_min=0", "train.collective_timeout_min=0 is not allowed; allowed: a number > 0"),
    ("train.slurm_requeue=yes", "train.slurm_requeue='yes' is not allowed; allowed: true or false"),
    ("paths.output_dir=", "paths.output_dir='' is not allowed; allowed: a directory"),
]


@pytest.mark.parametrize("override,message", BAD_TRAIN, ids=[o for o, _ in BAD_TRAIN])
def test_bad_training_values_name_the_key_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=[override]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_eval_reference_is_refused_before_work():
    cfg = compose_cfg(overrides=["eval.reference=/nonexistent/ref.npz"])
    config = check_train(cfg)    # a valid value; the file is checked next, before any work
    with pytest.raises(ConfigError, match="eval.reference='/nonexistent/ref.npz' does not exist"):
        check_train_files(config)


@pytest.mark.parametrize("overrides,message", [
    (["model=flux", "model.lora={rank:0,target_modules:[to_q]}"], "model.lora.rank=0 is not allowed"),
    (["model=flux", "model.lora={rank:2,target_modules:[to_q],bad:1}"], "model.lora.bad is not a known key"),
    (["model=flux", "+model.frames=2"], "model.frames is a key of model.family=wan"),   # | the other video families
    (["data=imagenet256_wds"], "data.path is not set (the config leaves it ???): pass data.path="),
    (["data=imagenet256_wds", "data.path=/x", "data.builtin=toy_shapes"], "data.builtin='toy_shapes' is not allowed"),
    (["eval=inception"], "eval.reference is not set"),
    (["eval.tread_scale=2", "eval.tread_weak_selection_ratio=0.1", "eval.selection_ratio=0.3"],
     "must be above the main branch"),
])
def test_rules_between_keys(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        check_train(compose_cfg(overrides=overrides))
    assert message in str(err.value)


def test_mandatory_keys_only_matter_when_used():
    """eval=inception's reference is required only while evaluation runs; every key is still checked."""
    check_train(compose_cfg(overrides=["eval=inception", "eval.every_steps=0", "eval.at_end=false"]))
    check_train(compose_cfg(overrides=["eval.every_steps=0", "eval.at_end=false", "eval.reference=/nonexistent"]))
    for at_end in ("true", "false"):
        with pytest.raises(ConfigError, match="eval.batch_size=0 is not allowed"):
            check_train(compose_cfg(overrides=["eval.every_steps=0", f"eval.at_end={at_end}", "eval.batch_size=0"]))


def test_run_safety_keys_have_defaults():
    """train.nonfinite / max_nonfinite_skips / collective_timeout_min / slurm_requeue (training/ reads them)."""
    t = check_train(compose_cfg()).train
    assert (t.nonfinite, t.max_nonfinite_skips, t.collective_timeout_min, t.slurm_requeue) == ("skip", 20, 30, True)
    t = check_train(compose_cfg(overrides=["train.nonfinite=stop", "train.collective_timeout_min=0.5",
                                           "train.slurm_requeue=false"])).train
    assert (t.nonfinite, t.collective_timeout_min, t.slurm_requeue) == ("stop", 0.5, False)


def test_sample_and_fid_configs_are_checked():
    with pytest.raises(ConfigError, match="num_samples=0 is not allowed; allowed: a positive integer"):
        check_sample(compose_cfg("sample", ["checkpoint=x", "num_samples=0"]))
    with pytest.raises(ConfigError, match="checkpoint is not set"):
        check_sample(compose_cfg("sample"))
    with pytest.raises(ConfigError, match="mode=calc needs images="):
        check_fid(compose_cfg("fid", ["mode=calc"]))
    with pytest.raises(ConfigError, match="store_images=-1 is not allowed"):
        check_fid(compose_cfg("fid", ["mode=ref", "source=x", "out=y", "store_images=-1"]))


@pytest.mark.parametrize("override,message", [
    ("seeds=-3", "seeds=-3 is not allowed; allowed: null (0..num_samples-1)"),
    ("seeds=[1,-2]", "seeds=[1, -2] is not allowed"),
    ("seeds=[]", "seeds=[] is not allowed"),
    ("seeds=1.5", "seeds=1.5 is not allowed"),
    ("seeds=abc", "seeds='abc' is not allowed"),
    ("seeds=9-2", "seeds='9-2' is not allowed"),
    ("seeds='1,,2'", "seeds='1,,2' is not allowed"),
    ("device=tpu", "device='tpu' is not allowed; allowed: auto, cpu, cuda or cuda:N"),
    ("device=cuda:x", "device='cuda:x' is not allowed"),
    ("device=cuda:99", "device=cuda:99 is not available: this machine has"),
    ("num_steps=0", "num_steps=0 is not allowed"),
    ("batch_size=0", "batch_size=0 is not allowed"),
])
def test_sample_and_fid_seeds_and_devices(override, message):
    for program, base in (("sample", ["checkpoint=x"]), ("fid", ["mode=calc", "images=x", "ref=y"])):
        with pytest.raises(ConfigError) as err:
            (check_sample if program == "sample" else check_fid)(compose_cfg(program, [*base, override]))
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("seeds", ["'0-9'", "'3,7,11'", "'0-4,9'", "[1,2]", "5", "null"])
def test_good_seeds_pass(seeds):
    check_sample(compose_cfg("sample", ["checkpoint=x", f"seeds={seeds}"]))


@pytest.mark.parametrize("override,needle", [
    ("train.fooo=1", "Could not override 'train.fooo'"),
    ("model=nosuch", "Could not find 'model/nosuch'. Available options in 'model': "),
    ("train.seed=[1", "bad override 'train.seed=[1'"),
])
def test_hydra_errors_become_one_line(override, needle, monkeypatch):
    """tread.cli.errors.hydra_errors: Hydra's own composition errors as one `error:` line, HYDRA_FULL_ERROR restored."""
    from tread.cli.errors import hydra_errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        with hydra_errors():
            compose_cfg(overrides=[override])
    assert exit_.value.code.startswith("error: ") and needle in exit_.value.code and "\n" not in exit_.value.code
    assert "HYDRA_FULL_ERROR" not in os.environ


MEANING = "(the fraction of tokens dropped, as routing.routes[i].selection_ratio)."


@pytest.mark.parametrize("program,overrides,message", [
    ("train", ["eval.route_ratio=0.3"], f"eval.route_ratio was renamed: use eval.selection_ratio=0.3 {MEANING}"),
    ("train", ["+eval.tread_weak_ratio=0.5"],
     "eval.tread_weak_ratio was renamed: use eval.tread_weak_selection_ratio=0.5 ("),
    ("sample", ["checkpoint=x", "route_ratio=0.25"], f"route_ratio was renamed: use selection_ratio=0.25 {MEANING}"),
    ("sample", ["checkpoint=x", "+route_ratio=null"], "route_ratio was renamed: use selection_ratio=null ("),
    ("fid", ["mode=calc", "images=x", "ref=y", "tread_weak_ratio=0.6"],
     "tread_weak_ratio was renamed: use tread_weak_selection_ratio=0.6 ("),
])
def test_renamed_keys_are_refused_naming_the_new_key(program, overrides, message, monkeypatch):
    """The old sampling keys (tread/utils/renamed_keys.py), on the command line (Hydra refuses them) or in a config
    (+key: the schema refuses them), give one line naming the new key with the value given."""
    from tread.cli.errors import hydra_errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    check = {"train": check_train, "sample": check_sample, "fid": check_fid}[program]
    with pytest.raises((SystemExit, ConfigError)) as err:
        with hydra_errors(sampling_section="eval" if program == "train" else ""):   # as train.py, sample.py, fid.py
            check(compose_cfg(program, overrides))
    text = str(err.value.code if isinstance(err.value, SystemExit) else err.value)
    assert message in text and "\n" not in text


def test_an_old_sampling_key_outside_its_section_is_just_unknown(monkeypatch):
    """train.py holds the sampling keys under eval: a top-level route_ratio was never a train.py key, so Hydra's
    own refusal stands (naming a top-level selection_ratio would send the user to another unknown key)."""
    from tread.cli.errors import hydra_errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as err:
        with hydra_errors(sampling_section="eval"):
            compose_cfg("train", ["route_ratio=0.3"])
    assert "Could not override 'route_ratio'" in str(err.value.code) and "renamed" not in str(err.value.code)


def test_checkpoints_written_before_the_rename_read_in_todays_names(tmp_path):
    """A checkpoint whose stored config has the old eval keys reads (read_meta) as today's code writes it, in the
    same key order: a resume lists no config change, and sampling reads its eval settings."""
    from omegaconf import OmegaConf

    from tread.checkpoint.resume import config_changes
    from tread.checkpoint.files import read_meta

    now = OmegaConf.to_container(compose_cfg(overrides=["eval.selection_ratio=0.25"]), resolve=True)
    renames = {"selection_ratio": "route_ratio", "tread_weak_selection_ratio": "tread_weak_ratio"}
    old = {**now, "eval": {renames.get(k, k): v for k, v in now["eval"].items()}}
    assert "route_ratio" in old["eval"]
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": 2, "step": 4, "config": old}))
    config = read_meta(tmp_path)["config"]
    assert list(config["eval"]) == list(now["eval"]) and config["eval"]["selection_ratio"] == 0.25
    assert config_changes(config, now) == {}


# Each program's one-line refusal as a real subprocess (not only in-process): tests/test_bad_inputs.py,
# test_harness_matches_the_real_program (train.py, sample.py, fid.py and the precompute script).


# ----------------------------------------------------------------------------- the schema's gaps, closed (issue 25)

SCHEMA_GAPS = [
    # keys of another model: model.sprint is model=sprint's, and model=sprint needs it
    (["+model.sprint={start:2,end:-3}"], "model.sprint={start: 2, end: -3} is a key of model=sprint"),
    (["model=sprint", "~model.sprint"], "model.sprint is missing; model._target_=tread.models.build_sprint needs"),
    (["model=sprint", "model.sprint.end=40"], "model.sprint.end=40 must be a block index in -12..11"),
    (["model=flux", "+model.depth=4"], "model.depth is not a known key"),
    # DiT architecture overrides: each in its range, and fitting together
    (["+model.mlp_ratio=0.001"], "model.mlp_ratio=0.001 is not allowed; allowed: a number in [0.25, 16]"),
    (["+model.mlp_ratio=100"], "model.mlp_ratio=100 is not allowed"),
    (["+model.depth=0"], "model.depth=0 is not allowed; allowed: an integer in [1, 128]"),
    (["+model.depth=1000"], "model.depth=1000 is not allowed"),
    (["+model.hidden_size=4"], "model.hidden_size=4 is not allowed; allowed: a multiple of 4 in [8, 16384]"),
    (["+model.hidden_size=98", "+model.num_heads=2"], "model.hidden_size=98 is not allowed; allowed: a multiple of 4"),
    (["+model.num_heads=0"], "model.num_heads=0 is not allowed; allowed: an integer in [1, 256]"),
    (["+model.num_heads=7"], "model.num_heads=7 does not divide model.hidden_size=96 (DiT-T/2's)"),
    (["+model.patch_size=0"], "model.patch_size=0 is not allowed; allowed: an integer in [1, 16]"),
    (["+model.patch_size=3"], "model.patch_size=3 does not divide model.input_size=16 (data.resolution)"),
    (["model.arch=DiT-T/8", "data.builtin_args.resolution=12"], "model.patch_size=8 (DiT-T/8's) does not divide"),
    # the families' diffusers geometry: block counts first (not the route, "allowed 0..-1"), then each range
    (["model=flux", "model.config={num_layers:0,num_single_layers:0}"],
     "model.config.num_layers=0 and model.config.num_single_layers=0 leave the flux transformer without blocks"),
    (["model=sd3", "model.config={num_layers:0}"], "model.config.num_layers=0 leaves the sd3 transformer without"),
    (["model=auraflow", "model.config={num_mmdit_layers:0,num_single_dit_layers:0}"],
     "model.config.num_mmdit_layers=0 and model.config.num_single_dit_layers=0 leave the auraflow transformer"),
    (["model=flux", "model.config={num_layers:-1}"], "model.config.num_layers=-1 is not allowed; allowed: an integer "
                                                      "in [0, 256]"),
    (["model=flux", "model.config={num_attention_heads:0}"], "model.config.num_attention_heads=0 is not allowed"),
    (["model=wan", "model.config={patch_size:[1,2,40]}"], "model.config.patch_size=[1, 2, 40] is not allowed"),
    (["model=pixart", "model.config={attention_head_dim:2.5}"], "model.config.attention_head_dim=2.5 is not "
                                                                "allowed; allowed: an integer in [1, 1024]"),
    # values shown as the user types them (Hydra's true/false/null), not Python's
    (["resume=true"], "resume=true is not allowed"),
    (["resume=[true,null]"], "resume=[true, null] is not allowed"),
    (["data.allow_nonfinite=maybe"], "data.allow_nonfinite='maybe' is not allowed; allowed: false (a dataset "
                                     "holding NaN/inf is refused"),
]


@pytest.mark.parametrize("overrides,message", SCHEMA_GAPS, ids=[" ".join(o) for o, _ in SCHEMA_GAPS])
def test_schema_gaps_are_closed(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=overrides))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "True" not in str(err.value) and "None" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["+model.depth=4", "+model.hidden_size=64", "+model.num_heads=8", "+model.mlp_ratio=2.0", "+model.patch_size=1"],
    ["model=sprint"], ["model=flux", "model.config={num_layers:0,num_single_layers:2}"],
    ["model=wan", "model.config={patch_size:[1,2,2]}"], ["data.allow_nonfinite=true"],
])
def test_architecture_overrides_in_range_pass(overrides):
    check_train(compose_cfg(overrides=overrides))


def test_show_spells_values_in_hydra_syntax():
    from tread.schema.base import show

    assert show(True) == "true" and show(None) == "null" and show("a") == "'a'" and show(0.5) == "0.5"
    assert show([True, None, 2]) == "[true, null, 2]" and show({"a": False, "b": [None]}) == "{a: false, b: [null]}"


def test_every_family_preset_has_its_block_counts_checked():
    """The layer keys the schema counts (num_*layers) are the presets' block counts, for every family."""
    from tread.models.families import FAMILIES, family_module
    from tread.schema.model import LAYER_KEY

    for family in FAMILIES:
        for name, preset in family_module(family).PRESETS.items():
            layers = [k for k, v in preset.items() if LAYER_KEY.match(k) and isinstance(v, int)]
            assert layers and sum(preset[k] for k in layers) >= 1, (family, name)
