"""Plan TREAD routes for a model, data size and target: list candidates, count FLOPs, optionally time the best,
recommend.

    python scripts/plan_routes.py --arch DiT-B/2 --target-speedup 1.3                 # FLOPs only, seconds
    python scripts/plan_routes.py --arch DiT-B/2 --batch 64 --target-speedup 1.3 --measure 3   # + timing
    python scripts/plan_routes.py --arch DiT-XL/2 --flops-fraction 0.7
    python scripts/plan_routes.py --model flux --preset tiny --target-speedup 1.2 --measure 3
    python scripts/plan_routes.py --arch DiT-T/4 --batch 8 --target-speedup 1.1 --pilot 200 --pilot-top 2 \\
        --set data.builtin_args.num_per_class=100

Model: the model a `python train.py model=<--model> model.arch=<--arch> (or model.preset=<--preset)
<--set overrides>` would build (schema.compose, models.build_model). --batch is the global batch (default:
train.batch_size). Geometry (tread/perf/geometry.py): --resolution/--channels as named; otherwise a DiT plans for the
data its size trains on (DiT-S/B/L/XL: ImageNet-256 SD-VAE latents, 4x32x32; DiT-T: the built-in toy data),
the families and --data for their config's data. The first output line says which geometry and why.

Candidates (the paper's guidelines): one route {ratio, start, end} with start >= --min-start (2), end <=
--max-end (-4, i.e. depth-4; negative counts from the end), at least --min-blocks blocks, ratio on the grid
--ratio-step, 2*step, ... <= --max-ratio (0.25, 0.5) or the explicit --ratios.

Target (at least one; all given must hold):
  --target-speedup X      training-step speedup vs dense >= X: by theory the FLOPs bound dense/route FLOPs,
                          when timed the measured step-time ratio against a dense baseline;
  --flops-fraction F      training FLOPs per step <= F x dense (0 < F < 1);
  --gflops-per-sample G   training GFLOPs per sample (3 x forward: forward + backward) <= G.
FLOPs are theoretical (tread/models/flops.py: matmuls and attention, multiply-add = 2; a training step is 3 x
forward x batch): DiT's analytic count, the diffusers families counted on one forward by torch's
FlopCounterMode with the route set (tread.models.flops.forward_flops_with_routes, as the training loop counts them).

Timing (--measure K; default 0: FLOPs only): at most K of the candidates that meet the target by FLOPs are timed, each
paired with the dense baseline in --rounds interleaved rounds (speedup = dense median / candidate median of the same
pairing). A step is THE training step of the candidate's composed config (tread.perf.benchmark.StepBench:
tread.training.step.TrainStep as train.py runs it). Progress and an estimate of the time left go to stderr. Candidates
that do the same work as a timed one (same ratio, span length and FLOPs) are not timed again. With --target-speedup the
next candidate timed is the first in rule order whose FLOPs bound times the fraction of the bound realised so far
(median over the timed ones; 1.0 at first) reaches the target, or, when none is predicted to, the one with the largest
bound; once one meets the target only candidates before it in rule order are timed, and timing stops when none is left.
With FLOPs targets only, the first K in rule order.

Recommendation rule: among the candidates that meet the target (measured speedup when timed, FLOPs
otherwise; only timed candidates count once any is timed), the one that keeps the most compute, i.e. the
fewest routed token-blocks (blocks x dropped tokens); ties go to the paper's default route, by distance of
ratio to 0.5, then start to 2, then end to depth-4. If none meets the target, the closest one is given
(highest measured speedup) and the output says that it does not meet it.

--pilot N trains dense and the top --pilot-top K candidates (qualifying ones first, in rule order) for N
steps each on the configured data with tread.training.loop.train (eval off, or FID at the end with --pilot-fid),
into --out/pilot/<label>, and ranks them by final loss (the step-weighted mean of the logged training losses
over the second half of the steps) or FID, next to their training throughput; the best routed candidate
becomes the recommendation ("basis": "pilot"). --pilot-seconds S compares at equal training time instead
(train.time_budget_min), capped at --pilot N steps when both are given.

Output: a Markdown table on stdout (--markdown PATH too), everything as JSON with --json PATH; main(argv)
returns the same dict. Bad inputs stop with a one-line "error: ..." before any timing.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tread.cli.errors import user_errors
from tread.models import DIT_ARCHS, build_model
from tread.models.families import family_module
from tread.perf.benchmark import PairedTimer, split_steps
from tread.perf.geometry import Geometry, choose_geometry, is_dit, token_patch
from tread.perf.overrides import check_device, check_sets, compose_or_raise, precision_name, run_overrides
from tread.perf.peaks import device_name
from tread.perf.pilot import Pilot, check_pilot_data, run_pilot
from tread.perf.plan import (PAPER_END_FROM_END, RULE, PlanError, Space, TimeFn, evaluate_candidates, flops_function,
                       generate_candidates, measure_candidates, paired_time_fn, ratio_grid, recommend, resolve_span,
                       train_command, unreachable_message)
from tread.perf.units import fmt_flops
from tread.schema import CONFIG_DIR
from tread.utils.device import resolve_device
from tread.utils.errors import USER_ERRORS

ROOT = CONFIG_DIR.parent
# --set keys the planner owns (the flag to use instead)
RESERVED = {"model": "--model", "model.arch": "--arch", "model.preset": "--preset", "data": "--data",
            "data.resolution": "--resolution", "data.builtin_args.resolution": "--resolution",
            "data.channels": "--channels", "train.batch_size": "--batch", "routing": "the planner (candidates)",
            "routing.routes": "the planner (candidates)", "routing.enabled": "the planner (candidates)"}

__all__ = ["PlanError", "RULE", "main", "parse_args", "plan"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        raise PlanError(message)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tread", help="a configs/model config: tread (default), dit, flux, sd3, ...")
    g.add_argument("--arch", default=None, help="DiT size for model=tread|dit, e.g. DiT-B/2 (default: the data's)")
    g.add_argument("--preset", default=None, help="family preset for model=flux|sd3|... (default: the config's)")
    g.add_argument("--data", default=None, help="a configs/data config (default: the composed one, toy)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override, as for train.py (repeatable)")
    g.add_argument("--resolution", type=int, default=None, help="latent side (default: the arch's usual data)")
    g.add_argument("--channels", type=int, default=None, help="latent channels (default: the arch's usual data)")
    g.add_argument("--batch", type=int, default=None, help="global batch per step (default: train.batch_size)")
    g = p.add_argument_group("target (at least one)")
    g.add_argument("--target-speedup", type=float, default=None, help="step speedup vs dense >= X (X > 1)")
    g.add_argument("--flops-fraction", type=float, default=None, help="training FLOPs <= F x dense (0 < F < 1)")
    g.add_argument("--gflops-per-sample", type=float, default=None,
                   help="training GFLOPs per sample (3 x forward) <= G")
    g = p.add_argument_group("candidates")
    g.add_argument("--min-start", type=int, default=2, help="first block a route may start at (default 2)")
    g.add_argument("--max-end", type=int, default=-PAPER_END_FROM_END,
                   help="last block a route may end at; negative counts from the end (default -4 = depth-4)")
    g.add_argument("--min-blocks", type=int, default=1, help="shortest route, in blocks (default 1)")
    g.add_argument("--max-ratio", type=float, default=0.5, help="largest selection ratio (default 0.5)")
    g.add_argument("--ratio-step", type=float, default=0.25, help="ratio grid step: step, 2 step, ... <= max-ratio")
    g.add_argument("--ratios", type=float, nargs="+", default=None, help="explicit ratios instead of the grid")
    g = p.add_argument_group("timing")
    g.add_argument("--measure", type=int, default=0, help="candidates to time (default 0: FLOPs only)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per config and pairing")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per config and pairing")
    g.add_argument("--rounds", type=int, default=2, help="interleaved rounds the timed steps are split into")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    g.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="train.mixed_precision of the timed steps and pilots (default: the config's)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the timed steps and the pilot runs (train.compile; default: eager)")
    g = p.add_argument_group("pilot trainings")
    g.add_argument("--pilot", type=int, default=0, metavar="N", help="train dense + top candidates N steps each")
    g.add_argument("--pilot-seconds", type=float, default=None, metavar="S",
                   help="pilot at equal training time: each run stops after S seconds of training (train."
                        "time_budget_min), after --pilot N steps at most when N is given")
    g.add_argument("--pilot-top", type=int, default=2, metavar="K", help="candidates in the pilot (default 2)")
    g.add_argument("--pilot-fid", action="store_true", help="rank the pilot by FID at its end (eval.at_end)")
    g.add_argument("--out", default=None, help="pilot run dirs go here (default outputs/plan_routes/<timestamp>)")
    g = p.add_argument_group("output")
    g.add_argument("--show", type=int, default=15, help="qualifying candidates listed in the table (default 15)")
    g.add_argument("--json", default=None, help="write the result here")
    g.add_argument("--markdown", default=None, help="write the Markdown table here")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """Checks that need no model; the rest (arch, resolution, depth) follow in plan()."""
    for flag, group, value in (("--model", "model", a.model), ("--data", "data", a.data)):
        names = sorted(q.stem for q in (CONFIG_DIR / group).glob("*.yaml") if not q.stem.startswith("_"))
        if value is not None and value not in names:
            raise PlanError(f"{flag} {value} is not a {group} config; allowed: {', '.join(names)}")
    positive = {"--resolution": a.resolution, "--channels": a.channels, "--batch": a.batch, "--steps": a.steps,
                "--rounds": a.rounds, "--threads": a.threads, "--min-blocks": a.min_blocks,
                "--pilot-top": a.pilot_top, "--show": a.show}
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


def check_target(a: argparse.Namespace) -> None:
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
def model_overrides(a: argparse.Namespace) -> list[str]:
    """model=..., data=..., and --arch / --preset, checked against the model config they apply to."""
    head = [f"model={a.model}"] + ([f"data={a.data}"] if a.data else [])
    probe = compose_or_raise(head + list(a.sets) + ["routing=none"], PlanError)
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
        presets = sorted(family_module(probe.model.family).PRESETS)
        if a.preset not in presets:
            raise PlanError(f"--preset {a.preset} is not a {probe.model.family} preset; allowed: {', '.join(presets)}")
        head.append(f"model.preset={a.preset}")
    return head


@dataclass
class Configs:
    """The overrides train.py would get (model: model, data, --arch/--preset; the geometry's; batch: --batch;
    then --set), and the dense config they compose to."""

    model: list[str]
    geometry: Geometry
    batch: list[str]
    sets: list[str]
    dense_cfg: Any = None

    @property
    def head(self) -> list[str]:
        return self.model + self.geometry.overrides + self.batch

    @property
    def overrides(self) -> list[str]:
        return self.head + self.sets

    def train_overrides(self) -> list[str]:
        """For the train command: the geometry's train overrides (the usual data by name, data=imagenet256)."""
        return self.model + self.geometry.train_overrides + self.batch + self.sets


