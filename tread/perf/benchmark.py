"""Timing the training step (tread.training.step.TrainStep) of a checked training config (tread.schema.check_train)
built as train() builds it, on a fixed synthetic batch; configs are timed in interleaved rounds (docs/benchmarks.md).
"""
from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch._dynamo.config as dynamo_config
from torch._dynamo.utils import counters

from tread.models.flops import model_forward_flops, train_step_flops
from tread.perf.memory import MemoryMeter, static_bytes
from tread.perf.peaks import fraction_of_bound, mfu, speedup_bound
from tread.perf.routes import route_dicts
from tread.schema.train import TrainConfig
from tread.training.setup import build_parts, make_accelerator, seed_streams
from tread.training.step import StepStats
from tread.training.trainer import Trainer

GRAPH_KEYS = ("unique_graphs", "graph_breaks")


def synthetic_batch(model: torch.nn.Module, batch: int, device: torch.device, seed: int = 0,
                    grid: Optional[tuple[int, int]] = None) -> tuple:
    """(x, labels) of the model's input shape: x (B, C, R, R) (or B, C, H, W for a bucket's `grid`), or
    (B, C, T, ., .) for video models with frames > 1, and labels below the model's class count; the same for every
    config of one geometry."""
    shape = [batch, model.in_channels, *(grid or (model.input_size, model.input_size))]
    if model.frames_axis and model.frames > 1:
        shape.insert(2, model.frames)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    y = torch.randint(0, model.num_classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of fn takes, synchronising CUDA around it."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class StepBench:
    """THE training step of one checked training config (kept as `cfg`), as the Trainer builds it: `parts` are the
    run's model, objective, EMA and optimizer, `batch` the synthetic micro-batch on the device; its Accelerator is
    made as train() makes it."""

    def __init__(self, config: TrainConfig):
        self.cfg = config
        self.accelerator = make_accelerator(self.cfg.train)
        self.parts = build_parts(self.cfg, self.accelerator)
        seed_streams(self.cfg.train.seed, self.cfg.routing.seed, self.parts.model, self.accelerator.process_index)
        self.parts.prepare()
        self.parts.net.train()
        self.train_step = Trainer.make_step(self.cfg, self.parts, dataset=None)
        self.step_index = 0
        self.micro = self.cfg.micro_batch(self.accelerator.num_processes)
        self.batch = synthetic_batch(self.parts.model, self.micro, self.device)
        self.losses: list[torch.Tensor] = []      # every step's loss, on the device (read after timing)
        self.built_fingerprint = self.trained_fingerprint()
        self.released_fingerprint: Optional[float] = None      # taken by release()

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def model(self) -> torch.nn.Module:
        return self.parts.model

    def step(self, batch: Optional[tuple] = None) -> StepStats:
        """One optimizer update, the loop's step number `step_index`; each of its grad_accum_steps micro-batches
        is `batch` (default: the synthetic batch)."""
        stats = self.train_step(itertools.repeat(self.batch if batch is None else batch), self.step_index)
        self.step_index += 1
        self.losses.append(stats.loss)
        return stats

    def trained_fingerprint(self) -> float:
        """The sum of squares of the trained parameters (float64): an update that changes any of them moves it."""
        with torch.no_grad():
            return float(sum(p.detach().double().square().sum() for p in self.parts.model.parameters()
                             if p.requires_grad))

    def loss_record(self) -> dict:
        """Every step's loss so far, whether all are finite, and whether the trained parameters moved since the
        build (a step that updates nothing, e.g. skipped as non-finite every time, leaves them where they were)."""
        losses = [float(v) for v in self.losses]
        now = self.trained_fingerprint() if self.released_fingerprint is None else self.released_fingerprint
        return {"losses": losses, "loss_finite": all(map(math.isfinite, losses)),
                "params_moved": now != self.built_fingerprint}

    def timed(self, steps: int) -> list[float]:
        """Seconds of each of `steps` steps on the synthetic batch."""
        return [timed(self.step, self.device) for _ in range(steps)]

    def forward_flops(self) -> float:
        """Forward FLOPs per sample with this config's routes (what the training loop logs)."""
        return model_forward_flops(self.parts.model)

    def routes(self) -> list[dict]:
        return route_dicts(self.parts.model.routing.routes)

    def static_bytes(self) -> int:
        return static_bytes(self.parts)

    def release(self) -> None:
        """Free this config's memory (weights, gradients, optimizer state, EMA, batch): the model and its EMA move
        to the meta device, so what a record reads (config, routes, FLOPs counted shape-only, losses) stays."""
        self.released_fingerprint = self.trained_fingerprint()
        self.parts.optimizer.zero_grad(set_to_none=True)
        self.parts.optimizer.state.clear()
        self.parts.model.to("meta")
        self.parts.ema.to("meta")
        self.batch = None
        self.accelerator.free_memory()
        gc.collect()


# ----------------------------------------------------------------------------- interleaved timing
def split_steps(steps: int, rounds: int) -> list[int]:
    """`steps` split into at most `rounds` near-equal rounds."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks so far in this process (torch._dynamo counters)."""
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def allow_compiled_configs(n: int) -> None:
    """Every config compiles its own model's routed forward, and dynamo caches per code object: raise its
    recompile limit so n configs (each a few route shapes) never fall back to eager."""
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key):
            setattr(dynamo_config, key, max(getattr(dynamo_config, key), 16 * n + 16))


