"""Checkpoints of a training run: TrainingState written as a directory of safetensors files (layout and the
reading side: tread/utils/checkpoints.py), atomically, never with non-finite weights.

A checkpoint is written as step_XXXXXXX.tmp, checkpoint.json last, and renamed when complete, so a crash
never leaves one that looks finished. Old checkpoints are pruned by renaming them to *.trash first, so a
crash during pruning leaves nothing that looks like a checkpoint; `clean_run_dir` removes such leftovers
at the next start. A failed write (disk full, permissions) removes its temp directory, keeps the previous
checkpoint and ends the run with an error naming the path and the cause.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator

from tread.models.lora import adapter_state_dict, has_lora
from tread.models.lora_export import diffusers_lora
from tread.training.fsdp import gathered, is_sharded
from tread.training.state import TrainingState
from tread.utils.checkpoints import (FORMAT, LEGACY_FILE, META_FILE, TRAIN_FILE, WEIGHT_FILES, CheckpointError,
                               checkpoint_dir, find_checkpoint, latest_legacy, list_checkpoints, load_model_file,
                               rng_file, step_of)
from tread.utils.distributed import any_rank
from tread.utils.errors import UserError
from tread.utils.io import atomic_write_json
from tread.utils.tensorfile import StateFileError, load_state, save_state, save_tensors


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (disk full, permissions, non-finite weights)."""


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def trash_dir(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name + ".trash")


def save_checkpoint(accelerator: Accelerator, run_dir: Path, state: TrainingState, config: dict, data_meta: dict,
                    keep_last: Optional[int], trainable: Optional[set[str]]) -> Path:
    """Every process saves its RNG; the main process writes the weights, the resume state and
    checkpoint.json, renames the directory into place and prunes old checkpoints. `trainable`
    (adapter-only checkpoints) limits the saved weights to those names. Every process raises
    CheckpointWriteError if any process failed, after the partial directory is removed."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = tmp_dir(final)
    full = state.state_dict()
    if trainable is not None:   # adapter-only: what is written is what is checked (a quantized base has no isfinite)
        full.update({k: {n: v for n, v in full[k].items() if n in trainable} for k in WEIGHT_FILES})
    agree_finite(full, state.step)
    accelerator.wait_for_everyone()
    failure = _try(lambda: _write_rng(tmp, full["rng"], accelerator.process_index), tmp)
    # The adapter export reads the EMA module itself: a sharded one is gathered on every process first.
    with gathered(state.ema_model, when=is_sharded(state.ema_model) and has_lora(state.model)):
        if not any_rank(failure is not None) and accelerator.is_main_process:
            failure = _try(lambda: _write_main(tmp, final, state, full, config, data_meta, trainable), tmp)
    if any_rank(failure is not None):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(run_dir)
        raise CheckpointWriteError(f"{failure or 'another process failed to write its part of the checkpoint'}; "
                                   f"the previous checkpoint ({previous[-1] if previous else 'none'}) is kept.")
    if accelerator.is_main_process:
        finalize(final, keep_last)
    accelerator.wait_for_everyone()
    return final


def _try(write, tmp: Path) -> Optional[str]:
    """None if write() succeeded, else what failed, for the error line."""
    try:
        write()
        return None
    except OSError as err:
        cause = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
                 errno.EROFS: "read-only file system"}.get(err.errno, err.strerror or str(err))
        return f"could not write checkpoint '{err.filename or tmp}': {cause} ({err})"


def _write_rng(tmp: Path, rng: dict, rank: int) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    save_state(rng, tmp / rng_file(rank))


def _write_main(tmp: Path, final: Path, state: TrainingState, full: dict, config: dict, data_meta: dict,
                trainable: Optional[set[str]]) -> None:
    for key, name in WEIGHT_FILES.items():
        weights = full[key] if trainable is None else {n: v for n, v in full[key].items() if n in trainable}
        save_tensors(weights, tmp / name)
    save_state({k: full[k] for k in ("step", "train_sec", "optimizer", "loader", "world_size")}, tmp / TRAIN_FILE)
    if has_lora(state.model):  # the EMA adapter alone: for diffusers pipelines, and in peft's format
        export_adapter(state.ema_model, tmp)
    atomic_write_json(tmp / META_FILE, {"format": FORMAT, "step": state.step, "config": config,
                                        "data_meta": data_meta, "adapter_only": trainable is not None})


def check_finite(full: dict[str, Any], step: int) -> None:
    """Refuse to write weights or EMA weights with NaN/inf (the run stops; earlier checkpoints stay). One host
    sync per state dict."""
    for key in ("model", "ema"):
        names = [n for n, t in full[key].items() if t.is_floating_point()]
        finite = torch.stack([torch.isfinite(full[key][n]).all() for n in names]).cpu() if names else None
        if finite is not None and not finite.all():
            name = names[int((~finite).nonzero()[0])]
            raise CheckpointWriteError(
                f"not writing the checkpoint of step {step}: the {key} weight '{name}' holds non-finite values "
                f"(see train.nonfinite); the earlier checkpoints are kept.")


def agree_finite(full: dict[str, Any], step: int) -> None:
    """check_finite on every process, and every process raises if any did: with train.parallel=fsdp only rank 0
    holds the gathered weights (with DDP all hold the same ones and agree anyway)."""
    try:
        check_finite(full, step)
        failure = None
    except CheckpointWriteError as err:
        failure = err
    if any_rank(failure is not None):
        raise failure or CheckpointWriteError(f"not writing the checkpoint of step {step}: another process found "
                                              f"non-finite weights (see train.nonfinite); the earlier checkpoints "
                                              f"are kept.")


def finalize(final: Path, keep_last: Optional[int]) -> None:
    """Rename the complete temp dir into place (replacing a checkpoint of the same step) and prune old ones,
    never the newest."""
    if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
        _remove(final)
    os.replace(tmp_dir(final), final)
    if keep_last:
        for old in list_checkpoints(final.parent.parent)[:-max(1, keep_last)]:
            _remove(old)


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint dir: renamed first, so a crash midway leaves a *.trash dir, not a broken step."""
    trash = trash_dir(ckpt)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(ckpt, trash)
    shutil.rmtree(trash)


