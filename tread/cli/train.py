"""train.py's task function: one Hydra job = one training run (or one job of a sweep)."""
from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from tread.cli.errors import user_errors
from tread.runtime.preempt import EXIT_PREEMPTED
from tread.runtime.slurm import export_slurm_env
from tread.training.loop import train
from tread.training.summary import record_failure


def main(cfg: DictConfig) -> None:
    """Train into Hydra's run directory. In a sweep a failed job is recorded in its summary.json and the
    sweep goes on; otherwise a bad input ends as one `error:` line. A preempted run (stop signal, checkpoint
    written) exits with EXIT_PREEMPTED (75)."""
    export_slurm_env()  # srun tasks (hydra/launcher=slurm) -> RANK, WORLD_SIZE, ...: one accelerate rank each
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)   # as typed: ${...} left unresolved
    if hc.mode == RunMode.MULTIRUN:
        try:
            summary = train(cfg, run_dir, overrides=overrides)
        except Exception as err:  # noqa: BLE001 - any failure of one job is recorded; the others run
            record_failure(run_dir, overrides, err)
            print(f"job {hc.job.num} failed ({type(err).__name__}: {err}); recorded in {run_dir}/summary.json",
                  file=sys.stderr)
            return
    else:
        with user_errors():
            summary = train(cfg, run_dir, overrides=overrides)
    if summary["status"] == "preempted":   # checkpoint written: resume=auto (or the requeued job) continues
        sys.exit(EXIT_PREEMPTED)
