"""Train a DiT (dense or TREAD) with the composed Hydra config.

    python train.py                                    # built-in offline toy run (TREAD DiT-T/4)
    accelerate launch train.py experiment=imagenet256_dit_xl2_tread data.path=... eval.reference=...
    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5
    python train.py -m hydra/launcher=slurm hydra.launcher.partition=<p> ... # SLURM sweep, one job per run (README)
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from hydra.types import RunMode

    from training.distributed import export_slurm_env
    from training.loop import USER_ERRORS, record_failure, train  # imported here so --help stays fast

    export_slurm_env()  # srun tasks (hydra/launcher=slurm) -> RANK, WORLD_SIZE, ...: one accelerate rank each
    hc = HydraConfig.get()
    run_dir, overrides = hc.runtime.output_dir, list(hc.overrides.task)
    try:
        train(cfg, run_dir, overrides=overrides)
    except Exception as err:
        if hc.mode == RunMode.MULTIRUN:  # a sweep: record this job as failed and let the others run
            record_failure(run_dir, overrides, err)
            print(f"job {hc.job.num} failed ({type(err).__name__}: {err}); recorded in {run_dir}/summary.json",
                  file=sys.stderr)
            return
        if isinstance(err, USER_ERRORS):
            sys.exit(f"error: {err}")
        raise


if __name__ == "__main__":
    main()
