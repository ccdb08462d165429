"""The route planner's logic: candidates under the paper's guidelines, their FLOPs, which to time and in what order,
and the recommendation rule (docs/ablations.md, "Route planning", states the rules).
"""
from __future__ import annotations

import math
import shlex
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

from tread.models.flops import RouteFlops, forward_flops_with_routes, train_step_flops
from tread.perf.benchmark import PairedTimer
from tread.perf.routes import label_of, route_dicts, routing_overrides
from tread.routing import Route, tokens_per_block, tokens_processed_fraction
from tread.schema.train import TrainConfig
from tread.utils.errors import UserError

PAPER_RATIO, PAPER_START, PAPER_END_FROM_END = 0.5, 2, 4   # the paper's route: 0.5 over blocks 2..depth-4
EPS = 1e-9

RULE = ("among the candidates that meet the target (measured speedup when timed, FLOPs otherwise), the one that "
        "keeps the most compute: fewest routed token-blocks (blocks x dropped tokens); ties go to the paper's "
        "default route (ratio nearest 0.5, then start nearest 2, then end nearest depth-4); if none meets the "
        "target, the closest one (highest measured speedup) is given and marked as missing it")

TimeFn = Callable[[dict], dict]  # candidate row -> {"dense_s": ..., "step_s": ...} (medians of one pairing)


class PlanError(UserError):
    """A bad planner input; the program prints it as one line, 'error: ...'."""


@dataclass(frozen=True)
class Space:
    """The candidate space: selection ratios, the blocks a route may span, its shortest length."""

    ratios: tuple[float, ...]
    min_start: int = PAPER_START
    max_end: int = -PAPER_END_FROM_END     # negative counts from the end
    min_blocks: int = 1
    max_ratio: float = 0.5


def ratio_grid(ratios: Optional[Sequence[float]], ratio_step: float, max_ratio: float) -> list[float]:
    """The selection ratios to try: `ratios` (--ratios), else step, 2 step, ... <= max_ratio."""
    if ratios:
        for r in ratios:
            if not 0.0 < r < 1.0:
                raise PlanError(f"--ratios {r:g} is out of range; a selection ratio is the fraction of tokens dropped "
                                f"and must lie in [0, 1), and 0 is the dense baseline (always included), so "
                                f"allowed: 0 < ratio < 1")
            if r > max_ratio + EPS:
                raise PlanError(f"--ratios {r:g} exceeds --max-ratio {max_ratio:g} (the paper keeps at least half "
                                f"the tokens); pass --max-ratio {r:g} to allow it")
        return sorted(set(float(r) for r in ratios))
    if not 0.0 < ratio_step <= max_ratio + EPS:
        raise PlanError(f"--ratio-step {ratio_step:g} is out of range; allowed: 0 < step <= --max-ratio "
                        f"({max_ratio:g})")
    n = int(math.floor(max_ratio / ratio_step + EPS))
    return [round(k * ratio_step, 10) for k in range(1, n + 1)]


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


def routed_token_blocks(routes: Sequence[Route], depth: int, num_tokens: int) -> int:
    """Token-block evaluations a route set saves: sum of blocks x dropped tokens (routing.tokens_per_block)."""
    return depth * num_tokens - sum(tokens_per_block(routes, depth, num_tokens))


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


def flops_row(label: str, routes: Sequence[Route], fwd: float, batch: int) -> dict:
    train = train_step_flops(fwd, batch)
    return {"label": label, "routes": route_dicts(routes), "forward_flops_per_sample": fwd,
            "train_flops_per_step": train, "train_gflops_per_sample": 3 * fwd / 1e9}


