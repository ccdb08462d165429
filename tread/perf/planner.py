"""The route planner as a library: `plan(PlanRequest(...))` composes the config, lists, counts, times and pilots
the candidates as asked and recommends one; scripts/plan_routes.py is its command line. Bad values raise
PlanError naming the flag before any timing.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tread.models import DIT_ARCHS
from tread.schema.builders import build_model
from tread.models.families import family_module
from tread.perf.benchmark import PairedTimer, split_steps
from tread.perf.geometry import Geometry, choose_geometry, is_dit, token_patch
from tread.schema.train import DataSection, ModelSection
from tread.perf.overrides import (check_device, check_sets, compose_or_raise, fused_adamw, precision_name,
                                  run_overrides)
from tread.perf.peaks import device_name
from tread.perf.pilot import Pilot, check_pilot_data, run_pilot
from tread.perf.plan import (PAPER_END_FROM_END, PAPER_START, RULE, PlanError, Space, TimeFn, evaluate_candidates,
                             flops_function, generate_candidates, measure_candidates, paired_time_fn, ratio_grid,
                             recommend, resolve_span, train_command, unreachable_message)
from tread.perf.context_memory import exchange_per_step, route_stats
from tread.perf.plan_report import markdown
from tread.perf.routes import label_of
from tread.routing.shards import check_split
from tread.routing.spec import RouteConfigError
from tread.schema import CONFIG_DIR
from tread.schema.train import TrainConfig
from tread.utils.device import resolve_device
from tread.utils.threads import cpu_threads
from tread.utils.errors import USER_ERRORS

ROOT = CONFIG_DIR.parent
PRECISIONS = ("fp32", "bf16")
# --set keys the planner owns (the flag to use instead)
RESERVED = {"model": "--model", "model.arch": "--arch", "model.preset": "--preset", "data": "--data",
            "data.resolution": "--resolution", "data.builtin_args.resolution": "--resolution",
            "data.channels": "--channels", "train.batch_size": "--batch", "routing": "the planner (candidates)",
            "routing.routes": "the planner (candidates)", "routing.enabled": "the planner (candidates)"}


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: one field per flag of scripts/plan_routes.py (--target-speedup is target_speedup), the same
    defaults. Checked when built (the checks that need no model); the rest in plan()."""

    model: str = "tread"                          # a configs/model config
    arch: Optional[str] = None                    # DiT size (model=tread|dit)
    preset: Optional[str] = None                  # family preset (model=flux|sd3|...)
    data: Optional[str] = None                    # a configs/data config (None: the composed one)
    sets: tuple[str, ...] = ()                    # extra Hydra overrides, as for train.py
    resolution: Optional[int] = None              # latent side (None: the arch's usual data)
    channels: Optional[int] = None                # latent channels (None: the arch's usual data)
    batch: Optional[int] = None                   # global batch (None: train.batch_size)
    target_speedup: Optional[float] = None        # step speedup vs dense >= X
    flops_fraction: Optional[float] = None        # training FLOPs <= F x dense
    gflops_per_sample: Optional[float] = None     # training GFLOPs per sample <= G
    min_start: int = PAPER_START                  # first block a route may start at
    max_end: int = -PAPER_END_FROM_END            # last block a route may end at (negative: from the end)
    min_blocks: int = 1                           # shortest route, in blocks
    max_ratio: float = 0.5                        # largest selection ratio
    ratio_step: float = 0.25                      # ratio grid step
    ratios: Optional[tuple[float, ...]] = None    # explicit ratios instead of the grid
    measure: int = 0                              # candidates to time (0: FLOPs only)
    steps: int = 10                               # timed steps per config and pairing
    warmup: int = 3                               # untimed steps per config and pairing
    rounds: int = 2                               # interleaved rounds the timed steps are split into
    threads: Optional[int] = None                 # torch CPU threads while planning (None: torch's)
    device: str = "auto"                          # auto, cpu, cuda
    precision: Optional[str] = None               # fp32 | bf16 of the timed steps and pilots (None: the config's)
    compile: bool = False                         # torch.compile the timed steps and pilots
    pilot: int = 0                                # pilot steps per run (0: no pilot, unless pilot_seconds)
    pilot_seconds: Optional[float] = None         # pilot at equal training time
    context_parallel: int = 1                     # processes per context group: per-process all-to-all (1: none)
    pilot_top: int = 2                            # candidates in the pilot
    pilot_fid: bool = False                       # rank the pilot by FID at its end
    out: Optional[str] = None                     # pilot run dirs (None: outputs/plan_routes/<timestamp>)
    show: int = 15                                # qualifying candidates listed in the table

    def __post_init__(self):
        object.__setattr__(self, "sets", tuple(self.sets))
        object.__setattr__(self, "ratios", None if self.ratios is None else tuple(self.ratios))
        check_request(self)

    @property
    def target(self) -> dict:
        return {"speedup": self.target_speedup, "flops_fraction": self.flops_fraction,
                "gflops_per_sample": self.gflops_per_sample}


