"""Checkpoints whose files decode but whose values are wrong (issue: "every value read from a checkpoint is
checked"): a resume (train.py resume=...), sample.py and fid.py mode=bench refuse each one with one `error:` line
naming the file and the key, before anything in the run dir changes. The run each case breaks is a copy of the
finished tiny run ({out}/run, one checkpoint: nothing to fall back to, so the resume is refused; with an earlier
good checkpoint it falls back: tests/test_checkpoint_fuzz.py). The rules: tests/bad_input_table.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from bad_input_table import checkpoint_json, copy_run, fid, refused, sample, train
from tread.checkpoint.tensorfile import load_state, load_tensors, save_state, save_tensors

pytestmark = pytest.mark.slow   # ~60 program runs in the harness beside the other tables


def state_edit(file: str, edit: Callable[[Any], Any], replace: bool = False) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with one state file's tree (train_state, rng_rank0) edited in place by `edit` (or, with
    `replace`, replaced by what it returns)."""
    def setup(out: Path, places: dict) -> None:
        path = copy_run(out, places) / file
        tree = load_state(path)
        result = edit(tree)
        save_state(result if replace else tree, path)
    return setup


def train_state(edit: Callable[[dict], Any], replace: bool = False) -> Callable[[Path, dict], None]:
    return state_edit("train_state.safetensors", edit, replace)


def rng(edit: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    return state_edit("rng_rank0.safetensors", edit)


def put(tree: dict, dotted: str, value: Any) -> None:
    """tree[a][b] = value for dotted 'a.b' (None: delete the key)."""
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree[key]
    if value is None:
        del tree[last]
    else:
        tree[last] = value


def setting(dotted: str, value: Any) -> Callable[[Path, dict], None]:
    return train_state(lambda tree: put(tree, dotted, value))


def meta(edit: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with its checkpoint.json edited."""
    return checkpoint_json(copy_run, edit)


def weights(file: str, edit: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with a weights file's {name: tensor} edited (edit returns the new dict)."""
    def setup(out: Path, places: dict) -> None:
        path = copy_run(out, places) / file
        save_tensors(edit(load_tensors(path)), path)
    return setup


def first(tensors: dict, fn: Callable[[torch.Tensor], Any]) -> dict:
    name = sorted(tensors)[0]
    return {**tensors, name: fn(tensors[name])}


def nan_all(tensors: dict) -> dict:
    return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()}


def moment(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path, dict], None]:
    def edit(tree: dict) -> None:
        entry = tree["optimizer"]["state"][0]
        entry["exp_avg"] = fn(entry["exp_avg"])
    return train_state(edit)


TS = "train_state.safetensors"


def resume(id: str, setup: Callable[[Path, dict], None], *needles: str) -> Any:
    return train(f"resume_{id}", "resume={out}/run", setup=setup, needles=needles)


