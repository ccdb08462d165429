"""Plan TREAD routes for a model, data size and target: list candidates, count FLOPs, time the best, recommend.

    python scripts/plan_routes.py --arch DiT-B/2 --resolution 32 --channels 4 --batch 64 --target-speedup 1.3
    python scripts/plan_routes.py --arch DiT-XL/2 --resolution 32 --channels 4 --flops-fraction 0.7 --measure 0
    python scripts/plan_routes.py --model flux --preset tiny --target-speedup 1.2 --measure 3
    python scripts/plan_routes.py --arch DiT-T/4 --batch 8 --target-speedup 1.1 --pilot 200 --pilot-top 2 \\
        --set data.builtin_args.num_per_class=100

Model: the model a `python train.py model=<--model> model.arch=<--arch> (or model.preset=<--preset)
<--set overrides>` would build, composed from configs/train.yaml with Hydra's compose API. --resolution and
--channels set the latent size (data.resolution / data.builtin_args.resolution for built-in data,
data.channels; default: the data config's), --batch the global batch (default: train.batch_size).

Candidates (the paper's guidelines): one route {ratio, start, end} with start >= --min-start (2), end <=
--max-end (-4, i.e. depth-4; negative counts from the end), at least --min-blocks blocks, ratio on the grid
--ratio-step, 2*step, ... <= --max-ratio (0.25, 0.5) or the explicit --ratios.

Target (at least one; all given must hold):
  --target-speedup X      training-step speedup vs dense >= X: by theory the FLOPs bound dense/route FLOPs,
                          when timed the measured step-time ratio against a dense baseline;
  --flops-fraction F      training FLOPs per step <= F x dense (0 < F < 1);
  --gflops-per-sample G   training GFLOPs per sample (3 x forward: forward + backward) <= G.
FLOPs are theoretical (training/flops.py: matmuls and attention, multiply-add = 2; a training step is 3 x
forward x batch): DiT's analytic count, the diffusers families counted on one forward by torch's
FlopCounterMode with the route set (training.flops.model_forward_flops, as the training loop logs them).

Timing: the candidates that meet the target by FLOPs are sorted by the rule below and at most --measure K of
them are timed (step = the objective's loss forward, backward, AdamW step: scripts/benchmark.py's Stepper),
each paired with the dense baseline in --rounds interleaved rounds (speedup = dense median / candidate
median of the same pairing). Candidates that do the same work as a timed one (same ratio, span length and
FLOPs; only the span's position differs) are not timed again. With --target-speedup the next candidate timed
is the first in rule order whose FLOPs bound times the fraction of the bound realised so far (median over the
timed ones; 1.0 at first) reaches the target, or, when none is predicted to, the one with the largest bound;
once one meets the target only candidates before it in rule order are timed (nothing else could change the
recommendation), and timing stops when none is left. With FLOPs targets only, the first K in rule order.

Recommendation rule: among the candidates that meet the target (measured speedup when timed, FLOPs
otherwise; only timed candidates count once any is timed), the one that keeps the most compute, i.e. the
fewest routed token-blocks (blocks x dropped tokens); ties go to the paper's default route, by distance of
ratio to 0.5, then start to 2, then end to depth-4. If none meets the target, the closest one is given
(highest measured speedup) and the output says that it does not meet it.

--pilot N trains dense and the top --pilot-top K candidates (qualifying ones first, in rule order) for N
steps each on the configured data with training.loop.train (routing.routes set to the candidate, eval off,
or FID at the end with --pilot-fid), into --out/pilot/<label>, and ranks them by final loss (the step-weighted
mean of the logged training losses over the second half of the steps) or FID, next to their training
throughput; the best routed candidate becomes the recommendation ("basis": "pilot"). --pilot-seconds S
compares at equal training time instead (train.time_budget_min; routed runs then take more steps), capped at
--pilot N steps when both are given. Pilots need long enough runs to separate candidates: in the first steps
DiT's zero-initialised gates make routed and dense losses nearly identical.

Output: a Markdown table on stdout (--markdown PATH too), everything as JSON with --json PATH; main(argv)
returns the same dict. Bad inputs stop with a one-line "error: ..." before any timing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from routing.spec import Route, tokens_processed_fraction  # noqa: E402
from scripts.benchmark import MemoryMeter, Stepper, device_name, fmt_flops, split_steps, time_configs  # noqa: E402
from training.flops import forward_flops_with_routes, model_forward_flops, train_step_flops  # noqa: E402

CONFIG_DIR = ROOT / "configs"
PAPER_RATIO, PAPER_START, PAPER_END_FROM_END = 0.5, 2, 4   # the paper's route: 0.5 over blocks 2..depth-4
EPS = 1e-9

RULE = ("among the candidates that meet the target (measured speedup when timed, FLOPs otherwise), the one that "
        "keeps the most compute: fewest routed token-blocks (blocks x dropped tokens); ties go to the paper's "
        "default route (ratio nearest 0.5, then start nearest 2, then end nearest depth-4); if none meets the "
        "target, the closest one (highest measured speedup) is given and marked as missing it")

# --set keys the planner owns (the flag to use instead)
RESERVED = {"model": "--model", "model.arch": "--arch", "model.preset": "--preset", "data": "--data",
            "data.resolution": "--resolution", "data.builtin_args.resolution": "--resolution",
            "data.channels": "--channels", "train.batch_size": "--batch", "routing": "the planner (candidates)",
            "routing.routes": "the planner (candidates)", "routing.enabled": "the planner (candidates)"}


class PlanError(ValueError):
    """A bad input; main() prints it as one line, 'error: ...'."""


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
    g.add_argument("--resolution", type=int, default=None, help="latent side (default: the data config's)")
    g.add_argument("--channels", type=int, default=None, help="latent channels (default: the data config's)")
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
    g.add_argument("--measure", type=int, default=4, help="candidates to time (0: FLOPs only; default 4)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per config and pairing")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per config and pairing")
    g.add_argument("--rounds", type=int, default=2, help="interleaved rounds the timed steps are split into")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the timed models and the pilot runs (default: eager; pilots with "
                        "train.compile=false)")
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
    models = sorted(q.stem for q in (CONFIG_DIR / "model").glob("*.yaml"))
    if a.model not in models:
        raise PlanError(f"--model {a.model} is not a model config; allowed: {', '.join(models)}")
    if a.data is not None:
        datas = sorted(q.stem for q in (CONFIG_DIR / "data").glob("*.yaml"))
        if a.data not in datas:
            raise PlanError(f"--data {a.data} is not a data config; allowed: {', '.join(datas)}")
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
    if not 0.0 < a.max_ratio < 1.0:
        raise PlanError(f"--max-ratio {a.max_ratio:g} is out of range; selection ratios are the fraction of tokens "
                        f"dropped and must lie in [0, 1), and 0 is dense, so allowed: 0 < max-ratio < 1")
    ratio_grid(a)  # raises on a bad --ratios / --ratio-step
    for item in a.sets:
        key = item.split("=", 1)[0].lstrip("+~")
        if "=" not in item or not key:
            raise PlanError(f"--set {item!r} is not a Hydra override; allowed: KEY=VALUE, e.g. --set train.seed=1")
        for reserved, flag in RESERVED.items():
            if key == reserved or (reserved.startswith("routing.") and key.startswith(reserved)):
                raise PlanError(f"--set {item} is not allowed: {key} is set by {flag}")
    if a.device != "auto":
        try:
            dev = torch.device(a.device)
        except RuntimeError:
            raise PlanError(f"--device {a.device} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise PlanError(f"--device {a.device} is not allowed; allowed: auto, cpu, cuda, cuda:N")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"--device {a.device} is not available here (no CUDA device); allowed: auto, cpu")


def ratio_grid(a: argparse.Namespace) -> list[float]:
    """The selection ratios to try: --ratios, else step, 2 step, ... <= --max-ratio."""
    if a.ratios:
        for r in a.ratios:
            if not 0.0 < r < 1.0:
                raise PlanError(f"--ratios {r:g} is out of range; a selection ratio is the fraction of tokens dropped "
                                f"and must lie in [0, 1), and 0 is the dense baseline (always included), so "
                                f"allowed: 0 < ratio < 1")
            if r > a.max_ratio + EPS:
                raise PlanError(f"--ratios {r:g} exceeds --max-ratio {a.max_ratio:g} (the paper keeps at least half "
                                f"the tokens); pass --max-ratio {r:g} to allow it")
        return sorted(set(float(r) for r in a.ratios))
    if not 0.0 < a.ratio_step <= a.max_ratio + EPS:
        raise PlanError(f"--ratio-step {a.ratio_step:g} is out of range; allowed: 0 < step <= --max-ratio "
                        f"({a.max_ratio:g})")
    n = int(math.floor(a.max_ratio / a.ratio_step + EPS))
    return [round(k * a.ratio_step, 10) for k in range(1, n + 1)]


# ----------------------------------------------------------------------------- candidates and FLOPs
def resolve_span(depth: int, min_start: int, max_end: int) -> tuple[int, int]:
    """(first start, last end) after resolving a negative --max-end; raises when empty or out of range."""
    if not 0 <= min_start < depth:
        raise PlanError(f"--min-start {min_start} is out of range for depth {depth}; allowed: 0..{depth - 1}")
    if not -depth <= max_end < depth:
        raise PlanError(f"--max-end {max_end} is out of range for depth {depth}; allowed: {-depth}..{depth - 1} "
                        f"(negative counts from the end, -1 is the last block)")
    end = max_end % depth
    if end < min_start:
        raise PlanError(f"--max-end {max_end} (block {end}) comes before --min-start {min_start} for depth {depth}; "
                        f"allowed: --max-end >= {min_start} (or {min_start - depth} from the end)")
    return min_start, end


def generate_candidates(depth: int, ratios: Sequence[float], min_start: int = PAPER_START,
                        max_end: int = -PAPER_END_FROM_END, min_blocks: int = 1) -> list[tuple[Route, ...]]:
    """Single routes {ratio, start, end} with min_start <= start <= end <= max_end, end - start + 1 >= min_blocks."""
    lo, hi = resolve_span(depth, min_start, max_end)
    out = [(Route(float(r), s, e),) for r in ratios for s in range(lo, hi + 1)
           for e in range(s + min_blocks - 1, hi + 1)]
    if not out:
        raise PlanError(f"--min-blocks {min_blocks} leaves no candidate: routes may span blocks {lo}..{hi} "
                        f"({hi - lo + 1} blocks); allowed: --min-blocks <= {hi - lo + 1}")
    return out


def routed_token_blocks(routes: Sequence[Route], num_tokens: int) -> int:
    """Token-block evaluations a route set saves: sum of blocks x dropped tokens."""
    return sum(r.num_blocks * (num_tokens - r.num_keep(num_tokens)) for r in routes)


def label_of(routes: Sequence[Route]) -> str:
    return "; ".join(f"{r.selection_ratio:g} @ {r.start_layer_idx}..{r.end_layer_idx}" for r in routes) or "dense"


def route_dicts(routes: Sequence[Route]) -> list[dict]:
    return [{"selection_ratio": r.selection_ratio, "start_layer_idx": r.start_layer_idx,
             "end_layer_idx": r.end_layer_idx} for r in routes]


def routing_overrides(routes: Sequence[Route]) -> list[str]:
    if not routes:
        return ["routing=none"]
    body = ",".join(f"{{selection_ratio:{r.selection_ratio:g},start_layer_idx:{r.start_layer_idx},"
                    f"end_layer_idx:{r.end_layer_idx}}}" for r in routes)
    return ["routing=paper", f"routing.routes=[{body}]"]


def rule_key(c: dict, depth: int) -> tuple:
    """Sort key of the recommendation rule: most compute kept first, then nearest the paper's route."""
    r = c["routes"][0] if c["routes"] else {"selection_ratio": 0.0, "start_layer_idx": 0, "end_layer_idx": 0}
    return (c["routed_token_blocks"], abs(r["selection_ratio"] - PAPER_RATIO),
            abs(r["start_layer_idx"] - PAPER_START), abs(r["end_layer_idx"] - (depth - PAPER_END_FROM_END)),
            r["selection_ratio"], r["start_layer_idx"], r["end_layer_idx"])


