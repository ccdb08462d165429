"""Write a tiny AutoencoderKLWan (temporal factor 2, spatial factor 2, 4 latent channels) fitted to the moving toy
shapes at the video worked example's clip sizes (tread/encoders/tiny_video_vae.py; `--help`), for precompute's
--vae DIR and the video worked example:

    OMP_NUM_THREADS=1 python scripts/tiny_video_vae.py DIR --steps 1000
"""
import argparse

import torch

from tread.cli.errors import user_errors
from tread.data.buckets import parse_buckets
from tread.data.builtin.toy_clips import generate_toy_clips
from tread.encoders.tiny_video_vae import SPATIAL_FACTOR, TEMPORAL_FACTOR, save_tiny_video_vae


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny AutoencoderKLWan fitted to the moving toy shapes.")
    parser.add_argument("out", help="folder to write (config.json, diffusion_pytorch_model.safetensors)")
    parser.add_argument("--steps", type=int, default=1000, help="fitting steps (default 1000; 0: random weights)")
    parser.add_argument("--sizes", default="32x32,48x32,32x48",
                        help="frame sizes WIDTHxHEIGHT it is fitted on, even (default 32x32,48x32,32x48)")
    parser.add_argument("--frames", type=int, default=9, help="frames per fitting clip (1 + 2k; default 9)")
    parser.add_argument("--per-class", type=int, default=8, help="fitting clips per class and size (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, clip and batch seed (default 0)")
    args = parser.parse_args()
    with user_errors():
        sizes = parse_buckets(args.sizes, "--sizes")
        if (args.steps < 0 or args.frames < 1 or (args.frames - 1) % TEMPORAL_FACTOR or args.per_class < 1
                or any(b.height % SPATIAL_FACTOR or b.width % SPATIAL_FACTOR for b in sizes)):
            raise SystemExit(f"error: --steps {args.steps} --sizes {args.sizes} --frames {args.frames} --per-class "
                             f"{args.per_class}; allowed: steps >= 0, even sizes, frames 1 + 2k (1, 3, 5, ...), "
                             f"per-class >= 1")
        clips = [torch.from_numpy(generate_toy_clips(args.per_class, args.frames, (b.height, b.width),
                                                     args.seed + k)[0]) for k, b in enumerate(sizes)]
        out, losses = save_tiny_video_vae(args.out, clips, args.steps, args.seed)
        fitted = f", reconstruction MSE {losses[-1]:.4f} after {len(losses)} steps" if losses else ", random"
        print(f"wrote a tiny video VAE (AutoencoderKLWan) to {out}{fitted}")


if __name__ == "__main__":
    main()
