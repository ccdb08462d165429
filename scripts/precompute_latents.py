"""Encode an image folder with a VAE into a latent dataset (tread/cli/precompute.py; `--help` lists every flag).

    python scripts/precompute_latents.py --images /data/imagenet/train --out /data/in256_sdvae
    accelerate launch --num_processes 8 scripts/precompute_latents.py --images /data/imagenet/train \\
        --out /data/in256_sdvae --flip --ref-out /data/in256_ref.npz --inception-weights /w/pt_inception.pth
"""
import sys

from tread.cli.precompute import cli

if __name__ == "__main__":
    sys.exit(cli())