RESUME_CASES = [
    resume("step_negative", setting("step", -3), TS, "step=-3"),
    resume("step_huge", setting("step", 10**15), TS, "step=1000000000000000"),
    resume("step_string", setting("step", "abc"), TS, "step='abc'"),
    resume("step_bool", setting("step", True), TS, "step=True"),
    resume("step_other_than_dir", setting("step", 5), TS, "step=5", "checkpoint.json step says 1"),
    resume("train_sec_negative", setting("train_sec", -1.0), TS, "train_sec=-1.0"),
    resume("train_sec_nan", setting("train_sec", float("nan")), TS, "train_sec=nan"),
    resume("train_sec_string", setting("train_sec", "x"), TS, "train_sec='x'"),
    resume("world_size_zero", setting("world_size", 0), TS, "world_size=0"),
    resume("loader_missing", setting("loader", None), TS, "loader=None"),
    resume("loader_epoch_negative", setting("loader.epoch", -1), TS, "loader.epoch=-1"),
    resume("loader_epoch_huge", setting("loader.epoch", 2**50), TS, f"loader.epoch={2**50}"),
    resume("loader_epoch_float", setting("loader.epoch", 1.5), TS, "loader.epoch=1.5"),
    resume("loader_batch_string", setting("loader.batch", "x"), TS, "loader.batch='x'"),
    resume("loader_batch_size_zero", setting("loader.batch_size", 0), TS, "loader.batch_size=0"),
    resume("optimizer_empty", setting("optimizer", {}), TS, "optimizer is not an optimizer state"),
    resume("optimizer_no_groups", setting("optimizer.param_groups", []), TS, "optimizer.param_groups",
           "param groups of"),
    resume("optimizer_group_short", train_state(lambda t: t["optimizer"]["param_groups"][0]["params"].pop()), TS,
           "param groups of"),
    resume("optimizer_moment_shape", moment(lambda m: m[:1]), TS, "optimizer.state[0].exp_avg", "shape"),
    resume("optimizer_moment_nan", moment(lambda m: torch.full_like(m, float("nan"))), TS,
           "optimizer.state[0].exp_avg", "non-finite"),
    resume("optimizer_entry_for_no_param", train_state(lambda t: t["optimizer"]["state"].update({9999: {}})), TS,
           "optimizer.state has an entry 9999"),
    resume("rng_torch_short", rng(lambda r: r.update(torch=r["torch"][:100])), "rng.torch", "uint8"),
    resume("rng_numpy_short", rng(lambda r: r.update(numpy=(r["numpy"][0], r["numpy"][1][:10], *r["numpy"][2:]))),
           "rng.numpy[1]"),
    resume("rng_python_short", rng(lambda r: r.update(python=(3, r["python"][1][:5], None))), "rng.python[1]"),
    resume("rng_numpy_missing", rng(lambda r: r.pop("numpy")), "rng lacks 'numpy'"),
    resume("rng_router_missing", rng(lambda r: r.pop("router")), "rng.router=None"),
    resume("rng_router_seed_string", rng(lambda r: r["router"].update(seed="s")), "rng.router.seed='s'"),
    resume("weights_nan", weights("model.safetensors", nan_all), "model.safetensors", "non-finite"),
    resume("ema_tensor_missing", weights("ema.safetensors", lambda t: dict(sorted(t.items())[1:])), "ema.safetensors",
           "missing"),
    resume("weights_extra_tensor", weights("model.safetensors", lambda t: {**t, "extra.weight": torch.zeros(2)}),
           "model.safetensors", "'extra.weight' is not in the model"),
    resume("weights_wrong_shape", weights("model.safetensors", lambda t: first(t, lambda v: v.reshape(-1)[:3])),
           "model.safetensors", "has shape [3]"),
    resume("meta_step_other", meta(lambda m: m.update(step=7)), "checkpoint.json", "step=7"),
    resume("meta_format_99", meta(lambda m: m.update(format=99)), "checkpoint.json", "format=99"),
    resume("meta_model_extra_key", meta(lambda m: m["config"]["model"].update(foo=1)), "checkpoint.json",
           "model.foo"),
    resume("meta_seed_string", meta(lambda m: m["config"]["train"].update(seed="abc")), "checkpoint.json",
           "train.seed='abc'"),
    resume("meta_seed_huge", meta(lambda m: m["config"]["train"].update(seed=2**70)), "checkpoint.json",
           f"train.seed={2**70}"),
    resume("meta_no_diffusion", meta(lambda m: m["config"].pop("diffusion")), "checkpoint.json", "diffusion"),
    resume("train_state_not_a_mapping", train_state(lambda t: [1, 2], replace=True), TS, "no resume state"),
]


def checkpoint(id: str, setup: Callable[[Path, dict], None], *needles: str) -> Any:
    return sample(f"checkpoint_{id}", "checkpoint={out}/run", ckpt=False, setup=setup, needles=needles)


SAMPLE_CASES = [
    checkpoint("format_99", meta(lambda m: m.update(format=99)), "checkpoint.json", "format=99"),
    checkpoint("model_extra_key", meta(lambda m: m["config"]["model"].update(foo=1)), "checkpoint.json",
               "model.foo"),
    checkpoint("seed_string", meta(lambda m: m["config"]["train"].update(seed="abc")), "train.seed='abc'"),
    checkpoint("seed_huge", meta(lambda m: m["config"]["train"].update(seed=2**70)), f"train.seed={2**70}"),
    checkpoint("no_model_section", meta(lambda m: m["config"].pop("model")), "checkpoint.json", "model is missing"),
    checkpoint("step_string", meta(lambda m: m.update(step="abc")), "checkpoint.json", "step='abc'"),
    checkpoint("ema_all_nan", weights("ema.safetensors", nan_all), "ema.safetensors", "non-finite"),
    checkpoint("ema_tensor_missing", weights("ema.safetensors", lambda t: dict(sorted(t.items())[1:])),
               "ema.safetensors", "missing"),
    checkpoint("other_family_weights", weights("ema.safetensors", lambda t: {f"transformer.{k}": v
                                                                              for k, v in t.items()}),
               "ema.safetensors", "is not in the model"),
    checkpoint("ema_wrong_shape", weights("ema.safetensors", lambda t: first(t, lambda v: v.reshape(-1)[:3])),
               "ema.safetensors", "has shape [3]"),
    fid("bench_format_99", "mode=bench", "checkpoints={out}/run", "ref={ref}",
        setup=meta(lambda m: m.update(format=99)), needles=("checkpoint.json", "format=99")),
    fid("bench_seed_string", "mode=bench", "checkpoints={out}/run", "ref={ref}",
        setup=meta(lambda m: m["config"]["train"].update(seed="abc")), needles=("train.seed='abc'",)),
    fid("bench_model_extra_key", "mode=bench", "checkpoints={out}/run", "ref={ref}",
        setup=meta(lambda m: m["config"]["model"].update(foo=1)), needles=("model.foo",)),
]

CASES = RESUME_CASES + SAMPLE_CASES


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