def make_configs(a: argparse.Namespace) -> Configs:
    model = model_overrides(a)
    probe = compose_or_raise(model + list(a.sets) + ["routing=none"], PlanError)
    c = Configs(model, choose_geometry(probe, a.resolution, a.channels, a.data),
                [f"train.batch_size={a.batch}"] if a.batch is not None else [], list(a.sets))
    c.dense_cfg = compose_or_raise(c.overrides + ["routing=none"], PlanError)
    return c


def model_for_flops(cfg: Any, a: argparse.Namespace) -> Any:
    """The dense model to count FLOPs on: a DiT on the meta device (shapes only, no memory), a diffusers family
    on the CPU (its forward is counted by FlopCounterMode). A DiT's patch divisibility is a flag error."""
    res = int(cfg.data.resolution)
    if is_dit(cfg) and res % token_patch(cfg):
        patch, lower = token_patch(cfg), res - res % token_patch(cfg)
        examples = f"{lower} or {lower + patch}" if lower else f"{patch}"
        raise PlanError(f"--resolution {res} is not divisible by the patch size {patch} of {cfg.model.arch}; "
                        f"allowed: multiples of {patch}, e.g. {examples}")
    try:
        with torch.device("meta" if is_dit(cfg) else "cpu"):
            return build_model(cfg.model)
    except USER_ERRORS as err:   # our config errors name the key and the allowed values
        raise PlanError(f"model={a.model} ({cfg.model.get('arch')}) cannot be built for --resolution {res} "
                        f"--channels {int(cfg.data.channels)}: {str(err).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- the plan
def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the table."""
    print(msg, file=sys.stderr, flush=True)


def pilot_of(a: argparse.Namespace) -> Pilot:
    return Pilot(a.pilot, a.pilot_seconds, a.pilot_top, a.pilot_fid,
                 run_overrides(a.precision, a.device, a.compile), list(a.sets))


def candidates(a: argparse.Namespace, c: Configs, target: dict) -> dict:
    """FLOPs of dense and every candidate on the model train.py builds; raises when no candidate can meet it."""
    model = model_for_flops(c.dense_cfg, a)
    depth, num_tokens, batch = int(model.depth), int(model.num_tokens), int(c.dense_cfg.train.batch_size)
    space = Space(tuple(ratio_grid(a.ratios, a.ratio_step, a.max_ratio)), a.min_start, a.max_end, a.min_blocks,
                  a.max_ratio)
    route_sets = generate_candidates(depth, space.ratios, space.min_start, space.max_end, space.min_blocks)
    dense, rows = evaluate_candidates(route_sets, flops_function(model), depth, num_tokens, batch, target)
    if not any(r["meets_theory"] for r in rows):
        raise PlanError(unreachable_message(rows, target, space, depth))
    return {"depth": depth, "tokens": num_tokens, "batch": batch, "space": space, "dense": dense, "rows": rows}


def plan_device(a: argparse.Namespace) -> torch.device:
    return resolve_device("cpu" if a.device == "cpu" else "auto")


def time_candidates(a: argparse.Namespace, c: Configs, found: dict, target: dict,
                    time_fn: Optional[TimeFn]) -> dict:
    """Time at most --measure candidates against dense (nothing with --measure 0); what the settings record."""
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
    timed_rows = measure_candidates(rows, a.measure, time_fn, target, log=log)
    left = [r for r in rows if r["meets_theory"] and not r.get("measured") and not r.get("same_cost_as")]
    timed = [r for r in rows if r.get("measured")]
    found["dense"]["step_ms"] = (1e3 * statistics.median(timer.dense_times) if timer is not None and
                                 timer.dense_times else statistics.median(r["dense_step_ms"] for r in timed))
    return {"timing": "measured" if timer is not None else "injected",
            "stopped_early": len(timed_rows) < a.measure and bool(left),
            "device": timer.dense.device if timer is not None else plan_device(a)}


def settings_of(a: argparse.Namespace, c: Configs, found: dict, timing: dict) -> dict:
    cfg, (lo, hi), dev = c.dense_cfg, resolve_span(found["depth"], a.min_start, a.max_end), timing["device"]
    return {"model": a.model, "model_name": str(cfg.model.get("arch")), "family": str(cfg.model.get("family") or "dit"),
            "overrides": c.overrides, "geometry": c.geometry.line(found["tokens"]), "geometry_source": c.geometry.why,
            "usual_data": c.geometry.usual_data,
            "resolution": int(cfg.data.resolution), "channels": int(cfg.data.channels), "tokens": found["tokens"],
            "depth": found["depth"], "batch": found["batch"], "ratios": list(found["space"].ratios), "span": [lo, hi],
            "min_start": a.min_start, "max_end": a.max_end, "min_blocks": a.min_blocks, "max_ratio": a.max_ratio,
            "measure": a.measure, "steps": a.steps, "warmup": a.warmup,
            "rounds": len(split_steps(a.steps, a.rounds)), "device": str(dev), "device_name": device_name(dev),
            "threads": torch.get_num_threads(), "precision": a.precision or precision_name(cfg.train, dev),
            "compile": bool(a.compile), "torch": torch.__version__,
            "gradient_checkpointing": bool(cfg.model.get("gradient_checkpointing", False)),
            "fused_adamw": bool(cfg.optimizer.get("fused", True)), "show": a.show,
            "flops": "theoretical: 3 x forward x batch, matmuls + attention, multiply-add = 2 (tread/models/flops.py)",
            "timing": timing["timing"]}


def apply_pilot(a: argparse.Namespace, c: Configs, res: dict, pilot: Pilot) -> None:
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


def plan(a: argparse.Namespace, time_fn: Optional[TimeFn] = None) -> dict:
    check_args(a)
    target = {"speedup": a.target_speedup, "flops_fraction": a.flops_fraction,
              "gflops_per_sample": a.gflops_per_sample}
    c = make_configs(a)
    found = candidates(a, c, target)
    pilot = pilot_of(a)
    if a.measure or pilot.enabled:   # long runs: say up front what they plan for
        log(c.geometry.line(found["tokens"]))
    if pilot.enabled:
        check_pilot_data(c.dense_cfg)
    timing = time_candidates(a, c, found, target, time_fn)
    rows = found["rows"]
    rec = recommend(rows, target)
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


# ----------------------------------------------------------------------------- output
def target_text(t: dict) -> str:
    parts = []
    if t.get("speedup") is not None:
        parts.append(f"step speedup >= {t['speedup']:g}x")
    if t.get("flops_fraction") is not None:
        parts.append(f"training FLOPs <= {t['flops_fraction']:g} x dense")
    if t.get("gflops_per_sample") is not None:
        parts.append(f"training GFLOPs/sample <= {t['gflops_per_sample']:g}")
    return " and ".join(parts)


def header_lines(res: dict) -> list[str]:
    s, t = res["settings"], res["target"]
    stopped = "; stopped early: no untimed candidate could change the pick" if res["timing_stopped_early"] else ""
    lines = [s["geometry"],
             f"Route plan for {s['model_name']} (model={s['model']}), {s['tokens']} tokens "
             f"({s['resolution']}x{s['resolution']}x{s['channels']}), depth {s['depth']}, batch {s['batch']}; "
             f"target: {target_text(t)}.",
             f"Candidates: single routes, ratios {', '.join(f'{r:g}' for r in s['ratios'])}, blocks "
             f"{s['span'][0]}..{s['span'][1]} (start >= {s['min_start']}, end <= {s['max_end']}), >= "
             f"{s['min_blocks']} blocks: {res['num_candidates']} candidates, {res['num_meet_theory']} meet the "
             f"target by FLOPs; {res['num_measured']} timed (--measure {s['measure']}{stopped})."]
    if res["num_measured"]:
        lines.append(f"Timing: THE training step on {s['device_name']} ({s['device']}), {s['threads']} threads, "
                     f"{s['precision']}, {'compiled' if s['compile'] else 'eager'}; per pairing {s['warmup']} warm-up "
                     f"+ {s['steps']} timed steps per config in {s['rounds']} interleaved rounds with dense; "
                     f"torch {s['torch']}.")
    return lines


def candidate_row(c: dict, rec: str) -> str:
    name = f"**{c['label']}** (recommended)" if c["label"] == rec else c["label"]
    if c.get("measured"):
        timed = (f"{c['step_ms']:.1f} ms | {c['speedup']:.3f}x | {100 * c['fraction_of_bound']:.0f}% | "
                 f"{'yes' if c['meets_measured'] else 'no'}")
    elif c.get("same_cost_as"):
        timed = f"not timed (same work as {c['same_cost_as']}) | - | - | -"
    else:
        timed = "not timed | - | - | -"
    return (f"| {c['rule_rank'] or '-'} | {name} | {100 * c['tokens_fraction']:.1f}% | "
            f"{fmt_flops(c['train_flops_per_step'])} | {c['flops_ratio']:.3f} | {c['speedup_bound']:.3f}x | "
            f"{'yes' if c['meets_theory'] else 'no'} | {timed} |")


def pilot_lines(p: dict) -> list[str]:
    what = "FID at the end" if p["metric"] == "final_fid" else "final loss (mean over the second half)"
    budget = " and ".join(([f"{p['steps']} steps"] if p["steps"] else []) +
                          ([f"{p['seconds']:g} s of training"] if p["seconds"] else []))
    first = " (whichever comes first)" if p["steps"] and p["seconds"] else ""
    lines = ["", f"Pilot: {budget} each{first}, ranked by {what}; speedup = steps per training second vs dense.",
             "", "| rank | route | steps | final loss | FID | train s | speedup | meets target |",
             "|---|---|---|---|---|---|---|---|"]
    for x in p["runs"]:
        fid = "-" if x["final_fid"] is None else f"{x['final_fid']:.2f}"
        loss = "-" if x["final_loss"] is None else f"{x['final_loss']:.4f}"
        meets = "-" if x["meets_target"] is None else ("yes" if x["meets_target"] else "no")
        lines.append(f"| {x['rank']} | {x['label']} | {x['steps']} | {loss} | {fid} | {x['train_sec']:.1f} | "
                     f"{x['speedup']:.2f}x | {meets} |")
    lines.append(f"\nPilot pick: **{p['best']}** (best routed candidate by the pilot metric; dense ranks "
                 f"{p['dense_rank']}).")
    return lines


def markdown(res: dict) -> str:
    s, d, r = res["settings"], res["dense"], res["recommendation"]
    lines = header_lines(res) + [
        "", "| # | route | tokens processed | train FLOPs/step | FLOPs ratio | bound | meets (FLOPs) | step | "
        "speedup | of bound | meets (timed) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense_t = f"{d['step_ms']:.1f} ms | 1.000x" if d.get("step_ms") is not None else "- | -"
    lines.append(f"| - | dense | 100.0% | {fmt_flops(d['train_flops_per_step'])} | 1.000 | 1.000x | - | {dense_t} | "
                 f"- | - |")
    shown = [c for c in res["candidates"] if c["meets_theory"]][:s["show"]]
    shown += [c for c in res["candidates"] if c.get("measured") and c not in shown]
    lines += [candidate_row(c, r["label"]) for c in shown]
    more = res["num_meet_theory"] - len([c for c in shown if c["meets_theory"]])
    if more > 0:
        lines.append(f"\n{more} more candidates meet the target by FLOPs (not shown, not timed; all in --json).")
    verdict = "meets the target" if r["meets_target"] else "does NOT meet the target (closest)"
    lines += ["", f"Recommendation ({r['basis']}): **{r['label']}**, {verdict}: {r['reason']}.",
              f"Rule: {RULE}.", f"Train it: `{r['train_command']}`"]
    if s["usual_data"]:
        lines[-1] += f" (plus data.path=<your {s['usual_data']} latents>)"
    if res.get("pilot"):
        lines += pilot_lines(res["pilot"])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, time_fn: Optional[TimeFn] = None) -> dict:
    """Plan routes; returns the result dict (what --json writes). Bad input: SystemExit('error: ...').
    time_fn replaces the timing (tests): candidate row -> {"dense_s", "step_s"}."""
    threads = torch.get_num_threads()
    try:
        with user_errors():
            a = parse_args(argv)
            if a.threads:
                torch.set_num_threads(a.threads)
            res = plan(a, time_fn)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their thread count
    print(res["markdown"])
    for path, text in ((a.json, json.dumps(res, indent=2)), (a.markdown, res["markdown"] + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    return res
