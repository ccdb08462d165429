"""Checkpoints of earlier versions (model.pt, train_state.pt, rng_rank{r}.pt: pickles) into today's format.

Loading a pickle can run code the file names, so the training and sampling paths never read these files.
This converter reads them once, on the user's explicit word (scripts/convert_checkpoint.py --trust), and
even then only with torch's restricted unpickler (`weights_only=True`) plus numpy's array reconstruction
(the old random-stream files hold numpy state): a file that names any other code is refused, not run.
The config inside must name only the project's builders. The new files are written next to the old ones,
checkpoint.json last; the pickles are left in place unless asked to remove them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tread.utils.checkpoints import (FORMAT, LEGACY_FILE, META_FILE, TRAIN_FILE, WEIGHT_FILES, CheckpointError,
                                     rng_file, step_of)
from tread.utils.io import atomic_write_json
from tread.utils.targets import PROJECT_TARGETS, check_targets, upgrade_targets
from tread.utils.tensorfile import save_state, save_tensors

LEGACY_TRAIN, LEGACY_RNG = "train_state.pt", "rng_rank{}.pt"
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


def convert(step_dir: Path, remove_pickles: bool = False) -> Path:
    """Write the new-format files of one old step dir; returns it."""
    model = restricted_load(step_dir / LEGACY_FILE)
    if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        raise CheckpointError(f"'{step_dir / LEGACY_FILE}' is not a checkpoint of this project (no config).")
    check_targets(upgrade_targets(model["config"]), PROJECT_TARGETS, f"checkpoint '{step_dir}'")
    for key, name in WEIGHT_FILES.items():
        save_tensors(model[key], step_dir / name)
    if (step_dir / LEGACY_TRAIN).is_file():
        save_state(restricted_load(step_dir / LEGACY_TRAIN), step_dir / TRAIN_FILE)
    for old in sorted(step_dir.glob(LEGACY_RNG.format("*"))):
        rank = int(old.name[len("rng_rank"):-len(".pt")])
        save_state(restricted_load(old), step_dir / rng_file(rank))
    atomic_write_json(step_dir / META_FILE, {"format": FORMAT, "step": int(model["step"]), "config": model["config"],
                                             "data_meta": model.get("data_meta", {}),
                                             "adapter_only": bool(model.get("adapter_only"))})
    if remove_pickles:
        for old in [step_dir / LEGACY_FILE, step_dir / LEGACY_TRAIN, *step_dir.glob(LEGACY_RNG.format("*"))]:
            old.unlink(missing_ok=True)
    return step_dir
