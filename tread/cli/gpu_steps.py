"""What `make gpu-check` runs (tread/cli/gpu_check.py runs it): the steps in order, each a command of the project's
own scripts at GPU sizes (or, with --quick, tiny sizes that run on a CPU), and how each step's JSON is judged:
finite losses, trained parameters that moved, no recompiles within a bucket, static memory as the table counts it.
docs/benchmarks.md, "GPU", says what each step shows.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

Check = Callable[[Path], list[str]]      # the step's JSON -> problems (empty: it passed)

LEAN = ["ema.mode=trained", "optimizer=adamw8bit", "train.mixed_precision=bf16", "routing=paper"]
STATIC_TOLERANCE = 0.05                  # measured static bytes against the memory table's figure


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]            # after the python executable, from the repo root
    timeout: int               # seconds
    cuda: bool = True          # skipped without CUDA (said so in the report)
    markdown: Optional[str] = None   # a file the step writes its table to, under --out
    output: Optional[str] = None     # the JSON the step writes, under --out, that `check` judges
    check: Optional[Check] = None
    blocking_rerun: bool = False     # when it fails on CUDA, run it again with CUDA_LAUNCH_BLOCKING=1


# ----------------------------------------------------------------------------- judging a step's JSON
def trained(where: str, rec: dict) -> list[str]:
    """A record's losses finite and its trained parameters moved."""
    problems = []
    if not rec.get("loss_finite", False):
        problems.append(f"{where}: a loss was not finite ({rec.get('losses', '?')})")
    if not rec.get("params_moved", False):
        problems.append(f"{where}: the trained parameters did not move")
    return problems


def check_benchmark(path: Path) -> list[str]:
    """scripts/benchmark.py --json: every config trained; with --grids, no recompile while a bucket was timed and
    none when the first bucket came back."""
    problems = []
    for rec in json.loads(path.read_text())["results"]:
        where = f"{rec['model']} {rec['config']}"
        problems += trained(where, rec)
        if rec.get("compile", {}).get("graph_breaks"):
            problems.append(f"{where}: {rec['compile']['graph_breaks']} graph breaks")
        for bucket in rec.get("buckets", []):
            grid = "x".join(map(str, bucket["grid"]))
            if bucket["timed"]["unique_graphs"]:
                problems.append(f"{where}: bucket {grid} recompiled while timed")
            if bucket.get("revisit") and bucket["warmup"]["unique_graphs"]:
                problems.append(f"{where}: bucket {grid} compiled again when it came back")
    return problems


def check_measure(path: Path) -> list[str]:
    """scripts/memory_table.py --measure --json: it trained, and it holds the static bytes the table counts."""
    m = json.loads(path.read_text())
    problems = trained(m["run"], m)
    if not math.isclose(m["static"], m["estimate"], rel_tol=STATIC_TOLERANCE):
        problems.append(f"{m['run']}: {m['static']} static bytes held against the table's {m['estimate']} "
                        f"(more than {STATIC_TOLERANCE:.0%} apart)")
    return problems


def check_video(path: Path) -> list[str]:
    """scripts/video_memory_gpu.py --out: every frame count fitted and every route trained."""
    problems = []
    for row in json.loads(path.read_text())["rows"]:
        where = f"{row['family']} {row['preset']} {row['route']} at {row['tokens']} tokens"
        problems += [f"{where}: out of memory"] if row["oom"] else trained(where, row)
    return problems


# ----------------------------------------------------------------------------- the steps
BENCH = ["scripts/benchmark.py", "--precision", "bf16", "--routes", "none", "paper"]


def timing(q: bool, steps: int, warmup: int) -> list[str]:
    """--quick: one warm-up and one timed step (two losses, one update between them)."""
    return ["--steps", "1" if q else str(steps), "--warmup", "1" if q else str(warmup)]


def bench_step(name: str, out: Path, stem: str, flags: list[str], timeout: int, q: bool, **kw) -> Step:
    """A scripts/benchmark.py step writing out/<stem>.json and .md, judged by check_benchmark."""
    files = ["--json", str(out / f"{stem}.json"), "--markdown", str(out / f"{stem}.md")]
    return Step(name, [*BENCH, *flags, *files], timeout, cuda=not q,
                markdown=f"{stem}.md", output=f"{stem}.json", check=check_benchmark, **kw)


