"""Peak CUDA memory of a video family's training step (Wan `mid`, several latent frame counts, routing none
vs paper); prints a markdown table and writes the rows as JSON (docs/benchmarks.md, "Video memory").

    PYTHONPATH=. python3 scripts/video_memory_gpu.py --wheels .whl --out outputs/video_memory_gpu.json
    PYTHONPATH=. python3 scripts/video_memory_gpu.py --device cpu --tiny --out /tmp/v.json   # the same, tiny, here
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import MAX_FRAMES, Parser, UsageError, int_in
from tread.cli.gpu_check import install_wheels, missing_modules

TINY = {"preset": "tiny", "frames": [1, 3], "latents": "8x12"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="video_memory_gpu.py", description=__doc__)
    add = p.add_argument
    add("--family", default="wan", help="a video family (inputs B, C, T, H, W)")
    add("--preset", default="mid", help="its preset")
    add("--frames", type=int_in(1, MAX_FRAMES), nargs="+", default=[1, 5, 9, 21], help="latent frames, smallest first")
    add("--latents", default="60x104", help="latent HxW (60x104: 480x832 pixels)")
    add("--routes", nargs="+", default=["none", "paper"], help="routing configs")
    add("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: saved bytes only (no CUDA peak)")
    add("--tiny", action="store_true", help="the tiny preset at 1 and 3 frames of 8x12 latents (tries it in seconds)")
    add("--out", default="outputs/video_memory_gpu.json", help="JSON of the rows")
    add("--wheels", default=None, help="a folder of wheels for the dependencies this machine lacks")
    return p


def bootstrap(wheels: Optional[str]) -> None:
    """Install the missing dependencies from `wheels` into a temporary folder put first on sys.path."""
    missing = missing_modules()
    if not missing or wheels is None:
        return
    site = Path(tempfile.mkdtemp(prefix="video_memory_site_"))
    complaint = install_wheels(Path(wheels), site)
    if complaint:
        sys.exit(f"error: --wheels {wheels}: {complaint}")
    sys.path.insert(0, str(site))


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        sys.exit(f"error: {err}")
    if args.tiny:
        args.preset, args.frames, args.latents = TINY["preset"], TINY["frames"], TINY["latents"]
    bootstrap(args.wheels)
    # deferred: torch, hydra and diffusers may only be importable once bootstrap has installed the wheels
    from tread.cli.errors import user_errors
    from tread.cli.memory_table import latent_size
    from tread.perf.video_memory import gpu_rows, gpu_table

    with user_errors():
        latents = latent_size("--latents", args.latents)
        start = time.monotonic()
        rows = gpu_rows(args.family, args.preset, sorted(args.frames), latents, args.routes, device=args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name(args.device), "seconds": round(time.monotonic() - start, 1),
                               "rows": rows}, indent=1, default=list))
    print(gpu_table(rows))
    print(f"\n{device_name(args.device)}; rows in {out}")
    return 0


def device_name(device: str) -> str:
    import torch     # deferred with the others (see main)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    return f"{name}, torch {torch.__version__}"
