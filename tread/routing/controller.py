"""When routes apply, and the shared block loop that applies them.

Every backbone family owns one `RoutingController` and runs its blocks through
`run_blocks`, so route semantics (training-only by default, inference override,
gather at start, scatter after end) live in one place.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint

from tread.routing.router import TokenRouter, gather_tokens, keep_count, scatter_tokens
from tread.routing.schedule import RouteSchedule, schedule_from_config
from tread.routing.shards import SequenceSplit, check_split, shard_keep
from tread.routing.spec import Route, RouteConfigError, resolve_routes, routing_from_config, tokens_processed_fraction


@dataclass
class RoutePlan:
    """What one forward pass routes, decided eagerly before it runs (RoutingController.plan): the active routes, their
    keep counts (force-keep growth included) and pre-drawn scores, so the forward compiles into one graph."""

    routes: list[Route] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)              # kept tokens per route
    noise: list[torch.Tensor] = field(default_factory=list)    # (B, N) scores per route, in [0, 1]
    fp32_blocks: frozenset[int] = frozenset()                  # blocks run outside autocast
    num_tokens: int = 0
    shards: int = 1                                            # contiguous shards that each keep keep / shards
    split: Optional[SequenceSplit] = None                      # the context group holding the shards, if split

    @property
    def stats(self) -> list[tuple[int, int, int, int]]:
        """(start, end, kept, total) per route: what routing.processed_fraction counts."""
        return [(r.start_layer_idx, r.end_layer_idx, k, self.num_tokens) for r, k in zip(self.routes, self.keep)]


class RoutingController:
    """Holds a model's validated routes, its routing schedule, its router and the inference-time override.

    `routes` (routing.routes) are what inference routing and TREAD guidance use; training steps route
    `training_routes`, the current schedule phase's (set by `set_step`).
    """

    def __init__(self, routes: Sequence[Route], depth: int, router: Optional[TokenRouter] = None,
                 fp32_after_route: bool = False, schedule: Optional[RouteSchedule] = None):
        self.routes = list(routes)    # validated at build time, non-negative indices
        self.depth = depth            # number of routable blocks
        self.router = router or TokenRouter()
        self.fp32_after_route = bool(fp32_after_route)  # the paper code's fp32 block after each route
        self.schedule = schedule
        self.training_routes = list(routes) if schedule is None else schedule.routes_at(0)
        self._override: Optional[list[Route]] = None

    @classmethod
    def from_config(cls, routing: Optional[Mapping[str, Any]], depth: int) -> "RoutingController":
        """The controller a `routing` config group describes ({enabled, routes, seed, selection,
        fp32_after_route}), validated against `depth`; every backbone builds its routing here."""
        routing = dict(routing or {})
        flag = bool(routing.get("fp32_after_route", False))
        router = TokenRouter(seed=int(routing.get("seed") or 0), **dict(routing.get("selection") or {}))
        routes = routing_from_config(routing, depth)
        if routing.get("schedule") and not routing.get("enabled", False):
            raise RouteConfigError("routing.schedule is set but routing is disabled (routing.enabled=false, e.g. "
                                   "routing=none or model=dit); pick a routing preset, e.g. routing=paper.")
        schedule = schedule_from_config(routing.get("schedule"), routes, depth)
        return cls(routes, depth, router, fp32_after_route=flag, schedule=schedule)

    def set_step(self, step: int) -> None:
        """Route training step `step` as the schedule says (no-op without a schedule)."""
        if self.schedule is not None:
            self.training_routes = self.schedule.routes_at(step)

    def routes_at(self, step: int) -> list[Route]:
        """The routes training step `step` takes."""
        return self.schedule.routes_at(step) if self.schedule is not None else list(self.routes)

    def plan(self, batch: int, num_tokens: int, device: torch.device, training: bool,
             force_keep: Optional[torch.Tensor] = None, grid: Optional[Sequence[int]] = None, shards: int = 1,
             split: Optional[SequenceSplit] = None) -> RoutePlan:
        """The routes this forward takes, with their keep counts and scores drawn now, in route order, from the router's
        generator(s). `grid`: the batch's token grid, which structured selection needs. `split`: the sequence is
        split over a context group (its degree is the shard count); `shards` without a split routes one process's
        whole sequence as that many shards would (shards.py). Scores and keep counts are of the whole sequence."""
        shards = split.degree if split is not None else shards
        routes = self.active_routes(training)
        if shards > 1:
            check_split(num_tokens, shards)
            keep = [shard_keep(r.num_keep(num_tokens), num_tokens, shards, force_keep) for r in routes]
        else:
            keep = [keep_count(r.num_keep(num_tokens), force_keep) for r in routes]
        noise = [self.router.draw(batch, num_tokens, device, grid, r.selection_ratio, force_keep) for r in routes]
        return RoutePlan(routes, keep, noise, self.fp32_blocks(routes), num_tokens, shards, split)

    def fp32_blocks(self, routes: Sequence[Route]) -> frozenset[int]:
        """Blocks to run in fp32 (outside autocast): the one after each route's end, when enabled."""
        if not self.fp32_after_route:
            return frozenset()
        return frozenset(r.end_layer_idx + 1 for r in routes if r.end_layer_idx + 1 < self.depth)

    @property
    def enabled(self) -> bool:
        return bool(self.routes)

    def active_routes(self, training: bool) -> list[Route]:
        """Routes for this forward: the override if set, else the training routes in grad-enabled training."""
        if self._override is not None:
            return self._override
        if training and torch.is_grad_enabled():
            return self.training_routes
        return []

    @contextlib.contextmanager
    def override(self, selection_ratio: Optional[float] = None,
                 routes: Optional[Sequence[Mapping[str, Any]]] = None) -> Iterator[None]:
        """Route at inference too (e.g. TREAD-guided sampling): `selection_ratio` reuses the configured spans with a new
        ratio, `routes` gives explicit specs; `selection_ratio=0` with no routes configured is dense."""
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


