"""checkpoint.layout=sharded (tread/checkpoint/sharded.py, tread/checkpoint/state.py): weights, EMA and optimizer as a
torch.distributed.checkpoint folder. In one process here (the FSDP runs that write and read real shards:
tests/test_fsdp.py): exact resume, the same weights for sampling, the conversion both ways, and an index that can
only make DCP's records (a planted pickle is refused, not run)."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, compose_cfg, shared_cache
from tread.cli.convert_checkpoint import main as convert_main
from tread.checkpoint.layouts import convert_layout
from tread.training.loop import train
from tread.checkpoint.files import CheckpointError, load_model_file, read_checkpoint
from tread.checkpoint.sharded import INDEX, SHARDED_DIR, ShardedFileError, ShardedWriteError, save_sharded, tensor_index
from tread.checkpoint.tensorfile import load_state

QUIET = ["eval.every_steps=0", "eval.at_end=false", "train.lr_warmup_steps=3", "ema.decay=0.5"]


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def same_weights(a: Path, b: Path) -> None:
    x, y = load_model_file(a), load_model_file(b)
    for key in ("model", "ema"):
        assert sorted(x[key]) == sorted(y[key])
        assert all(torch.equal(x[key][n], y[key][n]) for n in x[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny run to step 6 with a sharded checkpoint at 3, and the same run with single-file checkpoints."""
    root, cache_dir = tmp_path_factory.mktemp("sharded"), shared_cache(tmp_path_factory)
    for layout in ("sharded", "single"):
        cfg = compose_cfg("train", TINY + [f"paths.cache_dir={cache_dir}", *QUIET, "train.max_steps=6",
                                           "checkpoint.every_steps=3", "checkpoint.keep_last=null",
                                           f"checkpoint.layout={layout}"])
        train(cfg, root / layout)
    return root


def test_a_sharded_checkpoint_holds_the_same_state_and_resumes_exactly(runs, tiny_cfg, tmp_path):
    sharded, single = (runs / name / "checkpoints" / "step_0000003" for name in ("sharded", "single"))
    assert (sharded / SHARDED_DIR / INDEX).is_file() and not (sharded / "model.safetensors").exists()
    assert json.loads((sharded / "checkpoint.json").read_text())["layout"] == "sharded"
    same_weights(sharded, single)                               # what sample.py and fid.py read
    assert losses(runs / "sharded") == losses(runs / "single")
    train(tiny_cfg(*QUIET, "train.max_steps=6", "checkpoint.every_steps=0", f"resume={sharded}"), tmp_path / "r")
    resumed = losses(tmp_path / "r")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == losses(runs / "single")[s] for s in resumed)
    same_weights(tmp_path / "r", runs / "single")               # optimizer moments and step counts came back too


def test_conversion_both_ways_is_exact(runs, tiny_cfg, tmp_path):
    single = runs / "single" / "checkpoints" / "step_0000003"
    as_sharded = convert_layout(single, tmp_path / "step_sharded", "sharded")
    back = convert_layout(as_sharded, tmp_path / "step_single", "single")
    same_weights(back, single)
    a, b = (load_state(p / "train_state.safetensors")["optimizer"] for p in (single, back))
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    train(tiny_cfg(*QUIET, "train.max_steps=6", "checkpoint.every_steps=0", f"resume={as_sharded}"), tmp_path / "r")
    assert losses(tmp_path / "r") == {s: v for s, v in losses(runs / "single").items() if s > 3}


def test_the_converter_refuses_before_writing(runs, tmp_path):
    sharded = runs / "sharded" / "checkpoints" / "step_0000003"
    for argv, needle in (([str(sharded), "--layout", "sharded", "--out", str(tmp_path / "x")],
                          "is sharded; allowed: single"),
                         ([str(sharded), "--layout", "single"], "--layout needs --out"),
                         ([str(sharded), "--layout", "single", "--out", str(sharded)], "exists")):
        with pytest.raises(SystemExit) as exit_:
            convert_main(argv)
        err = str(exit_.value.code)               # sys.exit(message): printed as one line on stderr, status 1
        assert err.startswith("error: ") and needle in err and "\n" not in err, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()


def test_a_planted_pickle_in_the_index_is_refused_not_run(runs, tmp_path):
    """A `.metadata` that names os.system is refused with the name, before anything is read; nothing runs."""
    ckpt = tmp_path / "step_0000003"
    convert_layout(runs / "single" / "checkpoints" / "step_0000003", ckpt, "sharded")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    (ckpt / SHARDED_DIR / INDEX).write_bytes(pickle.dumps(Payload()))
    for read in (lambda: load_model_file(ckpt), lambda: read_checkpoint(ckpt, 0)):
        with pytest.raises(CheckpointError, match=r"cannot be read: it names (posix|os)\.system, which a checkpoint "
                                                  r"index may not"):
            read()
    assert not marker.exists()


def test_only_tensors_are_read_from_a_sharded_folder(tmp_path):
    """DCP stores non-tensors as pickled bytes and unpickles them on load; a folder declaring one is refused."""
    save_sharded({"model": {"w": torch.ones(2)}, "extra": {"obj": [1, 2]}}, tmp_path / "f")
    with pytest.raises(ShardedFileError, match="entry 'extra.obj' is not a tensor; sharded checkpoints hold tensors"):
        tensor_index(tmp_path / "f")


def test_a_failed_sharded_write_names_the_rank_and_the_cause(tmp_path):
    """DCP gathers each process's failure into one exception; the write error says which rank failed and why (the
    checkpoint's error line quotes it)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ShardedWriteError, match=r"^rank 0: (NotADirectoryError|FileExistsError): .*file"):
        save_sharded({"model": {"w": torch.zeros(3)}}, tmp_path / "file" / SHARDED_DIR)


def test_a_launch_that_never_shards_loads_no_dtensor_code():
    """torch.distributed.checkpoint, .tensor and .fsdp take most of a second to import: train.py's imports leave them
    to the first sharded read or write (tread/checkpoint/sharded.py, tread/training/fsdp.py)."""
    code = ("import sys, tread.cli.train; print(sorted(m for m in ('torch.distributed.checkpoint', "
            "'torch.distributed.tensor', 'torch.distributed.fsdp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
