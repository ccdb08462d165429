"""One training step (one optimizer update over grad_accum_steps micro-batches): what train.py runs every
step, and what the benchmark and the route planner time. Random draws on the training stream, in order:
moments, label dropout, the features' (caption dropout, first frames; only when enabled), then the objective's
sigma/t and noise.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from tread.data import COND_KEYS, draw_latents
from tread.diffusion.common import call_with_aux
from tread.models.families.first_frame import I2V_KEYS
from tread.routing import resize_loss_mask
from tread.training.ema import ema_decay_at, ema_update
from tread.utils.dtensor import full
from tread.training.feature import Feature
from tread.training.guard import nonfinite_flag
from tread.schema.phases import TrainPhases
from tread.schema.train import TrainConfig
from tread.training.setup import TrainingParts


@dataclass(frozen=True)
class StepSettings:
    """What the step needs from the config and the data (no defaults here: every value comes from the config)."""

    grad_accum_steps: int
    grad_clip: Optional[float]
    label_dropout: float
    lr: float
    lr_warmup_steps: int
    lr_schedule: str                # constant | linear | cosine after the warm-up (lr_factor)
    max_steps: int                  # where linear and cosine reach 0
    ema_decay: float
    ema_warmup: bool
    use_mask: bool                  # weight the loss by the data's loss masks
    force_keep: bool                # routes never drop tokens more than half under the loss mask
    data_meta: Mapping[str, Any]    # the dataset's meta (moments data: draw_latents)
    phases: Optional[TrainPhases] = None      # routing.schedule's per-phase lr, warm-up, clipping, path drop; None: off

    @classmethod
    def from_config(cls, config: TrainConfig, use_mask: bool = False, data_meta: Optional[Mapping[str, Any]] = None,
                    routed: bool = True) -> "StepSettings":
        """From a checked training config; `use_mask` whether this run weights its loss by loss masks (the data's
        and train.masked_loss), `routed` whether the model has routes (force-keep needs them)."""
        t = config.train
        return cls(grad_accum_steps=t.grad_accum_steps, grad_clip=t.grad_clip, label_dropout=t.label_dropout,
                   lr=config.optimizer.lr, lr_warmup_steps=t.lr_warmup_steps, lr_schedule=t.lr_schedule,
                   max_steps=t.max_steps, ema_decay=config.ema.decay,
                   ema_warmup=config.ema.warmup, use_mask=use_mask,
                   force_keep=bool(use_mask and t.mask_force_keep and routed), data_meta=dict(data_meta or {}),
                   phases=config.phases)


@dataclass
class StepStats:
    """What a step reports: the loss stays on the device (no host sync per step)."""

    loss: torch.Tensor            # mean over the micro-batches, detached
    tokens_fraction: float        # share of token-block evaluations done (1.0 dense; force-keep raises it)
    data_sec: float               # time spent waiting for batches
    lr: float
    nonfinite: torch.Tensor       # 1.0 when the loss or gradient norm was NaN/inf and the update was skipped
    grid: Optional[tuple[int, ...]] = None     # the batches' latent (H, W) or video (T, H, W): their bucket's
    terms: dict[str, torch.Tensor] = field(default_factory=dict)   # the features' loss terms (model.repa: "repa")


class TrainStep:
    """step(batches, step) -> StepStats: one optimizer update from the next grad_accum_steps batches."""

    def __init__(self, parts: TrainingParts, settings: StepSettings, features: Sequence[Feature] = ()):
        self.parts, self.s, self.features = parts, settings, list(features)
        self.null_label = parts.model.num_classes
        self.takes_text = parts.model.text_conditioned   # DiT is class-conditional: text is ignored
        self.aux = any(f.aux for f in self.features)
        self.termed = [f for f in self.features if f.term is not None]

    def __call__(self, batches: Iterator, step: int) -> StepStats:
        p, s = self.parts, self.s
        lr = set_lr(p.optimizer, step_lr(step, s))
        p.model.routing.set_step(step)                     # routing.schedule: this step's phase
        clip = self.set_phase(step)
        loss_sum = torch.zeros((), device=p.accelerator.device)
        term_sums = {f.term: torch.zeros((), device=p.accelerator.device) for f in self.termed}
        tokens, data_sec = 0.0, 0.0
        for micro in range(s.grad_accum_steps):
            start = time.perf_counter()
            batch = next(batches)
            data_sec += time.perf_counter() - start   # the time the step waited for data (0 when prefetch keeps up)
            loss, terms = self.micro_step(batch, sync=micro == s.grad_accum_steps - 1)
            grid = tuple(batch[0].shape[2:])        # latent (H, W), video (T, H, W)
            loss_sum += loss.detach() / s.grad_accum_steps
            for name, term in terms.items():
                term_sums[name] += term.detach() / s.grad_accum_steps
            tokens += p.model.processed_fraction() / s.grad_accum_steps
        bad = nonfinite_flag(loss_sum, self.grad_norm(clip))
        self.optimizer_step(bad)
        ema_update(p.ema, p.accelerator.unwrap_model(p.net), ema_decay_at(step, s.ema_decay, s.ema_warmup), skip=bad)
        return StepStats(loss_sum, tokens, data_sec, lr, bad, grid, term_sums)

    def set_phase(self, step: int) -> Optional[float]:
        """A routing.schedule phase's path_drop_prob on a SPRINT model; returns the step's max gradient norm."""
        if self.s.phases is None:
            return self.s.grad_clip
        hyper = self.s.phases.at(step)
        if hyper.path_drop_prob is not None and self.parts.model.path_drop_prob is not None:    # SPRINT
            self.parts.model.path_drop_prob = hyper.path_drop_prob
        return hyper.grad_clip

    def grad_norm(self, clip: Optional[float]) -> torch.Tensor:
        """The total gradient norm (clipped to `clip` when set: train.grad_clip or the phase's), on the device; with
        sharded gradients (train.parallel=fsdp) torch reduces it over the shards and full() takes its replicated
        value."""
        p = self.parts
        if clip:
            return full(p.accelerator.clip_grad_norm_(p.net.parameters(), clip))
        return full(torch.nn.utils.get_total_norm([q.grad for q in p.net.parameters() if q.grad is not None]))

    def optimizer_step(self, bad: torch.Tensor) -> None:
        """The update, skipped when `bad` is 1: on the device by a fused optimizer (found_inf), by the grad
        scaler under fp16 (it skips non-finite gradients itself), on the host otherwise (one sync)."""
        p = self.parts
        inner = getattr(p.optimizer, "optimizer", p.optimizer)     # accelerate's wrapper holds the optimizer
        if p.accelerator.scaler is None and inner.defaults.get("fused"):
            inner.found_inf = bad
            p.optimizer.step()
            del inner.found_inf
        elif p.accelerator.scaler is not None or not bool(bad.item()):
            p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)

    def micro_step(self, batch: tuple, sync: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of one micro-batch; returns its (undivided) loss and the features' loss terms."""
        p, s = self.parts, self.s
        x, y, extras = split_batch(batch, p.accelerator.device)
        x = draw_latents(x, s.data_meta)                   # moments data: one latent drawn per read (training RNG)
        y = drop_labels(y, s.label_dropout, self.null_label)
        # text; Kontext references: never dropped; first frames (and their image embeddings) only through model.i2v
        cond = {k: extras[k] for k in COND_KEYS if k in extras and k not in I2V_KEYS}
        for feature in self.features:
            cond = feature.condition(cond, extras, x.shape[0])
        mask = extras.get("loss_mask") if s.use_mask else None
        kwargs: dict[str, Any] = {"cond": cond} if cond and self.takes_text else {}
        if mask is not None and s.force_keep:
            kwargs["force_keep"] = p.model.tokens_from_mask(mask, x.shape[2:])   # tokens > half under the mask
        terms = {}
        with p.accelerator.no_sync(p.net) if not sync else contextlib.nullcontext():
            with p.accelerator.autocast():
                # REPA: the backbone also returns its projected tokens and their ids (tread/models/repa.py)
                loss, aux = call_with_aux(p.diffusion.loss, p.net, x, y, return_aux=self.aux, **kwargs)
                loss = reduce_loss(loss, mask, self.loss_weight(loss, cond))
                for feature in self.termed:
                    terms[feature.term] = feature.loss_term(aux, x, extras)
                    loss = loss + feature.weight * terms[feature.term]
            p.accelerator.backward(loss / s.grad_accum_steps)
        return loss, terms

    def loss_weight(self, loss: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The features' weights of the unreduced loss, multiplied (None when none weights it)."""
        weights = [w for w in (f.loss_weight(loss, cond) for f in self.features) if w is not None]
        return functools.reduce(operator.mul, weights) if weights else None


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int) -> float:
    """The lr multiplier at optimizer step `step` (0-based), a pure function of the step (an exact resume needs no
    scheduler state): warm-up (step + 1) / warmup_steps, then diffusers' constant, linear or cosine schedule."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if schedule == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return 1.0


def step_lr(step: int, s: StepSettings) -> float:
    """The lr of optimizer step `step`: the config's curve, or with phases the current phase's (restarted at its
    start when it sets lr or warmup_steps)."""
    if s.phases is None:
        return s.lr * lr_factor(step, s.lr_warmup_steps, s.lr_schedule, s.max_steps)
    h = s.phases.at(step)
    return h.lr * lr_factor(step - h.lr_origin, h.warmup_steps, s.lr_schedule, s.max_steps - h.lr_origin)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def drop_labels(labels: torch.Tensor, p: float, null_label: int) -> torch.Tensor:
    """Classifier-free guidance training: replace labels by the null class with probability p."""
    if p <= 0:
        return labels
    drop = torch.rand(labels.shape, device=labels.device) < p
    return torch.where(drop, torch.full_like(labels, null_label), labels)


def split_batch(batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x, y) or (x, y, extras) from the loader, on `device`; extras: text / text_mask / pooled / loss_mask."""
    x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
    extras = {k: v.to(device, non_blocking=True) for k, v in (batch[2] if len(batch) > 2 else {}).items()}
    return x, y, extras


def reduce_loss(loss: torch.Tensor, mask: Optional[torch.Tensor], frames: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """Mean of the unreduced loss (B, C, ...); with a loss mask (B, 1, h, w) in [0, 1], the mask-weighted mean
    over the covered latent cells (the mask is area-resized to the latent grid); the features' weights `frames`
    (video: (B, 1, T, 1, 1); model.i2v: 0 on given frames) weight it too."""
    if mask is None and frames is None:
        return loss.mean()
    weight = torch.ones_like(loss[:, :1])
    if mask is not None:
        cells = resize_loss_mask(mask, loss.shape[-2:]).to(loss.dtype)
        weight = weight * (cells.unsqueeze(2) if loss.dim() == 5 else cells)   # video: one mask for every frame
    if frames is not None:
        weight = weight * frames
    return (loss * weight).sum() / (weight.sum() * loss.shape[1]).clamp_min(1e-8)
