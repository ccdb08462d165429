"""Convert a checkpoint between the single and sharded layouts (checkpoint.layout; scripts/convert_checkpoint.py
--layout), in one process on the CPU. The result resumes at any process count, the source is never changed,
and OUT is written as OUT.tmp and renamed when complete.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tread.checkpoint.files import (META_FILE, TRAIN_FILE, WEIGHT_FILES, CheckpointError, find_checkpoint,
                                     is_sharded_checkpoint, load_model_file, read_meta, tmp_dir)
from tread.utils.io import atomic_write_json, file_in_the_way, unwritable_dir
from tread.utils.readers import read_json
from tread.checkpoint.sharded import SHARDED_DIR, ShardedFileError, full_tensors, save_sharded
from tread.checkpoint.tensorfile import StateFileError, load_state, save_state, save_tensors

LAYOUTS = ("single", "sharded")
KEPT_AS_IS = ("rng_rank*.safetensors", "adapter_model.safetensors", "pytorch_lora_weights.safetensors")


def convert_layout(source: Path, out: Path, layout: str) -> Path:
    """Write the checkpoint `source` (a step dir, or a run dir's latest) in `layout` as the step dir `out`."""
    src = find_checkpoint(source, "checkpoint")
    meta = read_meta(src)                                 # a checkpoint of ours, naming only our builders
    current = "sharded" if is_sharded_checkpoint(src, meta) else "single"
    if layout not in LAYOUTS or layout == current:
        raise CheckpointError(f"--layout {layout}: '{src}' is {current}; allowed: "
                              f"{' or '.join(x for x in LAYOUTS if x != current)}")
    out = Path(out)
    check_out(src, out)
    tmp = tmp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (to_sharded if layout == "sharded" else to_single)(src, tmp)
        for pattern in KEPT_AS_IS:
            for f in src.glob(pattern):
                shutil.copy2(f, tmp / f.name)
        meta = read_json(src / META_FILE, "", "a checkpoint description (JSON)", CheckpointError)
        atomic_write_json(tmp / META_FILE, {**meta, "layout": layout})
    except (StateFileError, ShardedFileError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint '{src}': {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    return out


def check_out(src: Path, out: Path) -> None:
    """--out is a new directory that can be made, outside the checkpoint it converts."""
    if out.exists():
        raise CheckpointError(f"--out '{out}' exists; give a new directory (nothing was overwritten)")
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise CheckpointError(f"--out '{out}' cannot be made: '{blocker}' is a file, not a directory; give a new "
                              f"directory")
    if out.resolve().is_relative_to(src.resolve()):
        raise CheckpointError(f"--out '{out}' lies inside the checkpoint '{src}' it converts; give a new directory "
                              f"outside it (the source is never changed)")
    unwritable = unwritable_dir(out.parent)
    if unwritable is not None:
        raise CheckpointError(f"--out '{out}' cannot be written: '{unwritable[0]}': {unwritable[1].strerror}")


def to_sharded(src: Path, dst: Path) -> None:
    weights = load_model_file(src)
    train = load_state(src / TRAIN_FILE)
    optimizer = train.pop("optimizer")
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for index, entries in optimizer["state"].items():
        plain = [k for k, v in entries.items() if not torch.is_tensor(v)]
        if plain:
            raise CheckpointError(f"checkpoint '{src}': optimizer state {plain} of parameter {index} is not a tensor; "
                                  f"the sharded layout holds tensors only")
        moments[str(index)] = dict(entries)
    save_sharded({"model": weights["model"], "ema": weights["ema"], "optimizer": moments}, dst / SHARDED_DIR)
    save_state({**train, "optimizer_groups": optimizer["param_groups"]}, dst / TRAIN_FILE)


def to_single(src: Path, dst: Path) -> None:
    tensors = full_tensors(src / SHARDED_DIR, ("model", "ema", "optimizer"))
    train: dict[str, Any] = load_state(src / TRAIN_FILE)
    groups = train.pop("optimizer_groups")
    train.pop("optimizer_params", None)
    state = {int(i): entries for i, entries in tensors["optimizer"].items()}
    for key, name in WEIGHT_FILES.items():
        save_tensors(tensors[key], dst / name)
    save_state({**train, "optimizer": {"state": dict(sorted(state.items())), "param_groups": groups}},
               dst / TRAIN_FILE)
