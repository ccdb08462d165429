"""Resuming: which checkpoint a launch continues (the newest that reads and passes every check; a corrupt one
falls back to the previous), which config changes a resume allows, and every value it would take (step, data
position, random streams, saved config, weights, optimizer state) checked against the run built for it before
any of it is applied."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from tread.checkpoint.files import (TRAIN_FILE, WEIGHT_FILES, CheckpointError, latest_legacy, list_checkpoints,
                                    read_checkpoint, resume_candidates)
from tread.checkpoint.saved_config import check_saved_config
from tread.checkpoint.sharded import tensor_index
from tread.checkpoint.state import TrainingState, optimizer_params, rng_state
from tread.checkpoint.values import ResumeValueError, check_plain, check_rng, check_router, check_step
from tread.models.lora import is_adapter_param, weights_mismatch
from tread.utils.distributed import broadcast_object
from tread.utils.errors import UserError
from tread.utils.finite import first_nonfinite

# Keys a resume may change: routes (e.g. a dense fine-tuning phase), memory settings, and the initialisation
# (weights come from the checkpoint), plus REPA's loss weight.
MUTABLE_MODEL_KEYS = ("model.routing", "model.gradient_checkpointing", "model.init", "model.repa.weight")


class ResumeError(UserError):
    """A resume that cannot continue the run (another architecture, no usable checkpoint)."""


def resume_plan(run_dir: Path, resume: Any, requeued: bool = False) -> list[Path]:
    """Checkpoints to try, newest first ([]: a fresh run). A directory with checkpoints needs resume=auto (or
    is a `requeued` SLURM job's); every process checks before any collective, so none waits at a barrier."""
    if resume in (None, "", "null", "none") and requeued and list_checkpoints(run_dir):
        tqdm.write("requeued SLURM job: continuing the run's latest checkpoint (as resume=auto)")
        resume = "auto"
    candidates = resume_candidates(resume, run_dir)
    if not candidates and (list_checkpoints(run_dir) or latest_legacy(run_dir)):
        raise FileExistsError(
            f"Run directory '{run_dir}' already holds checkpoints and resume={resume or 'null'}. Use resume=auto to "
            f"continue it, or a new hydra.run.dir to start fresh; nothing was overwritten.")
    return candidates


def read_resume(candidates: list[Path], rank: int, check: Callable[[dict, Path], None] = lambda read, ckpt: None
                ) -> tuple[Optional[Path], Optional[dict]]:
    """(checkpoint dir, its contents) of the newest candidate that reads and passes `check`; rank 0 chooses, the
    others read the same one. A corrupt checkpoint is reported and the previous one tried; none usable ->
    CheckpointError; any other UserError ends the launch on every process."""
    chosen, read, errors, fatal = None, None, [], None
    if rank == 0:
        for ckpt in candidates:
            try:
                read = read_checkpoint(ckpt, rank)
                check(read, ckpt)
                chosen = ckpt
                break
            except CheckpointError as err:
                errors.append(str(err))
                tqdm.write(f"warning: {err}" + ("; trying the previous checkpoint" if ckpt != candidates[-1] else ""))
            except UserError as err:
                fatal = err
                break
    chosen_name, failed = broadcast_object((str(chosen) if chosen else None, str(fatal) if fatal else None))
    if failed is not None:
        raise fatal if fatal is not None else ResumeError(failed)
    if candidates and chosen_name is None:
        raise CheckpointError(f"no checkpoint of the run can be read: {'; '.join(errors)}")
    if chosen_name is not None and rank != 0:
        chosen = Path(chosen_name)
        read = read_checkpoint(chosen, rank)
        check(read, chosen)
    return chosen, read


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a.b[0].c': value} of a nested config."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items()
                for k, v in flatten(sub, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(tree, list) and tree and any(isinstance(v, (dict, list)) for v in tree):
        return {k: v for i, sub in enumerate(tree) for k, v in flatten(sub, f"{prefix}[{i}]").items()}
    return {prefix: tree}


def config_changes(saved: dict, now: dict) -> dict[str, list]:
    """{key: [saved value, new value]} for every key that differs (resume itself left out)."""
    a, b = flatten(saved), flatten(now)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if k != "resume" and a.get(k) != b.get(k)}


def check_changes(changes: dict[str, list], ckpt: Path) -> None:
    """Refuse architecture and optimizer changes, naming the keys; the others are the user's choice."""
    arch = [k for k in changes if k.startswith("model.") and not k.startswith(MUTABLE_MODEL_KEYS)]
    if arch:
        shown = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in arch[:5])
        raise ResumeError(f"resume from '{ckpt}' would change the architecture ({shown}); a checkpoint only "
                          f"continues the model it was trained with. Resume with the checkpoint's model keys, or start "
                          f"a new run (another hydra.run.dir).")
    if "optimizer._target_" in changes:
        was, now = changes["optimizer._target_"]
        raise ResumeError(f"resume from '{ckpt}' would change the optimizer ({was} -> {now}); its saved state only "
                          f"loads into the optimizer that wrote it. Resume with the checkpoint's optimizer (e.g. "
                          f"optimizer=adamw for torch.optim.AdamW, adamw8bit for torchao.optim.AdamW8bit), or start a "
                          f"new run (another hydra.run.dir).")


