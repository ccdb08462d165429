"""Checkpoints of a training run: TrainingState written as a directory (layout: utils/checkpoints.py), atomically.

A checkpoint is written as step_XXXXXXX.tmp and renamed when complete, so a crash never leaves one that
looks finished. model.pt holds what sampling needs (EMA + raw backbone weights, the resolved config and the
data's meta), train_state.pt what resuming needs besides (optimizer, data position, step, training time),
and every process writes its own rng_rank{r}.pt.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from models.lora import adapter_state_dict, has_lora
from training.state import TrainingState
from utils.io import atomic_write
from utils.checkpoints import MODEL_FILE, checkpoint_dir, find_checkpoint, list_checkpoints, load_model_file

TRAIN_FILE = "train_state.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _atomic_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """`resume` (null | auto | PATH) -> a checkpoint dir or None; clear errors for bad paths."""
    if resume in (None, "", "null", "none"):
        return None
    if resume == "auto":
        ckpts = list_checkpoints(run_dir)
        return ckpts[-1] if ckpts else None
    try:
        return find_checkpoint(resume, "resume")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} Use resume=auto to continue the latest checkpoint in hydra.run.dir.") from None


def save_checkpoint(accelerator: Accelerator, run_dir: Path, state: TrainingState, config: dict, data_meta: dict,
                    keep_last: Optional[int], trainable: Optional[set[str]]) -> Path:
    """Every process saves its RNG; the main process writes the weights and the resume state, renames the
    directory into place and prunes old checkpoints. `trainable` (adapter-only checkpoints) limits the saved
    weights to those names."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = tmp_dir(final)
    accelerator.wait_for_everyone()
    full = state.state_dict()
    tmp.mkdir(parents=True, exist_ok=True)
    _atomic_save(full["rng"], tmp / rng_file(accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = {k: full[k] if trainable is None else {n: v for n, v in full[k].items() if n in trainable}
                   for k in ("model", "ema")}
        _atomic_save({"step": state.step, "config": config, "data_meta": data_meta, **weights,
                      "adapter_only": trainable is not None}, tmp / MODEL_FILE)
        _atomic_save({k: full[k] for k in ("step", "train_sec", "optimizer", "loader", "world_size")}, tmp / TRAIN_FILE)
        if has_lora(state.model):  # the EMA adapter alone in peft's format, for diffusers pipelines
            export_adapter(state.ema_model, tmp / "adapter_model.safetensors")
        finalize(final, keep_last)
    accelerator.wait_for_everyone()
    return final


def finalize(final: Path, keep_last: Optional[int]) -> None:
    """Rename the complete temp dir into place (replacing a checkpoint of the same step) and prune old ones."""
    if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
        shutil.rmtree(final)
    os.replace(tmp_dir(final), final)
    if keep_last:
        for old in list_checkpoints(final.parent.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(ckpt: Path, state: TrainingState, rank: int) -> None:
    """Restore `state` from a checkpoint directory (this process's RNG when the saved run had this rank)."""
    model_file = load_model_file(ckpt)
    train = torch.load(Path(ckpt) / TRAIN_FILE, map_location="cpu", weights_only=False)
    rng_path = Path(ckpt) / rng_file(rank)
    rng = torch.load(rng_path, map_location="cpu", weights_only=False) if rng_path.is_file() else None
    state.load_state_dict({**train, "model": model_file["model"], "ema": model_file["ema"], "rng": rng},
                          adapter_only=bool(model_file.get("adapter_only")), where=str(ckpt))


def export_adapter(model: torch.nn.Module, path: Path) -> None:
    """Write the LoRA adapter of `model`'s diffusers transformer as peft-format safetensors."""
    target = getattr(model, "transformer", model)
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(target).items()}, str(path))
