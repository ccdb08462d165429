"""Route sets as the benchmark and the planner name them: labels, plain dicts, and the Hydra overrides that
give a composed training config those routes."""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

from tread.routing import Route

RouteLike = Union[Route, Mapping[str, Any]]


def route_dicts(routes: Sequence[RouteLike]) -> list[dict]:
    """Plain {selection_ratio, start_layer_idx, end_layer_idx} dicts (what JSON output holds)."""
    out = []
    for r in routes:
        r = r.__dict__ if isinstance(r, Route) else r
        out.append({"selection_ratio": r["selection_ratio"], "start_layer_idx": r["start_layer_idx"],
                    "end_layer_idx": r["end_layer_idx"]})
    return out


def label_of(routes: Sequence[RouteLike]) -> str:
    """'0.5 @ 2..8; ...', or 'dense' for no routes."""
    return "; ".join(f"{r['selection_ratio']:g} @ {r['start_layer_idx']}..{r['end_layer_idx']}"
                     for r in route_dicts(routes)) or "dense"


def routing_overrides(routes: Sequence[RouteLike]) -> list[str]:
    """The overrides that set exactly these routes (routing=none for none), as train.py takes them."""
    if not routes:
        return ["routing=none"]
    body = ",".join(f"{{selection_ratio:{r['selection_ratio']:g},start_layer_idx:{r['start_layer_idx']},"
                    f"end_layer_idx:{r['end_layer_idx']}}}" for r in route_dicts(routes))
    return ["routing=paper", f"routing.routes=[{body}]"]
