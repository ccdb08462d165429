"""Training hyperparameters by step: routing.schedule phases that set `train: {lr, batch_size, warmup_steps,
grad_clip}` or `path_drop_prob`; semantics in docs/routes.md, "Phases that change training hyperparameters".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence



@dataclass(frozen=True)
class StepHyper:
    """The hyperparameters of one training step."""

    lr: float                        # peak lr of the current lr curve
    lr_origin: int                   # the step the lr curve (warm-up, then train.lr_schedule) starts from
    warmup_steps: int
    grad_clip: Optional[float]       # None: no clipping
    batch_size: int                  # global batch
    path_drop_prob: Optional[float]  # model=sprint's; None for other models


class TrainPhases:
    """at(step) -> StepHyper: the config's hyperparameters, overridden phase by phase."""

    def __init__(self, base: StepHyper, phases: Sequence[tuple[int, dict[str, Any]]] = ()):
        self.base = base
        self.phases = list(phases) or [(0, {})]      # (start_step, phase spec), in order from step 0
        self.hypers = [self._hyper(start, spec) for start, spec in self.phases]

    @classmethod
    def from_sections(cls, train: Any, lr: float, routing: Any, sprint: Any) -> "TrainPhases":
        """From the checked train section, optimizer.lr, the routing section and model.sprint (None but for
        model=sprint)."""
        base = StepHyper(lr=float(lr), lr_origin=0, warmup_steps=int(train.lr_warmup_steps),
                         grad_clip=float(train.grad_clip) if train.grad_clip else None, batch_size=int(train.batch_size),
                         path_drop_prob=float(sprint.path_drop_prob) if sprint is not None else None)
        specs = [phase.plain() for phase in routing.schedule or []] if routing.enabled else []
        return cls(base, [(int(s["start_step"]), s) for s in specs])

    def _hyper(self, start: int, spec: dict[str, Any]) -> StepHyper:
        train, b = spec.get("train") or {}, self.base
        restart = "lr" in train or "warmup_steps" in train
        drop = spec.get("path_drop_prob")
        return StepHyper(lr=float(train.get("lr", b.lr)), lr_origin=start if restart else b.lr_origin,
                         warmup_steps=int(train.get("warmup_steps", 0 if restart else b.warmup_steps)),
                         grad_clip=float(train["grad_clip"]) if "grad_clip" in train else b.grad_clip,
                         batch_size=int(train.get("batch_size", b.batch_size)),
                         path_drop_prob=float(drop) if drop is not None else b.path_drop_prob)

    def at(self, step: int) -> StepHyper:
        for (start, _), hyper in zip(reversed(self.phases), reversed(self.hypers)):
            if step >= start:
                return hyper
        return self.hypers[0]

    def batch_phases(self) -> list[tuple[int, int, Optional[int]]]:
        """(first step, global batch, index of the phase that set it or None for train.batch_size) of each run of
        steps with one batch size, in order; one entry when the batch never changes."""
        out: list[tuple[int, int, Optional[int]]] = []
        for i, ((start, spec), hyper) in enumerate(zip(self.phases, self.hypers)):
            if not out or hyper.batch_size != out[-1][1]:
                out.append((start, hyper.batch_size, i if "batch_size" in (spec.get("train") or {}) else None))
        return out

    def changes_batch(self) -> bool:
        return len(self.batch_phases()) > 1 or self.batch_phases()[0][1] != self.base.batch_size

    def batch_sum(self, start: int, end: int) -> int:
        """Samples trained in steps [start, end) (global batches summed)."""
        return sum(self.at(s).batch_size for s in range(start, end))
