"""The checkpoint directory layout, finding a checkpoint from what a user typed (find_checkpoint), and reading
it (weights for sampling, everything for a resume). Nothing is a pickle, and every stored `_target_` must be
a project builder (docs/reliability.md, "Checkpoints cannot run code").
"""
from __future__ import annotations

import shutil

import re
from pathlib import Path
from typing import Any, Optional, Union

from tread.utils.errors import UserError
from tread.utils.readers import read_json
from tread.utils.renamed_keys import upgrade_keys
from tread.checkpoint.sharded import SHARDED_DIR, ShardedFileError, check_sharded, full_tensors
from tread.schema.builders import TARGETS
from tread.utils.targets import check_targets, upgrade_targets
from tread.checkpoint.tensorfile import StateFileError, load_state, load_tensors

PathLike = Union[str, Path]
STEP_DIR = re.compile(r"^step_(\d+)$")
META_FILE = "checkpoint.json"
WEIGHT_FILES = {"model": "model.safetensors", "ema": "ema.safetensors"}
TRAIN_FILE = "train_state.safetensors"
LEGACY_FILE = "model.pt"              # the pickle format of earlier versions
FORMAT = 2
CONVERT = "python scripts/convert_checkpoint.py"
TMP_SUFFIX, TRASH_SUFFIX = ".tmp", ".trash"    # a step dir being written, one being pruned


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, of the old pickle format, or naming
    code that is not one of the project's builders."""


