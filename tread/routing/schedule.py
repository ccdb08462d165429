"""Routing schedules (routing.schedule): phases by training step, each with the configured routes, a ratio, a
linear ratio ramp or explicit routes, and optionally its own training hyperparameters.

The routes of a step are a pure function of the step, so resume is exact; inference is unaffected
(docs/routes.md, "Routing schedules").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from tread.routing.spec import Route, RouteConfigError, resolve_routes

PHASE_FIELDS = ("start_step", "selection_ratio", "routes", "train", "path_drop_prob")
TRAIN_FIELDS = ("lr", "batch_size", "warmup_steps", "grad_clip")   # a phase's `train` keys


@dataclass(frozen=True)
class Phase:
    """One phase: steps [start_step, end_step) (end_step None: to the end of training)."""

    start_step: int
    end_step: Optional[int]
    routes: tuple[Route, ...]                       # at the phase's start
    ramp: Optional[tuple[float, float]] = None     # (from, to) selection ratio over the phase's spans

    def routes_at(self, step: int) -> tuple[Route, ...]:
        if self.ramp is None:
            return self.routes
        a, b = self.ramp
        ratio = a + (b - a) * (step - self.start_step) / (self.end_step - self.start_step)
        return tuple(Route(ratio, r.start_layer_idx, r.end_layer_idx) for r in self.routes)

    def describe(self) -> str:
        """'0.5 @ 2..8', '0.5→0.25 @ 2..8' or 'none (dense)'."""
        if not self.routes:
            return "none (dense)"
        spans = ", ".join(f"{r.start_layer_idx}..{r.end_layer_idx}" for r in self.routes)
        if self.ramp is not None:
            return f"{self.ramp[0]:g}→{self.ramp[1]:g} @ {spans}"
        return ", ".join(f"{r.selection_ratio:g} @ {r.start_layer_idx}..{r.end_layer_idx}" for r in self.routes)


class RouteSchedule:
    """The phases of routing.schedule, validated against a model's depth; routes_at(step) is what a training
    step routes."""

    def __init__(self, phases: Sequence[Phase]):
        self.phases = list(phases)

    def phase_at(self, step: int) -> Phase:
        for phase in reversed(self.phases):
            if step >= phase.start_step:
                return phase
        return self.phases[0]

    def routes_at(self, step: int) -> list[Route]:
        return list(self.phase_at(step).routes_at(step))

    def route_lists(self) -> list[list[Route]]:
        """Every phase's routes at its start and (for a ramp) at its last step: for checks against a model."""
        out = []
        for p in self.phases:
            out.append(list(p.routes))
            if p.ramp is not None:
                out.append(list(p.routes_at(p.end_step - 1)))
        return out


def _where(i: int, name: Optional[str] = None) -> str:
    return f"routing.schedule[{i}]" + (f".{name}" if name else "")


