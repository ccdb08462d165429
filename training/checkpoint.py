"""Checkpoints as state_dict directories, written atomically.

checkpoints/step_0001200/
  model.pt           inference artifact: EMA + raw backbone weights and the resolved config
  train_state.pt     resume state: optimizer, step, data position, router state
  rng_rank{r}.pt     each process's RNG states (so every rank resumes its own stream)
A checkpoint directory is written as step_XXXX.tmp and renamed when complete, so a
crash never leaves a checkpoint that looks finished.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / "model.pt").is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """`resume` (null | auto | PATH) -> a checkpoint dir or None; clear errors for bad paths."""
    if resume in (None, "", "null", "none"):
        return None
    if resume == "auto":
        ckpts = list_checkpoints(run_dir)
        return ckpts[-1] if ckpts else None
    path = Path(resume).expanduser()
    if path.is_file():
        path = path.parent
    if (path / "model.pt").is_file():
        return path
    ckpts = list_checkpoints(path)
    if ckpts:
        return ckpts[-1]
    raise FileNotFoundError(
        f"resume={resume!r}: no checkpoint found there. Expected a checkpoint directory "
        f"(…/checkpoints/step_XXXXXXX with model.pt) or a run directory containing checkpoints/; "
        f"use resume=auto to continue the latest checkpoint in hydra.run.dir."
    )


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_rank_rng(ckpt_tmp: Path, rank: int, extra: dict[str, Any]) -> None:
    """Every process writes its RNG streams into the (still temporary) checkpoint dir."""
    ckpt_tmp.mkdir(parents=True, exist_ok=True)
    _atomic_save({**rng_state(), **extra}, ckpt_tmp / f"rng_rank{rank}.pt")


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def finalize(final: Path, model_state: dict[str, Any], train_state: dict[str, Any], keep_last: Optional[int]) -> None:
    """Main process: write model + train state into the temp dir, rename it, prune old ones."""
    tmp = tmp_dir(final)
    tmp.mkdir(parents=True, exist_ok=True)
    _atomic_save(model_state, tmp / "model.pt")
    _atomic_save(train_state, tmp / "train_state.pt")
    if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last:
        for old in list_checkpoints(final.parent.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def load_model_file(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / "model.pt" if Path(ckpt).is_dir() else Path(ckpt)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: '{path}' (expected …/checkpoints/step_XXXXXXX/model.pt).")
    return torch.load(path, map_location="cpu", weights_only=False)


def load_train_state(ckpt: Path, rank: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    state = torch.load(Path(ckpt) / "train_state.pt", map_location="cpu", weights_only=False)
    rng_path = Path(ckpt) / f"rng_rank{rank}.pt"
    rng = torch.load(rng_path, map_location="cpu", weights_only=False) if rng_path.is_file() else None
    return state, rng


def model_weights(model: torch.nn.Module, trainable: Optional[set[str]]) -> dict[str, torch.Tensor]:
    """The state dict to save: all of it, or (adapter-only checkpoints) just the `trainable` names."""
    state = model.state_dict()
    return state if trainable is None else {k: v for k, v in state.items() if k in trainable}


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], adapter_only: bool = False,
                       where: str = "checkpoint") -> None:
    """Load full weights strictly, or adapter-only weights over a freshly built base (model.pretrained or the
    seeded initialisation); every key of an adapter-only checkpoint must exist in the model."""
    if not adapter_only:
        model.load_state_dict(weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise ValueError(f"{where}: adapter weights {sorted(unexpected)[:5]} do not exist in the model built from its "
                         f"config; was model.lora changed?")
    lora = [k for k in missing if "lora_" in k]
    if lora:
        raise ValueError(f"{where}: adapter-only checkpoint lacks adapter weights {sorted(lora)[:5]}.")
