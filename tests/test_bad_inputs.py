"""The bad-input acceptance table: every program (train.py, sample.py, fid.py, scripts/precompute_latents.py)
refuses each bad config value, data directory, flag and checkpoint path below before any work: a non-zero exit
status, exactly one `error:` line naming the key or file and the offending value, no traceback, no work done
(no progress bar, and nothing in the case's folder but what a refused launch may leave: see leftover_work),
and nothing already written (a finished run directory, a dataset) changed. What happened is asserted, never how
long it took: each case's seconds are recorded (record_property "refusal_secs") and tests/conftest.py prints
them as a figure at the end of the session.

The cases run through tests/bad_input_harness.py (a fork server that has the programs' imports loaded: about
0.3 s a case instead of 4.5 s; two at a time, every module's cases queued when the session's `world` is built,
each test waiting for its own); test_harness_matches_the_real_program runs some of them as real subprocesses to
show that the harness gives what the programs give. The machinery, the placeholders ({run}, {data}, {bad}, ...)
and the rules: tests/bad_input_table.py. More tables: tests/test_bad_inputs_*.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from bad_input_harness import digest, leftover_work
from bad_input_table import (PRECOMPUTE, PROGRESS, REGISTRY, bad_data, check_refused, copy_run, fid, plant_pickle,
                             precompute, refused, sample, train)

pytestmark = pytest.mark.slow   # 40-70 s on a 2-core machine: ~110 program runs and a tiny training run


CONFIG_CASES = [
    train("route_selection_ratio_above_one", "routing.routes.0.selection_ratio=1.5",
          needles=("routing.routes[0].selection_ratio=1.5 is not allowed",)),
    train("route_beyond_depth", "routing.routes.0.end_layer_idx=40",
          needles=("routing.routes[0].end_layer_idx=40 is out of range",)),
    train("tread_without_routes", "model=tread", "routing.routes=[]",
          needles=("routing.routes", "TREAD training requires you to configure the routes")),
    train("schedule_not_from_zero", "routing.schedule=[{{start_step:5}}]",
          needles=("routing.schedule[0].start_step=5 must be 0",)),
    train("schedule_ramp_last", "routing.schedule=[{{start_step:0,selection_ratio:[0.5,0.2]}}]",
          needles=("routing.schedule[0].selection_ratio=[0.5, 0.2]", "add a phase after it")),
    train("schedule_unknown_field", "routing.schedule=[{{start_step:0,ratio:0.5}}]",
          needles=("routing.schedule[0].ratio",)),
    train("repa_block_beyond_depth", "repa=toy", "model.repa.block=30",
          needles=("model.repa.block=30",)),
    train("mixed_precision_fp8", "train.mixed_precision=fp8", needles=("train.mixed_precision='fp8'",)),
    # diffusers families: their own keys, checked before any training work
    train("family_preset_unknown", "model=flux", "model.preset=huge",
          needles=("model.preset='huge' is not a flux preset",)),
    train("family_config_key_unknown", "model=sd3", "model.config={{foo:1}}",
          needles=("model.config for sd3 has a key that SD3Transformer2DModel does not take",)),
    train("family_lora_matches_nothing", "model=wan", "model.lora={{rank:4,target_modules:[nope]}}",
          needles=("model.lora.target_modules ['nope'] match no module",)),
    train("family_pretrained_missing", "model=pixart", "model.pretrained={missing}/pixart",
          needles=("model.pretrained='{missing}/pixart' (pixart) does not exist",)),
    train("family_route_beyond_depth", "model=flux", "routing.routes.0.end_layer_idx=8",
          needles=("routing.routes[0].end_layer_idx=8 is out of range for a model with depth 8",)),
    train("grad_clip_zero", "train.grad_clip=0"),
    train("lr_zero", "optimizer.lr=0"),
    train("lr_string", "optimizer.lr=fast", needles=("optimizer.lr='fast'", "a number > 0")),
    train("lr_nan", "optimizer.lr=nan"),
    train("eps_zero", "optimizer.eps=0"),
    train("beta2_one", "optimizer.betas=[0.9,1.0]", needles=("optimizer.betas=[0.9, 1.0]", "[0, 1)")),
    train("beta1_negative", "optimizer.betas=[-0.1,0.999]", needles=("optimizer.betas=[-0.1, 0.999]",)),
    train("weight_decay_negative", "optimizer.weight_decay=-0.01"),
    train("sigma_min_zero", "diffusion.sigma_min=0"),
    train("sigma_min_above_max", "diffusion.sigma_min=100", needles=("diffusion.sigma_min=100", "sigma_max")),
    train("P_std_negative", "diffusion.P_std=-1"),
    train("rf_shift_zero", "diffusion=rf", "diffusion.shift=0"),
    train("warmup_negative", "train.lr_warmup_steps=-1"),
    train("keep_last_zero", "checkpoint.keep_last=0"),
    train("keep_last_negative", "checkpoint.keep_last=-2"),
    train("num_workers_negative", "train.num_workers=-1"),
    train("seed_string", "train.seed=abc", needles=("train.seed='abc'", "an integer")),
    train("seed_float", "train.seed=1.5"),
    train("seed_negative", "train.seed=-1"),
    train("ema_decay_string", "ema.decay=high", needles=("ema.decay='high'", "[0, 1)")),
    train("wandb_mode_unknown", "wandb.mode=loud", needles=("wandb.mode='loud'", "disabled, offline, online")),
    train("arch_unknown", "model.arch=DiT-Z/2", needles=("model.arch='DiT-Z/2'", "DiT-T/2", "DiT-XL/2")),
    train("bool_as_string", "train.cpu=yes", needles=("train.cpu='yes'", "true or false")),
    train("eval_steps_zero", "eval.num_steps=0"),
    train("eval_only_at_end_batch_zero", "eval.every_steps=0", "eval.at_end=true", "eval.batch_size=0"),
    train("eval_reference_missing", "eval.reference={missing}/ref.npz",
          needles=("eval.reference", "{missing}/ref.npz")),
    train("unknown_train_key", "+train.foo=1", needles=("train.foo", "not a known key")),
    # sampling keys renamed (tread/utils/renamed_keys.py): on the command line, and as a config gives them (+)
    train("eval_route_ratio_renamed", "eval.route_ratio=0.3",
          needles=("eval.route_ratio was renamed: use eval.selection_ratio=0.3",)),
    train("eval_tread_weak_ratio_renamed", "+eval.tread_weak_ratio=0.5",
          needles=("eval.tread_weak_ratio was renamed: use eval.tread_weak_selection_ratio=0.5",)),
    train("unknown_model_key", "+model.bar=2", needles=("model.bar", "not a known key")),
    train("nonfinite_unknown", "train.nonfinite=maybe", needles=("train.nonfinite='maybe'", "skip", "stop")),
    train("nonfinite_skips_zero", "train.max_nonfinite_skips=0"),
    train("collective_timeout_zero", "train.collective_timeout_min=0"),
    train("slurm_requeue_string", "train.slurm_requeue=sometimes", needles=("train.slurm_requeue='sometimes'",)),
    train("output_dir_empty", "paths.output_dir=", needles=("paths.output_dir=''",)),
    # Hydra's own composition errors (before any of our code runs).
    train("unknown_key_without_plus", "train.fooo=1", needles=("train.fooo",)),
    train("unknown_group_option", "model=nosuch", needles=("model/nosuch", "tread")),
    train("override_syntax", "train.seed=[1", needles=("train.seed=[1",)),
    train("unresolvable_interpolation", "train.seed=${{oops}}", needles=("train.seed", "oops")),
]

def _meta(d: Path, **changes: Any) -> None:
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, **changes}))


def _labels(d: Path, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    np.save(d / "labels.npy", fn(np.load(d / "labels.npy")))


def _latents(d: Path, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    np.save(d / "latents.npy", fn(np.load(d / "latents.npy")))


DATA_CASES = [
    train("data_path_missing", "data.builtin=null", "data.path={missing}/dataset", needles=("{missing}/dataset",)),
    train("data_path_is_a_file", "data.builtin=null", "data.path={ref}", needles=("{ref}", "not a directory")),
    bad_data("empty", "{bad}/empty", "no meta.json")(lambda d: [p.unlink() for p in d.iterdir()]),
    bad_data("no_meta", "{bad}/no_meta", "no meta.json")(lambda d: (d / "meta.json").unlink()),
    bad_data("no_latents", "{bad}/no_latents/latents.npy", "missing")(lambda d: (d / "latents.npy").unlink()),
    bad_data("no_labels", "{bad}/no_labels/labels.npy", "missing")(lambda d: (d / "labels.npy").unlink()),
    bad_data("meta_not_json", "{bad}/meta_not_json/meta.json", "invalid JSON")(
        lambda d: (d / "meta.json").write_text("{not json")),
    bad_data("meta_format", "{bad}/meta_format/meta.json", "'format'", "'imagenet'")(
        lambda d: _meta(d, format="imagenet")),
    bad_data("latents_shape", "{bad}/latents_shape/latents.npy", "[400, 4, 16, 16]")(
        lambda d: np.save(d / "latents.npy", np.zeros((400, 4, 16, 16), np.float16))),
    bad_data("latents_dtype", "{bad}/latents_dtype/latents.npy", "int32")(
        lambda d: _latents(d, lambda x: x.astype(np.int32))),
    bad_data("latents_not_npy", "{bad}/latents_not_npy/latents.npy", "corrupt")(
        lambda d: (d / "latents.npy").write_bytes(b"not a numpy file" * 10)),
    bad_data("latents_truncated", "{bad}/latents_truncated/latents.npy", "truncated")(
        lambda d: (d / "latents.npy").write_bytes((d / "latents.npy").read_bytes()[:5000])),
    bad_data("labels_out_of_range", "{bad}/labels_out_of_range/labels.npy", "[0, 10]")(
        lambda d: _labels(d, lambda y: np.where(np.arange(len(y)) == 7, 10, y))),
    bad_data("labels_float", "{bad}/labels_float/labels.npy", "float32")(
        lambda d: _labels(d, lambda y: y.astype(np.float32))),
    bad_data("labels_count", "{bad}/labels_count/labels.npy", "[399]")(lambda d: _labels(d, lambda y: y[:399])),
    bad_data("channels_mismatch", "{bad}/channels_mismatch", "4 channels", "data.channels")(
        lambda d: (np.save(d / "latents.npy", np.zeros((400, 4, 16, 16), np.float16)), _meta(d, shape=[4, 16, 16]))),
    bad_data("classes_mismatch", "{bad}/classes_mismatch", "12 classes", "data.num_classes")(
        lambda d: _meta(d, num_classes=12, class_names=None)),
]

CHECKPOINT_PATH_CASES = [
    train("resume_missing", "resume={missing}/run", needles=("resume=", "{missing}/run", "does not exist")),
    train("resume_no_checkpoint", "resume={empty}", needles=("resume=", "{empty}", "no checkpoint")),
    train("run_dir_has_checkpoints", "hydra.run.dir={run}", needles=("{run}", "already holds checkpoints")),
    sample("checkpoint_missing", "checkpoint={missing}/run", ckpt=False,
           needles=("checkpoint=", "{missing}/run", "does not exist")),
    sample("checkpoint_no_checkpoint", "checkpoint={empty}", ckpt=False, needles=("checkpoint=", "{empty}")),
    sample("checkpoint_not_set", ckpt=False, needles=("checkpoint is not set",)),
    fid("bench_checkpoint_missing", "mode=bench", "checkpoints={missing}/run", "ref={ref}",
        needles=("checkpoints=", "{missing}/run", "does not exist")),
    fid("bench_no_checkpoint", "mode=bench", "checkpoints={empty}", "ref={ref}", needles=("checkpoints=", "{empty}")),
]

def _foreign_target(out: Path, places: dict) -> None:
    meta_file = copy_run(out, places) / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"] = {"_target_": "pathlib.Path.write_text", "self": str(Path(places["run"]).parent /
                                                                                  "payload_ran"), "data": "x"}
    meta_file.write_text(json.dumps(meta))


def _truncate(out: Path, places: dict) -> None:
    weights = copy_run(out, places) / "ema.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _incomplete(out: Path, places: dict) -> None:
    (copy_run(out, places) / "checkpoint.json").unlink()


# ---- Checkpoint contents: a copy of the finished run ({out}/run) broken by the case's setup first.
# A planted pickle payload would create {base}/payload_ran: a new file in the world, which every case checks for.
CHECKPOINT_CASES = [
    sample("pickle_payload", "checkpoint={out}/run", ckpt=False, setup=plant_pickle, needles=("model.pt", "old pickle format", "--trust")),
    sample("foreign_target", "checkpoint={out}/run", ckpt=False, setup=_foreign_target,
           needles=("model._target_='pathlib.Path.write_text'", "not one of the project's builders")),
    sample("truncated_weights", "checkpoint={out}/run", ckpt=False, setup=_truncate, needles=("ema.safetensors", "truncated")),
    sample("incomplete_checkpoint", "checkpoint={out}/run/checkpoints/step_0000001", ckpt=False,
           setup=_incomplete,
           needles=("step_0000001", "no checkpoint")),
    fid("bench_pickle_payload", "mode=bench", "checkpoints={out}/run", "ref={ref}", setup=plant_pickle,
        needles=("model.pt", "old pickle format")),
    fid("bench_foreign_target", "mode=bench", "checkpoints={out}/run", "ref={ref}", setup=_foreign_target,
        needles=("model._target_='pathlib.Path.write_text'",)),
    train("resume_pickle_payload", "resume={out}/run", setup=plant_pickle,
          needles=("model.pt", "old pickle format", "--trust")),
    train("resume_foreign_target", "resume={out}/run", setup=_foreign_target,
          needles=("model._target_='pathlib.Path.write_text'",)),
    train("resume_other_architecture", "resume={run}", "model.arch=DiT-S/4",
          needles=("model.arch: 'DiT-T/4' -> 'DiT-S/4'", "architecture")),
    train("keep_last_minus_one", "checkpoint.keep_last=-1"),
]


SAMPLE_CASES = [
    sample("num_samples_zero", "num_samples=0"),
    sample("batch_zero", "batch_size=0"),
    sample("steps_zero", "num_steps=0"),
    sample("seed_negative", "seeds=-3"),
    sample("seeds_string", "seeds=abc", needles=("seeds='abc'",)),
    sample("seeds_unquoted_list", "seeds=1,2", needles=("seeds=1,2",)),
    sample("device_unknown", "device=tpu", needles=("device='tpu'", "cuda:N")),
    sample("device_bad_index", "device=cuda:x", needles=("device='cuda:x'",)),
    sample("device_absent", "device=cuda:99", needles=("device=cuda:99", "not available")),
    sample("class_out_of_range", "classes=[99]", needles=("classes=[99]", "10 classes")),
    sample("unknown_key", "+foo=1", needles=("foo is not a known key",)),
    sample("out_dir_is_a_file", "out_dir={ref}", needles=("out_dir=", "{ref}")),
    sample("out_dir_has_samples", "out_dir={samples}", needles=("out_dir=", "{samples}", "already holds samples")),
    sample("route_spans_beyond_depth", "route_spans=[[0,40]]", "selection_ratio=0.5",
           needles=("end_layer_idx=40", "depth 12")),
    sample("tread_weak_selection_ratio_above_one", "tread_scale=2", "tread_weak_selection_ratio=1.5",
           needles=("tread_weak_selection_ratio=1.5 is not allowed",)),
    sample("route_ratio_renamed", "route_ratio=0.25", needles=("route_ratio was renamed: use selection_ratio=0.25",)),
    sample("tread_weak_ratio_renamed", "tread_scale=2", "+tread_weak_ratio=0.5",
           needles=("tread_weak_ratio was renamed: use tread_weak_selection_ratio=0.5",)),
]

FID_CASES = [
    fid("mode_missing", needles=("mode=???",)),
    fid("mode_unknown", "mode=foo"),
    fid("calc_without_images", "mode=calc", needles=("mode=calc needs images=",)),
    fid("images_missing", "mode=calc", "images={missing}/imgs", "ref={ref}", needles=("images={missing}/imgs",)),
    fid("ref_missing", "mode=calc", "images={imgs}", "ref={missing}/ref.npz", needles=("ref={missing}/ref.npz",)),
    fid("batch_zero", "mode=calc", "images={imgs}", "ref={ref}", "batch_size=0"),
    fid("device_unknown", "mode=calc", "images={imgs}", "ref={ref}", "device=tpu", needles=("device='tpu'",)),
    fid("metric_unknown", "mode=calc", "images={imgs}", "ref={ref}", "metrics=[fid,lpips]",
        needles=("metrics[1]='lpips'",)),
    fid("out_json_exists", "mode=calc", "images={imgs}", "ref={ref}", "out_json={ref}",
        needles=("out_json={ref}", "already exists")),
    fid("bench_num_samples_zero", "mode=bench", "checkpoints={run}", "ref={ref}", "num_samples=0"),
    fid("bench_seed_negative", "mode=bench", "checkpoints={run}", "ref={ref}", "seeds=-1"),
    fid("bench_steps_zero", "mode=bench", "checkpoints={run}", "ref={ref}", "num_steps=0"),
    fid("bench_too_few_samples", "mode=bench", "checkpoints={run}", "ref={ref}", "num_samples=3",
        needles=("3 images", "num_samples")),
    fid("bench_route_ratio_renamed", "mode=bench", "checkpoints={run}", "ref={ref}", "route_ratio=0.5",
        needles=("route_ratio was renamed: use selection_ratio=0.5",)),
    fid("bench_tread_weak_ratio_renamed", "mode=bench", "checkpoints={run}", "ref={ref}", "tread_weak_ratio=0.5",
        needles=("tread_weak_ratio was renamed: use tread_weak_selection_ratio=0.5",)),
    fid("ref_source_missing", "mode=ref", "source={missing}/src", "out={out}/r.npz", needles=("source={missing}/src",)),
    fid("ref_out_exists", "mode=ref", "source={data}", "out={ref}", needles=("out={ref}", "already exists")),
]

PRECOMPUTE_CASES = [
    precompute("no_flags", needles=("--images DIR is required",)),
    precompute("images_missing", "--images", "{missing}/imgs", "--out", "{out}/ds",
               needles=("--images", "{missing}/imgs")),
    precompute("out_missing", "--images", "{imgs}", needles=("--out DIR is required",)),
    precompute("out_exists", "--images", "{imgs}", "--out", "{data}", needles=("--out", "{data}", "already exists")),
    precompute("resolution_small", "--images", "{imgs}", "--out", "{out}/ds", "--resolution", "4",
               needles=("--resolution=4",)),
    precompute("kind_unknown", "--images", "{imgs}", "--out", "{out}/ds", "--kind", "foo", needles=("--kind='foo'",)),
    precompute("dtype_unknown", "--images", "{imgs}", "--out", "{out}/ds", "--dtype", "int8",
               needles=("--dtype='int8'",)),
    precompute("device_unknown", "--images", "{imgs}", "--out", "{out}/ds", "--device", "tpu",
               needles=("--device='tpu'",)),
    precompute("batch_zero", "--images", "{imgs}", "--out", "{out}/ds", "--batch-size", "0",
               needles=("--batch-size=0",)),
    precompute("seed_negative", "--images", "{imgs}", "--out", "{out}/ds", "--seed", "-1", needles=("--seed=-1",)),
    precompute("labels_missing", "--images", "{imgs}", "--out", "{out}/ds", "--labels", "{missing}/labels.csv",
               needles=("--labels", "{missing}/labels.csv")),
    precompute("ref_out_exists", "--images", "{imgs}", "--out", "{out}/ds", "--ref-out", "{ref}",
               needles=("--ref-out", "{ref}", "already exists")),
    precompute("text_family_unknown", "--images", "{imgs}", "--out", "{out}/ds", "--text-family", "foo",
               needles=("--text-family='foo'",)),
    precompute("no_images", "--images", "{empty}", "--out", "{out}/ds", "--device", "cpu",
               needles=("no images", "{empty}")),
    precompute("batch_not_int", "--images", "{imgs}", "--out", "{out}/ds", "--batch-size", "abc",
               needles=("--batch-size", "abc")),
    precompute("unknown_flag", "--images", "{imgs}", "--out", "{out}/ds", "--bogus", needles=("--bogus",)),
]

CASES = CONFIG_CASES + DATA_CASES + CHECKPOINT_PATH_CASES + CHECKPOINT_CASES + SAMPLE_CASES + FID_CASES + \
    PRECOMPUTE_CASES
# Run again as real subprocesses (one of each program, a dataset and a checkpoint path).
REAL = ["seed_string", "data_labels_out_of_range", "sample/device_unknown", "fid/bench_seed_negative",
        "precompute/kind_unknown", "resume_missing"]



def test_the_table_is_big_enough():
    assert len(CASES) >= 70
    assert {c.program for c in CASES} == {"train.py", "sample.py", "fid.py", PRECOMPUTE}


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)


@pytest.mark.parametrize("name", REAL)
def test_harness_matches_the_real_program(world, name, record_property):
    """The case as a real `python <program> ...` subprocess: refused the same way, with the same status and error
    line as in the harness."""
    case = REGISTRY[name]
    real, real_out = world.real[name].result()
    record_property("real_refusal_secs", real["secs"])   # imports included (~3.5 s): the time a user waits
    forked, out = world.forked[name]
    forked = forked.result()
    assert (real["rc"], check_refused(world, case, real, real_out)) == \
        (forked["rc"], check_refused(world, case, forked, out))


def test_the_checks_see_a_training_step(world):
    """What check_refused rules out does show when it happens: {run}'s launch, one training step, printed a
    progress bar and left metrics.jsonl, summary.json, config.yaml and a checkpoint beside its records."""
    assert PROGRESS.search(world.made["stderr"]), world.made["stderr"][-2000:]
    work = [line.removesuffix(": new") for line in leftover_work(Path(world.places["run"]), {})]
    assert {"metrics.jsonl", "summary.json", "config.yaml"} <= set(work), work
    assert any(path.startswith("checkpoints/step_0000001/") for path in work), work


def test_nothing_written_before_was_changed(world):
    """After all the cases (of every module: all are queued when `world` is built): every file made before them
    has the same bytes, and the only new ones are Hydra's records of launches into {run} (no lock left held)."""
    for future, _ in world.forked.values():
        future.exception()                                     # wait for every queued case
    for future in world.real.values():
        future.exception()
    now = digest(world.base)
    assert {k: v for k, v in now.items() if k in world.hashes} == world.hashes
    assert [k for k in now if k not in world.hashes and not k.startswith("run/.hydra/")] == []
