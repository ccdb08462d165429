"""Memory per GPU of full fine-tuning and LoRA under DDP and FSDP for the model presets, from meta-device
parameter counts (nothing allocated); --measure steps one preset's LoRA run here (docs/scaling.md).

    python scripts/memory_table.py                          # every DiT / family preset, FSDP over 2 and 8 GPUs
    python scripts/memory_table.py --preset flux:dev --preset DiT-XL/2 --lora-rank 32
    python scripts/memory_table.py --measure flux:mid --set model.base_dtype=bf16 --set optimizer=adamw8bit
    python scripts/memory_table.py --video wan:mid         # saved activations of the video step
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tread.cli.args import MAX_BATCH, MAX_CHANNELS, MAX_FRAMES, MAX_ROUNDS, MAX_SIDE, MAX_WORLD, Parser, int_in
from tread.cli.errors import user_errors
from tread.schema.builders import build_model
from tread.models.families import FAMILIES, family_module
from tread.perf.benchmark import StepBench
from tread.perf.memory import (MemoryMeter, ParamCounts, count_params, data_channels, map_large_allocations,
                               markdown_table, memory_per_gpu, memory_rows, release_free_memory, static_bytes,
                               table_presets)
from tread.perf.overrides import check_sets, compose_or_raise
from tread.perf.context_memory import context_table
from tread.perf.video_memory import (CPU_FRAMES, CPU_LATENTS, GPU_FRAMES, GPU_LATENTS, activation_rows,
                                     activation_table, video_table)
from tread.schema.model import AdamW8bit, FamilyModel
from tread.utils.errors import UserError

GiB = 2 ** 30


class MemoryTableError(UserError):
    """A --preset that names no known model preset, or a --measure run that cannot be built."""


def parse_presets(names: Optional[Sequence[str]]) -> Optional[list[tuple[str, str]]]:
    """--preset FAMILY:PRESET or a DiT name -> (family, preset) pairs; None: all."""
    if not names:
        return None
    known = table_presets()
    chosen = []
    for name in names:
        pair = ("dit", name) if name.startswith("DiT-") else tuple(name.split(":", 1))
        if pair not in known:
            allowed = ", ".join(p if f == "dit" else f"{f}:{p}" for f, p in known)
            raise MemoryTableError(f"--preset {name!r} is not a preset of the table; allowed: {allowed}.")
        chosen.append(pair)
    return chosen


def measure_overrides(family: str, preset: str, lora_rank: int, batch: int, resolution: int,
                      sets: Sequence[str]) -> list[str]:
    """`train.py` overrides of the measured run: the table's LoRA (rank on the family's lora_targets) on the
    preset's latent channels at `resolution` (the built-in class-labelled data's shape), eager, then `sets`."""
    targets = ",".join(family_module(family).FAMILY.lora_targets)
    return [f"model={family}", f"model.preset={preset}", f"model.lora={{rank:{lora_rank},target_modules:[{targets}]}}",
            f"data.channels={data_channels(family, preset)}", f"data.builtin_args.resolution={resolution}",
            f"train.batch_size={batch}", "train.compile=false", "eval.every_steps=0", "eval.at_end=false", *sets]


def run_counts(model: FamilyModel, lora_rank: int) -> ParamCounts:
    """The table's counts for the measured run's model section (built on the meta device without its adapters,
    quantization or low-precision base), with its class table (the built-in data is class-labelled) counted as
    trained, like the adapters."""
    spec = {**model.plain(), "lora": None, "quantize": None, "base_dtype": "fp32"}
    with torch.device("meta"):
        plain = build_model(spec)
    counts = count_params(plain, lora_rank, type(plain).lora_targets)
    table = tuple(p.numel() for p in plain.conditioner.parameters()) if plain.conditioner is not None else ()
    return dataclasses.replace(counts, total=counts.total - sum(table), lora=counts.lora + sum(table),
                               lora_sizes=counts.lora_sizes + table)


def measure(family: str, preset: str, sets: Sequence[str] = (), *, lora_rank: int = 16, steps: int = 3,
            batch: int = 2, resolution: int = 32) -> dict[str, Any]:
    """Build the LoRA run of measure_overrides as train.py would and run `steps` steps on a synthetic batch.
    Returns bytes ("static", "estimate": the DDP figure less gradients, "built": what the process holds once built,
    "peak": its peak over the steps; on CUDA the allocator's figures, else the RSS) plus the settings read from the
    composed config and the steps' losses."""
    config = compose_or_raise(measure_overrides(family, preset, lora_rank, batch, resolution, sets), MemoryTableError)
    model, optimizer = config.model, config.optimizer
    if not model.family:
        raise MemoryTableError(f"--measure runs a family preset's LoRA; the overrides {list(sets)} made model="
                               f"{model.target}.")
    settings = {"base_dtype": model.base_dtype, "ema": config.ema.mode, "adam_block":
                optimizer.block_size if isinstance(optimizer, AdamW8bit) else None}
    estimate = memory_per_gpu(run_counts(model, lora_rank), "ddp", 1, True, model.quantize, **settings)
    map_large_allocations()
    bench = StepBench(config)
    release_free_memory()
    meter = MemoryMeter(bench.device)       # CUDA's allocator, or the RSS and its peak from /proc/self
    if meter.method == "cpu_ru_maxrss_delta":
        raise MemoryTableError("--measure reads the peak RSS from /proc/self (Linux); it is not readable here.")
    meter.start()
    built = meter.base
    for _ in range(steps):
        bench.step()
    return {**settings, "quantize": model.quantize, "precision": bench.accelerator.mixed_precision,
            "device": str(bench.device), "method": meter.method, "resolution": resolution, "batch": batch,
            "tokens": int(bench.model.num_tokens), "static": static_bytes(bench.parts),
            "estimate": estimate["total"] - estimate["grads"], "built": built, "peak": built + meter.stop(),
            **bench.loss_record()}


def measure_line(name: str, sets: Sequence[str], m: dict[str, Any]) -> str:
    """One markdown row of a --measure result (GiB)."""
    shown = " ".join(sets) or "the defaults"
    cells = [f"{m[k] / GiB:.2f}" for k in ("static", "estimate", "built", "peak")]
    return (f"| {name} | {shown} | {m['precision']} | {m['resolution']}x{m['resolution']} ({m['tokens']} tokens) | "
            + " | ".join(cells) + f" | {m['method']} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = Parser(prog="memory_table.py", description=__doc__, error_type=MemoryTableError)
    parser.add_argument("--world", type=int_in(2, MAX_WORLD), nargs="+", default=[2, 8], help="FSDP world sizes (GPUs)")
    parser.add_argument("--lora-rank", type=int_in(1, MAX_CHANNELS), default=16,
                        help="LoRA rank on the attention projections")
    parser.add_argument("--preset", action="append", help="FAMILY:PRESET (flux:dev) or a DiT (DiT-XL/2); repeatable")
    parser.add_argument("--measure", metavar="FAMILY:PRESET", help="build and step this preset's LoRA run here")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="with --measure: a training-config override, e.g. model.base_dtype=bf16; repeatable")
    parser.add_argument("--steps", type=int_in(1, MAX_ROUNDS), default=3, help="with --measure: training steps")
    parser.add_argument("--batch", type=int_in(1, MAX_BATCH), default=2, help="with --measure: the batch")
    parser.add_argument("--resolution", type=int_in(1, MAX_SIDE), default=32,
                        help="with --measure: the latent side (FLUX: 128 for 1024 px)")
    parser.add_argument("--json", default=None, help="with --measure: also write the result here")
    add_video_args(parser)
    with user_errors():
        args = parser.parse_args(argv)
        if args.video:
            return video_main(args)
        if args.measure:
            return measure_main(args)
        rows = memory_rows(args.world, args.lora_rank, parse_presets(args.preset))
    print(markdown_table(rows))
    print(NOTE)


def measure_preset(name: str) -> tuple[str, str]:
    """--measure FAMILY:PRESET: any preset of a family (tiny included), or MemoryTableError naming the allowed."""
    family, _, preset = name.partition(":")
    if family not in FAMILIES or preset not in family_module(family).PRESETS:
        allowed = "; ".join(f"{f}:{'|'.join(family_module(f).PRESETS)}" for f in FAMILIES)
        raise MemoryTableError(f"--measure {name!r} is not a family preset (LoRA runs are the families'); allowed: "
                               f"{allowed}.")
    return family, preset


def measure_main(args: argparse.Namespace) -> None:
    """--measure: one LoRA run built and stepped here, its figures beside the table's (and as JSON with --json)."""
    family, preset = measure_preset(args.measure)
    check_sets(args.sets, {"model.lora": "--lora-rank", "model.preset": "--measure",
                           "data.builtin_args.resolution": "--resolution", "train.batch_size": "--batch"},
               MemoryTableError)
    result = measure(family, preset, args.sets, lora_rank=args.lora_rank, steps=args.steps, batch=args.batch,
                     resolution=args.resolution)
    if args.json:
        Path(args.json).write_text(json.dumps({"run": args.measure, "settings": list(args.sets), **result}, indent=1))
    print(MEASURE_HEAD + "\n" + measure_line(args.measure, args.sets, result))


def add_video_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--video", metavar="FAMILY:PRESET", help="measure the saved activations of this video preset's step here "
        "(gradient checkpointing, --routes), then carry them to --to-latents x --to-frames")
    add("--routes", nargs="+", default=["none", "paper"], help="with --video: routing configs, the dense one first")
    add("--frames", type=int_in(1, MAX_FRAMES), nargs="+", default=list(CPU_FRAMES),
        help="with --video: latent frames measured")
    add("--latents", default="x".join(map(str, CPU_LATENTS)), help="with --video: latent HxW measured")
    add("--to-frames", type=int_in(1, MAX_FRAMES), nargs="+", default=list(GPU_FRAMES),
        help="with --video: frames of the table")
    add("--to-latents", default="x".join(map(str, GPU_LATENTS)), help="with --video: latent HxW of the table")
    add("--context-parallel", type=int_in(1, MAX_WORLD), default=1, metavar="DEGREE",
        help="with --video: also the table per process of a context group of DEGREE (tokens, activations, all-to-all)")


