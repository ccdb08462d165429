"""The benchmark as a library: `run_benchmark(BenchRequest(...))` times THE training step under several route
configs, interleaved, and optionally the sampler, the FID feature extractor and the data loader.
scripts/benchmark.py is its command line (a BenchRequest field per flag); docs/benchmarks.md explains the figures.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Sequence

import torch

from tread.models.families import FAMILIES
from tread.perf.benchmark import (StepBench, Timed, allow_compiled_configs, bucket_records, split_steps,
                                  step_records, time_interleaved,
                                  time_one_at_a_time)
from tread.perf.fit import largest_fitting
from tread.perf.geometry import choose_geometry, resolution_for_tokens
from tread.perf.memory import MemoryMeter
from tread.perf.overrides import (DEVICES, check_device, check_sets, compose_or_raise, fused_adamw, precision_name,
                                  run_overrides)
from tread.perf.peaks import device_name, device_peak_flops
from tread.perf.routes import routing_overrides
from tread.perf.throughput import eval_feature_throughput, loader_throughput, sampling_throughput
from tread.schema import CONFIG_DIR
from tread.utils.threads import cpu_threads
from tread.utils.errors import UserError
from tread.utils.numbers import MAX_SIDE
from tread.utils.readers import parse_json

DENSE_NAMES = ("none", "dense")
FAMILY_CHOICES = ("dit", "all", *FAMILIES)
PRECISIONS = ("fp32", "bf16")
FEATURES = ("toy_classifier", "inception")
RESERVED = {"model": "--arch / --family", "model.arch": "--arch", "model.preset": "--preset",
            "routing": "--routes", "routing.routes": "--routes", "routing.enabled": "--routes"}


class BenchError(UserError):
    """A bad benchmark input; printed as one line, 'error: ...'."""


@dataclass(frozen=True)
class BenchRequest:
    """What to time: one field per flag of scripts/benchmark.py (--sampling-steps is sampling_steps), the same
    defaults. Checked when built."""

    arch: str = "DiT-S/2"                         # DiT size (model.arch) when family is dit
    family: str = "dit"                           # dit, a diffusers family, or all of them
    preset: str = "tiny"                          # family preset (model.preset)
    resolution: Optional[int] = None              # latent side (None: the arch's usual data)
    tokens: Optional[int] = None                  # tokens per image (square); sets the resolution
    channels: Optional[int] = None                # latent channels (None: the arch's usual data)
    batch: int = 32                               # global batch per step (train.batch_size)
    fit_batch: tuple[int, ...] = ()               # candidate batches: the largest that fits on CUDA replaces batch
    routes: tuple[str, ...] = ("paper",)          # none/dense, a configs/routing preset, or a JSON list of routes
    grids: tuple[str, ...] = ()                   # bucket grids "HxW": each config then steps on each in turn
    sets: tuple[str, ...] = ()                    # Hydra overrides of the training config, as for train.py
    steps: int = 10                               # timed steps per config
    warmup: int = 3                               # untimed steps per config
    rounds: int = 2                               # interleaved timing rounds
    one_at_a_time: bool = False                   # build, time and free one config at a time, per round
    threads: Optional[int] = None                 # torch CPU threads while timing (None: torch's)
    device: str = "auto"                          # auto, cpu (train.cpu), cuda
    precision: Optional[str] = None               # train.mixed_precision: fp32 | bf16 (None: the config's)
    gradient_checkpointing: bool = False          # model.gradient_checkpointing
    unfused_adamw: bool = False                   # optimizer.fused=false
    compile: bool = False                         # train.compile
    compile_backend: Optional[str] = None         # train.compile_backend (None: the config's)
    cache_dir: Optional[str] = None               # paths.cache_dir
    sampling: bool = False                        # also time the dense config's sampler
    sampling_steps: int = 40                      # sampler steps
    eval_features: bool = False                   # also time the FID feature extractor
    features: str = "toy_classifier"              # toy_classifier | inception
    inception_weights: Optional[str] = None       # local Inception weights
    image_size: int = 32                          # image side for eval_features
    eval_batch: Optional[int] = None              # images per extractor call (None: batch)
    eval_repeats: int = 5                         # extractor calls timed
    data_loader: bool = False                     # also time the training data loader
    data_path: Optional[str] = None               # a latent dataset for data_loader (None: the built-in data)
    loader_workers: int = 0                       # DataLoader workers for data_loader

    def __post_init__(self):
        object.__setattr__(self, "routes", tuple(self.routes))
        object.__setattr__(self, "sets", tuple(self.sets))
        object.__setattr__(self, "fit_batch", tuple(self.fit_batch or ()))
        object.__setattr__(self, "grids", tuple(self.grids or ()))
        check_request(self)

    @property
    def grid_sizes(self) -> list[tuple[int, int]]:
        """--grids as (H, W) pairs (checked when the request is built)."""
        return [parse_grid(g) for g in self.grids]


GRID = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def parse_grid(text: str) -> tuple[int, int]:
    """'24x16' -> (24, 16): a bucket's latent height x width, each 1..MAX_SIDE."""
    m = GRID.match(text)
    if not m or max(int(m[1]), int(m[2])) > MAX_SIDE:
        raise BenchError(f"--grids {text!r} is not a latent grid; allowed: HxW with H and W integers in "
                         f"[1, {MAX_SIDE}], e.g. 24x16")
    return int(m[1]), int(m[2])


