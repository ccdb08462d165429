"""Checkpoints that cannot run code, survive crashes and never hold non-finite weights; resume hygiene."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from tread.data.loader import ShardedBatchSampler
from tread.sampling import load_for_inference
from tread.checkpoint.legacy import convert
from tread.checkpoint.files import clean_run_dir
from tread.runtime.run_dir import trim_metrics
from tread.checkpoint import save as ckpt_mod
from tread.checkpoint.save import CheckpointWriteError, finalize
from tread.training.guard import NonFiniteError
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.checkpoint.files import (CheckpointError, find_checkpoint, list_checkpoints, load_model_file, step_of,
                                     tmp_dir)
from tread.schema.builders import CHOICES, TARGETS
from tread.schema.model import DiTModel, FamilyModel
from tread.utils.targets import TargetError
from tread.checkpoint.tensorfile import StateFileError, load_state, save_state

QUIET = ["eval.every_steps=0", "eval.at_end=false"]


def weights(run: Path, key: str = "model") -> dict[str, torch.Tensor]:
    return load_model_file(list_checkpoints(run)[-1])[key]


def test_state_file_round_trip_without_pickle(tmp_path):
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), fused=True)
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()
    tied = torch.randn(5)
    state = {"opt": opt.state_dict(), "np": np.random.get_state(), "py": random.getstate(), "nan": float("nan"),
             "tied": [tied, tied], "int_keys": {3: "a"}, "__odd": (1, None)}
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.999) and set(back["opt"]["state"]) == {0, 1}
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], state["np"][1])
    assert back["py"] == state["py"] and np.isnan(back["nan"]) and back["int_keys"] == {3: "a"}
    assert back["__odd"] == (1, None) and torch.equal(back["tied"][1], tied)
    opt.load_state_dict(back["opt"])
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "s.safetensors").read_bytes()[:-100])
    with pytest.raises(StateFileError, match="truncated or corrupt"):
        load_state(tmp_path / "cut.safetensors")


def test_each_target_builds_and_checks_as_its_table_says():
    """The one table per section is what the schema checks by and what a checkpoint may name."""
    for section, table in CHOICES.items():
        assert TARGETS[section] == tuple(table)
        for name, choice in table.items():
            assert name in typing.get_args(choice.section.model_fields["target"].annotation)
    assert {c.section for c in CHOICES["model"].values()} == {DiTModel, FamilyModel}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4 (copied by tests that change it)."""
    from conftest import TINY, compose_cfg, shared_cache

    run = tmp_path_factory.mktemp("trained") / "run"
    train(compose_cfg("train", TINY + [f"paths.cache_dir={shared_cache(tmp_path_factory)}", *QUIET,
                                       "checkpoint.keep_last=null"]), run)
    return run


def copy_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def test_no_pickle_in_a_checkpoint(trained):
    names = sorted(p.name for p in list_checkpoints(trained)[-1].iterdir())
    assert names == ["checkpoint.json", "ema.safetensors", "model.safetensors", "rng_rank0.safetensors",
                     "train_state.safetensors"]


def test_foreign_target_in_a_checkpoint_is_refused(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    meta_file = list_checkpoints(run)[-1] / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    victim = tmp_path / "written_by_checkpoint"
    meta["config"]["model"] = {"_target_": "pathlib.Path.write_text", "self": str(victim), "data": "pwned"}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(TargetError, match="model._target_='pathlib.Path.write_text' is not one of the project's"):
        load_for_inference(run)
    assert not victim.exists()


def test_checkpoints_from_before_the_tread_package_load_and_resume(trained, tmp_path, tiny_cfg):
    """Checkpoints written when the packages were top-level name their builders without the `tread.` prefix
    (models.build_dit, diffusion.EDM): they load for sampling and resume with no spurious config change."""
    run = copy_run(trained, tmp_path)
    for step_dir in list_checkpoints(run):
        meta = json.loads((step_dir / "checkpoint.json").read_text())
        for section in ("model", "diffusion"):
            meta["config"][section]["_target_"] = meta["config"][section]["_target_"].removeprefix("tread.")
        (step_dir / "checkpoint.json").write_text(json.dumps(meta))
    assert json.loads((list_checkpoints(run)[-1] / "checkpoint.json").read_text())["config"]["model"]["_target_"] \
        == "models.build_dit"
    net, diffusion, _, config = load_for_inference(run)
    assert config.model.target == "tread.models.build_dit" and type(diffusion).__name__ == "EDM"
    summary = train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "checkpoint.keep_last=null"), run)
    assert summary["start_step"] == 4 and summary["config_changes"] == {"train.max_steps": [4, 6]}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(trained, tmp_path, tiny_cfg, capsys):
    run = copy_run(trained, tmp_path)
    newest = list_checkpoints(run)[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    summary = train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "checkpoint.keep_last=null"), run)
    out = capsys.readouterr()
    assert "step_0000004" in out.err + out.out and "trying the previous checkpoint" in out.err + out.out
    assert summary["start_step"] == 2 and summary["final_step"] == 6
    steps = [r["step"] for r in read_metrics(run) if r["type"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_refuses_another_architecture_and_lists_other_changes(trained, tmp_path, tiny_cfg):
    run = copy_run(trained, tmp_path)
    with pytest.raises(Exception, match=r"model.arch: 'DiT-T/4' -> 'DiT-S/4'"):
        train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "model.arch=DiT-S/4"), run)
    with pytest.raises(Exception, match=r"would change the optimizer \(torch.optim.AdamW -> torchao.optim.AdamW8bit\)"):
        train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "optimizer=adamw8bit"), run)
    summary = train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "train.batch_size=4",
                             "routing.routes.0.selection_ratio=0.25"), run)
    assert summary["config_changes"]["train.batch_size"] == [8, 4]
    assert summary["config_changes"]["routing.routes[0].selection_ratio"] == [0.5, 0.25]


