"""Time the paper code's training step (CompVis/tread, from PAPER_DIR) and ours side by side, in one process.

    python scripts/compare_paper.py /path/to/tread                       # DiT-S/2 @ 64 tokens and DiT-B/2 @ 256
    python scripts/compare_paper.py /path/to/tread --sizes DiT-S/2:16:32 --precisions fp32 --rounds 5
    python scripts/compare_paper.py /path/to/tread --compile false true --json compare.json   # eager and compiled

What each side runs and what is printed: docs/benchmarks.md, "Against the paper code, in one process".
PAPER_DIR is imported, never copied into this project.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tread.cli.args import MAX_BATCH, MAX_ROUNDS, MAX_SIDE, MAX_STEPS, Parser, int_in, parse_int
from tread.cli.errors import user_errors
from tread.perf.benchmark import StepBench, allow_compiled_configs, time_interleaved
from tread.perf.memory import MemoryMeter
from tread.perf.overrides import compose_or_raise
from tread.perf.paper import PaperBench, import_paper
from tread.perf.peaks import device_name
from tread.training.setup import mixed_precision
from tread.utils.threads import MAX_CPU_THREADS, cpu_threads
from tread.utils.errors import UserError

PAPER_ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}   # its configs/model/tread.yaml
SIDES = ("paper", "ours")


class CompareError(UserError):
    """A bad compare_paper.py input; printed as one line, 'error: ...'."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="compare_paper.py", description=__doc__, error_type=CompareError)
    add = p.add_argument
    add("paper_dir", help="a checkout of https://github.com/CompVis/tread")
    add("--sizes", nargs="+", default=["DiT-S/2:16:32", "DiT-B/2:32:8"], help="ARCH:RESOLUTION:BATCH per size")
    add("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    add("--compile", nargs="+", default=["default"], choices=["default", "true", "false"],
        help="our train.compile, one row each: default (train.yaml's auto: on with CUDA, and on CPU with a C++ "
             "compiler), true, false")
    add("--steps", type=int_in(1, MAX_STEPS), default=6, help="timed steps per config")
    add("--warmup", type=int_in(0, MAX_STEPS), default=2, help="untimed steps per config (compilation happens here)")
    add("--rounds", type=int_in(1, MAX_ROUNDS), default=3, help="interleaved rounds the steps are split into")
    add("--threads", type=int_in(1, MAX_CPU_THREADS), default=None, help="torch CPU threads (default: torch's)")
    add("--json", default=None, help="also write the results here")
    return p


def parse_size(text: str) -> tuple[str, int, int]:
    try:
        arch, resolution, batch = text.split(":")
        return arch, parse_int(resolution, 1, MAX_SIDE), parse_int(batch, 1, MAX_BATCH)
    except ValueError:
        raise CompareError(f"--sizes {text!r} is not ARCH:RESOLUTION:BATCH (a latent side in [1, {MAX_SIDE}], a "
                           f"batch in [1, {MAX_BATCH}]); allowed e.g. DiT-S/2:16:32") from None


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before the paper code is imported or a model built."""
    for size in args.sizes:
        parse_size(size)


def our_overrides(arch: str, resolution: int, batch: int, dense: bool, bf16: bool, compile: str) -> list[str]:
    """The training config of our side: train.yaml's own defaults with the model, geometry, batch, route and
    precision named."""
    return ["~experiment", f"model={'dit' if dense else 'tread'}", f"model.arch={arch}", "data.channels=4",
            f"data.resolution={resolution}", "data.num_classes=1000", f"train.batch_size={batch}",
            f"train.mixed_precision={'bf16' if bf16 else 'no'}", "routing=none" if dense else "routing=paper",
            f"train.compile={'auto' if compile == 'default' else compile}"]


def build_group(paper: Any, size: str, precisions: Sequence[str], compiles: Sequence[str]) -> list[tuple[dict, Any]]:
    """(key, bench) for every precision x dense/routed of one size: the paper's step, then ours per --compile, in
    the interleaving order."""
    arch, resolution, batch = parse_size(size)
    group, shared = [], None
    for precision in precisions:
        for dense in (True, False):
            key = {"size": size, "precision": precision, "dense": dense}
            ours = [StepBench(compose_or_raise(our_overrides(arch, resolution, batch, dense, precision == "bf16", c),
                                               CompareError)) for c in compiles]
            shared = shared or ours[0].batch               # one synthetic batch for every config
            for bench in ours:
                bench.batch = shared
            theirs = PaperBench(paper, arch, resolution, 4, shared, None if dense else [PAPER_ROUTE],
                                precision == "bf16")
            group += [({**key, "side": "paper", "compile": "-"}, theirs)]
            group += [({**key, "side": "ours", "compile": c}, bench) for c, bench in zip(compiles, ours)]
    return group


def summarise(size: str, precisions: Sequence[str], compiles: Sequence[str], times: dict) -> list[dict]:
    """One row per precision and --compile: ms per step of each config, ours / paper, routed speedups, and ours
    against the paper's fp32 step."""
    def ms(precision, side, dense, compile):
        return 1e3 * statistics.median(times[(size, precision, side, dense, compile if side == "ours" else "-")])

    rows = []
    for precision in precisions:
        for c in compiles:
            m = {(side, d): ms(precision, side, d, c) for side in SIDES for d in (True, False)}
            row = {"size": size, "precision": precision, "compile": c,
                   **{f"{side}_{'dense' if d else 'routed'}_ms": m[(side, d)] for side in SIDES for d in (True, False)},
                   "ratio_dense": m[("ours", True)] / m[("paper", True)],
                   "ratio_routed": m[("ours", False)] / m[("paper", False)],
                   "paper_speedup": m[("paper", True)] / m[("paper", False)],
                   "ours_speedup": m[("ours", True)] / m[("ours", False)]}
            if "fp32" in precisions:
                row["vs_paper_fp32_dense"] = m[("ours", True)] / ms("fp32", "paper", True, c)
                row["vs_paper_fp32_routed"] = m[("ours", False)] / ms("fp32", "paper", False, c)
            rows.append(row)
    return rows


