"""checkpoint.layout=sharded (tread/checkpoint/sharded.py, tread/checkpoint/state.py): weights, EMA and optimizer as a
torch.distributed.checkpoint folder. In one process here (the FSDP runs that write and read real shards:
tests/test_fsdp.py): exact resume, the same weights for sampling, the conversion both ways, and an index that can
only make DCP's records (a planted pickle is refused, not run); broken shards and indexes refused in one line, or,
for resume=auto, the previous checkpoint resumed (the table of refusals: tests/test_bad_inputs_sharded.py)."""
from __future__ import annotations

import io
import json
import pickle
import shutil
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
from tread.checkpoint.resume import check_moments
from tread.checkpoint.sharded import (INDEX, SHARDED_DIR, ShardedFileError, ShardedWriteError, full_tensors,
                                      save_sharded, tensor_index)
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


# ----------------------------------------------------------------------------- broken sharded files (issue 43)

def break_newest(run: Path, tmp_path: Path, kind: str) -> Path:
    """A copy of the sharded run whose newest checkpoint (step 6) has its .distcp cut short, deleted or replaced by a
    pickle; returns the copy."""
    copy = tmp_path / "run"
    shutil.copytree(run / "sharded", copy)
    shard = copy / "checkpoints" / "step_0000006" / SHARDED_DIR / "__0_0.distcp"
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "missing":
        shard.unlink()
    else:
        shard.write_bytes(pickle.dumps({"not": "a shard"}))
    return copy


@pytest.mark.parametrize("kind", ["truncated", "missing", "pickle"])
def test_resume_auto_falls_back_from_a_broken_sharded_checkpoint(runs, tiny_cfg, tmp_path, capsys, kind):
    """As with single files: one warning naming the newest checkpoint and its file, then the previous one resumes (and
    the run ends as the unbroken one did)."""
    copy = break_newest(runs, tmp_path, kind)
    capsys.readouterr()
    train(tiny_cfg(*QUIET, "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.layout=sharded",
                   "resume=auto"), copy)
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "step_0000006" in warned[0] and "__0_0.distcp" in warned[0], warned
    assert warned[0].endswith("trying the previous checkpoint"), warned
    assert {s: v for s, v in losses(copy).items() if s > 3} == {s: v for s, v in losses(runs / "single").items()
                                                              if s > 3}