def meets_flops(c: dict, dense_train: float, batch: int, target: dict) -> bool:
    ok = True
    if target.get("flops_fraction") is not None:
        ok &= c["train_flops_per_step"] <= target["flops_fraction"] * dense_train * (1 + EPS)
    if target.get("gflops_per_sample") is not None:
        ok &= c["train_flops_per_step"] / batch <= target["gflops_per_sample"] * 1e9 * (1 + EPS)
    return bool(ok)


def evaluate_candidates(route_sets: Sequence[tuple[Route, ...]], forward_flops: Callable[[Sequence[Route]], float],
                        depth: int, num_tokens: int, batch: int, target: dict) -> tuple[dict, list[dict]]:
    """The dense row and one row per candidate (FLOPs, bound, tokens, whether it meets the target by FLOPs),
    the candidates sorted by the rule."""
    dense_fwd = float(forward_flops(()))
    dense_train = train_step_flops(dense_fwd, batch)
    dense = {"label": "dense", "routes": [], "forward_flops_per_sample": dense_fwd,
             "train_flops_per_step": dense_train, "train_gflops_per_sample": 3 * dense_fwd / 1e9,
             "flops_ratio": 1.0, "speedup_bound": 1.0, "tokens_fraction": 1.0, "routed_token_blocks": 0}
    rows = []
    for routes in route_sets:
        fwd = float(forward_flops(routes))
        tr = train_step_flops(fwd, batch)
        c = {"label": label_of(routes), "routes": route_dicts(routes), "forward_flops_per_sample": fwd,
             "train_flops_per_step": tr, "train_gflops_per_sample": 3 * fwd / 1e9, "flops_ratio": tr / dense_train,
             "speedup_bound": dense_train / tr, "tokens_fraction": tokens_processed_fraction(list(routes), depth,
                                                                                            num_tokens),
             "routed_token_blocks": routed_token_blocks(routes, num_tokens), "overrides": routing_overrides(routes)}
        c["meets_flops"] = meets_flops(c, dense_train, batch, target)
        x = target.get("speedup")
        c["meets_theory"] = c["meets_flops"] and (x is None or c["speedup_bound"] >= x * (1 - EPS))
        rows.append(c)
    rows.sort(key=lambda c: rule_key(c, depth))
    rank = 0
    for c in rows:
        c["measured"] = False
        if c["meets_theory"]:
            rank += 1
            c["rule_rank"] = rank
        else:
            c["rule_rank"] = None
    return dense, rows


