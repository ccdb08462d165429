"""When routes apply, and the shared block loop that applies them.

Every backbone family owns one `RoutingController` and runs its blocks through
`run_blocks`, so route semantics (training-only by default, inference override,
gather at start, scatter after end) live in one place.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from routing.router import TokenRouter, gather_tokens, scatter_tokens
from routing.spec import Route, RouteConfigError, resolve_routes


class RoutingController:
    """Holds a model's validated routes, its router and the inference-time override."""

    def __init__(self, routes: Sequence[Route], depth: int, router: Optional[TokenRouter] = None):
        self.routes = list(routes)    # validated at build time, non-negative indices
        self.depth = depth            # number of routable blocks
        self.router = router or TokenRouter()
        self._override: Optional[list[Route]] = None

    @property
    def enabled(self) -> bool:
        return bool(self.routes)

    def active_routes(self, training: bool) -> list[Route]:
        """Routes for this forward: the override if set, else the routes in grad-enabled training."""
        if self._override is not None:
            return self._override
        if training and torch.is_grad_enabled():
            return self.routes
        return []

    @contextlib.contextmanager
    def override(self, selection_ratio: Optional[float] = None,
                 routes: Optional[Sequence[Mapping[str, Any]]] = None) -> Iterator[None]:
        """Route at inference too (e.g. for TREAD-guided sampling).

        `selection_ratio` reuses the configured spans with a new ratio; `routes` gives
        explicit route specs. `selection_ratio=0` with no routes configured is dense.
        """
        if routes is not None:
            new = resolve_routes(routes, self.depth)
        elif selection_ratio is not None:
            if not self.routes and selection_ratio > 0:
                raise RouteConfigError(
                    f"Inference routing with selection_ratio={selection_ratio} needs route spans, but this model has "
                    f"no routes configured; pass explicit routes instead."
                )
            new = resolve_routes(
                [{"selection_ratio": selection_ratio, "start_layer_idx": r.start_layer_idx,
                  "end_layer_idx": r.end_layer_idx} for r in self.routes], self.depth)
        else:
            raise ValueError("override() needs selection_ratio or routes.")
        previous, self._override = self._override, new
        try:
            yield
        finally:
            self._override = previous


def run_blocks(blocks: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, routes: Sequence[Route],
               router: TokenRouter, force_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run `blocks` over tokens x (B, N, D), routing a subset past each route's span.

    Each block is a callable on (B, n, D) tokens; per-sample conditioning is bound by
    the caller. At a route's start the kept tokens are gathered; after its end they are
    scattered back over the route-start tokens, so set-aside tokens re-enter unchanged.
    """
    starts = {r.start_layer_idx: r for r in routes}
    route: Optional[Route] = None
    x_start = ids_keep = None
    for i, block in enumerate(blocks):
        if i in starts:
            route = starts[i]
            x_start = x
            ids_keep = router.select(x, route.num_keep(x.shape[1]), force_keep)   # (B, K)
            x = gather_tokens(x, ids_keep)                                         # (B, K, D)
        x = block(x)
        if route is not None and i == route.end_layer_idx:
            x = scatter_tokens(x_start, x, ids_keep)                               # (B, N, D)
            route = x_start = ids_keep = None
    return x