def test_an_explicit_resume_of_a_broken_sharded_checkpoint_is_refused(runs, tiny_cfg, tmp_path):
    copy = break_newest(runs, tmp_path, "truncated")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp' holds \d+ bytes, but the index stores tensor '.*' at "
                                              r"bytes \d+\.\.\d+; the file is truncated"):
        train(tiny_cfg(*QUIET, f"resume={copy / 'checkpoints' / 'step_0000006'}"), tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def rewrite_index(folder: Path, edit) -> None:
    from tread.checkpoint.dcp_io import SafeReader

    metadata = SafeReader(folder).read_metadata()
    edit(metadata)
    (folder / INDEX).write_bytes(pickle.dumps(metadata))


def huge_tensor(metadata) -> None:
    """The first entry claims 10^13 elements, its one chunk too (stored where its real bytes are)."""
    fqn, entry = next(iter(metadata.state_dict_metadata.items()))
    old = next(k for k in metadata.storage_data if k.fqn == fqn)
    entry.size = torch.Size([10**13])
    entry.chunks = [type(entry.chunks[0])(offsets=torch.Size([0]), sizes=torch.Size([10**13]))]
    metadata.storage_data[type(old)(fqn, torch.Size([0]))] = metadata.storage_data.pop(old)


def shared_bytes(metadata) -> None:
    """The smallest chunk stored in the largest one's bytes."""
    by_length = sorted(metadata.storage_data.items(), key=lambda item: item[1].length)
    metadata.storage_data[by_length[0][0]] = by_length[-1][1]


@pytest.mark.parametrize("edit,needle", [
    (huge_tensor, r"\.metadata': tensor '.*' claims a \[10000000000000\] torch.float32 chunk \(40000000000000 bytes\) "
                  r"in \d+ bytes of '__0_0.distcp'; the index is corrupt"),
    (shared_bytes, r"\.metadata': tensors '.*' and '.*' are stored in the same bytes of '.*__0_0.distcp'"),
    (lambda m: setattr(next(iter(m.storage_data.values())), "relative_path", "../../model.safetensors"),
     r"is stored at '../../model.safetensors' .*, which is not a byte range of a file in its folder"),
])
def test_an_index_claiming_more_than_its_files_hold_is_refused_before_allocating(runs, tmp_path, edit, needle):
    ckpt = tmp_path / "step_0000003"
    shutil.copytree(runs / "sharded" / "checkpoints" / "step_0000003", ckpt)
    rewrite_index(ckpt / SHARDED_DIR, edit)
    for read in (lambda: load_model_file(ckpt), lambda: read_checkpoint(ckpt, 0)):
        with pytest.raises(CheckpointError, match=needle):
            read()


def test_a_planted_pickle_in_a_shard_is_refused_not_run(tmp_path):
    """A .distcp item is unpickled by torch's weights-only unpickler, and only after its bytes passed the index checks;
    an archive naming os.system is refused with the file and the tensor, and nothing runs."""
    folder, marker = tmp_path / "f", tmp_path / "ran"
    save_sharded({"model": {"w": torch.zeros(4)}}, folder)

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save({"x": Payload(), "pad": torch.zeros(64)}, buffer)
    (folder / "__0_0.distcp").write_bytes(buffer.getvalue())
    rewrite_index(folder, lambda m: [setattr(i, "length", len(buffer.getvalue())) for i in m.storage_data.values()])
    with pytest.raises(ShardedFileError, match=r"__0_0.distcp': tensor 'model.w' \(bytes 0\.\.\d+\) cannot be read "
                                               r"\(its pickled layout is not a tensor's\)"):
        full_tensors(folder, ("model",))
    assert not marker.exists()


def test_a_sharded_checkpoint_without_its_folder_names_the_folder(runs, tmp_path):
    ckpt = tmp_path / "step_0000003"
    shutil.copytree(runs / "sharded" / "checkpoints" / "step_0000003", ckpt, ignore=shutil.ignore_patterns(SHARDED_DIR))
    for read in (lambda: load_model_file(ckpt), lambda: read_checkpoint(ckpt, 0),
                 lambda: convert_layout(ckpt, tmp_path / "out", "single")):
        with pytest.raises(CheckpointError, match=rf"'{ckpt / SHARDED_DIR}' is missing: .* a sharded checkpoint "
                                                  rf"\(checkpoint.json says layout='sharded'\) without its shards"):
            read()
    assert not (tmp_path / "out").exists()


def test_optimizer_entries_of_no_parameter_or_another_shape_are_refused(tmp_path):
    """check_moments: nothing of another size than its parameter is allocated for an optimizer entry (a step count,
    one element, may be any shape)."""
    named = [("w", torch.nn.Parameter(torch.zeros(3, 2)))]
    ok = {("optimizer", "0", "exp_avg"): (torch.Size([3, 2]), torch.float32),
          ("optimizer", "0", "step"): (torch.Size([]), torch.float32)}
    check_moments(ok, named, tmp_path)
    for extra, needle in ((("optimizer", "1", "exp_avg"), "is the optimizer state of no parameter"),
                          (("optimizer", "0", "exp_avg_sq"), r"has shape \[10000000000000\], its parameter 'w' "
                                                             r"\[3, 2\]")):
        with pytest.raises(CheckpointError, match=needle):
            check_moments({**ok, extra: (torch.Size([10**13]), torch.float32)}, named, tmp_path)


@pytest.mark.parametrize("argv,needle", [
    (["--layout", "bogus", "--out", "{tmp}/x"], "argument --layout: invalid choice: 'bogus'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--layout", "single", "--out", "{tmp}/file/x"], "cannot be made: '{tmp}/file' is a file, not a directory"),
    (["--layout", "single", "--out", "{src}/inner"], "lies inside the checkpoint"),
    (["--out", "{tmp}/x"], "--out '{tmp}/x' is for --layout single|sharded, which is missing"),
])
def test_the_converter_refuses_bad_flags_in_one_line(runs, tmp_path, argv, needle):
    src = runs / "sharded" / "checkpoints" / "step_0000003"
    (tmp_path / "file").write_text("")
    fill = lambda s: s.replace("{tmp}", str(tmp_path)).replace("{src}", str(src))   # noqa: E731
    with pytest.raises(SystemExit) as exit_:
        convert_main([str(src), *map(fill, argv)])
    err = str(exit_.value.code)
    assert err.startswith("error: ") and fill(needle) in err and "\n" not in err, err
    assert not (tmp_path / "x").exists() and not (src / "inner").exists() and not (src / "inner.tmp").exists()
