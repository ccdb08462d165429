"""Generate samples from a checkpoint: a PNG folder, a grid, an ADM-format .npz and sampling.json.

    python sample.py checkpoint=outputs/runs/<run> num_samples=100 cfg_scale=1.5
    python sample.py checkpoint=... selection_ratio=0.5             # inference-time routing: fewer FLOPs
    python sample.py checkpoint=... tread_scale=1.5 tread_weak_selection_ratio=0.5 guidance_interval='[0.3,10]'
"""
import hydra
from omegaconf import DictConfig

import tread.cli.sample
from tread.cli.errors import hydra_errors


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
def main(cfg: DictConfig) -> None:
    tread.cli.sample.main(cfg)


if __name__ == "__main__":
    with hydra_errors():   # Hydra's own composition errors (unknown key, bad override) as one error: line
        main()