def unreachable_message(rows: list[dict], target: dict, a: argparse.Namespace, depth: int, ratios) -> str:
    lo, hi = resolve_span(depth, a.min_start, a.max_end)
    constraints = (f"ratios {','.join(f'{r:g}' for r in ratios)} (--max-ratio {a.max_ratio:g}), start >= "
                   f"--min-start {a.min_start}, end <= --max-end {a.max_end} (block {hi} of depth {depth}), "
                   f"--min-blocks {a.min_blocks}")
    parts = []
    if target.get("speedup") is not None:
        best = max(rows, key=lambda c: c["speedup_bound"])
        if best["speedup_bound"] < target["speedup"] * (1 - EPS):
            parts.append(f"--target-speedup {target['speedup']:g} is unreachable: the largest FLOPs-bound speedup is "
                         f"{best['speedup_bound']:.3f}x ({best['label']}); allowed: <= {best['speedup_bound']:.3f}")
    if target.get("flops_fraction") is not None:
        best = min(rows, key=lambda c: c["flops_ratio"])
        if best["flops_ratio"] > target["flops_fraction"] * (1 + EPS):
            parts.append(f"--flops-fraction {target['flops_fraction']:g} is unreachable: the lowest FLOPs fraction is "
                         f"{best['flops_ratio']:.4f} ({best['label']}); allowed: >= {best['flops_ratio']:.4f}")
    if target.get("gflops_per_sample") is not None:
        best = min(rows, key=lambda c: c["train_gflops_per_sample"])
        if best["train_gflops_per_sample"] > target["gflops_per_sample"] * (1 + EPS):
            parts.append(f"--gflops-per-sample {target['gflops_per_sample']:g} is unreachable: the lowest is "
                         f"{best['train_gflops_per_sample']:.4g} GFLOPs ({best['label']}); allowed: >= "
                         f"{best['train_gflops_per_sample']:.4g}")
    if not parts:
        parts.append("the targets together are unreachable: no candidate meets all of them at once")
    return "; ".join(parts) + f" under the constraints ({constraints}); relax --max-ratio, --min-start or --max-end"


# ----------------------------------------------------------------------------- measurement order and the rule
TimeFn = Callable[[dict], dict]  # candidate row -> {"dense_s": ..., "step_s": ...} (medians of one pairing)


