"""The checkpoint directory layout, and finding a checkpoint from what a user typed.

    <run dir>/checkpoints/step_0001200/
        model.pt          inference artifact: EMA + raw weights, the resolved config, the data's meta
        train_state.pt    resume state (training/checkpoint.py writes it)
        rng_rank{r}.pt    each process's RNG streams

Sampling, checkpoint benchmarking and resuming all accept a run directory (its latest checkpoint), a
step directory or its model.pt; `find_checkpoint` is the one place that turns those into a step dir.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

PathLike = Union[str, Path]
STEP_DIR = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.pt"


def checkpoint_dir(run_dir: PathLike, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def step_of(ckpt: PathLike) -> Optional[int]:
    """The step of a step_XXXXXXX directory (None for other names)."""
    match = STEP_DIR.match(Path(ckpt).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: PathLike) -> list[Path]:
    """Complete checkpoints of a run (a model.pt present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if step_of(p) is not None and (p / MODEL_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_checkpoint(spec: PathLike, key: str = "checkpoint") -> Path:
    """A step directory from a run directory (its latest checkpoint), a step directory or its model.pt.
    FileNotFoundError names `key`, the path and what is accepted."""
    path = Path(spec).expanduser()
    if path.name == MODEL_FILE and path.is_file():
        path = path.parent
    if (path / MODEL_FILE).is_file():
        return path
    found = list_checkpoints(path) if path.is_dir() else []
    if found:
        return found[-1]
    what = "does not exist" if not path.exists() else "holds no checkpoint (model.pt)"
    raise FileNotFoundError(f"{key}='{spec}': '{path}' {what}. Give a run directory, a "
                            f"checkpoints/step_XXXXXXX directory or its model.pt.")


def run_dir_of(checkpoint: PathLike) -> Path:
    """The run directory that holds a checkpoint (given as run dir, step dir or model.pt)."""
    path = Path(checkpoint)
    if path.name == MODEL_FILE:
        path = path.parent
    return path.parent.parent if path.parent.name == "checkpoints" else path


def load_model_file(ckpt: PathLike) -> dict[str, Any]:
    """The inference artifact of a checkpoint (a step dir or its model.pt), on the CPU."""
    path = Path(ckpt) / MODEL_FILE if Path(ckpt).is_dir() else Path(ckpt)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: '{path}' (expected …/checkpoints/step_XXXXXXX/model.pt).")
    return torch.load(path, map_location="cpu", weights_only=False)