def describe_changes(changes: dict[str, list]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_resume(state: TrainingState, read: dict[str, Any], ckpt: Path, saved: dict) -> None:
    """CheckpointError unless `read` (read_checkpoint's dict) can be loaded into `state` as it is; ResumeError
    (not a corrupt checkpoint: no fallback) when the launch's config (`saved`, as checkpoints keep it) would change the architecture."""
    check_saved_config(read["config"], ckpt)
    check_changes(config_changes(read["config"], saved), ckpt)
    where = Path(ckpt) / TRAIN_FILE
    try:
        check_step(read, read["checkpoint_step"])
        check_plain(read)
        if read.get("rng") is not None:
            template = {k: v for k, v in rng_state().items() if k != "cuda"}
            check_rng({k: v for k, v in read["rng"].items() if k != "router"}, template)
            check_router(read["rng"].get("router"))
        if read.get("sharded") is None:
            check_optimizer(state, read.get("optimizer"))
    except ResumeValueError as err:
        raise CheckpointError(f"'{where}': {err}; the checkpoint is corrupt") from None
    adapter_only = bool(read.get("adapter_only"))
    if read.get("sharded") is not None:
        check_index(state, read["sharded"], adapter_only, read.get("optimizer_groups"))
        return
    for top, module in (("model", state.model), ("ema", state.ema_model)):
        problem = weights_mismatch(read.get(top), module.state_dict(), adapter_only)
        if problem:
            raise CheckpointError(f"'{Path(ckpt) / WEIGHT_FILES[top]}': {problem}; it is not a checkpoint of the "
                                  f"model its config builds, or it is corrupt")


def check_optimizer(state: TrainingState, saved: Any) -> None:
    """Its param groups hold as many parameters as this run's optimizer, and each moment has its parameter's
    shape and finite values (the step count may be a scalar)."""
    inner = getattr(state.optimizer, "optimizer", state.optimizer)
    named = optimizer_params(state.model, inner)
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise ResumeValueError("optimizer is not an optimizer state (state and param_groups)")
    check_groups(groups, inner.param_groups, "optimizer.param_groups")
    for index, entries in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(named) or not isinstance(entries, dict):
            raise ResumeValueError(f"optimizer.state has an entry {index!r} for no parameter")
    kinds = {tuple(sorted(e)) for e in saved["state"].values()}
    if len(kinds) > 1:
        raise ResumeValueError(f"optimizer.state entries hold different moments ({sorted(kinds)[:2]})")
    for index, entries in saved["state"].items():
        name, param = named[index]
        for key, value in entries.items():
            if isinstance(value, dict):            # an 8-bit moment (optimizer=adamw8bit): state.plain_optimizer_state
                check_8bit(value, param, f"optimizer.state[{index}].{key} ({name})")
            elif not isinstance(value, torch.Tensor) or (value.numel() > 1 and value.shape != param.shape):
                raise ResumeValueError(f"optimizer.state[{index}].{key} ({name}) does not fit the parameter's shape "
                                       f"{list(param.shape)}")
    bad = first_nonfinite(moment_tensors(saved["state"], [n for n, _ in named]))
    if bad is not None:
        raise ResumeValueError(f"{bad} holds non-finite values")


def moment_tensors(state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The floating tensors of a saved optimizer state by a readable name (an 8-bit moment: its scales and code
    table; its uint8 codes cannot be non-finite)."""
    out = {}
    for i, entries in state.items():
        for key, value in entries.items():
            parts = {".scale": value["scale"], ".qmap": value["qmap"]} if isinstance(value, dict) else {"": value}
            out.update({f"optimizer.state[{i}].{key}{part} ({names[i]})": t for part, t in parts.items()})
    return out


def check_8bit(value: dict, param: torch.Tensor, name: str) -> None:
    """An 8-bit moment as the state file holds it: uint8 codes of the parameter's shape, one scale per block of
    codes, a 256-entry code table and a sign flag (torchao's OptimState8bit)."""
    codes, scale, qmap = (value.get(k) for k in ("codes", "scale", "qmap"))
    if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and codes.shape == param.shape
            and isinstance(scale, torch.Tensor) and scale.dim() == 1 and scale.numel()
            and codes.numel() % scale.numel() == 0 and isinstance(qmap, torch.Tensor) and qmap.shape == (256,)
            and isinstance(value.get("signed"), bool)):
        raise ResumeValueError(f"{name} is not an 8-bit moment of the parameter's shape {list(param.shape)} (uint8 "
                               f"codes, a scale per block, a 256-entry code table)")


def check_index(state: TrainingState, folder: Path, adapter_only: bool, groups: Any) -> None:
    """A sharded folder's weights have the model's names and shapes (their values are read by each process as it
    loads its slices); its optimizer groups fit this run's."""
    index = tensor_index(folder)
    for top, module in (("model", state.model), ("ema", state.ema_model)):
        saved = {path[1]: tuple(size) for path, (size, _) in index.items() if path[0] == top and len(path) == 2}
        wanted = {k: tuple(v.shape) for k, v in module.state_dict().items()
                  if not adapter_only or is_adapter_param(k) or k in saved}
        wrong = [k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
        if wrong:
            raise CheckpointError(f"'{folder}': {top} tensor '{wrong[0]}' has shape {saved.get(wrong[0])}, the "
                                  f"model's is {wanted.get(wrong[0])} (None: absent); it is not a checkpoint of the "
                                  f"model its config builds")
    inner = getattr(state.optimizer, "optimizer", state.optimizer)
    check_moments(index, optimizer_params(state.model, inner), folder)
    try:
        check_groups(groups, inner.param_groups, "optimizer_groups")
    except ResumeValueError as err:
        raise CheckpointError(f"'{Path(folder).parent / TRAIN_FILE}': {err}") from None


def check_moments(index: dict, named: list, folder: Path) -> None:
    """Each optimizer entry of a sharded folder (optimizer.<parameter number>.<moment>) belongs to a parameter this run
    trains and has its shape, or is a scalar (a step count): nothing of another size is allocated for it."""
    for path, (size, _) in index.items():
        if path[0] != "optimizer":
            continue
        number = int(path[1]) if len(path) == 3 and path[1].isdecimal() else -1
        if not 0 <= number < len(named):
            raise CheckpointError(f"'{folder}': tensor '{'.'.join(path)}' is the optimizer state of no parameter (this "
                                  f"run trains {len(named)}); it is not a checkpoint of this run's model")
        name, param = named[number]
        if tuple(size) != tuple(param.shape) and math.prod(size) > 1:
            raise CheckpointError(f"'{folder}': tensor '{'.'.join(path)}' has shape {list(size)}, its parameter "
                                  f"'{name}' {list(param.shape)}; it is not a checkpoint of this run's model")


def check_groups(saved: Any, groups: list[dict], name: str) -> None:
    """Saved param groups as torch's state_dict writes them for `groups`: the parameters numbered 0, 1, ... in
    order, group by group, and each hyperparameter this optimizer has of its kind (a finite number, a tuple of
    them, a flag)."""
    sizes = [len(g["params"]) for g in groups]
    if not isinstance(saved, list) or [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved] != sizes:
        raise ResumeValueError(f"{name} do not hold param groups of {sizes} parameters as this run trains; was "
                               f"model.lora or the model changed?")
    start = 0
    for i, (group, live) in enumerate(zip(saved, groups)):
        if list(group["params"]) != list(range(start, start + len(live["params"]))):
            raise ResumeValueError(f"{name}[{i}].params are not the parameter numbers {start}..")
        start += len(live["params"])
        for key, value in group.items():
            if key != "params" and key in live and not same_kind(value, live[key]):
                raise ResumeValueError(f"{name}[{i}].{key}={value!r} is not allowed (this optimizer's is "
                                       f"{live[key]!r})")


def same_kind(value: Any, like: Any) -> bool:
    """A hyperparameter of the kind of `like`: a finite number for a number, a tuple of them for a tuple, a flag for
    a flag or an unset (None) choice."""
    if isinstance(like, bool) or like is None:
        return value is None or isinstance(value, bool)
    if isinstance(like, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(like, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(like) and all(
            same_kind(v, w) for v, w in zip(value, like))
    if isinstance(like, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == like.shape
    return isinstance(value, type(like))