# ----------------------------------------------------------------------------- checks that need no model
def check_request(a: PlanRequest) -> None:
    for flag, group, value in (("--model", "model", a.model), ("--data", "data", a.data)):
        names = sorted(q.stem for q in (CONFIG_DIR / group).glob("*.yaml") if not q.stem.startswith("_"))
        if value is not None and value not in names:
            raise PlanError(f"{flag} {value} is not a {group} config; allowed: {', '.join(names)}")
    positive = {"--resolution": a.resolution, "--channels": a.channels, "--batch": a.batch, "--steps": a.steps,
                "--rounds": a.rounds, "--threads": a.threads, "--min-blocks": a.min_blocks,
                "--pilot-top": a.pilot_top, "--show": a.show, "--context-parallel": a.context_parallel}
    for flag, v in positive.items():
        if v is not None and v < 1:
            raise PlanError(f"{flag} {v} is not allowed; it must be an integer >= 1")
    for flag, v in {"--warmup": a.warmup, "--measure": a.measure, "--pilot": a.pilot}.items():
        if v < 0:
            raise PlanError(f"{flag} {v} is not allowed; it must be an integer >= 0 (0 disables)")
    if a.pilot_seconds is not None and not (a.pilot_seconds > 0 and math.isfinite(a.pilot_seconds)):
        raise PlanError(f"--pilot-seconds {a.pilot_seconds:g} is not allowed; it must be > 0 (seconds of training)")
    check_target(a)
    if not 0.0 < a.max_ratio < 1.0:
        raise PlanError(f"--max-ratio {a.max_ratio:g} is out of range; selection ratios are the fraction of tokens "
                        f"dropped and must lie in [0, 1), and 0 is dense, so allowed: 0 < max-ratio < 1")
    ratio_grid(a.ratios, a.ratio_step, a.max_ratio)  # raises on a bad --ratios / --ratio-step
    check_sets(a.sets, RESERVED, PlanError)
    check_device(a.device, PlanError)
    if a.precision is not None and a.precision not in PRECISIONS:
        raise PlanError(f"--precision {a.precision} is not allowed; allowed: {', '.join(PRECISIONS)}")


def check_target(a: PlanRequest) -> None:
    if a.target_speedup is None and a.flops_fraction is None and a.gflops_per_sample is None:
        raise PlanError("no target given; pass --target-speedup X (X > 1), --flops-fraction F (0 < F < 1) "
                        "and/or --gflops-per-sample G (G > 0)")
    if a.target_speedup is not None and not (a.target_speedup > 1.0 and math.isfinite(a.target_speedup)):
        raise PlanError(f"--target-speedup {a.target_speedup:g} is not allowed; it must be > 1 (1 is dense)")
    if a.flops_fraction is not None and not 0.0 < a.flops_fraction < 1.0:
        raise PlanError(f"--flops-fraction {a.flops_fraction:g} is not allowed; it must lie in (0, 1) "
                        f"(training FLOPs as a fraction of dense)")
    if a.gflops_per_sample is not None and not (a.gflops_per_sample > 0 and math.isfinite(a.gflops_per_sample)):
        raise PlanError(f"--gflops-per-sample {a.gflops_per_sample:g} is not allowed; it must be > 0")