def cost_class(c: dict) -> tuple:
    """Route sets with the same ratios, span lengths and FLOPs do the same work (only where the span sits
    differs), so one of them is timed for all."""
    return (tuple((r["selection_ratio"], r["end_layer_idx"] - r["start_layer_idx"]) for r in c["routes"]),
            c["train_flops_per_step"])


def measure_candidates(rows: list[dict], k: int, time_fn: TimeFn, target: dict,
                       log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Time at most k of the candidates that meet the target by FLOPs (see the module docstring for the order);
    fills step/speedup fields in place and returns the timed rows in the order they were timed."""
    pending = [c for c in rows if c["meets_theory"]]
    x = target.get("speedup")
    timed, fractions = [], []
    while pending and len(timed) < k:
        same = {cost_class(c): c["label"] for c in timed}
        for c in [c for c in pending if cost_class(c) in same]:   # same work as a timed one: not timed again
            c["same_cost_as"] = same[cost_class(c)]
            pending.remove(c)
        if not pending:
            break
        f = statistics.median(fractions) if fractions else 1.0
        pick = next((c for c in pending if x is None or c["speedup_bound"] * f >= x * (1 - EPS)), None)
        if pick is None:
            pick = max(pending, key=lambda c: c["speedup_bound"])  # ties: the first in rule order
        pending.remove(pick)
        log(f"timing {pick['label']} against dense ({len(timed) + 1} of at most {k})")
        t = time_fn(pick)
        pick.update({"measured": True, "measure_order": len(timed) + 1, "step_ms": 1e3 * t["step_s"],
                     "dense_step_ms": 1e3 * t["dense_s"], "speedup": t["dense_s"] / t["step_s"]})
        pick["fraction_of_bound"] = pick["speedup"] / pick["speedup_bound"]
        pick["meets_measured"] = pick["meets_flops"] and (x is None or pick["speedup"] >= x * (1 - EPS))
        for key in ("counted_forward_flops", "flops_match", "step_ms_all", "dense_step_ms_all"):
            if key in t:
                pick[key] = t[key]
        fractions.append(pick["fraction_of_bound"])
        timed.append(pick)
        if x is not None and pick["meets_measured"]:
            # only a candidate earlier in rule order can still change the recommendation: time those, or stop
            pending = [c for c in pending if c["rule_rank"] < pick["rule_rank"]]
    same = {cost_class(c): c["label"] for c in timed}
    for c in rows:
        if c["meets_theory"] and not c.get("measured") and cost_class(c) in same:
            c["same_cost_as"] = same[cost_class(c)]
    return timed


def recommend(rows: list[dict], target: dict) -> dict:
    """The rule (RULE) on evaluated rows; rows are sorted by rule_key already."""
    timed = [c for c in rows if c.get("measured")]
    if timed:
        ok = [c for c in timed if c["meets_measured"]]
        basis = "measured"
    else:
        ok = [c for c in rows if c["meets_theory"]]
        basis = "theory"
    if ok:
        best = ok[0]
        how = "by measurement" if basis == "measured" else "by FLOPs (nothing timed)"
        among = ("the only timed candidate that does" if len(ok) == 1 and basis == "measured" else
                 f"it keeps the most compute ({best['routed_token_blocks']} routed token-blocks) of the {len(ok)} "
                 f"{'timed ' if basis == 'measured' else ''}candidates that do")
        why = f"meets the target {how}; {among}"
        return {"label": best["label"], "routes": best["routes"], "basis": basis, "meets_target": True,
                "reason": why, "rule": RULE}
    if timed:
        best = max(timed, key=lambda c: c["speedup"])
        why = (f"none of the {len(timed)} timed candidates meets the target; this one comes closest "
               f"({best['speedup']:.3f}x measured, {best['speedup_bound']:.3f}x FLOPs bound)")
    else:  # cannot happen after the reachability check, kept for library callers
        best = max(rows, key=lambda c: c["speedup_bound"])
        why = "no candidate meets the target by FLOPs; this one comes closest"
    return {"label": best["label"], "routes": best["routes"], "basis": basis, "meets_target": False,
            "reason": why, "rule": RULE}


# ----------------------------------------------------------------------------- configs and models
def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def base_overrides(a: argparse.Namespace) -> tuple[list[str], Any]:
    """The overrides train.py would get (without routing), and the dense config they compose to."""
    head = [f"model={a.model}"] + ([f"data={a.data}"] if a.data else [])
    try:
        probe = compose(head + list(a.sets) + ["routing=none"])
    except Exception as err:  # noqa: BLE001 - Hydra's errors: bad key, bad value, missing config
        raise PlanError(f"the overrides {' '.join(head + list(a.sets))} do not compose: "
                        f"{str(err).splitlines()[0]}") from None
    is_dit = is_dit_cfg(probe)
    ov = list(head)
    if a.arch is not None:
        if not is_dit:
            raise PlanError(f"--arch {a.arch} applies to model=tread|dit; model={a.model} is a diffusers family: "
                            f"use --preset (e.g. --preset tiny)")
        from models.dit import DIT_ARCHS
        if a.arch not in DIT_ARCHS:
            raise PlanError(f"--arch {a.arch} is not a known DiT; allowed: {', '.join(DIT_ARCHS)}")
        ov.append(f"model.arch={a.arch}")
    if a.preset is not None:
        if is_dit:
            raise PlanError(f"--preset {a.preset} applies to the diffusers families; model={a.model} is a DiT: use "
                            f"--arch (e.g. --arch DiT-B/2)")
        from models.families import family_module
        presets = sorted(family_module(probe.model.family).PRESETS)
        if a.preset not in presets:
            raise PlanError(f"--preset {a.preset} is not a {probe.model.family} preset; allowed: {', '.join(presets)}")
        ov.append(f"model.preset={a.preset}")
    if a.resolution is not None:
        builtin = probe.data.get("builtin")
        ov.append(f"data.builtin_args.resolution={a.resolution}" if builtin else f"data.resolution={a.resolution}")
    if a.channels is not None:
        ov.append(f"data.channels={a.channels}")
    if a.batch is not None:
        ov.append(f"train.batch_size={a.batch}")
    ov += list(a.sets)
    try:
        cfg = compose(ov + ["routing=none"])
    except Exception as err:  # noqa: BLE001
        raise PlanError(f"the overrides {' '.join(ov)} do not compose: {str(err).splitlines()[0]}") from None
    return ov, cfg


def instantiate_model(model_cfg, device: Optional[str] = None):
    """The model train.py builds (training.loop.build: our config errors unwrapped), on `device` if given."""
    from training.loop import build

    with torch.device(device) if device is not None else contextlib.nullcontext():
        return build(model_cfg)


def is_dit_cfg(cfg) -> bool:
    return cfg.model.get("_target_") == "models.build_dit"


def check_model_cfg(cfg) -> None:
    """A DiT's arch and patch divisibility as flag errors, before building anything (the families' own checks
    name the key and the allowed values)."""
    res = int(cfg.data.resolution)
    if is_dit_cfg(cfg):
        from models.dit import DIT_ARCHS
        arch = cfg.model.arch
        if arch not in DIT_ARCHS:
            raise PlanError(f"model.arch {arch} (--arch) is not a known DiT; allowed: {', '.join(DIT_ARCHS)}")
        patch = int(arch.split("/")[1])
        if res % patch:
            lower, upper = res - res % patch, res - res % patch + patch
            raise PlanError(f"--resolution {res} is not divisible by the patch size {patch} of {arch}; allowed: "
                            f"multiples of {patch}, e.g. {lower or upper} or {upper}")


def model_for_flops(cfg, a: argparse.Namespace):
    """The dense model to count FLOPs on: a DiT on the meta device (shapes only, no memory), a diffusers family
    on the CPU (its forward is counted by FlopCounterMode)."""
    check_model_cfg(cfg)
    flags = f"--resolution {int(cfg.data.resolution)} --channels {int(cfg.data.channels)}"
    try:
        model = instantiate_model(cfg.model, "meta" if is_dit_cfg(cfg) else "cpu")
    except Exception as err:  # noqa: BLE001 - our config errors name the key and the allowed values
        raise PlanError(f"model={a.model} ({cfg.model.get('arch')}) cannot be built for {flags}: "
                        f"{str(err).splitlines()[0]}") from None
    return model


def flops_function(model) -> Callable[[Sequence[Route]], float]:
    """Forward FLOPs per sample for a route set, cached: training.flops.forward_flops_with_routes (DiT's
    analytic count, or the families' counted forward with the routes set through the inference override)."""
    cache: dict = {}

    def fn(routes: Sequence[Route]) -> float:
        key = tuple(routes)
        if key not in cache:
            cache[key] = forward_flops_with_routes(model, route_dicts(routes))
        return cache[key]
    return fn


class PairedTimer:
    """time_fn for measure_candidates: the dense baseline's Stepper stays built; each call builds the
    candidate from its composed config (same init seed), times both with benchmark.time_configs in interleaved
    rounds, counts its FLOPs as the training loop does, and frees it."""

    def __init__(self, overrides: list[str], dense_cfg, a: argparse.Namespace, device: torch.device, dtype):
        from hydra.utils import instantiate

        self.overrides, self.a, self.device, self.dtype = overrides, a, device, dtype
        self.backend = (("inductor" if device.type == "cuda" else "aot_eager") if a.compile else None)
        if a.compile:
            import torch._dynamo.config as dcfg
            for key in ("recompile_limit", "cache_size_limit"):
                if hasattr(dcfg, key):
                    setattr(dcfg, key, max(getattr(dcfg, key), 16 * (a.measure + 1) + 16))
        self.objective = instantiate(dense_cfg.diffusion)
        torch.manual_seed(0)
        model = instantiate_model(dense_cfg.model)
        shape = [int(dense_cfg.train.batch_size), model.in_channels, model.input_size, model.input_size]
        if getattr(model, "frames_axis", False) and getattr(model, "frames", 1) > 1:
            shape.insert(2, model.frames)
        gen = torch.Generator("cpu").manual_seed(0)
        self.x = torch.randn(shape, generator=gen).to(device)
        self.y = torch.randint(0, model.num_classes, (shape[0],), generator=gen).to(device)
        # the Stepper as the training config sets it up: gradient checkpointing and fused AdamW from the config
        self.stepper = type("ConfigStepper", (Stepper,), {
            "gradient_checkpointing": bool(dense_cfg.model.get("gradient_checkpointing", False)),
            "fused_adamw": bool(dense_cfg.optimizer.get("fused", True))})
        self.dense = self.stepper(model, self.objective, device, dtype, self.backend)
        self.meter = MemoryMeter(device)
        self.dense_times: list[float] = []

    def __call__(self, cand: dict) -> dict:
        cfg = compose(self.overrides + cand["overrides"])
        torch.manual_seed(0)
        model = instantiate_model(cfg.model)
        counted = model_forward_flops(model)  # what the training loop logs for this config
        st = self.stepper(model, self.objective, self.device, self.dtype, self.backend)
        meas = time_configs([self.dense, st], self.x, self.y, self.a.steps, self.a.warmup, self.a.rounds,
                            self.meter, bool(self.backend))
        self.dense_times += meas[0]["times"]
        del st, model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"dense_s": statistics.median(meas[0]["times"]), "step_s": statistics.median(meas[1]["times"]),
                "step_ms_all": [1e3 * t for t in meas[1]["times"]],
                "dense_step_ms_all": [1e3 * t for t in meas[0]["times"]],
                "counted_forward_flops": counted,
                "flops_match": math.isclose(counted, cand["forward_flops_per_sample"], rel_tol=1e-9)}


