"""When routes apply, and the shared block loop that applies them.

Every backbone family owns one `RoutingController` and runs its blocks through
`run_blocks`, so route semantics (training-only by default, inference override,
gather at start, scatter after end) live in one place.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.utils.checkpoint

from routing.router import TokenRouter, gather_tokens, scatter_tokens
from routing.spec import Route, RouteConfigError, resolve_routes, routing_from_config


class RoutingController:
    """Holds a model's validated routes, its router and the inference-time override."""

    def __init__(self, routes: Sequence[Route], depth: int, router: Optional[TokenRouter] = None,
                 fp32_after_route: bool = False):
        self.routes = list(routes)    # validated at build time, non-negative indices
        self.depth = depth            # number of routable blocks
        self.router = router or TokenRouter()
        self.fp32_after_route = bool(fp32_after_route)  # the paper code's fp32 block after each route
        self._override: Optional[list[Route]] = None

    @classmethod
    def from_config(cls, routing: Optional[Mapping[str, Any]], depth: int) -> "RoutingController":
        """The controller a `routing` config group describes ({enabled, routes, seed, selection,
        fp32_after_route}), validated against `depth`; every backbone builds its routing here."""
        routing = dict(routing or {})
        flag = routing.get("fp32_after_route", False)
        if not isinstance(flag, bool):
            raise RouteConfigError(f"routing.fp32_after_route={flag!r} must be true or false.")
        router = TokenRouter(seed=int(routing.get("seed") or 0), **dict(routing.get("selection") or {}))
        return cls(routing_from_config(routing, depth), depth, router, fp32_after_route=flag)

    def fp32_blocks(self, routes: Sequence[Route]) -> frozenset[int]:
        """Blocks to run in fp32 (outside autocast): the one after each route's end, when enabled."""
        if not self.fp32_after_route:
            return frozenset()
        return frozenset(r.end_layer_idx + 1 for r in routes if r.end_layer_idx + 1 < self.depth)

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


def run_blocks(blocks: Sequence[Callable[..., Any]], x: torch.Tensor, routes: Sequence[Route],
               router: TokenRouter, force_keep: Optional[torch.Tensor] = None, *, context: Any = None,
               per_token: Optional[Mapping[str, torch.Tensor]] = None, checkpoint: bool = False,
               stats: Optional[list] = None, fp32_blocks: frozenset[int] = frozenset()) -> Any:
    """Run `blocks` over routable tokens x (B, N, D), routing a subset past each route's span.

    Two calling conventions, one routing semantics:

    * plain (DiT): `block(x) -> x`, per-sample conditioning bound by the caller; returns x.
    * with `context` or `per_token` (diffusers families): `block(x, context, per_token) -> (x, context)`.
      `context` is state that is never routed (text stream, register tokens, ...) and flows through every
      block; `per_token` holds tensors shaped (B, N, ...) that belong to the tokens (per-sample RoPE
      frequencies, per-token timestep modulation) and are gathered with them. Returns (x, context).

    At a route's start the kept tokens (and their per-token tensors) are gathered; after its end they are
    scattered back over the route-start tokens, so set-aside tokens re-enter unchanged. `force_keep` (B, N)
    marks tokens that are never dropped. `checkpoint` recomputes each block in backward (activation
    checkpointing); selection happens outside the checkpointed call, so recomputation sees the same tokens.
    `stats`, when given, receives one (start, end, kept, total) tuple per route taken. Blocks in
    `fp32_blocks` run outside autocast on float32 inputs (RoutingController.fp32_blocks).
    """
    plain = context is None and per_token is None
    full_tokens = dict(per_token or {})
    tokens = full_tokens
    starts = {r.start_layer_idx: r for r in routes}
    route: Optional[Route] = None
    x_start = ids_keep = None
    for i, block in enumerate(blocks):
        if i in starts:
            route = starts[i]
            x_start = x
            ids_keep = router.select(x, route.num_keep(x.shape[1]), force_keep)   # (B, K)
            x = gather_tokens(x, ids_keep)                                         # (B, K, D)
            tokens = {k: gather_tokens(v, ids_keep) for k, v in full_tokens.items()}
            if stats is not None:
                stats.append((route.start_layer_idx, route.end_layer_idx, ids_keep.shape[1], x_start.shape[1]))
        fp32 = i in fp32_blocks
        with torch.autocast(x.device.type, enabled=False) if fp32 else contextlib.nullcontext():
            if plain:
                x = _call(block, checkpoint, _f32(x) if fp32 else x)
            else:
                args = (x, context, tokens) if not fp32 else (_f32(x), _f32(context), _f32(tokens))
                x, context = _call(block, checkpoint, *args)
        if route is not None and i == route.end_layer_idx:
            x = scatter_tokens(x_start, x, ids_keep)                               # (B, N, D)
            tokens = full_tokens
            route = x_start = ids_keep = None
    return x if plain else (x, context)


def _f32(value: Any) -> Any:
    """float32 copies of the floating-point tensors in value (a tensor, tuple/list or dict)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_f32(v) for v in value)
    if isinstance(value, dict):
        return {k: _f32(v) for k, v in value.items()}
    return value


def _call(block: Callable[..., Any], checkpoint: bool, *args: Any) -> Any:
    if checkpoint and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
    return block(*args)