def lora_step(base: str, out: Path, q: bool) -> Step:
    """A FLUX LoRA over a `base` (bf16 | fp8) base, lean (EMA of the trained values, 8-bit AdamW), bf16, routed,
    at 1024 px (128x128 latents) on `mid`: its static bytes against the table's, and its peak."""
    stem = f"flux_lora_{base}"
    size = ["flux:tiny", "--resolution", "8", "--steps", "2"] if q else ["flux:mid", "--resolution", "128",
                                                                        "--batch", "1", "--steps", "4"]
    sets = [a for s in [f"model.base_dtype={base}", *LEAN] for a in ("--set", s)]
    return Step(f"FLUX LoRA {base} base", ["scripts/memory_table.py", "--measure", *size, *sets, "--json",
                                           str(out / f"{stem}.json")], 180, cuda=not q, output=f"{stem}.json",
                check=check_measure)


def family_steps(out: Path, q: bool) -> list[Step]:
    mid = ["--family", "all", "--preset", "tiny", "--tokens", "4", "--batch", "1"] if q else \
        ["--family", "all", "--preset", "mid", "--tokens", "4096", "--batch", "4"]
    flux = ["--family", "flux", "--preset", "tiny", "--tokens", "16", "--batch", "2"] if q else \
        ["--family", "flux", "--preset", "mid", "--fit-batch", "32", "16", "8", "4"]
    buckets = ["--family", "flux", "--preset", "tiny", "--tokens", "16", "--batch", "2", "--grids", "8x12", "12x8"] \
        if q else ["--family", "flux", "--preset", "mid", "--tokens", "1024", "--batch", "8", "--grids", "48x80",
                   "80x48"]
    compiled = ["--compile", "--compile-backend", "eager"] if q else ["--compile"]   # dynamo's graphs either way
    video = ["--device", "cpu", "--tiny"] if q else ["--frames", "11", "21", "--latents", "60x104"]
    return [
        bench_step("FLUX mid routed step", out, "flux_mid", [*flux, *timing(q, 6, 2)], 300, q, blocking_rerun=True),
        bench_step("every family mid routed step", out, "families_mid", [*mid, *timing(q, 4, 2)], 420, q),
        lora_step("bf16", out, q),
        lora_step("fp8", out, q),
        Step("Wan mid long sequences", ["scripts/video_memory_gpu.py", *video, "--routes", "none", "paper",
                                        "--out", str(out / "wan_long.json")], 240, cuda=not q,
             output="wan_long.json", check=check_video),
        bench_step("compiled buckets", out, "buckets", [*buckets, *compiled, *timing(q, 3, 2)], 300, q),
    ]


def dit_steps(args: argparse.Namespace, out: Path) -> list[Step]:
    q = args.quick
    xl = ["--arch", "DiT-S/2", "--tokens", "16", "--batch", "4"] if q else \
        ["--arch", "DiT-XL/2", "--tokens", "256", "--fit-batch", *map(str, args.xl_batches)]
    sizes = ["DiT-S/2:8:4"] if q else ["DiT-B/2:32:128", "DiT-XL/2:32:64"]
    return [
        bench_step("DiT-XL/2 benchmark", out, "dit_xl2", [*xl, *([] if q else ["--compile"]), *timing(q, 8, 3),
                                                          "--sampling", "--sampling-steps", "2" if q else "18"],
                   420, q),
        Step("compare_paper", ["scripts/compare_paper.py", str(args.paper_dir), "--sizes", *sizes, "--precisions",
                               "fp32" if q else "bf16", *timing(q, 6, 3), "--rounds", "1" if q else "2",
                               "--json", str(out / "compare_paper.json")], 420, cuda=not q),
    ]


def steps(args: argparse.Namespace, out: Path) -> list[Step]:
    """The checks in order, the families' first (never measured on a GPU before); --quick shrinks every size so
    that the whole sequence runs on a CPU in a few minutes."""
    gpu_tests = Step("gpu tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"],
                     300)
    out_steps = [gpu_tests, *family_steps(out, args.quick), *dit_steps(args, out)]
    unknown = sorted(set(args.only or ()) - {s.name for s in out_steps})
    if unknown:
        raise SystemExit(f"error: --only {', '.join(unknown)} is not a step; allowed: "
                         f"{', '.join(repr(s.name) for s in out_steps)}")
    if args.paper_dir is None:
        out_steps = [s for s in out_steps if s.name != "compare_paper"]
    return [s for s in out_steps if args.only is None or s.name in args.only]