def _new_measurement() -> dict:
    return {"times": [], "transient": 0, "timed": dict.fromkeys(GRAPH_KEYS, 0)}


def _warm_up(bench: StepBench, warmup: int) -> dict:
    """`warmup` untimed steps (compilation happens here); the graphs and graph breaks they compiled."""
    before = dynamo_counts()
    for _ in range(warmup):
        bench.step()
    sync(bench.device)
    return _delta(dynamo_counts(), before)


def _time_round(bench: StepBench, n: int, meter: MemoryMeter, o: dict) -> None:
    """n timed steps into measurement o: their times, the transient memory peak, the graphs compiled meanwhile."""
    before = dynamo_counts()
    meter.start()
    o["times"] += bench.timed(n)
    o["transient"] = max(o["transient"], meter.stop())
    d = _delta(dynamo_counts(), before)
    o["timed"] = {k: o["timed"][k] + d[k] for k in GRAPH_KEYS}


def time_interleaved(benches: Sequence[StepBench], steps: int, warmup: int, rounds: int,
                     meter: MemoryMeter) -> list[dict]:
    """Warm every config up (compilation happens here), then time them in interleaved rounds; per config the step
    times, memory peak, static bytes and the graphs and graph breaks compiled."""
    out = [_new_measurement() for _ in benches]
    for bench, o in zip(benches, out):
        o["warmup"] = _warm_up(bench, warmup)
    for n in split_steps(steps, rounds):
        for bench, o in zip(benches, out):
            _time_round(bench, n, meter, o)
    for bench, o in zip(benches, out):
        o["static"] = bench.static_bytes()
    return out


def time_one_at_a_time(builders: Sequence[Callable[[], StepBench]], steps: int, warmup: int,
                       rounds: int) -> tuple[list[StepBench], list[dict]]:
    """time_interleaved for models of which two configs do not fit in memory: each round builds, warms up, times
    and releases each config in turn (the same seed gives the same weights). Returns the released benches and
    time_interleaved's measurements."""
    out = [_new_measurement() for _ in builders]
    benches: list[StepBench] = []
    for n in split_steps(steps, rounds):
        benches = []
        for build, o in zip(builders, out):
            bench = build()
            warm = _warm_up(bench, warmup)
            o.setdefault("warmup", warm)
            _time_round(bench, n, MemoryMeter(bench.device), o)
            o["static"] = bench.static_bytes()
            bench.release()
            benches.append(bench)
    return benches, out


def bucket_records(bench: StepBench, grids: Sequence[tuple[int, int]], steps: int, warmup: int) -> list[dict]:
    """The same StepBench on each bucket's latent grid (H, W) in turn, as bucketed training feeds them, then the
    first grid again: per grid the graphs compiled by its first `warmup` steps (a new shape: one graph per bucket
    under train.compile), those compiled while its `steps` were timed (0 for a clean bucket), and its step time."""
    out = []
    for grid in [*grids, grids[0]]:
        bench.model.check_size(*grid, bench.model.frames)
        batch = synthetic_batch(bench.model, bench.micro, bench.device, grid=grid)
        before = dynamo_counts()
        for _ in range(max(1, warmup)):
            bench.step(batch)
        sync(bench.device)
        warm, before = _delta(dynamo_counts(), before), dynamo_counts()
        times = [timed(lambda: bench.step(batch), bench.device) for _ in range(steps)]
        out.append({"grid": list(grid), "tokens": int(bench.model.tokens_in(batch[0])), "warmup": warm,
                    "timed": _delta(dynamo_counts(), before), "step_ms": 1e3 * statistics.median(times)})
    out[-1]["revisit"] = True
    return out


