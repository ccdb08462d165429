"""Time the training step of a model under several route configs on this device (docs/benchmarks.md).

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-XL/2 --tokens 256 --batch 64 --precision bf16 --compile \\
        --routes none paper --sampling --json bench.json --markdown bench.md
    python scripts/benchmark.py --family all --preset tiny          # every diffusers family, one table

Every flag is an override of the config train.py composes (--set KEY=VALUE: any other key); a dense
baseline comes first and the configs are timed in interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import (MAX_BATCH, MAX_CHANNELS, MAX_ROUNDS, MAX_SIDE, MAX_STEPS, MAX_TOKENS, MAX_WORKERS, Parser,
                            int_in)
from tread.cli.errors import user_errors
from tread.perf.benchmark_report import markdown
from tread.perf.benchmark_run import (FAMILY_CHOICES, FEATURES, PRECISIONS, BenchError, BenchRequest,
                                      run_benchmark)
from tread.perf.overrides import DEVICES
from tread.utils.threads import MAX_CPU_THREADS

__all__ = ["BenchError", "BenchRequest", "build_parser", "main", "request_of", "run_benchmark"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark.py", description=__doc__)
    add = p.add_argument
    add("--arch", default="DiT-S/2", help="DiT size, e.g. DiT-S/2, DiT-XL/2, DiT-T/4 (model.arch)")
    add("--family", default="dit", choices=FAMILY_CHOICES,
        help="dit (--arch) or a diffusers family (--preset); 'all' times every family")
    add("--preset", default="tiny", help="family preset (tiny, mid, ...)")
    add("--resolution", type=int_in(1, MAX_SIDE), default=None, help="latent side (default: the arch's usual data)")
    add("--tokens", type=int_in(1, MAX_TOKENS), default=None, help="tokens per image (square); sets the resolution")
    add("--channels", type=int_in(1, MAX_CHANNELS), default=None,
        help="latent channels (default: the arch's usual data)")
    add("--batch", type=int_in(1, MAX_BATCH), default=32, help="global batch per step (train.batch_size)")
    add("--fit-batch", type=int_in(1, MAX_BATCH), nargs="+", default=[], metavar="B",
        help="CUDA: candidate batches; the largest whose dense eager step fits in memory replaces --batch")
    add("--routes", nargs="+", default=["paper"],
        help="route configs: none/dense, a configs/routing preset, or a JSON list of routes; a dense baseline "
             "is added first when none is given")
    add("--grids", nargs="+", default=[], metavar="HxW",
        help="bucket latent grids: after timing, each config steps on each grid in turn and then the first again "
             "(graphs compiled per bucket, step time)")
    add("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="a Hydra override of the training config, as for train.py (repeatable)")
    add("--steps", type=int_in(1, MAX_STEPS), default=10, help="timed steps per config")
    add("--warmup", type=int_in(0, MAX_STEPS), default=3, help="untimed steps per config (compilation happens here)")
    add("--rounds", type=int_in(1, MAX_ROUNDS), default=2, help="interleaved timing rounds the steps are split into")
    add("--one-at-a-time", action="store_true",
        help="hold one config in memory at a time: each round builds each config afresh (same weights), warms it "
             "up, times it and frees it (models of which two configs do not fit in memory)")
    add("--threads", type=int_in(1, MAX_CPU_THREADS), default=None, help="torch CPU threads (default: torch's)")
    add("--device", default="auto", choices=DEVICES, help="auto (accelerate's choice), cpu (train.cpu), cuda")
    add("--precision", choices=PRECISIONS, default=None, help="train.mixed_precision (default: the config's)")
    add("--gradient-checkpointing", action="store_true",
        help="recompute every block in backward (model.gradient_checkpointing): less memory, more time")
    add("--unfused-adamw", action="store_true", help="torch's default AdamW instead of the fused one "
        "(optimizer.fused=false)")
    add("--compile", action="store_true", help="torch.compile the routed forward (train.compile=true)")
    add("--compile-backend", default=None, help="train.compile_backend (default: the config's, inductor)")
    add("--cache-dir", default=None, help="paths.cache_dir: the toy classifier and built-in data")
    add("--sampling", action="store_true", help="also time the dense config's sampler")
    add("--sampling-steps", type=int_in(1, MAX_ROUNDS), default=40, help="sampler steps (EDM Heun / RF Euler)")
    add("--eval-features", action="store_true", help="also time the FID feature extractor")
    add("--features", default="toy_classifier", choices=FEATURES)
    add("--inception-weights", default=None, help="local Inception weights (--features inception)")
    add("--image-size", type=int_in(1, MAX_SIDE), default=32, help="image side for --eval-features")
    add("--eval-batch", type=int_in(1, MAX_BATCH), default=None, help="images per extractor call (default --batch)")
    add("--eval-repeats", type=int_in(1, MAX_ROUNDS), default=5)
    add("--data-loader", action="store_true",
        help="also time the training data loader (--data-path, default the built-in toy data)")
    add("--data-path", default=None, help="a latent dataset directory for --data-loader")
    add("--loader-workers", type=int_in(0, MAX_WORKERS), default=0, help="DataLoader workers for --data-loader")
    add("--json", default=None, help="also write the results here")
    add("--markdown", default=None, help="also write the Markdown table here")
    return p


def request_of(args: argparse.Namespace) -> BenchRequest:
    """The parsed flags as the benchmark's request (checked as it is built)."""
    return BenchRequest(**{k: v for k, v in vars(args).items() if k not in ("json", "markdown")})


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the benchmark; returns {"settings", "results"[, "sampling", "eval", "loader"]} (what --json writes).
    A bad input exits with one line, 'error: ...'."""
    with user_errors():
        args = build_parser().parse_args(argv)
        out = run_benchmark(request_of(args))
    table = markdown(out)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return out
