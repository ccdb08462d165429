"""Refuse a run or sweep directory that cannot be written, in one `error:` line, before Hydra writes into it:
a Hydra callback that programs add as an override (`with_dir_check`); docs/reliability.md, "Failed writes".
"""
from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from tread.schema.base import show
from tread.training.run_log import TENSORBOARD_DIR, tracker_names
from tread.utils.io import unwritable_dir

TRACKER_DIRS = {"tensorboard": TENSORBOARD_DIR, "wandb": "wandb"}   # where each tracker writes, in the run dir

CHECK_OVERRIDE = f"++hydra.callbacks.writable_output_dir._target_={__name__}.WritableOutputDir"


def with_dir_check(argv: list[str]) -> list[str]:
    """`argv` (sys.argv) with the override that adds the check (once)."""
    return argv if CHECK_OVERRIDE in argv else [*argv, CHECK_OVERRIDE]


def refuse_unwritable(cfg: DictConfig, key: str) -> None:
    """Exit with one `error:` line when the directory at `key` (or the nearest existing one above it) cannot
    be written; a value that cannot be resolved is left to Hydra, which reports it."""
    directory = _select(cfg, key)
    found = unwritable_dir(str(directory)) if directory else None
    if found is None:
        return
    where, err = found
    sys.exit(f"error: {key}='{directory}' cannot be written: no file can be made in '{where}' ({_cause(err)}). Make "
             f"it writable, or set paths.output_dir (or {key}) to a directory you can write.")


def _cause(err: OSError) -> str:
    code = errno.errorcode.get(err.errno or 0)
    return f"{err.strerror or err}{f', {code}' if code else ''}"


def _select(cfg: DictConfig, key: str) -> Any:
    """A key's value, None where it is absent or cannot be resolved (Hydra or the config check reports that)."""
    try:
        return OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001 - not ours to report
        return None


def tracker_dir_problem(run_dir: Path, names: list[str]) -> Optional[tuple[str, str]]:
    """(tracker, why) for the first tracker that cannot write its folder in `run_dir` (a file in its place, or an
    existing folder no file can be made in; a folder still to be made is the run dir's check); None when each can."""
    for name in names:
        folder = run_dir / TRACKER_DIRS[name]
        if folder.exists() and not folder.is_dir():
            return name, "it is a file, not a folder"
        found = unwritable_dir(folder) if folder.is_dir() else None
        if found is not None:
            return name, f"no file can be made in it ({_cause(found[1])})"
    return None


def refuse_unwritable_trackers(cfg: DictConfig) -> None:
    """Exit with one `error:` line when a tracker of the training config (train.log_with, wandb by wandb.mode)
    cannot write its folder of the run dir (<run>/tensorboard, <run>/wandb), before Hydra writes into it; other
    programs' configs have no trackers."""
    log_with, mode, run_dir = (_select(cfg, k) for k in ("train.log_with", "wandb.mode", "hydra.run.dir"))
    if not run_dir or not OmegaConf.is_list(log_with):
        return
    listed = [v for v in log_with if isinstance(v, str)]
    found = tracker_dir_problem(Path(str(run_dir)).absolute(),
                                [n for n in tracker_names(listed, str(mode or "disabled")) if n in TRACKER_DIRS])
    if found is None:
        return
    name, problem = found
    said = f"train.log_with={show(listed)}" if name in listed else f"wandb.mode={mode}"
    sys.exit(f"error: {said} logs {name} into '{Path(str(run_dir)).absolute() / TRACKER_DIRS[name]}', but {problem}. "
             f"Allowed: remove (or make writable) what is in the way, another hydra.run.dir, or a run without "
             f"{name} (train.log_with without it" + (", wandb.mode=disabled)." if name == "wandb" else ")."))


class WritableOutputDir(Callback):
    """Refuses an unwritable hydra.run.dir (hydra.sweep.dir with -m), and a tracker folder in the run dir that
    cannot be written, before Hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config, "hydra.run.dir")
        refuse_unwritable_trackers(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config, "hydra.sweep.dir")
