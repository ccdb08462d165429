"""Checkpoints of earlier versions (model.pt, train_state.pt, rng_rank{r}.pt: pickles) into today's format,
read only on the user's --trust with torch's restricted unpickler, and checked before anything is written.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from tread.checkpoint.files import (FORMAT, LEGACY_FILE, META_FILE, TRAIN_FILE, WEIGHT_FILES, CheckpointError,
                                     rng_file, step_of)
from tread.utils.io import atomic_write_json
from tread.schema.builders import TARGETS
from tread.utils.targets import check_targets, upgrade_targets
from tread.checkpoint.tensorfile import save_state, save_tensors

LEGACY_TRAIN, LEGACY_RNG = "train_state.pt", "rng_rank{}.pt"
CONVERT_TMP = ".convert.tmp"       # the new files, until all are written
# numpy's array reconstruction: plain arrays, as np.random.get_state() holds; nothing that can call code
NUMPY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def legacy_dirs(path: Path) -> list[Path]:
    """Old-format step dirs of a run dir, or the step dir itself."""
    path = Path(path)
    if (path / LEGACY_FILE).is_file():
        return [path]
    root = path / "checkpoints"
    found = sorted(p for p in root.glob("step_*") if step_of(p) is not None and (p / LEGACY_FILE).is_file()) \
        if root.is_dir() else []
    if not found:
        raise CheckpointError(f"'{path}' holds no old-format checkpoint ({LEGACY_FILE}); give a run directory or a "
                              f"checkpoints/step_XXXXXXX directory.")
    return found


def restricted_load(path: Path) -> Any:
    """torch.load with weights_only=True (tensors, containers, numbers, numpy arrays); CheckpointError if the
    file names anything else."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - the restricted unpickler raises several kinds; all mean "refused"
        raise CheckpointError(f"'{path}' was not converted: it holds more than tensors and plain data, or is "
                              f"damaged ({str(err).splitlines()[0][:300]}). Nothing in it was run.") from None


def rank_files(step_dir: Path) -> dict[int, Path]:
    """{rank: rng_rank<rank>.pt}; CheckpointError for a file of that pattern whose rank is not a number."""
    found = {}
    for old in sorted(step_dir.glob(LEGACY_RNG.format("*"))):
        rank = old.name[len("rng_rank"):-len(".pt")]
        if not rank.isdigit():
            raise CheckpointError(f"'{old}' is not a random-stream file of an old checkpoint: expected rng_rank<N>.pt "
                                  f"with N a process rank (0, 1, ...). Rename or remove it; nothing was written.")
        found[int(rank)] = old
    return found


def _check_model(file: Path, model: Any) -> None:
    """An old model.pt: a config naming only our builders, an integer step and both weight mappings."""
    if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        raise CheckpointError(f"'{file}' is not a checkpoint of this project (no config).")
    check_targets(upgrade_targets(model["config"], TARGETS), TARGETS, f"checkpoint '{file.parent}'")
    missing = [k for k in ("step", *WEIGHT_FILES) if k not in model]
    if missing:
        raise CheckpointError(f"'{file}' has no {missing}: expected 'step' and the weights {list(WEIGHT_FILES)} "
                              f"({{parameter name: tensor}}) an old checkpoint holds. Nothing was written.")
    if not isinstance(model["step"], int) or isinstance(model["step"], bool) or model["step"] < 0:
        raise CheckpointError(f"'{file}' has step={model['step']!r}; expected an integer >= 0. Nothing was written.")
    for key in WEIGHT_FILES:
        weights = model[key]
        if not isinstance(weights, dict) or not weights or \
                not all(isinstance(k, str) and torch.is_tensor(v) for k, v in weights.items()):
            raise CheckpointError(f"'{file}' key '{key}' is {type(weights).__name__}{' (empty)' if not weights else ''}"
                                  f"; expected the weights: {{parameter name: tensor}}. Nothing was written.")


def read_legacy(step_dir: Path) -> tuple[dict, Optional[Any], dict[int, Any]]:
    """Every old file of a step dir, read (restricted_load) and checked before anything is written:
    (model.pt's checkpoint, train_state.pt's state or None, {rank: rng_rank<rank>.pt's streams})."""
    ranks = rank_files(step_dir)
    model = restricted_load(step_dir / LEGACY_FILE)
    _check_model(step_dir / LEGACY_FILE, model)
    train = restricted_load(step_dir / LEGACY_TRAIN) if (step_dir / LEGACY_TRAIN).is_file() else None
    return model, train, {rank: restricted_load(old) for rank, old in ranks.items()}


def _write_new(step_dir: Path, model: dict, train: Optional[Any], rngs: dict[int, Any]) -> None:
    """The safetensors files, written into a temporary folder beside the old files and moved in when all are
    written: a failure (a state that a state file cannot hold, a full disk) leaves the step dir as it was."""
    tmp = step_dir / CONVERT_TMP
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for key, name in WEIGHT_FILES.items():
            save_tensors(model[key], tmp / name)
        if train is not None:
            save_state(train, tmp / TRAIN_FILE)
        for rank, state in rngs.items():
            save_state(state, tmp / rng_file(rank))
    except TypeError as err:                        # save_state: "cannot store a <type> in a state file"
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"'{step_dir}' was not converted: {err}. Nothing was written.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for new in tmp.iterdir():
        os.replace(new, step_dir / new.name)
    tmp.rmdir()


def convert(step_dir: Path, remove_pickles: bool = False) -> Path:
    """Write the new-format files of one old step dir; returns it. Every old file is read and checked first,
    then the new files are written (checkpoint.json last): a refused or failed conversion writes nothing."""
    model, train, rngs = read_legacy(step_dir)
    _write_new(step_dir, model, train, rngs)
    atomic_write_json(step_dir / META_FILE, {"format": FORMAT, "step": int(model["step"]), "config": model["config"],
                                             "data_meta": model.get("data_meta", {}),
                                             "adapter_only": bool(model.get("adapter_only"))})
    if remove_pickles:
        for old in [step_dir / LEGACY_FILE, step_dir / LEGACY_TRAIN, *step_dir.glob(LEGACY_RNG.format("*"))]:
            old.unlink(missing_ok=True)
    return step_dir
