"""`train(cfg, run_dir)`: what train.py calls (tests call it directly with tiny configs). It checks the config,
makes the accelerator, takes the run dir's lock, then builds a Trainer and fits it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from tread.runtime.collectives import watch_collectives
from tread.runtime.run_dir import lock_run_dir, shared_run_dir
from tread.schema import check_train, check_train_files
from tread.training.setup import make_accelerator
from tread.training.trainer import Trainer


def train(cfg: DictConfig, run_dir: str | Path, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """Train per `cfg`, writing checkpoints, samples, metrics.jsonl and summary.json under `run_dir`;
    `overrides` (the command-line overrides, e.g. a sweep job's) are recorded in summary.json. A stop signal
    ends the run at the next step with a checkpoint and status "preempted" ("interrupted" for Ctrl-C)."""
    config = check_train(cfg)                                 # every key, before any work
    check_train_files(config)
    accelerator = make_accelerator(config.train)
    config.micro_batch(accelerator.num_processes)             # the batch splits over processes and accumulation
    with watch_collectives(config.train.collective_timeout_min):  # a stopped or lost rank is named, not waited for
        run_dir = shared_run_dir(Path(run_dir))
        with lock_run_dir(run_dir, accelerator.is_main_process):  # one launch at a time in a run dir
            return Trainer.build(config, run_dir, accelerator, overrides).fit()
