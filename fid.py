"""ADM-style evaluation: build references, score images, benchmark checkpoints (tread/cli/fid.py; every key:
configs/fid.yaml).

    python fid.py mode=ref source=<image folder | samples .npz | latent dataset dir> out=ref.npz
    python fid.py mode=calc images=<folder | .npz> ref=ref.npz out_json=metrics.json
    accelerate launch fid.py mode=bench 'checkpoints=outputs/runs/<run>/checkpoints/step_*' ref=ref.npz \\
        num_samples=50000 cfg_scale=1.5 features=inception
"""
import hydra
from omegaconf import DictConfig

import tread.cli.fid
from tread.cli.errors import hydra_errors

@hydra.main(version_base="1.3", config_path="configs", config_name="fid")
def main(cfg: DictConfig) -> None:
    tread.cli.fid.main(cfg)


if __name__ == "__main__":
    with hydra_errors():   # Hydra's own composition errors (unknown key, bad override) as one error: line
        main()