def _ratio(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= float(value) < 1:
        raise RouteConfigError(f"{where}={value!r} must be a selection ratio in [0, 1) (the fraction of tokens "
                               f"dropped), or a list [from, to] of two for a linear ramp over the phase.")
    return float(value)


def _phase(i: int, spec: Any, end: Optional[int], base: Sequence[Route], depth: int) -> Phase:
    start = spec["start_step"]
    if "routes" in spec and "selection_ratio" in spec:
        raise RouteConfigError(f"{_where(i)} gives both routes and selection_ratio; give one (routes: explicit "
                               f"routes, [] dense; selection_ratio: the ratio of routing.routes' spans).")
    if "routes" in spec:
        try:
            return Phase(start, end, tuple(resolve_routes(spec["routes"] or [], depth)))
        except RouteConfigError as err:
            raise RouteConfigError(f"{_where(i, 'routes')}: {str(err).replace('routing.routes', 'routes')}") from None
    ratio = spec.get("selection_ratio")
    if ratio is None:
        return Phase(start, end, tuple(base))
    if isinstance(ratio, (list, tuple)):
        if len(ratio) != 2:
            raise RouteConfigError(f"{_where(i, 'selection_ratio')}={list(ratio)!r}: a ramp is a list of two "
                                   f"ratios [from, to].")
        a, b = (_ratio(v, _where(i, "selection_ratio")) for v in ratio)
        if end is None:
            raise RouteConfigError(f"{_where(i, 'selection_ratio')}={list(ratio)!r} ramps, but phase {i} is the "
                                   f"last one: a ramp runs until the next phase's start_step, so add a phase after it.")
        return Phase(start, end, tuple(Route(a, r.start_layer_idx, r.end_layer_idx) for r in base), (a, b))
    r = _ratio(ratio, _where(i, "selection_ratio"))
    return Phase(start, end, tuple(Route(r, x.start_layer_idx, x.end_layer_idx) for x in base))


def _check_fields(i: int, spec: Any) -> int:
    if not isinstance(spec, Mapping):
        raise RouteConfigError(f"{_where(i)}={spec!r} must be a mapping with start_step and optionally "
                               f"selection_ratio or routes.")
    unknown = sorted(set(spec) - set(PHASE_FIELDS))
    if unknown:
        raise RouteConfigError(f"{_where(i)} has unknown field(s) {unknown}; allowed: {list(PHASE_FIELDS)}.")
    _check_train(i, spec.get("train"), spec.get("path_drop_prob"))
    start = spec.get("start_step")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise RouteConfigError(f"{_where(i, 'start_step')}={start!r} must be an integer >= 0 (the first training "
                               f"step of the phase).")
    return start


# a phase's `train` keys: (check, what is allowed)
TRAIN_CHECKS = {
    "lr": (lambda v: v > 0, "a number > 0 (the phase's optimizer lr)"),
    "batch_size": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1 (the phase's global batch)"),
    "warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (lr warm-up steps from the phase's "
                                                              "start; 0: none)"),
    "grad_clip": (lambda v: v > 0, "a max gradient norm > 0"),
}


def _check_train(i: int, train: Any, drop: Any) -> None:
    """The phase's `train` mapping and path_drop_prob: known keys, numbers in range (one error line each)."""
    if drop is not None and (isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1):
        raise RouteConfigError(f"{_where(i, 'path_drop_prob')}={drop!r} is not allowed; allowed: a number in [0, 1) "
                               f"(model=sprint's per-sample deep-path drop probability from this phase on).")
    if train is None:
        return
    if not isinstance(train, Mapping):
        raise RouteConfigError(f"{_where(i, 'train')}={train!r} is not allowed; allowed: a mapping with any of "
                               f"{list(TRAIN_FIELDS)}.")
    for name, value in train.items():
        if name not in TRAIN_CHECKS:
            raise RouteConfigError(f"{_where(i, 'train')}.{name} is not a phase key; allowed: {list(TRAIN_FIELDS)}.")
        ok, allowed = TRAIN_CHECKS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise RouteConfigError(f"{_where(i, 'train')}.{name}={value!r} is not allowed; allowed: {allowed}.")


def schedule_from_config(schedule: Optional[Sequence[Any]], base: Sequence[Route], depth: int
                         ) -> Optional[RouteSchedule]:
    """The RouteSchedule of routing.schedule (None when unset), validated now: phases start at step 0 and in
    increasing order, ratios in [0, 1), explicit routes valid for `depth`; `base` are the configured routes."""
    if not schedule:
        return None
    specs = list(schedule)
    starts = [_check_fields(i, s) for i, s in enumerate(specs)]
    if starts[0] != 0:
        raise RouteConfigError(f"routing.schedule[0].start_step={starts[0]} must be 0: the schedule covers "
                               f"training from its first step.")
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise RouteConfigError(f"routing.schedule[{i}].start_step={starts[i]} must be greater than "
                                   f"routing.schedule[{i - 1}].start_step={starts[i - 1]}: phases run in order.")
    needs_base = any("routes" not in s for s in specs)
    if needs_base and not base:
        raise RouteConfigError("routing.schedule has phases that use the configured route spans (no `routes` "
                               "given), but routing.routes is empty; pick a routing preset or give each phase "
                               "its routes.")
    ends = starts[1:] + [None]
    return RouteSchedule([_phase(i, s, e, base, depth) for i, (s, e) in enumerate(zip(specs, ends))])
