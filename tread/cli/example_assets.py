"""Offline inputs for the bucketed worked example (Makefile `example-buckets`, docs/buckets.md): the toy
shapes as an image folder with caption sidecars (scripts/toy_images.py), and a tiny AutoencoderKL fitted
to them (scripts/tiny_vae.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from tread.cli.args import MAX_SEED, MAX_STEPS, Parser, int_in
from tread.cli.errors import user_errors
from tread.data.buckets import parse_buckets
from tread.data.builtin.toy import generate_toy_shapes
from tread.data.builtin.toy_images import write_toy_image_folder
from tread.encoders.tiny_vae import save_tiny_vae


def toy_images(argv: Optional[Sequence[str]] = None) -> None:
    parser = Parser(prog="toy_images.py", description="Write the toy shapes as an image folder with caption sidecars.")
    parser.add_argument("out", help="folder to write (must be new or empty)")
    parser.add_argument("--sizes", default="32x32,48x32,32x48,64x64,96x64,64x96",
                        help="image sizes WIDTHxHEIGHT, comma-separated (default: three aspect ratios at two sizes)")
    parser.add_argument("--per-class", type=int_in(1, 100_000), default=24,
                        help="images per class at each size (default 24)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED - 1), default=0, help="generator seed (default 0)")
    with user_errors(FileExistsError):
        args = parser.parse_args(argv)
        written = write_toy_image_folder(args.out, parse_buckets(args.sizes, "--sizes"), args.per_class, args.seed)
        print(f"wrote {sum(written.values())} images with caption files to {args.out}: {written}")


def tiny_vae(argv: Optional[Sequence[str]] = None) -> None:
    parser = Parser(prog="tiny_vae.py", description="Write a tiny AutoencoderKL fitted to the toy shapes.")
    parser.add_argument("out", help="folder to write (config.json, diffusion_pytorch_model.safetensors)")
    parser.add_argument("--steps", type=int_in(0, MAX_STEPS), default=300,
                        help="fitting steps (default 300; 0: random weights)")
    parser.add_argument("--resolution", type=int_in(8, 1024), default=32, help="side of the toy images it is fitted on")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED - 1), default=0,
                        help="initialisation and batch seed (default 0)")
    with user_errors():
        args = parser.parse_args(argv)
        images, _ = generate_toy_shapes(100, args.resolution, args.seed)
        out, losses = save_tiny_vae(args.out, images, args.steps, args.seed)
        fitted = f", reconstruction loss {losses[-1]:.4f} after {len(losses)} steps" if losses else ", random"
        print(f"wrote a tiny VAE to {out}{fitted}")
