"""A run's evaluations along its training, read at a budget: a metric at equal steps, equal measured training
time (train_sec) or equal training FLOPs, interpolated linearly between the bracketing evaluations and never
extrapolated. Keys look like "fid@step=342", "fd_ae@time=118.5", "class_acc@flops=1.2e13".
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, Sequence

AXES = ("step", "time", "flops")
AT = re.compile(r"^(?P<metric>[a-z_0-9]+)@(?P<axis>step|time|flops)=(?P<x>[0-9.eE+-]+)$")


def flops_at(summary: dict[str, Any], step: int) -> float:
    """Training FLOPs spent by `step`: per phase of a routing schedule (each phase at its starting FLOPs per step,
    so a ramp is approximated), else train_flops_per_step x step."""
    schedule = summary.get("schedule")
    if not schedule:
        return (summary.get("train_flops_per_step") or math.nan) * step
    return sum(p["train_flops_per_step"] * max(0, min(step, math.inf if p.get("end_step") is None else p["end_step"])
                                                - p["start_step"]) for p in schedule)


def elapsed(run: dict[str, Any], e: dict[str, Any]) -> float:
    """Training seconds at an evaluation: its train_sec (training time, evaluations and checkpoints excluded),
    or for older runs the last train record's elapsed_sec at or before its step."""
    if e.get("train_sec") is not None:
        return float(e["train_sec"])
    before = [x.get("elapsed_sec", math.nan) for x in run["records"] if x.get("type") == "train" and x["step"] <= e["step"]]
    return before[-1] if before else math.nan


def position(run: dict[str, Any], e: dict[str, Any], axis: str) -> float:
    """Where evaluation record `e` lies on `axis`: its step, its measured training seconds or the FLOPs spent."""
    if axis == "step":
        return float(e["step"])
    return elapsed(run, e) if axis == "time" else flops_at(run["summary"], e["step"])


def curve(run: dict[str, Any], metric: str, axis: str) -> list[tuple[float, float]]:
    """The run's (x, value) evaluations of `metric` along `axis`, sorted by x (one per step: the last record)."""
    by_step = {r["step"]: r for r in run["records"] if r.get("type") == "eval" and r.get(metric) is not None}
    pts = sorted((position(run, e, axis), float(e[metric])) for e in by_step.values())
    return [p for p in pts if not math.isnan(p[0])]


def interpolate(points: Sequence[tuple[float, float]], x: float) -> Optional[float]:
    """Linear interpolation of sorted (x, y) points at x; None outside [first x, last x]."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] if x == points[-1][0] else None


def value_at(run: dict[str, Any], key: str) -> Optional[float]:
    """The run's value of a metric-at-budget key ("fid@time=118.5"), or None when it does not parse or the run's
    evaluations do not reach the budget."""
    m = AT.match(key)
    return None if m is None else interpolate(curve(run, m["metric"], m["axis"]), float(m["x"]))


def common_budget(runs: Sequence[dict[str, Any]], axis: str, metric: str = "fid") -> Optional[float]:
    """The largest budget on `axis` that every run's evaluations reach: the smallest of their last evaluation's
    positions (so every run is read by interpolation, none by extrapolation); None without evaluations."""
    ends = [pts[-1][0] for pts in (curve(r, metric, axis) for r in runs) if pts]
    return min(ends) if ends and len(ends) == len(runs) else None


def budget_key(metric: str, axis: str, x: float) -> str:
    """The metric key for `metric` at `x` on `axis`; x written exactly (17 significant digits round-trip a float),
    so a budget that is some run's last evaluation stays inside that run's range."""
    return f"{metric}@{axis}={x:.17g}" if axis != "step" else f"{metric}@step={int(x)}"


def budget_name(key: str, describe: Callable[[str], str]) -> Optional[str]:
    """A human name for a metric-at-budget key, e.g. 'FID at 118.5 s of training' (None for other keys)."""
    m = AT.match(key)
    if m is None:
        return None
    x = float(m["x"])
    where = {"step": f"at step {int(x)}", "time": f"at {x:.1f} s of training",
             "flops": f"at {x / 1e12:.3g} TFLOPs"}[m["axis"]]
    return f"{describe(m['metric'])} {where}"