# ----------------------------------------------------------------------------- pilot trainings
def pilot_loss(metrics_path: Path) -> Optional[float]:
    """Step-weighted mean of the logged training losses over the second half of the run's steps (at least the
    last logged window): each record's loss is the mean over the steps since the previous record."""
    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("type") == "train"]
    if not recs:
        return None
    half = recs[-1]["step"] / 2
    total = weight = 0.0
    prev = 0
    for r in recs:
        w = r["step"] - prev
        prev = r["step"]
        if r["step"] > half or r is recs[-1]:
            total += r["loss"] * w
            weight += w
    return total / weight


def pilot_candidates(rows: list[dict], k: int) -> list[dict]:
    """The top k for the pilot: candidates meeting the target by measurement, then by FLOPs, in rule order."""
    first = [c for c in rows if c.get("measured") and c["meets_measured"]]
    rest = [c for c in rows if c["meets_theory"] and c not in first]
    return (first + rest)[:k]


def pilot_enabled(a: argparse.Namespace) -> bool:
    return bool(a.pilot) or a.pilot_seconds is not None


def pilot_overrides(a: argparse.Namespace, device: torch.device) -> list[str]:
    n = a.pilot or 10 ** 9
    ov = [f"train.max_steps={n}", "checkpoint.every_steps=0", "eval.every_steps=0",
          f"eval.at_end={'true' if a.pilot_fid else 'false'}",
          f"train.mixed_precision={'bf16' if a.precision == 'bf16' else 'no'}",
          f"train.cpu={'true' if device.type == 'cpu' else 'false'}",
          f"train.compile={'true' if a.compile else 'false'}"]
    if a.pilot_seconds is not None:
        ov.append(f"train.time_budget_min={a.pilot_seconds / 60.0!r}")
    if not any(s.split("=", 1)[0].lstrip("+~") == "train.log_every_steps" for s in a.sets):
        ov.append(f"train.log_every_steps={max(1, n // 10) if a.pilot else 10}")
    return ov


