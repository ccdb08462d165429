"""Between training steps: the log window's averages, when periodic actions are due, the time budget, and the
data meta a checkpoint keeps."""
from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch
from accelerate import Accelerator

from tread.checkpoint.state import TrainingState
from tread.training.step import StepStats


def due(every: int, step: int, anyway: bool) -> bool:
    """Whether a periodic action fires after update `step` (less train.step_offset): every `every` steps from `every`
    on (0: never), or `anyway`."""
    return bool(anyway or (every and step > 0 and step % every == 0))


class LogWindow:
    """Training records average over the steps since the previous record: loss, throughput, token share, and the
    features' loss terms (`weights`: each term's name and weight; loss = diffusion loss + sum of weight x term)."""

    def __init__(self, device: torch.device, weights: Optional[Mapping[str, float]] = None):
        self.weights = dict(weights or {})
        self.sums = torch.zeros(2 + len(self.weights), device=device)   # (loss, count, terms...) over finite steps
        self.run_start = time.time()
        self.restart()

    def restart(self) -> None:
        self.steps, self.tokens, self.data_sec, self.start = 0, 0.0, 0.0, time.time()
        self.sums.zero_()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (spent on evaluation or checkpoints) out of the window's elapsed time."""
        self.start += seconds

    def add(self, stats: StepStats) -> None:
        finite = 1.0 - stats.nonfinite
        terms = [torch.where(finite > 0, stats.terms[name], 0.0) for name in self.weights]
        self.sums += torch.stack([torch.where(finite > 0, stats.loss, 0.0), finite, *terms])   # on the device: no sync
        self.steps += 1
        self.tokens += stats.tokens_fraction
        self.data_sec += stats.data_sec

    def record(self, state: TrainingState, lr: float, batch_size: int, accelerator: Accelerator) -> dict[str, Any]:
        """The record of this window (one host sync: the loss mean over processes and finite steps; None when
        every step was skipped); starts the next window."""
        elapsed = time.time() - self.start
        loss_sum, count, *term_sums = accelerator.reduce(self.sums, reduction="sum").tolist()
        mean_loss = loss_sum / count if count else None
        record = {"type": "train", "step": state.step, "loss": mean_loss, "lr": lr,
                  "steps_per_sec": self.steps / elapsed, "images_per_sec": self.steps * batch_size / elapsed,
                  "tokens_fraction": self.tokens / self.steps, "data_wait_frac": self.data_sec / elapsed,
                  "elapsed_sec": time.time() - self.run_start, "train_sec": state.train_sec}
        for name, total in zip(self.weights, term_sums):   # the terms inside `loss` (model.repa: repa_loss)
            record[f"{name}_loss"] = total / count if count else None
        if self.weights:
            record["diffusion_loss"] = mean_loss - sum(w * record[f"{n}_loss"] for n, w in self.weights.items()) \
                if count else None
        self.restart()
        return record


def checkpoint_data_meta(dataset: Any, model: Any) -> dict:
    """The data meta a checkpoint keeps (sampling reads its shape, classes and decoding): the data's; for
    bucketed data the buckets' shared meta at the model's square default grid (video: model.frames latent frames),
    with the bucket names."""
    if dataset.buckets is None:
        return dataset.meta
    meta = dataset.meta
    size = [model.input_size, model.input_size]
    video = meta.get("video")
    if video is None:
        return {**meta, "shape": [meta["shape"][0], *size], "buckets": [b.name for b in dataset.buckets]}
    frames = int(model.frames)            # video buckets: the model's default clip, T latent frames
    video = {**video, "frames": (frames - 1) * int(video.get("temporal_factor", 1)) + 1}
    return {**meta, "shape": [meta["shape"][0], frames, *size], "video": video,
            "buckets": [b.name for b in dataset.buckets]}


def time_budget_reached(state: TrainingState, budget_sec: float, every: int, accelerator: Accelerator) -> bool:
    """Whether the run's training time has reached train.time_budget_min. One process decides alone at every
    step; with several, rank 0 decides at logging steps and broadcasts, so every rank stops at the same step
    (a per-step broadcast would add a host sync to every step)."""
    if accelerator.num_processes == 1:
        return state.train_sec >= budget_sec
    if state.step % every:
        return False
    flag = torch.tensor([float(state.train_sec >= budget_sec)], device=accelerator.device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())
