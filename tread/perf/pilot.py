"""Pilot trainings of the route planner: dense and the top candidates trained with tread.training.loop.train for the
same steps (or the same training time) on the configured data, ranked by final loss or FID."""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tread.data import build_dataset
from tread.schema.train import DataSection
from tread.perf.plan import PlanError
from tread.perf.routes import routing_overrides
from tread.schema import compose
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.utils.errors import USER_ERRORS


@dataclass(frozen=True)
class Pilot:
    """What the pilot trains: steps or seconds, the top k candidates ranked by FID or loss; `run` are the run
    overrides (precision, device, compile), `sets` the user's --set overrides."""

    steps: int = 0
    seconds: Optional[float] = None
    top: int = 2
    fid: bool = False
    run: list[str] = field(default_factory=list)
    sets: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.steps) or self.seconds is not None

    @property
    def metric(self) -> str:
        return "final_fid" if self.fid else "final_loss"


def pilot_loss(run_dir: Path) -> Optional[float]:
    """Step-weighted mean of the logged training losses over the second half of the run's steps (at least the
    last logged window): each record's loss is the mean over the steps since the previous record."""
    recs = [r for r in read_metrics(run_dir) if r.get("type") == "train"]
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


def pilot_overrides(p: Pilot) -> list[str]:
    n = p.steps or 10 ** 9
    ov = [f"train.max_steps={n}", "checkpoint.every_steps=0", "eval.every_steps=0",
          f"eval.at_end={'true' if p.fid else 'false'}", *p.run]
    if p.seconds is not None:
        ov.append(f"train.time_budget_min={p.seconds / 60.0!r}")
    if not any(s.split("=", 1)[0].lstrip("+~") == "train.log_every_steps" for s in p.sets):
        ov.append(f"train.log_every_steps={max(1, n // 10) if p.steps else 10}")
    return ov


def check_pilot_data(data: DataSection) -> None:
    """Build (or open) the pilot's data (the dense config's data section) now, so a mismatch is an error before
    any timing."""
    want = (data.channels, data.resolution)
    name = data.builtin or data.path
    try:
        ds = build_dataset(data.plain())
    except USER_ERRORS as err:   # the data's own checks (shape, files) name what it has
        raise PlanError(f"--pilot trains on the data ({name}), which does not fit the plan's --channels {want[0]} "
                        f"--resolution {want[1]}: {str(err).splitlines()[0]}") from None
    if (ds.channels, ds.resolution) != want:
        raise PlanError(f"--pilot trains on the data ({name}, {ds.channels}x{ds.resolution}x{ds.resolution}) but the "
                        f"plan is for --channels {want[0]} --resolution {want[1]}; allowed: --channels {ds.channels} "
                        f"--resolution {ds.resolution}, or other --data")


def train_one(c: dict, overrides: list[str], p: Pilot, out: Path, log: Callable[[str], None]) -> dict:
    """Train candidate row `c` (dense: no routes) into out/pilot/<label>; its pilot record."""
    name = c["label"].replace(" @ ", "_").replace("..", "-").replace("; ", "+")
    run_dir = out / "pilot" / name
    ov = overrides + (c.get("overrides") or routing_overrides(())) + pilot_overrides(p)
    log(f"pilot: training {c['label']} for {p.steps or 'up to the time budget of'} steps into {run_dir}")
    try:
        with contextlib.redirect_stdout(sys.stderr):   # the loop's start-up lines: keep stdout for the table
            summary = train(compose(ov), run_dir, overrides=ov)
    except USER_ERRORS as err:
        raise PlanError(f"pilot run {c['label']} ({run_dir}) failed: {str(err).splitlines()[0]}") from None
    return {"label": c["label"], "routes": c["routes"], "run_dir": str(run_dir), "overrides": ov,
            "final_loss": pilot_loss(run_dir), "final_fid": summary.get("final_fid"),
            "train_sec": summary["train_sec"], "steps": summary["final_step"],
            "train_flops_per_step": summary["train_flops_per_step"],
            "flops_match": math.isclose(summary["train_flops_per_step"], c["train_flops_per_step"], rel_tol=1e-9),
            "meets_target": None if not c["routes"] else bool(c.get("meets_measured", c["meets_theory"]))}


def run_pilot(overrides: list[str], rows: list[dict], dense_row: dict, p: Pilot, out: Path,
              log: Callable[[str], None]) -> dict:
    """Train dense and the top candidates; rank them by the pilot metric, with throughput vs dense."""
    runs = [train_one(c, overrides, p, out, log) for c in [dense_row] + pilot_candidates(rows, p.top)]
    for r in runs:
        r["steps_per_sec"] = r["steps"] / r["train_sec"] if r["train_sec"] else None
    dense_rate = runs[0]["steps_per_sec"]
    for r in runs:  # training throughput vs dense (steps per second of training time)
        r["speedup"] = r["steps_per_sec"] / dense_rate if r["steps_per_sec"] and dense_rate else None
    metric = p.metric
    ranked = sorted(runs, key=lambda r: (r[metric] is None, r[metric] if r[metric] is not None else 0.0))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    routed = [r for r in ranked if r["routes"] and r[metric] is not None]
    return {"steps": p.steps or None, "seconds": p.seconds, "metric": metric, "data": overrides, "runs": ranked,
            "best": routed[0]["label"] if routed else None,
            "dense_rank": next(r["rank"] for r in ranked if not r["routes"])}
