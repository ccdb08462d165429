"""Refuse a run or sweep directory that cannot be written, in one `error:` line, before Hydra writes into it:
a Hydra callback that programs add as an override (`with_dir_check`); docs/reliability.md, "Failed writes".
"""
from __future__ import annotations

import errno
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from tread.utils.io import unwritable_dir

CHECK_OVERRIDE = f"++hydra.callbacks.writable_output_dir._target_={__name__}.WritableOutputDir"


def with_dir_check(argv: list[str]) -> list[str]:
    """`argv` (sys.argv) with the override that adds the check (once)."""
    return argv if CHECK_OVERRIDE in argv else [*argv, CHECK_OVERRIDE]


def refuse_unwritable(cfg: DictConfig, key: str) -> None:
    """Exit with one `error:` line when the directory at `key` (or the nearest existing one above it) cannot
    be written; a value that cannot be resolved is left to Hydra, which reports it."""
    try:
        directory = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001 - not ours to report: Hydra fails on it with its own message
        return
    found = unwritable_dir(str(directory)) if directory else None
    if found is None:
        return
    where, err = found
    code = errno.errorcode.get(err.errno or 0)
    cause = f"{err.strerror or err}{f', {code}' if code else ''}"
    sys.exit(f"error: {key}='{directory}' cannot be written: no file can be made in '{where}' ({cause}). Make it "
             f"writable, or set paths.output_dir (or {key}) to a directory you can write.")


class WritableOutputDir(Callback):
    """Refuses an unwritable hydra.run.dir (hydra.sweep.dir with -m) before Hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config, "hydra.sweep.dir")