def evaluate_candidates(route_sets: Sequence[tuple[Route, ...]], forward_flops: Callable[[Sequence[Route]], float],
                        depth: int, num_tokens: int, batch: int, target: dict) -> tuple[dict, list[dict]]:
    """The dense row and one row per candidate (FLOPs, bound, tokens, whether it meets the target by FLOPs),
    the candidates sorted by the rule."""
    dense = {**flops_row("dense", (), float(forward_flops(())), batch), "flops_ratio": 1.0, "speedup_bound": 1.0,
             "tokens_fraction": 1.0, "routed_token_blocks": 0}
    dense_train = dense["train_flops_per_step"]
    rows = []
    for routes in route_sets:
        c = flops_row(label_of(routes), routes, float(forward_flops(routes)), batch)
        c.update({"flops_ratio": c["train_flops_per_step"] / dense_train,
                  "speedup_bound": dense_train / c["train_flops_per_step"],
                  "tokens_fraction": tokens_processed_fraction(list(routes), depth, num_tokens),
                  "routed_token_blocks": routed_token_blocks(routes, depth, num_tokens),
                  "overrides": routing_overrides(routes)})
        c["meets_flops"] = meets_flops(c, dense_train, batch, target)
        x = target.get("speedup")
        c["meets_theory"] = c["meets_flops"] and (x is None or c["speedup_bound"] >= x * (1 - EPS))
        rows.append(c)
    rows.sort(key=lambda c: rule_key(c, depth))
    rank = 0
    for c in rows:
        c["measured"] = False
        rank += c["meets_theory"]
        c["rule_rank"] = rank if c["meets_theory"] else None
    return dense, rows


def unreachable_message(rows: list[dict], target: dict, space: Space, depth: int) -> str:
    lo, hi = resolve_span(depth, space.min_start, space.max_end)
    constraints = (f"ratios {','.join(f'{r:g}' for r in space.ratios)} (--max-ratio {space.max_ratio:g}), start >= "
                   f"--min-start {space.min_start}, end <= --max-end {space.max_end} (block {hi} of depth {depth}), "
                   f"--min-blocks {space.min_blocks}")
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


def flops_function(model: Any) -> Callable[[Sequence[Route]], float]:
    """Forward FLOPs per sample for a route set, cached: DiT's analytic count (forward_flops_with_routes), or a
    family's per-block polynomials from three counted forwards (tread.models.flops.RouteFlops)."""
    cache: dict = {}
    count = RouteFlops(model) if not model.analytic_flops else partial(forward_flops_with_routes, model)

    def fn(routes: Sequence[Route]) -> float:
        key = tuple(routes)
        if key not in cache:
            cache[key] = count(route_dicts(routes))
        return cache[key]
    return fn


# ----------------------------------------------------------------------------- measurement order and the rule
def cost_class(c: dict) -> tuple:
    """Route sets with the same ratios, span lengths and FLOPs do the same work (only where the span sits
    differs), so one of them is timed for all."""
    return (tuple((r["selection_ratio"], r["end_layer_idx"] - r["start_layer_idx"]) for r in c["routes"]),
            c["train_flops_per_step"])


def next_to_time(pending: list[dict], fractions: list[float], x: Optional[float]) -> dict:
    """The first in rule order whose bound x the fraction realised so far reaches the speedup target, else the
    largest bound (ties: the first in rule order)."""
    f = statistics.median(fractions) if fractions else 1.0
    pick = next((c for c in pending if x is None or c["speedup_bound"] * f >= x * (1 - EPS)), None)
    return pick if pick is not None else max(pending, key=lambda c: c["speedup_bound"])


def record_timing(pick: dict, t: dict, order: int, x: Optional[float]) -> None:
    pick.update({"measured": True, "measure_order": order, "step_ms": 1e3 * t["step_s"],
                 "dense_step_ms": 1e3 * t["dense_s"], "speedup": t["dense_s"] / t["step_s"]})
    pick["fraction_of_bound"] = pick["speedup"] / pick["speedup_bound"]
    pick["meets_measured"] = pick["meets_flops"] and (x is None or pick["speedup"] >= x * (1 - EPS))
    for key in ("counted_forward_flops", "flops_match", "step_ms_all", "dense_step_ms_all"):
        if key in t:
            pick[key] = t[key]


def mark_same_cost(rows: list[dict], timed: list[dict]) -> None:
    """Candidates that do the same work as a timed one are not timed again; they name it."""
    same = {cost_class(c): c["label"] for c in timed}
    for c in rows:
        if c["meets_theory"] and not c.get("measured") and cost_class(c) in same:
            c["same_cost_as"] = same[cost_class(c)]


