"""The run directory at a launch's start (main process): what an interrupted launch left removed, metrics.jsonl
cut back to the resumed step, config.yaml written."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from tread.checkpoint.files import clean_run_dir
from tread.runtime.run_dir import trim_metrics
from tread.utils.io import WriteError, atomic_write_text


def prepare_run_dir(run_dir: Path, config_yaml: str, resumed: Optional[dict]) -> None:
    """Main process: remove what an interrupted launch left, cut metrics.jsonl back to the resumed step, write
    config.yaml (`config_yaml`: the run's config as YAML text)."""
    try:
        _prepare_run_dir(run_dir, config_yaml, resumed)
    except WriteError:
        raise
    except OSError as err:              # a full or read-only disk: one line naming the file (or the run dir)
        raise WriteError(err.errno, err.strerror or str(err), str(err.filename or run_dir)) from err


def _prepare_run_dir(run_dir: Path, config_yaml: str, resumed: Optional[dict]) -> None:
    for sub in ("checkpoints", "samples"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    for name in clean_run_dir(run_dir):
        tqdm.write(f"removed {run_dir / 'checkpoints' / name} (left by an interrupted launch)")
    step = int(resumed["step"]) if resumed is not None else 0
    dropped = trim_metrics(run_dir, step)
    if dropped:
        tqdm.write(f"metrics.jsonl: dropped {dropped} record(s) after step {step} (logged by an interrupted launch "
                   f"after its last checkpoint; those steps are trained and logged again)")
    atomic_write_text(run_dir / "config.yaml", config_yaml)   # whole, or WriteError
