"""ADM-style evaluation: build references, score images, benchmark checkpoints (tread/cli/fid.py).

    # reference statistics (mu/sigma, mu_s/sigma_s and 10K reference images arr_0) from images or a dataset
    python fid.py mode=ref source=<image folder | samples .npz | latent dataset dir> out=ref.npz
    # metrics of generated images against a reference (ours, or ADM's VIRTUAL_imagenet256_labeled.npz as is)
    python fid.py mode=calc images=<folder | .npz> ref=ref.npz out_json=metrics.json
    # checkpoint benchmarking: sample, decode, score, one table row per checkpoint
    accelerate launch fid.py mode=bench 'checkpoints=outputs/runs/<run>/checkpoints/step_*' ref=ref.npz \\
        num_samples=50000 cfg_scale=1.5 features=inception

Metrics: fid, sfid, is, precision, recall, kid (metrics=[...]). Features default to the offline toy
classifier (built-in data); features=inception gives numbers comparable with the literature.
See configs/fid.yaml for every key.
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