# ----------------------------------------------------------------------------- configs and the model
def model_overrides(a: PlanRequest) -> list[str]:
    """model=..., data=..., and --arch / --preset, checked against the model config they apply to."""
    head = [f"model={a.model}"] + ([f"data={a.data}"] if a.data else [])
    probe = compose_or_raise(head + list(a.sets) + ["routing=none"], PlanError).model
    if a.arch is not None:
        if not is_dit(probe):
            raise PlanError(f"--arch {a.arch} applies to model=tread|dit; model={a.model} is a diffusers family: "
                            f"use --preset (e.g. --preset tiny)")
        if a.arch not in DIT_ARCHS:
            raise PlanError(f"--arch {a.arch} is not a known DiT; allowed: {', '.join(DIT_ARCHS)}")
        head.append(f"model.arch={a.arch}")
    if a.preset is not None:
        if is_dit(probe):
            raise PlanError(f"--preset {a.preset} applies to the diffusers families; model={a.model} is a DiT: use "
                            f"--arch (e.g. --arch DiT-B/2)")
        presets = sorted(family_module(probe.family).PRESETS)
        if a.preset not in presets:
            raise PlanError(f"--preset {a.preset} is not a {probe.family} preset; allowed: {', '.join(presets)}")
        head.append(f"model.preset={a.preset}")
    return head


@dataclass
class Configs:
    """The overrides train.py would get (model: model, data, --arch/--preset; the geometry's; batch: --batch;
    then --set), and the dense config they compose to, checked."""

    model: list[str]
    geometry: Geometry
    batch: list[str]
    sets: list[str]
    dense: Optional[TrainConfig] = None

    @property
    def head(self) -> list[str]:
        return self.model + self.geometry.overrides + self.batch

    @property
    def overrides(self) -> list[str]:
        return self.head + self.sets

    def train_overrides(self) -> list[str]:
        """For the train command: the geometry's train overrides (the usual data by name, data=imagenet256)."""
        return self.model + self.geometry.train_overrides + self.batch + self.sets


def make_configs(a: PlanRequest) -> Configs:
    model = model_overrides(a)
    probe = compose_or_raise(model + list(a.sets) + ["routing=none"], PlanError)
    c = Configs(model, choose_geometry(probe.model, probe.data, a.resolution, a.channels, a.data),
                [f"train.batch_size={a.batch}"] if a.batch is not None else [], list(a.sets))
    check_patch(probe.model, c.geometry.resolution)   # before the dense config's check refuses it by its keys
    c.dense = compose_or_raise(c.overrides + ["routing=none"], PlanError)
    return c


def check_patch(model: ModelSection, res: int) -> None:
    """A DiT's patch divisibility of the planned resolution is a flag error."""
    if is_dit(model) and res % token_patch(model):
        patch, lower = token_patch(model), res - res % token_patch(model)
        examples = f"{lower} or {lower + patch}" if lower else f"{patch}"
        raise PlanError(f"--resolution {res} is not divisible by the patch size {patch} of {model.arch}; "
                        f"allowed: multiples of {patch}, e.g. {examples}")