def check_pilot_data(dense_cfg, a: argparse.Namespace) -> None:
    """Build (or open) the pilot's data now, so a mismatch is an error before any timing."""
    from data import build_dataset

    if a.pilot_seconds is not None and "time_budget_min" not in dense_cfg.train:
        raise PlanError(f"--pilot-seconds {a.pilot_seconds:g} needs train.time_budget_min, which this checkout's "
                        f"configs/train.yaml does not have; use --pilot N (equal steps)")
    want = (int(dense_cfg.data.channels), int(dense_cfg.data.resolution))
    try:
        ds = build_dataset(dense_cfg.data)
    except Exception as err:  # noqa: BLE001 - the data's own checks (shape, files) name what it has
        raise PlanError(f"--pilot trains on the data ({dense_cfg.data.get('name')}), which does not fit the plan's "
                        f"--channels {want[0]} --resolution {want[1]}: {str(err).splitlines()[0]}") from None
    if (ds.channels, ds.resolution) != want:
        raise PlanError(f"--pilot trains on the data ({dense_cfg.data.get('name')}, {ds.channels}x"
                        f"{ds.resolution}x{ds.resolution}) but the plan is for --channels {want[0]} --resolution "
                        f"{want[1]}; allowed: --channels {ds.channels} --resolution {ds.resolution}, or other --data")


def run_pilot(overrides: list[str], rows: list[dict], dense_row: dict, a: argparse.Namespace, out: Path,
              device: torch.device) -> dict:
    from training.loop import USER_ERRORS, train

    extra = pilot_overrides(a, device)
    chosen = [dense_row] + pilot_candidates(rows, a.pilot_top)
    runs = []
    for c in chosen:
        name = c["label"].replace(" @ ", "_").replace("..", "-").replace("; ", "+")
        run_dir = out / "pilot" / name
        ov = overrides + (c.get("overrides") or routing_overrides(())) + extra
        log(f"pilot: training {c['label']} for {a.pilot} steps into {run_dir}")
        try:
            with contextlib.redirect_stdout(sys.stderr):   # the loop's start-up lines: keep stdout for the table
                summary = train(compose(ov), run_dir, overrides=ov)
        except USER_ERRORS as err:
            raise PlanError(f"pilot run {c['label']} ({run_dir}) failed: {str(err).splitlines()[0]}") from None
        runs.append({"label": c["label"], "routes": c["routes"], "run_dir": str(run_dir), "overrides": ov,
                     "final_loss": pilot_loss(run_dir / "metrics.jsonl"), "final_fid": summary.get("final_fid"),
                     "train_sec": summary["train_sec"], "steps": summary["final_step"],
                     "train_flops_per_step": summary["train_flops_per_step"],
                     "flops_match": math.isclose(summary["train_flops_per_step"], c["train_flops_per_step"],
                                                 rel_tol=1e-9),
                     "meets_target": None if not c["routes"] else bool(c.get("meets_measured", c["meets_theory"]))})
    metric = "final_fid" if a.pilot_fid else "final_loss"
    for r in runs:
        r["steps_per_sec"] = r["steps"] / r["train_sec"] if r["train_sec"] else None
    for r in runs:  # training throughput vs dense (steps per second of training time)
        r["speedup"] = (r["steps_per_sec"] / runs[0]["steps_per_sec"]) if r["steps_per_sec"] and \
            runs[0]["steps_per_sec"] else None
    ranked = sorted(runs, key=lambda r: (r[metric] is None, r[metric] if r[metric] is not None else 0.0))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    routed = [r for r in ranked if r["routes"] and r[metric] is not None]
    return {"steps": a.pilot or None, "seconds": a.pilot_seconds, "metric": metric, "data": overrides, "runs": ranked,
            "best": routed[0]["label"] if routed else None,
            "dense_rank": next(r["rank"] for r in ranked if not r["routes"])}