# ----------------------------------------------------------------------------- records
@dataclass
class Timed:
    """A config timed: its label, its StepBench and what time_interleaved measured."""

    label: str
    bench: StepBench
    meas: dict

    @property
    def median_s(self) -> float:
        return statistics.median(self.meas["times"])


def compile_record(t: Timed) -> dict:
    """Graphs compiled in the warm-up, and recompiles and graph breaks while timed (both 0 for a clean step)."""
    warm, tm = t.meas["warmup"], t.meas["timed"]
    return {"backend": t.bench.cfg.train.compile_backend, "warmup": warm, "recompiles_timed": tm["unique_graphs"],
            "graph_breaks_timed": tm["graph_breaks"], "graph_breaks": warm["graph_breaks"] + tm["graph_breaks"]}


def step_records(timed_configs: Sequence[Timed], base: int, peak: Optional[float], model_name: str,
                 mem_method: str) -> list[dict]:
    """One result record per config: time, throughput, memory, FLOPs, speedup against config `base` (dense),
    its FLOPs bound and the fraction of it realised, MFU (CUDA with a known peak), compile counts."""
    batch = int(timed_configs[0].bench.cfg.train.batch_size)
    forward = [t.bench.forward_flops() for t in timed_configs]
    flops = [train_step_flops(f, batch) for f in forward]
    base_s, out = timed_configs[base].median_s, []
    for i, t in enumerate(timed_configs):
        med, model = t.median_s, t.bench.model
        speedup, achieved = base_s / med, flops[i] / med
        rec = {"model": model_name, "family": str(t.bench.cfg.model.family or "dit"),
               "preset": t.bench.cfg.model.preset, "config": t.label, "dense": not model.routing.enabled,
               "baseline": i == base, "routes": t.bench.routes(), "tokens": int(model.num_tokens), "batch": batch,
               "step_ms": 1e3 * med, "step_ms_all": [1e3 * s for s in t.meas["times"]],
               "images_per_s": batch / med, "tokens_per_s": batch * model.num_tokens / med,
               "peak_mem_bytes": t.meas["static"] + t.meas["transient"], "static_mem_bytes": t.meas["static"],
               "step_mem_bytes": t.meas["transient"], "peak_mem_method": mem_method, "forward_flops_per_sample": forward[i],
               "train_flops_per_step": flops[i], "flops_ratio": flops[i] / flops[base], "speedup": speedup,
               "speedup_bound": speedup_bound(flops[base], flops[i]),
               "fraction_of_bound": fraction_of_bound(speedup, flops[base], flops[i]),
               "achieved_flops_per_s": achieved, "mfu": mfu(achieved, peak) if t.bench.device.type == "cuda" else None}
        rec.update(t.bench.loss_record())
        if "buckets" in t.meas:
            rec["buckets"] = t.meas["buckets"]
        if t.bench.parts.compiled:
            rec["compile"] = compile_record(t)
        out.append(rec)
    return out


class PairedTimer:
    """Times configs one at a time against a dense baseline that stays built: each call builds the other
    config's StepBench, times both in interleaved rounds and frees it; dense_times collects every dense step."""

    def __init__(self, dense: TrainConfig, steps: int, warmup: int, rounds: int, max_configs: int = 16):
        allow_compiled_configs(max_configs + 1)
        self.steps, self.warmup, self.rounds = steps, warmup, rounds
        self.dense = StepBench(dense)
        self.meter = MemoryMeter(self.dense.device)
        self.dense_times: list[float] = []

    def __call__(self, candidate: TrainConfig) -> dict:
        bench = StepBench(candidate)
        counted = bench.forward_flops()   # what the training loop logs for this config
        dense, other = time_interleaved([self.dense, bench], self.steps, self.warmup, self.rounds, self.meter)
        self.dense_times += dense["times"]
        del bench
        if self.dense.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"dense_s": statistics.median(dense["times"]), "step_s": statistics.median(other["times"]),
                "step_ms_all": [1e3 * t for t in other["times"]],
                "dense_step_ms_all": [1e3 * t for t in dense["times"]], "counted_forward_flops": counted}