def clean_run_dir(run_dir: Path) -> list[str]:
    """Remove what interrupted launches leave in checkpoints/: temp dirs of unfinished writes, *.trash dirs of
    unfinished pruning and step dirs without checkpoint.json (nor an old-format model.pt). Returns their names."""
    root = Path(run_dir) / "checkpoints"
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        leftover = path.name.endswith((".tmp", ".trash")) or (
            step_of(path) is not None and not (path / META_FILE).exists() and not (path / LEGACY_FILE).exists())
        if leftover and path.is_dir():
            shutil.rmtree(path)
            removed.append(path.name)
    return removed


def read_checkpoint(ckpt: Path, rank: int) -> dict[str, Any]:
    """Everything a resume needs from a checkpoint dir, read and checked before any of it is applied.
    CheckpointError when a file is missing, truncated or corrupt, or the config names foreign code."""
    model_file = load_model_file(ckpt)
    try:
        train = load_state(Path(ckpt) / TRAIN_FILE)
        rng_path = Path(ckpt) / rng_file(rank)
        rng = load_state(rng_path) if rng_path.is_file() else None
    except StateFileError as err:
        raise CheckpointError(f"checkpoint '{ckpt}': {err}") from None
    return {**train, "model": model_file["model"], "ema": model_file["ema"], "rng": rng,
            "adapter_only": bool(model_file.get("adapter_only")), "config": model_file["config"]}


def resume_candidates(resume: Optional[str], run_dir: Path) -> list[Path]:
    """`resume` (null | auto | PATH) -> checkpoint dirs to try, newest first (auto falls back to older ones
    when the newest is corrupt); [] for a fresh run."""
    if resume in (None, "", "null", "none"):
        return []
    if resume == "auto":
        found = list_checkpoints(run_dir)
        if not found and latest_legacy(run_dir) is not None:
            find_checkpoint(run_dir, "resume")    # raises: old format, with the converter's command
        return found[::-1]
    try:
        return [find_checkpoint(resume, "resume")]
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} Use resume=auto to continue the latest checkpoint in hydra.run.dir.") from None


# The EMA adapter of adapter runs, beside the checkpoint's weights. The first name is diffusers' default LoRA file
# name, so `pipe.load_lora_weights(<step dir>)` picks it among the other .safetensors files of the directory.
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
PEFT_ADAPTER_FILE = "adapter_model.safetensors"


def export_adapter(model: torch.nn.Module, directory: Path) -> None:
    """Write the adapter of `model`'s diffusers transformer twice: as the exact plain LoRA that diffusers
    pipelines load (DIFFUSERS_LORA_FILE, tread/models/lora_export.py; LoKr and LoHa too) and in peft's own format for
    its type (PEFT_ADAPTER_FILE, keys relative to the transformer, peft's config in the metadata)."""
    target = getattr(model, "transformer", model)
    tensors, metadata = diffusers_lora(target)
    save_tensors(tensors, Path(directory) / DIFFUSERS_LORA_FILE, metadata=metadata)
    save_tensors(adapter_state_dict(target), Path(directory) / PEFT_ADAPTER_FILE,
                 metadata={"format": "pt", "peft_config": json.dumps(target.peft_config["default"].to_dict(),
                                                                      default=list, sort_keys=True)})