def measure_candidates(rows: list[dict], k: int, time_fn: TimeFn, target: dict,
                       log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Time at most k of the candidates that meet the target by FLOPs (order: docs/ablations.md), filling their
    step/speedup fields in place; returns the timed rows in timing order."""
    pending = [c for c in rows if c["meets_theory"]]
    x = target.get("speedup")
    timed, fractions, start = [], [], time.perf_counter()
    while len(timed) < k:
        mark_same_cost(pending, timed)
        pending = [c for c in pending if not c.get("same_cost_as")]
        if not pending:
            break
        pick = next_to_time(pending, fractions, x)
        pending.remove(pick)
        log(f"timing {pick['label']} against dense ({len(timed) + 1} of at most {k})")
        record_timing(pick, time_fn(pick), len(timed) + 1, x)
        fractions.append(pick["fraction_of_bound"])
        timed.append(pick)
        if x is not None and pick["meets_measured"]:
            # only a candidate earlier in rule order can still change the recommendation: time those, or stop
            pending = [c for c in pending if c["rule_rank"] < pick["rule_rank"]]
        log(progress_line(timed, pending, k, time.perf_counter() - start))
    mark_same_cost(rows, timed)
    return timed


def progress_line(timed: list[dict], pending: list[dict], k: int, elapsed: float) -> str:
    """'timed 1 of at most 4 candidates in 12 s; at most ~36 s more' (one pairing per distinct cost left)."""
    done = {cost_class(c) for c in timed}
    left = min(k - len(timed), len({cost_class(c) for c in pending} - done))
    more = f"at most ~{seconds(elapsed / len(timed) * left)} s more" if left else "nothing left to time"
    return f"timed {len(timed)} of at most {k} candidates in {seconds(elapsed)} s; {more}"


def seconds(s: float) -> str:
    return f"{s:.1f}" if s < 10 else f"{s:.0f}"


def recommend(rows: list[dict], target: dict) -> dict:
    """The rule (RULE) on evaluated rows; rows are sorted by rule_key already."""
    timed = [c for c in rows if c.get("measured")]
    basis = "measured" if timed else "theory"
    ok = [c for c in timed if c["meets_measured"]] if timed else [c for c in rows if c["meets_theory"]]
    if ok:
        best = ok[0]
        how = "by measurement" if timed else "by FLOPs (nothing timed)"
        among = ("the only timed candidate that does" if len(ok) == 1 and timed else
                 f"it keeps the most compute ({best['routed_token_blocks']} routed token-blocks) of the {len(ok)} "
                 f"{'timed ' if timed else ''}candidates that do")
        return {"label": best["label"], "routes": best["routes"], "basis": basis, "meets_target": True,
                "reason": f"meets the target {how}; {among}", "rule": RULE}
    if timed:
        best = max(timed, key=lambda c: c["speedup"])
        why = (f"none of the {len(timed)} timed candidates meets the target; this one comes closest "
               f"({best['speedup']:.3f}x measured, {best['speedup_bound']:.3f}x FLOPs bound)")
    else:  # cannot happen after the reachability check, kept for library callers
        best = max(rows, key=lambda c: c["speedup_bound"])
        why = "no candidate meets the target by FLOPs; this one comes closest"
    return {"label": best["label"], "routes": best["routes"], "basis": basis, "meets_target": False,
            "reason": why, "rule": RULE}


def train_command(overrides: Sequence[str], routes: Sequence[dict]) -> str:
    return "python train.py " + " ".join(shlex.quote(o) for o in list(overrides) + routing_overrides(routes))


def paired_time_fn(timer: PairedTimer, compose_candidate: Callable[[list[str]], TrainConfig]) -> TimeFn:
    """time_fn of the one training step: the candidate's composed config against the timer's dense baseline,
    with its FLOPs counted as the training loop counts them (flops_match: the same as the plan's)."""
    def time_fn(cand: dict) -> dict:
        t = timer(compose_candidate(cand["overrides"]))
        t["flops_match"] = math.isclose(t["counted_forward_flops"], cand["forward_flops_per_sample"], rel_tol=1e-9)
        return t
    return time_fn
