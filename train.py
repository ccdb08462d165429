"""Train a DiT (dense or TREAD) with the composed Hydra config.

    python train.py                                    # built-in offline toy run (TREAD DiT-T/4)
    accelerate launch train.py experiment=imagenet256_dit_xl2_tread data.path=... eval.reference=...
    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from training.loop import USER_ERRORS, train  # imported here so --help stays fast

    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