def model_for_flops(model: ModelSection, data: DataSection, a: PlanRequest) -> Any:
    """The dense model to count FLOPs on (the dense config's model, for its data's geometry), built on the meta
    device (shapes only, so a released preset plans on any machine)."""
    try:
        with torch.device("meta"):
            return build_model(model.plain())
    except USER_ERRORS as err:   # our config errors name the key and the allowed values
        raise PlanError(f"model={a.model} ({model.arch}) cannot be built for --resolution {data.resolution} "
                        f"--channels {data.channels}: {str(err).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- the plan
def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the table."""
    print(msg, file=sys.stderr, flush=True)


def pilot_of(a: PlanRequest) -> Pilot:
    return Pilot(a.pilot, a.pilot_seconds, a.pilot_top, a.pilot_fid,
                 run_overrides(a.precision, a.device, a.compile), list(a.sets))


def candidates(a: PlanRequest, c: Configs) -> dict:
    """FLOPs of dense and every candidate on the model train.py builds; raises when no candidate can meet it."""
    model = model_for_flops(c.dense.model, c.dense.data, a)
    depth, num_tokens, batch = int(model.depth), int(model.num_tokens), c.dense.train.batch_size
    space = Space(tuple(ratio_grid(a.ratios, a.ratio_step, a.max_ratio)), a.min_start, a.max_end, a.min_blocks,
                  a.max_ratio)
    route_sets = generate_candidates(depth, space.ratios, space.min_start, space.max_end, space.min_blocks)
    dense, rows = evaluate_candidates(route_sets, flops_function(model), depth, num_tokens, batch, a.target)
    if not any(r["meets_theory"] for r in rows):
        raise PlanError(unreachable_message(rows, a.target, space, depth))
    if a.context_parallel > 1:
        add_exchange(model, dense, rows, dict(zip(map(label_of, route_sets), route_sets)), a.context_parallel)
    return {"depth": depth, "tokens": num_tokens, "batch": batch, "space": space, "dense": dense, "rows": rows}


def add_exchange(model: Any, dense: dict, rows: list[dict], routes_of: dict, degree: int) -> None:
    """--context-parallel D: the bytes one process of a group sends per sample and step (Ulysses, bf16, with the
    checkpointed recompute: tread/perf/context_memory.py), into the dense row and each candidate's."""
    tokens, depth, width = int(model.num_tokens), int(model.depth), model.attention_width()
    try:
        check_split(tokens, degree, "--context-parallel")
    except RouteConfigError as err:
        raise PlanError(str(err)) from None
    dense["exchange_bytes"] = exchange_per_step([], depth, tokens, width, degree)
    for row in rows:
        row["exchange_bytes"] = exchange_per_step(route_stats(routes_of[row["label"]], tokens), depth, tokens, width,
                                                  degree)


def plan_device(a: PlanRequest) -> torch.device:
    return resolve_device("cpu" if a.device == "cpu" else "auto")


def time_candidates(a: PlanRequest, c: Configs, found: dict, time_fn: Optional[TimeFn]) -> dict:
    """Time at most `measure` candidates against dense (nothing with measure 0); what the settings record."""
    if not a.measure:
        return {"timing": "none", "stopped_early": False, "device": plan_device(a)}
    run = run_overrides(a.precision, a.device, a.compile)
    timer = None
    log(f"timing at most {a.measure} candidates, each paired with dense: {a.warmup} warm-up + {a.steps} timed "
        f"steps per config of THE training step; progress and an estimate follow")
    if time_fn is None:
        timer = PairedTimer(compose_or_raise(c.head + run + c.sets + ["routing=none"], PlanError), a.steps, a.warmup,
                            a.rounds, a.measure)
        time_fn = paired_time_fn(timer, lambda ov: compose_or_raise(c.head + run + c.sets + ov, PlanError))
    rows = found["rows"]
    timed_rows = measure_candidates(rows, a.measure, time_fn, a.target, log=log)
    left = [r for r in rows if r["meets_theory"] and not r.get("measured") and not r.get("same_cost_as")]
    timed = [r for r in rows if r.get("measured")]
    found["dense"]["step_ms"] = (1e3 * statistics.median(timer.dense_times) if timer is not None and
                                 timer.dense_times else statistics.median(r["dense_step_ms"] for r in timed))
    return {"timing": "measured" if timer is not None else "injected",
            "stopped_early": len(timed_rows) < a.measure and bool(left),
            "device": timer.dense.device if timer is not None else plan_device(a)}


def settings_of(a: PlanRequest, c: Configs, found: dict, timing: dict) -> dict:
    dense, (lo, hi), dev = c.dense, resolve_span(found["depth"], a.min_start, a.max_end), timing["device"]
    return {"model": a.model, "model_name": str(dense.model.arch), "family": str(dense.model.family or "dit"),
            "overrides": c.overrides, "geometry": c.geometry.line(found["tokens"]), "geometry_source": c.geometry.why,
            "usual_data": c.geometry.usual_data,
            "resolution": dense.data.resolution, "channels": dense.data.channels, "tokens": found["tokens"],
            "depth": found["depth"], "batch": found["batch"], "ratios": list(found["space"].ratios), "span": [lo, hi],
            "min_start": a.min_start, "max_end": a.max_end, "min_blocks": a.min_blocks, "max_ratio": a.max_ratio,
            "measure": a.measure, "steps": a.steps, "warmup": a.warmup,
            "rounds": len(split_steps(a.steps, a.rounds)), "device": str(dev), "device_name": device_name(dev),
            "threads": torch.get_num_threads(), "precision": a.precision or precision_name(dense.train, dev),
            "compile": bool(a.compile), "torch": torch.__version__,
            "gradient_checkpointing": dense.model.gradient_checkpointing,
            "fused_adamw": fused_adamw(dense.optimizer), "show": a.show,
            "flops": "theoretical: 3 x forward x batch, matmuls + attention, multiply-add = 2 (tread/models/flops.py)",
            "timing": timing["timing"], "context_parallel": a.context_parallel}


def apply_pilot(a: PlanRequest, c: Configs, res: dict, pilot: Pilot) -> None:
    """Run the pilot; its best routed candidate becomes the recommendation (the rule's pick is kept)."""
    out = Path(a.out) if a.out else ROOT / "outputs" / "plan_routes" / time.strftime("%Y-%m-%d_%H-%M-%S")
    rec, rows = res["recommendation"], res["candidates"]
    res["pilot"] = run_pilot(c.overrides, rows, res["dense"], pilot, out, log)
    res["rule_recommendation"] = dict(rec)
    res["settings"]["out"] = str(out)
    best = res["pilot"]["best"]
    if best is None:
        return
    row = next(r for r in rows if r["label"] == best)
    res["recommendation"] = {
        "label": best, "routes": row["routes"], "basis": "pilot",
        "meets_target": bool(row.get("meets_measured", row["meets_theory"])),
        "reason": f"lowest pilot {res['pilot']['metric'].replace('_', ' ')} among the {len(res['pilot']['runs']) - 1} "
                  f"routed pilot candidates (the rule picked {rec['label']})", "rule": RULE,
        "train_command": train_command(c.train_overrides(), row["routes"])}


def plan(a: PlanRequest, time_fn: Optional[TimeFn] = None) -> dict:
    """The plan of request `a`: {"settings", "target", "dense", "candidates", ..., "recommendation", "markdown"}
    (what scripts/plan_routes.py --json writes). time_fn replaces the timing (tests): candidate row ->
    {"dense_s", "step_s"}. Runs on a.threads torch threads, and gives the caller back its own count."""
    target = a.target
    with cpu_threads(a.threads):
        c = make_configs(a)
        found = candidates(a, c)
        pilot = pilot_of(a)
        if a.measure or pilot.enabled:   # long runs: say up front what they plan for
            log(c.geometry.line(found["tokens"]))
        if pilot.enabled:
            check_pilot_data(c.dense.data)
        timing = time_candidates(a, c, found, time_fn)
        rows = found["rows"]
        rec = recommend(rows, a.target)
        rec["train_command"] = train_command(c.train_overrides(), rec["routes"])
        res: dict[str, Any] = {
            "settings": settings_of(a, c, found, timing), "target": target, "dense": found["dense"],
            "candidates": rows, "num_candidates": len(rows), "num_meet_theory": sum(r["meets_theory"] for r in rows),
            "num_measured": sum(bool(r.get("measured")) for r in rows), "recommendation": rec,
            "timing_stopped_early": timing["stopped_early"]}
        if pilot.enabled:
            apply_pilot(a, c, res, pilot)
    res["markdown"] = markdown(res)
    return res
