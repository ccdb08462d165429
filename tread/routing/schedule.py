"""Routing schedules (routing.schedule): phases by training step, each with the configured routes, a ratio, a
linear ratio ramp or explicit routes, and optionally its own training hyperparameters.

The routes of a step are a pure function of the step, so resume is exact; inference is unaffected
(docs/routes.md, "Routing schedules").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from tread.routing.spec import Route, RouteConfigError, resolve_routes


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


def schedule_from_config(schedule: Optional[Sequence[Any]], base: Sequence[Route], depth: int
                         ) -> Optional[RouteSchedule]:
    """The RouteSchedule of routing.schedule (None when unset), validated now as a whole: phases start at step 0
    and in increasing order, ratios in [0, 1), explicit routes valid for `depth`; `base` are the configured routes.
    Each phase's keys and their types were checked with the config (tread/schema/model.py: Phase)."""
    if not schedule:
        return None
    specs = list(schedule)
    starts = [s["start_step"] for s in specs]
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