def check_request(args: BenchRequest) -> None:
    for flag, value, allowed in (("--family", args.family, FAMILY_CHOICES), ("--device", args.device, DEVICES),
                                 ("--precision", args.precision, (None, *PRECISIONS)),
                                 ("--features", args.features, FEATURES)):
        if value not in allowed:
            raise BenchError(f"{flag} {value} is not allowed; allowed: {', '.join(a for a in allowed if a)}")
    for flag, v in {"--steps": args.steps, "--rounds": args.rounds, "--batch": args.batch,
                    "--resolution": args.resolution, "--channels": args.channels, "--tokens": args.tokens,
                    "--threads": args.threads, "--sampling-steps": args.sampling_steps}.items():
        if v is not None and v < 1:
            raise BenchError(f"{flag} {v} is not allowed; it must be an integer >= 1")
    if any(b < 1 for b in args.fit_batch):
        raise BenchError(f"--fit-batch {' '.join(map(str, args.fit_batch))} is not allowed; each must be an integer >= 1")
    if args.fit_batch and (args.device == "cpu" or not torch.cuda.is_available()):
        raise BenchError("--fit-batch finds the largest batch that fits in a CUDA device's memory and this run has "
                         "no CUDA device; allowed here: --batch N")
    for grid in args.grids:
        parse_grid(grid)
    if args.grids and args.one_at_a_time:
        raise BenchError("--grids steps each built config on every grid after timing, and --one-at-a-time frees each "
                         "config after its round; allowed: one of them")
    if args.warmup < 0:
        raise BenchError(f"--warmup {args.warmup} is not allowed; it must be an integer >= 0")
    check_sets(args.sets, RESERVED, BenchError)
    check_device(args.device, BenchError)


