"""Writing a training run's checkpoints (single files or every process's shards, checkpoint.layout) atomically
and never with non-finite weights, and pruning old ones; docs/reliability.md, "Atomic checkpoints and exact
resume" and "Failed writes".
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

from tread.models.lora import adapter_state_dict, has_lora, is_adapter_param
from tread.models.lora_export import diffusers_lora
from tread.utils.dtensor import gathered_params, is_sharded, local
from tread.checkpoint.state import TrainingState
from tread.checkpoint.files import (FORMAT, META_FILE, TRAIN_FILE, WEIGHT_FILES, checkpoint_dir, list_checkpoints,
                                     rng_file, tmp_dir, trash_dir)
from tread.utils.distributed import any_rank
from tread.utils.errors import UserError
from tread.utils.finite import first_nonfinite
from tread.utils.io import atomic_write_json
from tread.checkpoint.sharded import SHARDED_DIR, ShardedWriteError, save_sharded
from tread.checkpoint.tensorfile import save_state, save_tensors


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (disk full, permissions, non-finite weights)."""


def save_checkpoint(accelerator: Accelerator, run_dir: Path, state: TrainingState, saved: dict, data_meta: dict,
                    keep_last: Optional[int], trainable: Optional[set[str]], sharded: bool = False) -> Path:
    """Save a checkpoint: every process its RNG (and, `sharded`, its shards), the main process the rest, then
    rename it into place and prune. `trainable` limits the saved weights to those names (adapter-only). Raises
    CheckpointWriteError on every process if any failed, after the partial directory is removed."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = tmp_dir(final)
    full, shards = checkpoint_state(state, trainable, sharded)
    accelerator.wait_for_everyone()
    failure = _try(lambda: _write_rng(tmp, full["rng"], accelerator.process_index), tmp)
    if shards is not None and not any_rank(failure is not None):
        failure = _try(lambda: save_sharded(shards, tmp / SHARDED_DIR), tmp)      # a collective
    # The adapter export reads the EMA module itself: a sharded one's adapters are gathered on every process first.
    adapters = [n for n, _ in state.ema_model.named_parameters() if is_adapter_param(n)] \
        if is_sharded(state.ema_model) and has_lora(state.model) else []
    with gathered_params(state.ema_model, adapters):
        if not any_rank(failure is not None) and accelerator.is_main_process:
            failure = _try(lambda: _write_main(tmp, state, full, saved, data_meta, trainable is not None,
                                                       shards is not None), tmp)
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


def checkpoint_state(state: TrainingState, trainable: Optional[set[str]], sharded: bool) -> tuple[dict, Optional[dict]]:
    """(what the main process writes, the tensors every process writes into the sharded folder or None), checked
    finite on every process first. Single-file: the full state (gathered on rank 0 under FSDP)."""
    if sharded:
        shards, plain = state.sharded_state(trainable)
        agree_finite({k: {n: local(t) for n, t in shards[k].items()} for k in WEIGHT_FILES}, state.step)
        return {**state.resume_state(), **plain}, shards
    full = state.state_dict()
    if trainable is not None:   # adapter-only: what is written is what is checked (a quantized base has no isfinite)
        full.update({k: {n: v for n, v in full[k].items() if n in trainable} for k in WEIGHT_FILES})
    agree_finite(full, state.step)
    return full, None


def _try(write, tmp: Path) -> Optional[str]:
    """None if write() succeeded, else what failed, for the error line."""
    try:
        write()
        return None
    except ShardedWriteError as err:        # a sharded write: DCP gathers every process's failure
        return f"could not write the sharded checkpoint '{tmp / SHARDED_DIR}': {err}"
    except OSError as err:
        cause = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
                 errno.EROFS: "read-only file system"}.get(err.errno, err.strerror or str(err))
        return f"could not write checkpoint '{err.filename or tmp}': {cause} ({err.strerror or err})"


def _write_rng(tmp: Path, rng: dict, rank: int) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    save_state(rng, tmp / rng_file(rank))


def _write_main(tmp: Path, state: TrainingState, full: dict, saved: dict, data_meta: dict,
                adapter_only: bool, sharded: bool) -> None:
    """The main process's files; `full` as checkpoint_state gives it (adapter-only weights already limited)."""
    if not sharded:
        for key, name in WEIGHT_FILES.items():
            save_tensors(full[key], tmp / name)
    keys = ("step", "train_sec", "tokens_sum", "tokens_steps", "loader", "world_size",
            *(("optimizer_groups", "optimizer_params") if sharded else ("optimizer",)))
    save_state({k: full[k] for k in keys}, tmp / TRAIN_FILE)
    if has_lora(state.model):  # the EMA adapter alone: for diffusers pipelines, and in peft's format
        export_adapter(state.ema_model, tmp)
    atomic_write_json(tmp / META_FILE, {"format": FORMAT, "step": state.step, "config": saved,
                                        "data_meta": data_meta, "adapter_only": adapter_only,
                                        "layout": "sharded" if sharded else "single"})


def check_finite(full: dict[str, Any], step: int) -> None:
    """Refuse to write weights or EMA weights with NaN/inf (the run stops; earlier checkpoints stay). One host
    sync per state dict."""
    for key in ("model", "ema"):
        name = first_nonfinite(full[key])
        if name is not None:
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
