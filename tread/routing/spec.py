"""Route specs (TREAD, Krause et al. 2025, arXiv 2501.04765): parsing and validation against a model's depth.

A route sets aside `selection_ratio` of the tokens from block `start_layer_idx` to `end_layer_idx`, both
inclusive; validation runs when the model is built, before any data is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from tread.utils.errors import UserError

ROUTE_FIELDS = ("selection_ratio", "start_layer_idx", "end_layer_idx")

NO_ROUTES_MESSAGE = (
    "TREAD training requires you to configure the routes. Either pick a preset "
    "(routing=paper, routing=balanced, routing=aggressive, routing=high-res, "
    "routing=conservative), give them explicitly, e.g. "
    "'routing.routes=[{selection_ratio:0.5,start_layer_idx:2,end_layer_idx:-4}]', "
    "or run dense with routing=none (or model=dit)."
)


class RouteConfigError(UserError):
    """A route spec that cannot run on this model; the message names route, field and value."""


@dataclass(frozen=True)
class Route:
    """A validated route with non-negative, inclusive block indices."""

    selection_ratio: float  # fraction of tokens set aside, in [0, 1)
    start_layer_idx: int    # first block that sees only the kept tokens
    end_layer_idx: int      # last block that sees only the kept tokens (inclusive)

    def num_keep(self, num_tokens: int) -> int:
        """Tokens kept by this route; at least one so attention is defined."""
        return max(1, num_tokens - int(num_tokens * self.selection_ratio))

    @property
    def num_blocks(self) -> int:
        return self.end_layer_idx - self.start_layer_idx + 1


def _field(route: Any, i: int, name: str) -> Any:
    if not isinstance(route, Mapping):
        raise RouteConfigError(
            f"routing.routes[{i}] must be a mapping with keys {list(ROUTE_FIELDS)}, "
            f"got {route!r} ({type(route).__name__})."
        )
    unknown = sorted(set(route) - set(ROUTE_FIELDS))
    if unknown:
        raise RouteConfigError(
            f"routing.routes[{i}] has unknown field(s) {unknown}; allowed fields are {list(ROUTE_FIELDS)}."
        )
    if name not in route or route[name] is None:
        raise RouteConfigError(f"routing.routes[{i}].{name} is missing; every route needs {list(ROUTE_FIELDS)}.")
    return route[name]


def resolve_routes(routes: Iterable[Any] | None, depth: int) -> list[Route]:
    """Validate `routes` against a model of `depth` blocks and resolve negative indices (-1 is the last block):
    then 0 <= start <= end < depth, sorted and non-overlapping."""
    routes = list(routes or [])
    resolved: list[Route] = []
    for i, route in enumerate(routes):
        ratio = _field(route, i, "selection_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise RouteConfigError(
                f"routing.routes[{i}].selection_ratio must be a number in [0, 1), got {ratio!r}."
            )
        if not 0.0 <= float(ratio) < 1.0:
            raise RouteConfigError(
                f"routing.routes[{i}].selection_ratio={ratio} is out of range: it is the fraction of "
                f"tokens dropped and must lie in [0, 1) (0 keeps all tokens, 0.5 keeps half)."
            )
        ends = []
        for name in ("start_layer_idx", "end_layer_idx"):
            value = _field(route, i, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise RouteConfigError(f"routing.routes[{i}].{name} must be an integer, got {value!r}.")
            if not -depth <= value < depth:
                raise RouteConfigError(
                    f"routing.routes[{i}].{name}={value} is out of range for a model with depth {depth}: "
                    f"allowed block indices are {-depth}..{depth - 1} (negative counts from the end, -1 is the last block)."
                )
            ends.append(value % depth)
        start, end = ends
        if start > end:
            raise RouteConfigError(
                f"routing.routes[{i}]: start_layer_idx={route['start_layer_idx']} (block {start}) comes after "
                f"end_layer_idx={route['end_layer_idx']} (block {end}) for depth {depth}; "
                f"end_layer_idx must be >= start_layer_idx after resolving negative indices."
            )
        if resolved and start <= resolved[-1].end_layer_idx:
            prev = resolved[-1]
            raise RouteConfigError(
                f"routing.routes[{i}].start_layer_idx={route['start_layer_idx']} (block {start}) must be greater than "
                f"routing.routes[{i - 1}].end_layer_idx (block {prev.end_layer_idx}): routes run in order and must not "
                f"overlap, so route {i} may start at block {prev.end_layer_idx + 1} at the earliest."
            )
        resolved.append(Route(float(ratio), start, end))
    return resolved


def routing_from_config(routing: Mapping[str, Any] | None, depth: int) -> list[Route]:
    """Routes from a `routing` config group ({enabled, routes, ...}); [] when disabled."""
    if routing is None or not routing.get("enabled", False):
        return []
    routes = routing.get("routes")
    if not routes:
        raise RouteConfigError(NO_ROUTES_MESSAGE)
    return resolve_routes(routes, depth)


def tokens_per_block(routes: Sequence[Route], depth: int, num_tokens: int,
                     keep: Optional[Sequence[int]] = None) -> list[int]:
    """Tokens each of the `depth` blocks processes: all, or a route's kept count (`keep`, default Route.num_keep) inside
    its span. FLOPs, token shares and the planner all count with it."""
    n = [num_tokens] * depth
    for j, r in enumerate(routes):
        kept = r.num_keep(num_tokens) if keep is None else keep[j]
        for i in range(r.start_layer_idx, r.end_layer_idx + 1):
            n[i] = kept
    return n


def tokens_processed_fraction(routes: Sequence[Route], depth: int, num_tokens: int,
                              keep: Optional[Sequence[int]] = None) -> float:
    """Average fraction of token-block evaluations that routing keeps (1.0 = dense)."""
    return sum(tokens_per_block(routes, depth, num_tokens, keep)) / (depth * num_tokens)