def route_configs(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(label, routing overrides) per --routes entry, with a dense config first when none is dense."""
    configs = [("dense" if s in DENSE_NAMES else s, routing_spec(s)) for s in specs]
    if not any(is_dense(ov) for _, ov in configs):
        configs.insert(0, ("dense", ["routing=none"]))
    return configs


def is_dense(routing_ov: Sequence[str]) -> bool:
    return list(routing_ov) == ["routing=none"]


def routing_spec(spec: str) -> list[str]:
    """A preset name from configs/routing (paper, balanced, ...), none/dense, or a JSON list of routes."""
    return list(_routing_spec(spec))


@functools.lru_cache(maxsize=64)
def _routing_spec(spec: str) -> tuple[str, ...]:
    """routing_spec, once per spec in a process (a preset is read by composing a config: most of a second)."""
    return tuple(_read_routing_spec(spec))


def _read_routing_spec(spec: str) -> list[str]:
    presets = sorted(p.stem for p in (CONFIG_DIR / "routing").glob("*.yaml") if not p.stem.startswith("_"))
    if spec in DENSE_NAMES:
        return ["routing=none"]
    if spec in presets:
        routing = compose_or_raise([f"routing={spec}"], BenchError).routing
        return [f"routing={spec}"] if routing.enabled and routing.routes else ["routing=none"]
    routes = parse_json(spec, f"--routes {spec!r}", f"none/dense, a preset ({', '.join(presets)}) or a JSON list of "
                        f"routes", BenchError)
    try:
        return routing_overrides([routes] if isinstance(routes, dict) else routes)
    except (KeyError, TypeError):
        raise BenchError(f"--routes {spec!r}: each route is a JSON object with selection_ratio, start_layer_idx "
                         f"and end_layer_idx") from None


def model_overrides(args: BenchRequest, family: Optional[str], dense: bool) -> list[str]:
    if family is None:
        return [f"model={'dit' if dense else 'tread'}", f"model.arch={args.arch}"]
    return [f"model={family}", f"model.preset={args.preset}"]


def base_overrides(args: BenchRequest, family: Optional[str]) -> tuple[list[str], Any]:
    """Everything but the model and routing overrides, and the geometry (see tread/perf/geometry.py)."""
    tail = ([f"train.batch_size={args.batch}"]
            + run_overrides(args.precision, args.device, args.compile, args.compile_backend)
            + (["model.gradient_checkpointing=true"] if args.gradient_checkpointing else [])
            + (["optimizer.fused=false"] if args.unfused_adamw else [])
            + ([f"paths.cache_dir={args.cache_dir}"] if args.cache_dir else []))
    probe = compose_or_raise(model_overrides(args, family, True) + tail + list(args.sets), BenchError)
    resolution = args.resolution if args.tokens is None else resolution_for_tokens(probe.model, args.tokens)
    geometry = choose_geometry(probe.model, probe.data, resolution, args.channels)
    return geometry.overrides + tail, geometry


def config_overrides(args: BenchRequest, family: Optional[str]) -> tuple[list[tuple[str, list[str], bool]],
                                                                         Any, list[str]]:
    """(label, overrides, dense) per route config, the geometry, and the overrides all configs share."""
    tail, geometry = base_overrides(args, family)
    configs = [(label, model_overrides(args, family, is_dense(ov)) + tail + ov + list(args.sets), is_dense(ov))
               for label, ov in route_configs(args.routes)]
    return configs, geometry, model_overrides(args, family, False) + tail + list(args.sets)


# ----------------------------------------------------------------------------- one model, all configs
def fitted(args: BenchRequest, family: Optional[str]) -> tuple[BenchRequest, Optional[dict]]:
    """args with --fit-batch resolved into batch (tread/perf/fit.py): the dense config, eager, two steps per
    candidate; and what was tried. Unchanged without --fit-batch."""
    if not args.fit_batch:
        return args, None

    def try_batch(batch: int) -> None:
        trial = replace(args, batch=batch, compile=False, fit_batch=())
        dense = next(ov for _, ov, is_dense in config_overrides(trial, family)[0] if is_dense)
        bench = StepBench(compose_or_raise(dense, BenchError))
        bench.step()
        bench.step()
        torch.cuda.synchronize(bench.device)

    batch, too_big = largest_fitting(args.fit_batch, try_batch)
    if batch is None:
        raise BenchError(f"--fit-batch: none of {', '.join(map(str, args.fit_batch))} fits in this GPU's memory "
                         f"(the dense step ran out of memory at each); allowed: smaller candidates")
    return replace(args, batch=batch, fit_batch=()), {"candidates": sorted(args.fit_batch), "out_of_memory": too_big,
                                                       "chosen": batch}


def bench_model(args: BenchRequest, family: Optional[str], peak: Optional[float]) -> dict:
    """Build every route config of one model, time them interleaved; records, model info and sampling."""
    args, fit = fitted(args, family)
    configs, geometry, shared = config_overrides(args, family)
    allow_compiled_configs(len(configs))
    checked = [compose_or_raise(overrides, BenchError) for _, overrides, _ in configs]
    if args.one_at_a_time:
        benches, meas = time_one_at_a_time([partial(StepBench, c) for c in checked], args.steps, args.warmup,
                                           args.rounds)
    else:
        benches = [StepBench(c) for c in checked]
        meas = time_interleaved(benches, args.steps, args.warmup, args.rounds, MemoryMeter(benches[0].device))
    if args.grids:
        for bench, m in zip(benches, meas):
            m["buckets"] = bucket_records(bench, args.grid_sizes, args.steps, args.warmup)
    dev = benches[0].device
    meter = MemoryMeter(dev)
    timed = [Timed(label, b, m) for (label, _, _), b, m in zip(configs, benches, meas)]
    base = next(i for i, (_, _, dense) in enumerate(configs) if dense)
    config, model = timed[base].bench.cfg, timed[base].bench.model
    name = str(config.model.arch) if family is None else f"{family}/{args.preset}"
    info = {"model": name, "family": family or "dit", "resolution": int(model.input_size),
            "channels": int(model.in_channels), "tokens": int(model.num_tokens), "depth": int(model.depth),
            "params": sum(p.numel() for p in model.parameters()),
            "geometry": geometry.line(model.num_tokens, "timing", "--resolution/--tokens/--channels time others"),
            "flops_source": ("analytic (tread/models/flops.py, = DiT.forward_flops)" if model.analytic_flops
                             else "torch FlopCounterMode, one forward (tread/models/flops.py)"),
            "overrides": shared, "config": config, "meter": meter.method, "device": dev, "fit_batch": fit}
    out = {"info": info, "results": step_records(timed, base, peak, name, meter.method)}
    if args.sampling:
        out["sampling"] = sampling_throughput(timed[base].bench, args.sampling_steps, name)
    return out


def settings_of(args: BenchRequest, infos: list[dict], peak: Optional[float], note: str) -> dict:
    first, config = infos[0], infos[0]["config"]
    t = config.train
    return {
        "model": first["model"] if len(infos) == 1 else "all families", "family": args.family,
        "arch": args.arch if args.family == "dit" else None, "preset": args.preset if args.family != "dit" else None,
        "resolution": first["resolution"], "channels": first["channels"], "tokens": first["tokens"],
        "depth": first["depth"], "params": first["params"], "geometry": first["geometry"],
        "models": [{k: v for k, v in i.items() if k not in ("config", "meter", "device")} for i in infos],
        "overrides": first["overrides"], "batch": t.batch_size, "fit_batch": first["fit_batch"],
        "grad_accum_steps": t.grad_accum_steps, "lr": float(config.optimizer.lr),
        "label_dropout": float(t.label_dropout), "grad_clip": t.grad_clip, "ema_decay": float(config.ema.decay),
        "device": str(first["device"]), "device_name": device_name(first["device"]), "threads": torch.get_num_threads(),
        "precision": precision_name(t, first["device"]), "compile": bool(args.compile),
        "compile_backend": t.compile_backend if args.compile else None, "fused_adamw": fused_adamw(config.optimizer),
        "gradient_checkpointing": config.model.gradient_checkpointing, "torch": torch.__version__,
        "steps": args.steps, "warmup": args.warmup, "rounds": len(split_steps(args.steps, args.rounds)),
        "one_at_a_time": bool(args.one_at_a_time),
        "route_specs": [label for label, _ in route_configs(args.routes)], "flops_source": first["flops_source"],
        "flops_per_step": "3 x forward FLOPs per sample x batch (multiply-add = 2)",
        "step": "tread.training.step.TrainStep of the composed config (what train.py runs)",
        "peak_flops": peak, "mfu_note": note, "peak_mem_method": first["meter"]}


def run_benchmark(args: BenchRequest) -> dict:
    """Time every route config of every model asked for; {"settings", "results"[, "sampling", "eval", "loader"]}
    (what scripts/benchmark.py --json writes). Runs on args.threads torch threads; the caller keeps its own."""
    families = [None] if args.family == "dit" else (list(FAMILIES) if args.family == "all" else [args.family])
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    peak, note = device_peak_flops(device_name(torch.device("cuda")) if cuda else None)
    if cuda and args.precision != "bf16" and peak:
        note += "; MFU is against the bf16 peak whatever the run's precision"
    with cpu_threads(args.threads):
        runs = [bench_model(args, family, peak) for family in families]
        out: dict[str, Any] = {"settings": settings_of(args, [r["info"] for r in runs], peak, note),
                               "results": [rec for r in runs for rec in r["results"]]}
        samplings = [r["sampling"] for r in runs if "sampling" in r]
        if samplings:
            out["sampling"] = samplings[0] if len(samplings) == 1 else samplings
        paths, device = runs[0]["info"]["config"].paths, runs[0]["info"]["device"]
        if args.eval_features:
            out["eval"] = eval_feature_throughput(args.features, args.image_size, args.eval_batch or args.batch,
                                                  args.eval_repeats, device, paths.cache_dir, args.inception_weights)
        if args.data_loader:
            out["loader"] = loader_throughput(args.data_path, paths.cache_dir, args.batch,
                                              args.loader_workers, max(10, args.steps), device,
                                              out["results"][0]["step_ms"])
    return out