def test_leftovers_of_interrupted_launches_are_cleaned(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    root = run / "checkpoints"
    (root / "step_0000006.tmp").mkdir()
    (root / "step_0000001.trash").mkdir()
    half = root / "step_0000003"
    half.mkdir()
    (half / "ema.safetensors").write_bytes(b"x")
    assert clean_run_dir(run) == ["step_0000001.trash", "step_0000003", "step_0000006.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002", "step_0000004"]


def test_pruning_keeps_the_newest_and_never_breaks_a_step_dir(trained, tmp_path, monkeypatch):
    run = copy_run(trained, tmp_path)
    shutil.copytree(list_checkpoints(run)[-1], tmp_dir(run / "checkpoints" / "step_0000006"))
    removed = []
    real_rmtree = shutil.rmtree

    def crash_midway(path, *a, **k):  # a crash during pruning: the dir is already renamed away
        removed.append(Path(path).name)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        finalize(run / "checkpoints" / "step_0000006", keep_last=1)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real_rmtree)
    assert removed == ["step_0000002.trash"]
    assert [p.name for p in list_checkpoints(run)] == ["step_0000004", "step_0000006"]
    assert clean_run_dir(run) == ["step_0000002.trash"]


def test_failed_write_says_where_and_why_and_keeps_the_previous(trained, tmp_path, tiny_cfg, monkeypatch):
    run = copy_run(trained, tmp_path)
    real = ckpt_mod.save_tensors

    def disk_full(tensors, path, *a, **k):
        if "step_0000006" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt_mod, "save_tensors", disk_full)
    with pytest.raises(CheckpointWriteError, match=r"step_0000006.tmp/model.safetensors': disk full .* previous "
                                                   r"checkpoint .*step_0000004\) is kept"):
        train(tiny_cfg(*QUIET, "train.max_steps=6", "resume=auto", "checkpoint.keep_last=1"), run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def nan_data(cache_dir: Path, tmp_path: Path, index: int) -> Path:
    """A copy of the tiny built-in data with one NaN value in sample `index`."""
    src = next(cache_dir.glob("toy_shapes_r16_n40_s0"))
    dst = tmp_path / "nan_data"
    shutil.copytree(src, dst)
    latents = np.load(dst / "latents.npy")
    latents[index, 0, 3, 3] = np.nan
    np.save(dst / "latents.npy", latents)
    return dst


def data_at(path: Path) -> list[str]:
    return [f"data.path={path}", "data.builtin=null", "data.resolution=16", "~data.builtin_args"]


def test_one_nan_sample_is_skipped_and_never_checkpointed(trained, tiny_cfg, cache_dir, tmp_path):
    """With data.allow_nonfinite=true (a start refuses such data otherwise: tests/test_dataset_integrity.py) the
    guard skips the step that draws the NaN sample: the one the data order (train.seed=0) puts in step 3's batch,
    so that 8 steps meet it and checkpoints come before and after it."""
    index = int(ShardedBatchSampler(400, 8, seed=0).epoch_indices(0)[2 * 8 + 5])
    data = nan_data(cache_dir, tmp_path, index=index)
    run = tmp_path / "nan_run"
    with pytest.warns(UserWarning, match="latents.npy"):
        summary = train(tiny_cfg(*QUIET, *data_at(data), "data.allow_nonfinite=true", "train.max_steps=8",
                                 "train.seed=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2"), run)
    assert summary["status"] == "completed" and summary["nonfinite_skips"] == 1
    records = [r for r in read_metrics(run) if r["type"] == "train"]
    assert sum(r["nonfinite_skips"] for r in records) == summary["nonfinite_skips"]
    assert all(np.isfinite(r["loss"]) for r in records if not r["nonfinite_skips"])   # one step per record:
    assert all(r["loss"] is None for r in records if r["nonfinite_skips"])            # no finite loss to show
    for ckpt in list_checkpoints(run):
        for key in ("model", "ema"):
            assert all(torch.isfinite(t).all() for t in load_model_file(ckpt)[key].values())


def test_nonfinite_stop_ends_the_run_and_keeps_the_finite_checkpoints(tiny_cfg, cache_dir, tmp_path):
    run = tmp_path / "stop_run"
    cfg = tiny_cfg(*QUIET, "train.max_steps=8", "train.nonfinite=stop", "optimizer.lr=1e30", "train.grad_clip=null")
    with pytest.raises(NonFiniteError, match="train.nonfinite=stop"):
        train(cfg, run)
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    for ckpt in list_checkpoints(run):
        assert all(torch.isfinite(t).all() for t in load_model_file(ckpt)["model"].values())


def test_trim_metrics_keeps_each_step_once(tmp_path):
    lines = [{"type": "train", "step": s} for s in (1, 2, 3, 4)] + [{"type": "eval", "step": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "tr')
    assert trim_metrics(tmp_path, 2) == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def legacy_checkpoint(step_dir: Path, payload: object | None = None) -> None:
    """A checkpoint as earlier versions wrote it (torch.save pickles)."""
    src = find_checkpoint(step_dir.parent.parent)
    model = load_model_file(src)
    step_dir.mkdir(parents=True)
    step = step_of(step_dir)              # the step its directory names (a converted checkpoint is checked for it)
    torch.save(payload if payload is not None else {**{k: model[k] for k in ("config", "data_meta", "model", "ema",
                                                                            "adapter_only")}, "step": step},
               step_dir / "model.pt")
    torch.save({**load_state(src / "train_state.safetensors"), "step": step}, step_dir / "train_state.pt")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               step_dir / "rng_rank0.pt")


class Payload:
    """Unpickling this runs os.system: what a planted checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_old_checkpoints_are_refused_then_converted(trained, tmp_path, tiny_cfg):
    run = copy_run(trained, tmp_path)
    old = run / "checkpoints" / "step_0000008"
    legacy_checkpoint(old)
    with pytest.raises(CheckpointError, match="old pickle format .*convert_checkpoint.py .* --trust"):
        find_checkpoint(old)
    only_old = tmp_path / "only_old"
    shutil.copytree(old, only_old / "checkpoints" / old.name)
    with pytest.raises(CheckpointError, match="old pickle format"):
        train(tiny_cfg(*QUIET, "resume=auto"), only_old)
    with pytest.raises(FileExistsError, match="already holds checkpoints"):   # never started over, nor overwritten
        train(tiny_cfg(*QUIET), only_old)
    assert sorted(p.name for p in (only_old / "checkpoints" / old.name).iterdir()) == [
        "model.pt", "rng_rank0.pt", "train_state.pt"]
    convert(old)
    assert find_checkpoint(run) == old and load_model_file(old)["step"] == 8
    converted, original = load_model_file(old)["model"], weights(trained)
    assert converted.keys() == original.keys() and all(torch.equal(converted[k], original[k]) for k in original)


def test_pickle_payload_is_never_run(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    marker = tmp_path / "payload_ran"
    old = run / "checkpoints" / "step_0000008"
    legacy_checkpoint(old, payload={"config": {}, "x": Payload(marker)})
    with pytest.raises(CheckpointError):
        find_checkpoint(old)
    with pytest.raises(CheckpointError, match="not converted.*Nothing in it was run"):
        convert(old)
    assert not marker.exists()


def test_the_converter_reads_nothing_without_trust(trained, tmp_path, capsys):
    from tread.cli.convert_checkpoint import main as convert_cli

    run = copy_run(trained, tmp_path)
    old = run / "checkpoints" / "step_0000008"
    legacy_checkpoint(old)
    with pytest.raises(SystemExit, match="error: --trust is missing: .* 1 old checkpoint"):
        convert_cli([str(run)])
    assert not (old / "checkpoint.json").exists()
    assert convert_cli([str(run), "--trust", "--remove-pickles"]) == [old]
    assert sorted(p.name for p in old.iterdir()) == ["checkpoint.json", "ema.safetensors", "model.safetensors",
                                                    "rng_rank0.safetensors", "train_state.safetensors"]
