"""train.py's task function: one Hydra job = one training run (or one job of a sweep)."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from tread.cli.errors import user_errors
from tread.runtime.preempt import EXIT_INTERRUPTED, stop_exit_status
from tread.runtime.slurm import export_slurm_env
from tread.training.loop import train
from tread.training.summary import record_failure


def main(cfg: DictConfig) -> None:
    """Train into Hydra's run directory. In a sweep a failed job is recorded in its summary.json and the
    sweep goes on; otherwise a bad input or a failed write ends as one `error:` line. A run stopped by a
    signal (checkpoint written) exits with EXIT_PREEMPTED (75), or EXIT_INTERRUPTED (130) after Ctrl-C."""
    export_slurm_env()  # srun tasks (hydra/launcher=slurm) -> RANK, WORLD_SIZE, ...: one accelerate rank each
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)   # as typed: ${...} left unresolved
    with user_errors():
        if hc.mode != RunMode.MULTIRUN:
            summary = train(cfg, run_dir, overrides=overrides)
        else:
            try:
                summary = train(cfg, run_dir, overrides=overrides)
            except Exception as err:  # noqa: BLE001 - any failure of one job is recorded; the others run
                record_failure(run_dir, overrides, err)
                print(f"job {hc.job.num} failed ({type(err).__name__}: {err}); recorded in {run_dir}/summary.json",
                      file=sys.stderr)
                return
    status = stop_exit_status(summary["status"])
    if status:                              # checkpoint written: resume=auto (or the requeued job) continues
        sys.exit(status)


@contextlib.contextmanager
def interrupt_exits() -> Iterator[None]:
    """Ctrl-C outside training (start-up, the final writes; training itself stops at a step with a checkpoint):
    one line and EXIT_INTERRUPTED, no KeyboardInterrupt traceback."""
    try:
        yield
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
