"""summary.json: what a run (or a sweep job) did, for the ablation report and for people. A failed job of a
sweep records its error there too, and the sweep goes on."""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from tread.data import COND_KEYS, has_model_conditioning
from tread.models.flops import forward_flops_with_routes, train_step_flops
from tread.routing import tokens_processed_fraction
from tread.runtime.preempt import stop_status
from tread.schema.train import TrainConfig
from tread.utils.io import WriteError, atomic_write_json


def sample_conditioning(model: Any, dataset) -> Optional[dict]:
    """One sample's text embeddings (and Kontext reference latents) when a text-conditioned family trains on
    data that has them (FLOPs are counted with them); None otherwise."""
    if model.text_conditioned and has_model_conditioning(dataset.conditioning or {}):
        extras = dataset.__getitems__([0])[2]
        return {k: extras[k] for k in COND_KEYS if k in extras}
    return None


def bucket_names(dataset) -> Optional[dict[tuple[int, int], str]]:
    """Bucketed data: latent (h, w) -> the bucket's name (image WIDTHxHEIGHT); None for other data."""
    if dataset.buckets is None:
        return None
    return {tuple(shape[1:]): b.name for b, shape in zip(dataset.buckets, dataset.shapes)}


def grid_weights(dataset) -> Optional[dict[tuple[int, int], float]]:
    """Bucketed data: latent (h, w) -> its share of the samples (of the steps, in expectation); None otherwise."""
    if dataset.buckets is None:
        return None
    total = float(sum(dataset.bucket_sizes))
    weights: dict[tuple[int, int], float] = {}
    for shape, n in zip(dataset.shapes, dataset.bucket_sizes):
        weights[tuple(shape[1:])] = weights.get(tuple(shape[1:]), 0.0) + n / total
    return weights