def defaults_line(rows: list[dict], device: torch.device) -> Optional[str]:
    """Defaults against defaults: ours at train.mixed_precision=auto's precision against the paper code's fp32
    step; None unless both were timed."""
    value, why = mixed_precision("auto", device)
    ours = "fp32" if value == "no" else value
    lines = [f"| {r['size']} | {ours} | {r['ours_dense_ms']:.0f} ms / {r['ours_routed_ms']:.0f} ms | "
             f"{r['vs_paper_fp32_dense']:.2f}x / {r['vs_paper_fp32_routed']:.2f}x |"
             for r in rows if r["precision"] == ours and r["compile"] == "default" and "vs_paper_fp32_dense" in r]
    if not lines:
        return None
    return (f"Defaults against defaults (ours: train.mixed_precision=auto -> {ours} ({why}), train.compile=auto; "
            f"the paper code: fp32):\n| size | our precision | ours dense / routed | ours / paper fp32 |\n"
            "|---|---|---|---|\n" + "\n".join(lines))


def markdown(rows: list[dict]) -> str:
    head = ("| size | precision | our train.compile | paper dense | ours dense | paper routed | ours routed | ours / "
            "paper (dense / routed) | routed speedup (paper / ours) | ours vs paper fp32 (dense / routed) |\n"
            + "|---" * 10 + "|")
    lines = [head]
    for r in rows:
        vs = (f"{r['vs_paper_fp32_dense']:.2f}x / {r['vs_paper_fp32_routed']:.2f}x" if "vs_paper_fp32_dense" in r
              else "-")
        lines.append(f"| {r['size']} | {r['precision']} | {r['compile']} | {r['paper_dense_ms']:.0f} ms | "
                     f"{r['ours_dense_ms']:.0f} ms | {r['paper_routed_ms']:.0f} ms | {r['ours_routed_ms']:.0f} ms | "
                     f"{r['ratio_dense']:.2f}x / {r['ratio_routed']:.2f}x | {r['paper_speedup']:.2f}x / "
                     f"{r['ours_speedup']:.2f}x | {vs} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Time both sides for every size (flags checked: check_args), print the tables; the results."""
    paper = import_paper(Path(args.paper_dir))
    allow_compiled_configs(4 * len(args.sizes) * len(args.precisions) * (1 + len(args.compile)))
    rows, times, device = [], {}, torch.device("cpu")
    for size in args.sizes:
        group = build_group(paper, size, args.precisions, args.compile)
        device = group[0][1].device                       # ours: the accelerator's; the paper's runs on our batch
        meas = time_interleaved([b for _, b in group], args.steps, args.warmup, args.rounds, MemoryMeter(device))
        for (key, _), m in zip(group, meas):
            times[(key["size"], key["precision"], key["side"], key["dense"], key["compile"])] = m["times"]
        rows += summarise(size, args.precisions, args.compile, times)
        del group
    out = {"device": device_name(device), "threads": torch.get_num_threads(), "rows": rows,
           "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "step_ms_all": {"|".join(map(str, k)): [1e3 * t for t in v] for k, v in times.items()}}
    print(f"{out['device']}, {out['threads']} threads; median of {args.steps} steps per config after {args.warmup} "
          f"warm-up steps, {args.rounds} interleaved rounds")
    print(markdown(rows))
    out["defaults"] = defaults_line(rows, device)
    if out["defaults"]:
        print(out["defaults"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    with user_errors():
        args = build_parser().parse_args(argv)
        check_args(args)
        with cpu_threads(args.threads):   # in-process callers (tests) keep their thread count
            return run(args)
