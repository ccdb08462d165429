"""Train a DiT (dense or TREAD) or a diffusers family with the composed Hydra config.

    python train.py                                    # built-in offline toy run (TREAD DiT-T/2)
    accelerate launch train.py experiment=imagenet256_dit_xl2_tread data.path=... eval.reference=...
    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5
    python train.py -m hydra/launcher=slurm hydra.launcher.partition=<p> ... # SLURM sweep, one job per run
"""
import sys

import hydra
from omegaconf import DictConfig

import tread.cli.train
from tread.cli.errors import hydra_errors
from tread.cli.writable_dirs import with_dir_check


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    tread.cli.train.main(cfg)


if __name__ == "__main__":
    sys.argv = with_dir_check(sys.argv)   # an unwritable run dir: one error line before Hydra writes into it
    with tread.cli.train.interrupt_exits(), hydra_errors(sampling_section="eval"):   # Ctrl-C; Hydra's errors
        main()