def latent_size(flag: str, value: str) -> tuple[int, int]:
    """'60x104' -> (60, 104), or MemoryTableError naming the flag."""
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise MemoryTableError(f"{flag} {value!r} is not a latent size; allowed: HxW in latent cells, e.g. 60x104.")
    return int(parts[0]), int(parts[1])


def video_main(args: argparse.Namespace) -> None:
    """--video: the measured rows (activation_table), then the full-size table (video_table)."""
    family, _, preset = args.video.partition(":")
    latents, to_latents = latent_size("--latents", args.latents), latent_size("--to-latents", args.to_latents)
    if len(set(args.frames)) < 2 or min(args.frames + args.to_frames) < 1 or args.routes[0] != "none":
        raise MemoryTableError(f"--frames {args.frames} / --to-frames {args.to_frames} / --routes {args.routes}: "
                               f"allowed: two or more distinct frame counts >= 1, routes starting with none.")
    rows = activation_rows(family, preset, args.frames, latents, args.routes)
    print(activation_table(rows) + "\n\n" + video_table(rows, args.to_frames, to_latents))
    if args.context_parallel > 1:
        print("\n" + context_table(rows, args.context_parallel, args.to_frames, to_latents))


MEASURE_HEAD = ("| run | settings | autocast | latents | static counted (GiB) | table (GiB) | built (GiB) | peak (GiB) "
                "| memory read by |\n|---|---|---|---|---|---|---|---|---|")
NOTE = """
Static bytes per GPU: fp32 weights, fp32 gradients of the trained parameters, AdamW's two fp32 moments and the EMA copy;
FSDP divides them by the world size and adds the all-gathered root group and two blocks. Activations are not counted.
bf16 mixed precision (autocast) keeps the fp32 master weights, so these figures hold for it too.
LoRA: rank x (in + out) per attention projection. bf16: model.base_dtype=bf16 (every frozen Linear in bf16); fp8: the
blocks' Linear weights in float8 + one fp32 scale per output row, the other Linear layers bf16; lean: ema.mode=trained
(the EMA holds the trained parameters only) + optimizer=adamw8bit (8-bit moments, one fp32 scale per 256 values);
int8/int4/nf4: model.quantize, the blocks' Linear weights at 8/4/4 bits + one fp32 scale per output row (int8) or per
64 values (int4, nf4). A quantized or fp8 base is shared by the EMA (counted once). DDP columns: replicated per GPU."""