def checkpoint_dir(run_dir: PathLike, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def tmp_dir(final: Path) -> Path:
    """Where the checkpoint `final` is written before it is renamed into place (a leftover means a crash)."""
    return final.with_name(final.name + TMP_SUFFIX)


def trash_dir(ckpt: Path) -> Path:
    """Where a pruned checkpoint is renamed before it is deleted (a leftover means a crash)."""
    return ckpt.with_name(ckpt.name + TRASH_SUFFIX)


def step_of(ckpt: PathLike) -> Optional[int]:
    """The step of a step_XXXXXXX directory (None for other names)."""
    match = STEP_DIR.match(Path(ckpt).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: PathLike) -> list[Path]:
    """Complete checkpoints of a run (checkpoint.json present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if step_of(p) is not None and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_checkpoint(spec: PathLike, key: str = "checkpoint") -> Path:
    """A step directory from a run directory (its latest checkpoint), a step directory or a file in it.
    Errors name `key`, the path and what is accepted; an old-format checkpoint names the converter."""
    path = Path(spec).expanduser()
    if path.is_file() and step_of(path.parent) is not None:
        path = path.parent
    if (path / META_FILE).is_file():
        return path
    found = list_checkpoints(path) if path.is_dir() else []
    if found:
        return found[-1]
    legacy = path if (path / LEGACY_FILE).is_file() else latest_legacy(path)
    if legacy is not None:
        raise CheckpointError(
            f"{key}='{spec}': '{legacy}' is a checkpoint of the old pickle format ({LEGACY_FILE}); loading a pickle "
            f"can run code hidden in it, so it is not read. If you trust its source, convert it once: "
            f"{CONVERT} {legacy} --trust")
    what = "does not exist" if not path.exists() else f"holds no checkpoint ({META_FILE})"
    raise FileNotFoundError(f"{key}='{spec}': '{path}' {what}. Give a run directory, a "
                            f"checkpoints/step_XXXXXXX directory or a file in it.")


def latest_legacy(run_dir: Path) -> Optional[Path]:
    """The newest old-format (pickle) checkpoint of a run dir, if any."""
    root = run_dir / "checkpoints"
    old = sorted(p for p in root.glob("step_*") if (p / LEGACY_FILE).is_file()) if root.is_dir() else []
    return old[-1] if old else None


def run_dir_of(checkpoint: PathLike) -> Path:
    """The run directory that holds a checkpoint (given as run dir, step dir or a file in it)."""
    path = Path(checkpoint)
    if path.is_file():
        path = path.parent
    return path.parent.parent if path.parent.name == "checkpoints" else path


def read_meta(ckpt: PathLike) -> dict[str, Any]:
    """checkpoint.json of a step dir ({"format", "step", "config", "data_meta", "adapter_only"}) with its config in
    today's names; a `_target_` that is not a project builder raises TargetError."""
    path = Path(ckpt) / META_FILE
    try:
        meta = read_json(path, "", "a checkpoint description (JSON)", CheckpointError, "The checkpoint is corrupt.")
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' is missing: '{ckpt}' is not a complete checkpoint.") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "step" not in meta:
        raise CheckpointError(f"'{path}' is not a checkpoint description (needs step and config).")
    step, named = meta["step"], step_of(ckpt)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or (named is not None and step != named):
        raise CheckpointError(f"'{path}': step={step!r} is not allowed; allowed: the step of its directory "
                              f"({named if named is not None else 'an integer >= 0'}); the checkpoint is corrupt.")
    if meta.get("format", FORMAT) != FORMAT:
        raise CheckpointError(f"'{path}': format={meta.get('format')!r} is not one this version reads (format "
                              f"{FORMAT}); it was written by another version of this project, or is corrupt.")
    check_targets(upgrade_targets(upgrade_keys(meta["config"]), TARGETS), TARGETS, f"checkpoint '{ckpt}'")
    return meta


def load_model_file(ckpt: PathLike) -> dict[str, Any]:
    """What sampling needs from a checkpoint (step dir or a file in it), on the CPU: its meta plus full "model" and
    "ema" weights. CheckpointError for incomplete, corrupt or code-naming checkpoints."""
    path = find_checkpoint(ckpt)
    meta = read_meta(path)
    try:
        if is_sharded_checkpoint(path, meta):
            weights = full_tensors(path / SHARDED_DIR, tuple(WEIGHT_FILES))
        else:
            weights = {k: load_tensors(path / name) for k, name in WEIGHT_FILES.items()}
    except (StateFileError, ShardedFileError) as err:
        raise CheckpointError(f"checkpoint '{path}': {err}") from None
    return {**meta, **weights}


def is_sharded_checkpoint(ckpt: Path, meta: dict[str, Any]) -> bool:
    """A step dir whose weights, EMA and optimizer are a torch.distributed.checkpoint folder (checkpoint.layout): as
    its checkpoint.json (`meta`) says, or, in one written before it said, as its files show. CheckpointError when the
    layout is not one, or a sharded checkpoint's folder is missing."""
    folder = Path(ckpt) / SHARDED_DIR
    layout = meta.get("layout", "sharded" if folder.is_dir() else "single")
    if layout not in ("single", "sharded"):
        raise CheckpointError(f"'{Path(ckpt) / META_FILE}': layout={layout!r} is not allowed; allowed: 'single' or "
                              f"'sharded'; the checkpoint is corrupt.")
    if layout == "sharded" and not folder.is_dir():
        raise CheckpointError(f"'{folder}' is missing: '{ckpt}' is a sharded checkpoint ({META_FILE} says "
                              f"layout='sharded') without its shards; it is incomplete.")
    return layout == "sharded"


def read_checkpoint(ckpt: Path, rank: int) -> dict[str, Any]:
    """Everything a resume needs from a checkpoint dir, read and checked before any of it is applied (a sharded
    checkpoint's index, its files' sizes and each stored chunk's archive header here, so that a broken one falls
    back before anything is loaded; its tensors as each process loads them). CheckpointError when a file is missing,
    truncated or corrupt, or the config names foreign code."""
    meta = read_meta(ckpt)
    sharded = is_sharded_checkpoint(Path(ckpt), meta)
    try:
        if sharded:      # its index and every stored chunk's archive (not their data: each process reads its own)
            check_sharded(Path(ckpt) / SHARDED_DIR)
            weights: dict[str, Any] = {"sharded": Path(ckpt) / SHARDED_DIR}
        else:
            weights = {k: v for k, v in load_model_file(ckpt).items() if k in WEIGHT_FILES}
        train = load_state(Path(ckpt) / TRAIN_FILE)
        rng_path = Path(ckpt) / rng_file(rank)
        rng = load_state(rng_path) if rng_path.is_file() else None
    except (StateFileError, ShardedFileError) as err:
        raise CheckpointError(f"checkpoint '{ckpt}': {err}") from None
    if not isinstance(train, dict):
        raise CheckpointError(f"'{Path(ckpt) / TRAIN_FILE}' holds no resume state (a mapping); it is corrupt.")
    return {**train, **weights, "rng": rng, "adapter_only": bool(meta.get("adapter_only")), "config": meta["config"],
            "checkpoint_step": meta["step"]}


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


def clean_run_dir(run_dir: Path) -> list[str]:
    """Remove what interrupted launches leave in checkpoints/: temp dirs of unfinished writes, *.trash dirs of
    unfinished pruning and step dirs without checkpoint.json (nor an old-format model.pt). Returns their names."""
    root = Path(run_dir) / "checkpoints"
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        leftover = path.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)) or (
            step_of(path) is not None and not (path / META_FILE).exists() and not (path / LEGACY_FILE).exists())
        if leftover and path.is_dir():
            shutil.rmtree(path)
            removed.append(path.name)
    return removed