class RoutedBackbone(nn.Module):
    """Base of every routed backbone (DiT and the diffusers families).

    `forward(x, noise_level, labels, force_keep=None, *, return_aux=False, **cond)` plans the routes eagerly,
    then runs `routed_forward` (the subclass's, with `run_blocks`); `compile()` compiles `routed_forward` alone.
    Subclasses set `self.routing` and provide `num_tokens` and `grid_of(x)` (and `tokens_in(x)` for other
    grids). `return_aux=True` returns (output, aux) where routed_forward supports it (DiT's REPA tokens).
    """

    routing: RoutingController
    last_route_plan: Optional[RoutePlan] = None   # the plan of the last forward (routes, keep counts)
    context_split: Optional[SequenceSplit] = None  # train.context_parallel: this process's share of the sequence
    route_shards: int = 1                         # without a split: route as that many shards would (shards.py)

    def forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor,
                force_keep: Optional[torch.Tensor] = None, *, return_aux: bool = False, **cond: Any) -> Any:
        grid = self.grid_of(x) if self.routing.router.needs_grid else None
        plan = self.routing.plan(x.shape[0], self.tokens_in(x), x.device, self.training, force_keep, grid,
                                 self.route_shards, self.context_split)
        self.last_route_plan = plan
        routed = self.__dict__.get("_compiled_routed_forward") or self.routed_forward
        if return_aux:
            cond["return_aux"] = True
        return routed(x, noise_level, labels, plan, force_keep, **cond)

    def tokens_in(self, x: torch.Tensor) -> int:
        """Routable tokens of input x, which the keep counts follow (default num_tokens; backbones that take other
        grids read them from x's shape)."""
        return self.num_tokens

    def routed_forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor, plan: RoutePlan,
                       force_keep: Optional[torch.Tensor] = None, **cond: Any) -> Any:
        raise NotImplementedError

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile the routed forward in place; parameter names, state dicts and checkpoints are
        unchanged. Copy the module (e.g. for EMA) before compiling it: the copy would share the compiled code."""
        self._compiled_routed_forward = torch.compile(self.routed_forward, *args, **kwargs)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the uncompiled forward inside the block (e.g. to count FLOPs without compiling again)."""
        compiled = self.__dict__.pop("_compiled_routed_forward", None)
        try:
            yield
        finally:
            if compiled is not None:
                self._compiled_routed_forward = compiled

    @property
    def last_route_stats(self) -> list[tuple[int, int, int, int]]:
        """(start, end, kept, total) per route of the last forward."""
        return self.last_route_plan.stats if self.last_route_plan is not None else []

    def processed_fraction(self) -> float:
        """Share of token-block evaluations the last forward did (1.0 dense); force-kept tokens raise it."""
        plan = self.last_route_plan
        if plan is None or not plan.routes:
            return 1.0
        return tokens_processed_fraction(plan.routes, self.routing.depth, plan.num_tokens, plan.keep)


