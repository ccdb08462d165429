"""Train a DiT (dense or TREAD) or a diffusers family with the composed Hydra config.

    python train.py                                    # built-in offline toy run (TREAD DiT-T/2)
    accelerate launch train.py experiment=imagenet256_dit_xl2_tread data.path=... eval.reference=...
    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5
    python train.py -m hydra/launcher=slurm hydra.launcher.partition=<p> ... # SLURM sweep, one job per run
"""
import hydra
from omegaconf import DictConfig

import tread.cli.train
from tread.cli.errors import hydra_errors


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    tread.cli.train.main(cfg)


if __name__ == "__main__":
    with hydra_errors(sampling_section="eval"):   # Hydra's composition errors (unknown key, bad override): one line
        main()