class RunSummary:
    """The summary of one launch of a run, written to <run dir>/summary.json by the main process at the end:
    start-phase, per-launch and whole-run keys (docs/ablations.md lists them all)."""

    def __init__(self, run_dir: Path, overrides: Optional[list[str]], config: TrainConfig, model: Any, dataset,
                 start_step: int, repa: Any = None):
        routes = model.routing.routes
        self.model, self.batch, self.budget_min = model, config.train.batch_size, config.train.time_budget_min
        # model.repa (a tread.training.repa.Repa): the frozen encoder's forward per image counts while its targets are
        # decoded and encoded each step, not when they were precomputed from the images
        self.encoder_flops = repa.encoder_flops if repa is not None and repa.targets == "decoded" else 0.0
        self.hyper = config.phases                      # routing.schedule phases may change the batch
        self.cond = sample_conditioning(model, dataset)
        self._flops: dict[tuple, float] = {}
        self.grid_weights = grid_weights(dataset)
        self.flops_per_step = self.step_flops(model.routing.routes_at(start_step), self.batch_at(start_step))
        self.data: dict[str, Any] = {
            "status": "running", "run_dir": str(run_dir), "overrides": list(overrides or []),
            "model": str(config.model.arch), "routes": [r.__dict__ for r in routes], "start_step": start_step,
            "tokens_fraction": self.tokens_fraction(model.routing.routes_at(start_step)),
            "train_flops_per_step": self.flops_per_step, "schedule": self.phases()}
        if repa is not None:
            self.data.update({"repa_targets": repa.targets,
                              "repa_encoder_flops_per_step": self.encoder_flops * self.batch_at(start_step)})
        if self.reference_tokens():
            self.data["tokens_fraction_with_reference"] = self.with_reference(self.data["tokens_fraction"])
        self.run_dir, self.start = Path(run_dir), time.time()
        self.tokens_sum = 0.0     # measured token share, summed over steps
        self.grids: dict[tuple[int, int], dict[str, float]] = {}   # latent (h, w) -> steps, seconds, token shares
        self.bucket_names = bucket_names(dataset)

    def add_step(self, grid: Optional[tuple[int, int]], seconds: float, tokens_fraction: float) -> None:
        """Count a step of this latent grid (bucketed data: one bucket per step) with its wall time."""
        self.tokens_sum += tokens_fraction
        if grid is not None:
            entry = self.grids.setdefault(tuple(grid), {"steps": 0, "first_sec": seconds, "sec": 0.0, "tokens": 0.0})
            entry["steps"] += 1
            entry["sec"] += seconds if entry["steps"] > 1 else 0.0
            entry["tokens"] += tokens_fraction

    def bucket_table(self) -> Optional[list[dict[str, Any]]]:
        """Per bucket (bucketed data only): steps taken in this launch, the wall seconds of its first step (which
        includes compiling its graph under train.compile) and the mean of the others, the measured token share, and
        the theoretical FLOPs of a step at its grid (with the routes of the launch's first step)."""
        if self.bucket_names is None:
            return None
        routes = self.model.routing.routes_at(self.data["start_step"])
        return [{"bucket": self.bucket_names.get(g, f"latent {g[-1]}x{g[-2]}" + (f"x{g[0]}" if len(g) == 3 else "")), "latent_hw": list(g),
                 "steps": e["steps"], "first_step_sec": e["first_sec"],
                 "sec_per_step": e["sec"] / (e["steps"] - 1) if e["steps"] > 1 else None,
                 "tokens_fraction": e["tokens"] / e["steps"],
                 "train_flops_per_step": train_step_flops(self.forward_flops(routes, g), self.batch)
                 + self.encoder_flops * self.batch}
                for g, e in sorted(self.grids.items())]

    def tokens_fraction(self, routes) -> float:
        return tokens_processed_fraction(routes, self.model.depth, self.model.num_tokens)

    def reference_tokens(self) -> int:
        """Never-routed reference image tokens per sample (model.kontext: the reference has the target's shape), 0
        without references."""
        return int(self.model.num_tokens) if self.model.kontext else 0

    def with_reference(self, fraction: float) -> float:
        """A target-token share as a share of all image tokens: the reference goes through every block in full."""
        n, ref = int(self.model.num_tokens), self.reference_tokens()
        return (fraction * n + ref) / (n + ref)

    def batch_at(self, step: int) -> int:
        """The global batch of training step `step` (train.batch_size, or its routing.schedule phase's)."""
        return self.hyper.at(step).batch_size

    def step_flops(self, routes, batch: int) -> float:
        """Theoretical FLOPs of a training step of `batch` samples taking `routes` (cached per route list and batch):
        for bucketed data the sample-weighted mean over bucket grids, plus the frozen REPA encoder's forward when
        its targets are decoded."""
        key = (tuple(routes), batch)
        if key not in self._flops:
            grids = self.grid_weights or {None: 1.0}
            forward = sum(w * self.forward_flops(routes, grid) for grid, w in grids.items())
            self._flops[key] = train_step_flops(forward, batch) + self.encoder_flops * batch
        return self._flops[key]

    def forward_flops(self, routes, grid: Optional[tuple[int, int]]) -> float:
        """Forward FLOPs per sample with `routes` at latent grid (H, W) (None: the default), REPA's head included."""
        kw = {} if grid is None else {"grid": grid}
        forward = forward_flops_with_routes(self.model, [r.__dict__ for r in routes], self.cond, **kw)
        return forward + self.model.repa_flops(list(routes), **kw)   # REPA's head (DiT)

    def phases(self) -> Optional[list[dict[str, Any]]]:
        """The routing schedule's phases with their routes, token share, global batch and FLOPs per step (at each
        phase's start); None without a schedule."""
        schedule = self.model.routing.schedule
        if schedule is None:
            return None
        return [{"start_step": p.start_step, "end_step": p.end_step, "routes": p.describe(),
                 "tokens_fraction": self.tokens_fraction(p.routes), "batch_size": self.batch_at(p.start_step),
                 "train_flops_per_step": self.step_flops(p.routes, self.batch_at(p.start_step))}
                for p in schedule.phases]

    def tokens_between(self, start: int, end: int) -> Optional[float]:
        """Theoretical token share of steps [start, end): the mean of each step's share (per phase of a schedule,
        ramps step by step) weighted by its batch, i.e. over the samples trained; None for no steps."""
        if end <= start:
            return None
        routing, shares = self.model.routing, {}
        if routing.schedule is None:
            return self.data["tokens_fraction"]
        for s in range(start, end):
            key = tuple(routing.routes_at(s))
            shares[key] = shares.get(key, 0) + self.batch_at(s)
        return sum(n * self.tokens_fraction(list(k)) for k, n in shares.items()) / self.hyper.batch_sum(start, end)

    def whole_run(self, step: int, measured_sum: float, measured_steps: int) -> dict[str, Any]:
        """The whole-run keys at `step`: theoretical token share and FLOPs over steps [0, step), and the measured
        share over the `measured_steps` steps of every launch whose per-step shares sum to `measured_sum` (the
        resume state carries both)."""
        run = {"tokens_fraction_run": self.tokens_between(0, step), "train_flops_run": self.flops_between(0, step),
               "tokens_fraction_measured_run": measured_sum / measured_steps if measured_steps else None,
               "tokens_fraction_measured_run_steps": measured_steps}
        if self.reference_tokens() and run["tokens_fraction_run"] is not None:
            run["tokens_fraction_run_with_reference"] = self.with_reference(run["tokens_fraction_run"])
        return run

    def flops_between(self, start: int, end: int) -> float:
        """Training FLOPs of steps [start, end): per step under a schedule (phases, ramps, batches), else
        constant."""
        routing = self.model.routing
        if routing.schedule is None:
            return self.flops_per_step * (end - start)
        return sum(self.step_flops(routing.routes_at(s), self.batch_at(s)) for s in range(start, end))

    def add_fid(self, step: int, fid: float) -> None:
        self.data.setdefault("fid", []).append((step, fid))

    def skip_eval(self, step: int, reason: str) -> None:
        """An evaluation due at `step` that a stop signal (`reason`: its name) skipped."""
        self.data.setdefault("eval_skipped", []).append({"step": step, "reason": reason})

    def finish(self, step: int, train_sec_total: float, train_sec: float, out_of_time: bool, is_main: bool, preempted: Optional[str] = None, nonfinite_skips: int = 0,
               measured: Optional[tuple[float, int]] = None) -> dict[str, Any]:
        """Complete the summary (throughput, FLOPs, final and best FID, skipped steps, whole-run keys). `preempted`:
        the stop signal's name; `measured`: (sum of measured token shares, steps) over all launches, else this
        launch's. The main process writes it."""
        steps_run = step - self.data["start_step"]
        per_sec = (lambda n: n / train_sec if train_sec else None)
        self.data.update({
            "status": stop_status(preempted) if preempted else "completed", "final_step": step,
            "wall_sec": time.time() - self.start,
            "stop_reason": preempted or ("time_budget" if out_of_time else "max_steps"), "signal": preempted,
            "nonfinite_skips": nonfinite_skips,
            "time_budget_min": self.budget_min, "train_sec_total": train_sec_total, "train_sec": train_sec,
            "steps_per_sec": per_sec(steps_run), "images_per_sec": per_sec(self.hyper.batch_sum(self.data["start_step"],
                                                                                                step)),
            "train_flops_total": self.flops_between(0, step),
            "tokens_fraction_measured": self.tokens_sum / steps_run if steps_run else None,
            **self.whole_run(step, *(measured or (self.tokens_sum, steps_run)))})
        if self.bucket_names is not None:
            self.data["buckets"] = self.bucket_table()
        fids = [f for _, f in self.data.get("fid", [])]
        self.data.update({"final_fid": fids[-1] if fids else None, "best_fid": min(fids) if fids else None})
        if is_main:
            atomic_write_json(self.run_dir / "summary.json", self.data)
        return self.data

    def fail(self, err: BaseException, step: int, is_main: bool) -> None:
        """summary.json of a launch that stopped with an error at `step` (the main process writes it). When it
        cannot be written either (the disk that failed a checkpoint is full), a warning says so and `err`, the
        cause, stays the error to report; summary.json keeps what it held."""
        self.data.update({"status": "failed", "final_step": step, "wall_sec": time.time() - self.start,
                          "error": f"{type(err).__name__}: {err}"})
        if is_main:
            try:
                atomic_write_json(self.run_dir / "summary.json", self.data)
            except WriteError as failed:
                print(f"warning: {failed}; it still holds what it held before this launch failed", file=sys.stderr)


def record_failure(run_dir: str | Path, overrides: list[str], err: BaseException) -> Path:
    """summary.json of a job that failed (sweeps go on; the ablation report lists it as failed)."""
    path = Path(run_dir) / "summary.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    summary = {**previous, "status": "failed", "run_dir": str(run_dir), "overrides": list(overrides),
               "error": f"{type(err).__name__}: {err}",
               "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:]}
    return atomic_write_json(path, summary)