def run_blocks(blocks: Sequence[Callable[..., Any]], x: torch.Tensor, plan: RoutePlan, router: TokenRouter,
               force_keep: Optional[torch.Tensor] = None, *, context: Any = None,
               per_token: Optional[Mapping[str, torch.Tensor]] = None, checkpoint: bool = False,
               tap: Optional[dict] = None) -> Any:
    """Run `blocks` over routable tokens x (B, N, D), routing a subset past each route of `plan`.

    Plain (DiT): `block(x) -> x`, returns x. With `context` or `per_token` (families):
    `block(x, context, per_token) -> (x, context)`; context is never routed, per_token tensors (B, N, ...) are
    gathered with the tokens; returns (x, context). `force_keep` (B, N) marks tokens never dropped, `checkpoint`
    recomputes each block in backward, `plan.fp32_blocks` run outside autocast, and `tap` = {"block": i}
    receives that block's tokens (and the kept ids inside a route) for REPA. With `plan.split`, x, per_token and
    force_keep are of the whole sequence: this process runs the blocks on its shard (routing within it, keep /
    degree tokens) and returns the whole sequence gathered from the group; context is the same on every process.
    """
    plain = context is None and per_token is None
    split, shards = plan.split, plan.shards
    if split is not None:
        x, per_token, force_keep = _local(split, x), _local(split, per_token), _local(split, force_keep)
        shards = 1
    full_tokens = dict(per_token or {})
    tokens = full_tokens
    starts = {r.start_layer_idx: j for j, r in enumerate(plan.routes)}
    route: Optional[Route] = None
    x_start = ids_keep = None
    for i, block in enumerate(blocks):
        if i in starts:
            j = starts[i]
            route, x_start = plan.routes[j], x
            keep, noise = plan.keep[j], plan.noise[j]
            if split is not None:
                keep, noise = keep // split.degree, split.local(noise)
            ids_keep = router.select(x, keep, force_keep, noise=noise, shards=shards)    # (B, K)
            x = gather_tokens(x, ids_keep)                                              # (B, K, D)
            tokens = {k: gather_tokens(v, ids_keep) for k, v in full_tokens.items()}
        fp32 = i in plan.fp32_blocks
        with torch.autocast(x.device.type, enabled=False) if fp32 else contextlib.nullcontext():
            if plain:
                x = _call(block, checkpoint, _f32(x) if fp32 else x)
            else:
                args = (x, context, tokens) if not fp32 else (_f32(x), _f32(context), _f32(tokens))
                x, context = _call(block, checkpoint, *args)
        if tap is not None and i == tap["block"]:
            tap["tokens"], tap["ids"] = x, ids_keep
        if route is not None and i == route.end_layer_idx:
            x = scatter_tokens(x_start, x, ids_keep)                                    # (B, N, D)
            tokens = full_tokens
            route = x_start = ids_keep = None
    if split is not None:
        x = split.gather(x)
    return x if plain else (x, context)


def _local(split: SequenceSplit, value: Any) -> Any:
    """This process's shard of a whole-sequence tensor (or of each tensor of a dict; None stays None)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: split.local(v) for k, v in value.items()}
    return split.local(value)


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