# ----------------------------------------------------------------------------- output
def train_command(overrides: list[str], routes: list[dict]) -> str:
    rts = [Route(**r) for r in routes]
    return "python train.py " + " ".join(shlex.quote(o) for o in overrides + routing_overrides(rts))


def target_text(t: dict) -> str:
    parts = []
    if t.get("speedup") is not None:
        parts.append(f"step speedup >= {t['speedup']:g}x")
    if t.get("flops_fraction") is not None:
        parts.append(f"training FLOPs <= {t['flops_fraction']:g} x dense")
    if t.get("gflops_per_sample") is not None:
        parts.append(f"training GFLOPs/sample <= {t['gflops_per_sample']:g}")
    return " and ".join(parts)


def markdown(res: dict) -> str:
    s, t = res["settings"], res["target"]
    lines = [f"Route plan for {s['model_name']} (model={s['model']}), {s['tokens']} tokens "
             f"({s['resolution']}x{s['resolution']}x{s['channels']}), depth {s['depth']}, batch {s['batch']}; "
             f"target: {target_text(t)}.",
             f"Candidates: single routes, ratios {', '.join(f'{r:g}' for r in s['ratios'])}, blocks "
             f"{s['span'][0]}..{s['span'][1]} (start >= {s['min_start']}, end <= {s['max_end']}), >= "
             f"{s['min_blocks']} blocks: {res['num_candidates']} candidates, {res['num_meet_theory']} meet the "
             f"target by FLOPs; {res['num_measured']} timed (--measure {s['measure']}"
             f"{'; stopped early: no untimed candidate could change the pick' if res['timing_stopped_early'] else ''}"
             f").",
             ]
    if res["num_measured"]:
        lines.append(f"Timing: {s['device_name']} ({s['device']}), {s['threads']} threads, {s['precision']}, "
                     f"{'compiled' if s['compile'] else 'eager'}; per pairing {s['warmup']} warm-up + {s['steps']} "
                     f"timed steps per config in {s['rounds']} interleaved rounds with dense; torch {s['torch']}.")
    lines += ["", "| # | route | tokens processed | train FLOPs/step | FLOPs ratio | bound | meets (FLOPs) | step | "
              "speedup | of bound | meets (timed) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    d = res["dense"]
    dense_t = f"{d['step_ms']:.1f} ms | 1.000x" if d.get("step_ms") is not None else "- | -"
    lines.append(f"| - | dense | 100.0% | {fmt_flops(d['train_flops_per_step'])} | 1.000 | 1.000x | - | {dense_t} | "
                 f"- | - |")
    rec = res["recommendation"]["label"]
    shown = [c for c in res["candidates"] if c["meets_theory"]][:s["show"]]
    shown += [c for c in res["candidates"] if c.get("measured") and c not in shown]
    for c in shown:
        name = f"**{c['label']}** (recommended)" if c["label"] == rec else c["label"]
        if c.get("measured"):
            timed = (f"{c['step_ms']:.1f} ms | {c['speedup']:.3f}x | {100 * c['fraction_of_bound']:.0f}% | "
                     f"{'yes' if c['meets_measured'] else 'no'}")
        elif c.get("same_cost_as"):
            timed = f"not timed (same work as {c['same_cost_as']}) | - | - | -"
        else:
            timed = "not timed | - | - | -"
        lines.append(f"| {c['rule_rank'] or '-'} | {name} | {100 * c['tokens_fraction']:.1f}% | "
                     f"{fmt_flops(c['train_flops_per_step'])} | {c['flops_ratio']:.3f} | {c['speedup_bound']:.3f}x | "
                     f"{'yes' if c['meets_theory'] else 'no'} | {timed} |")
    more = res["num_meet_theory"] - len([c for c in shown if c["meets_theory"]])
    if more > 0:
        lines.append(f"\n{more} more candidates meet the target by FLOPs (not shown, not timed; all in --json).")
    r = res["recommendation"]
    verdict = "meets the target" if r["meets_target"] else "does NOT meet the target (closest)"
    lines += ["", f"Recommendation ({r['basis']}): **{r['label']}**, {verdict}: {r['reason']}.",
              f"Rule: {RULE}.", f"Train it: `{r['train_command']}`"]
    if res.get("pilot"):
        p = res["pilot"]
        what = "FID at the end" if p["metric"] == "final_fid" else "final loss (mean over the second half)"
        budget = " and ".join(([f"{p['steps']} steps"] if p["steps"] else []) +
                              ([f"{p['seconds']:g} s of training"] if p["seconds"] else []))
        first = " (whichever comes first)" if p["steps"] and p["seconds"] else ""
        lines += ["", f"Pilot: {budget} each{first}, ranked by {what}; speedup = steps per training second vs "
                  f"dense.", "",
                  "| rank | route | steps | final loss | FID | train s | speedup | meets target |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in p["runs"]:
            fid = "-" if x["final_fid"] is None else f"{x['final_fid']:.2f}"
            loss = "-" if x["final_loss"] is None else f"{x['final_loss']:.4f}"
            meets = "-" if x["meets_target"] is None else ("yes" if x["meets_target"] else "no")
            lines.append(f"| {x['rank']} | {x['label']} | {x['steps']} | {loss} | {fid} | {x['train_sec']:.1f} | "
                         f"{x['speedup']:.2f}x | {meets} |")
        lines.append(f"\nPilot pick: **{p['best']}** (best routed candidate by the pilot metric; dense ranks "
                     f"{p['dense_rank']}).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def res_timed(rows: list[dict]) -> bool:
    return any(c.get("measured") for c in rows)


def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries only the table."""
    print(msg, file=sys.stderr, flush=True)


def plan(a: argparse.Namespace, time_fn: Optional[TimeFn] = None) -> dict:
    check_args(a)
    overrides, dense_cfg = base_overrides(a)
    target = {"speedup": a.target_speedup, "flops_fraction": a.flops_fraction,
              "gflops_per_sample": a.gflops_per_sample}
    model = model_for_flops(dense_cfg, a)
    depth, num_tokens, batch = int(model.depth), int(model.num_tokens), int(dense_cfg.train.batch_size)
    ratios = ratio_grid(a)
    route_sets = generate_candidates(depth, ratios, a.min_start, a.max_end, a.min_blocks)
    dense, rows = evaluate_candidates(route_sets, flops_function(model), depth, num_tokens, batch, target)
    del model
    if not any(c["meets_theory"] for c in rows):
        raise PlanError(unreachable_message(rows, target, a, depth, ratios))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if pilot_enabled(a):
        check_pilot_data(dense_cfg, a)
    timer, stopped_early = None, False
    if a.measure:
        if time_fn is None:
            timer = time_fn = PairedTimer(overrides, dense_cfg, a, device,
                                          torch.bfloat16 if a.precision == "bf16" else torch.float32)
        timed_rows = measure_candidates(rows, a.measure, time_fn, target, log=log)
        left = [c for c in rows if c["meets_theory"] and not c.get("measured") and not c.get("same_cost_as")]
        stopped_early = len(timed_rows) < a.measure and bool(left)
        timed = [c for c in rows if c.get("measured")]
        dense["step_ms"] = (1e3 * statistics.median(timer.dense_times) if timer is not None and timer.dense_times
                            else statistics.median(c["dense_step_ms"] for c in timed))
        del timer
    rec = recommend(rows, target)
    rec["train_command"] = train_command(overrides, rec["routes"])
    lo, hi = resolve_span(depth, a.min_start, a.max_end)
    res: dict[str, Any] = {
        "settings": {"model": a.model, "model_name": str(dense_cfg.model.get("arch")),
                     "family": str(dense_cfg.model.get("family") or "dit"), "overrides": overrides,
                     "resolution": int(dense_cfg.data.resolution), "channels": int(dense_cfg.data.channels),
                     "tokens": num_tokens, "depth": depth, "batch": batch, "ratios": ratios, "span": [lo, hi],
                     "min_start": a.min_start, "max_end": a.max_end, "min_blocks": a.min_blocks,
                     "max_ratio": a.max_ratio, "measure": a.measure, "steps": a.steps, "warmup": a.warmup,
                     "rounds": len(split_steps(a.steps, a.rounds)), "device": str(device),
                     "device_name": device_name(device), "threads": torch.get_num_threads(),
                     "precision": a.precision, "compile": bool(a.compile), "torch": torch.__version__,
                     "gradient_checkpointing": bool(dense_cfg.model.get("gradient_checkpointing", False)),
                     "fused_adamw": bool(dense_cfg.optimizer.get("fused", True)),
                     "show": a.show, "flops": "theoretical: 3 x forward x batch, matmuls + attention, "
                                              "multiply-add = 2 (training/flops.py)",
                     "timing": ("none" if not res_timed(rows) else
                                "measured" if isinstance(time_fn, PairedTimer) else "injected")},
        "target": target, "dense": dense, "candidates": rows, "num_candidates": len(rows),
        "num_meet_theory": sum(c["meets_theory"] for c in rows),
        "num_measured": sum(bool(c.get("measured")) for c in rows), "recommendation": rec,
        "timing_stopped_early": stopped_early}
    if pilot_enabled(a):
        out = Path(a.out) if a.out else ROOT / "outputs" / "plan_routes" / time.strftime("%Y-%m-%d_%H-%M-%S")
        res["pilot"] = run_pilot(overrides, rows, dense, a, out, device)
        res["rule_recommendation"] = dict(rec)
        best = res["pilot"]["best"]
        if best is not None:
            c = next(c for c in rows if c["label"] == best)
            res["recommendation"] = {
                "label": best, "routes": c["routes"], "basis": "pilot",
                "meets_target": bool(c.get("meets_measured", c["meets_theory"])),
                "reason": f"lowest pilot {res['pilot']['metric'].replace('_', ' ')} among the "
                          f"{len(res['pilot']['runs']) - 1} routed pilot candidates (the rule picked "
                          f"{rec['label']})", "rule": RULE, "train_command": train_command(overrides, c["routes"])}
        res["settings"]["out"] = str(out)
    res["markdown"] = markdown(res)
    return res


def main(argv: Optional[Sequence[str]] = None, time_fn: Optional[TimeFn] = None) -> dict:
    """Plan routes; returns the result dict (what --json writes). Bad input: SystemExit('error: ...').
    time_fn replaces the timing (tests): candidate row -> {"dense_s", "step_s"}."""
    threads = torch.get_num_threads()
    try:
        a = parse_args(argv)
        if a.threads:
            torch.set_num_threads(a.threads)
        res = plan(a, time_fn)
    except PlanError as err:
        raise SystemExit(f"error: {err}") from None
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their thread count
    print(res["markdown"])
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text(res["markdown"] + "\n")
    return res


if __name__ == "__main__":
    main()
