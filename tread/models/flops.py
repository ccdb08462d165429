"""Theoretical FLOPs of a backbone's forward pass and of a training step: matmuls only, a multiply-add is 2.

DiT is counted analytically, the diffusers families by FlopCounterMode on one sample; a training step is 3x the
forward times the batch. Counts take an optional grid (a bucket's latent size). See docs/benchmarks.md.
"""
from __future__ import annotations

import contextlib
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch.utils.flop_counter import FlopCounterMode

from tread.models.dit import parse_arch
from tread.routing import Route, resolve_routes, routing_from_config, tokens_per_block

RoutesLike = Union[None, Sequence[Route], Sequence[Mapping[str, Any]], Mapping[str, Any]]
Size = Optional[Sequence[int]]   # a batch's latent (H, W), e.g. an aspect-ratio bucket's; None: the model's default


def as_routes(routes: RoutesLike, depth: int) -> list[Route]:
    """Resolved routes from Route objects, a list of route dicts, or a routing config {enabled, routes}."""
    if routes is None:
        return []
    if isinstance(routes, Mapping):
        return routing_from_config(routes, depth)
    routes = list(routes)
    if all(isinstance(r, Route) for r in routes):
        return routes
    return resolve_routes(routes, depth)


def transformer_forward_flops(num_tokens: int, depth: int, hidden: int, routes: Sequence[Route] = (),
                              mlp_hidden: Optional[int] = None, io_features: int = 0) -> float:
    """Forward FLOPs per sample of a DiT-like stack; io_features = p*p*C (patch embed and final linear)."""
    D, H = hidden, mlp_hidden if mlp_hidden is not None else 4 * hidden
    block = sum(2 * n * (4 * D * D + 2 * D * H) + 4 * n * n * D
                for n in tokens_per_block(routes, depth, num_tokens))
    io = 2 * (2 * num_tokens * D * io_features)
    return float(block + io)


def dit_forward_flops(arch: str, resolution: int, channels: int, routes: RoutesLike = None,
                      grid: Size = None) -> float:
    """Forward FLOPs per sample of `arch` on resolution x resolution latents (or grid = (H, W) latents) with
    `channels` channels."""
    depth, hidden, _, patch = parse_arch(arch)
    height, width = (resolution, resolution) if grid is None else (int(grid[0]), int(grid[1]))
    if height % patch or width % patch:
        raise ValueError(f"latents {height}x{width} are not a multiple of the patch size {patch} of {arch}")
    n = (height // patch) * (width // patch)
    return transformer_forward_flops(n, depth, hidden, as_routes(routes, depth), io_features=patch * patch * channels)


def train_step_flops(forward_flops_per_sample: float, batch: int) -> float:
    """Forward + backward (2x forward) of a batch."""
    return 3.0 * forward_flops_per_sample * batch


def dit_train_flops(arch: str, resolution: int, channels: int, routes: RoutesLike = None, batch: int = 1) -> float:
    """Theoretical FLOPs of one DiT training step on `batch` samples (3 x forward x batch)."""
    return train_step_flops(dit_forward_flops(arch, resolution, channels, routes), batch)


def counted_forward_flops(model: Any, x: torch.Tensor, labels: torch.Tensor,
                          cond: Optional[Mapping[str, torch.Tensor]] = None) -> float:
    """Forward FLOPs of `model` on the first sample of x, counted by torch's FlopCounterMode (matmuls and
    attention), with the routes the model applies in grad-enabled training."""
    return float(flop_counter(model, x, labels, cond).get_total_flops())


def flop_counter(model: Any, x: torch.Tensor, labels: torch.Tensor,
                 cond: Optional[Mapping[str, torch.Tensor]] = None) -> FlopCounterMode:
    """The FlopCounterMode of one forward on the first sample of x (per-module counts included); on the meta device
    the model's shape_only() context makes value-dependent parts countable."""
    shape_only = model.shape_only if x.device.type == "meta" else contextlib.nullcontext
    with FlopCounterMode(display=False) as counter, torch.enable_grad(), shape_only():
        extra = {"cond": {k: v[:1] for k, v in cond.items()}} if cond else {}
        model(x[:1], torch.full((1,), 500.0, device=x.device), labels[:1], **extra)
    return counter


def model_forward_flops(model: Any, cond: Optional[Mapping[str, torch.Tensor]] = None, grid: Size = None) -> float:
    """Theoretical forward FLOPs per sample of a backbone with its configured routes, on the default latent size or
    grid = (H, W); `cond`: one sample's text conditioning. The router's and the global random streams are left
    where they were, so counting never disturbs an exact resume."""
    if model.analytic_flops:
        return float(model.forward_flops(grid=grid))
    return float(training_flop_counter(model, cond, grid).get_total_flops())


def training_flop_counter(model: Any, cond: Optional[Mapping[str, torch.Tensor]] = None,
                          grid: Size = None) -> FlopCounterMode:
    """flop_counter of a family's eager training forward on one zero sample (latents of the default size or of
    grid = (H, W)), leaving the router's random stream and the global one where they were."""
    param = next(model.parameters())
    shape = sample_shape(model, grid)
    was_training = model.training
    saved = model.routing.router.state_dict()  # counting must not advance the router's RNG
    model.train()
    devices = [param.device] if param.device.type == "cuda" else []
    try:
        with model.eager(), torch.random.fork_rng(devices=devices):
            return flop_counter(model, torch.zeros(shape, device=param.device),
                                torch.zeros(1, dtype=torch.long, device=param.device),
                                {k: v.to(param.device) for k, v in (cond or {}).items()})
    finally:
        model.train(was_training)
        model.routing.router.load_state_dict(saved)


def sample_shape(model: Any, grid: Size = None) -> list[int]:
    """The shape of one sample a family's FLOPs are counted on: (1, C, H, W) or (1, C, frames, H, W), with (H, W) =
    grid or the default square; a video grid (T, H, W) sets the frames too."""
    size = (model.input_size, model.input_size) if grid is None else tuple(int(g) for g in grid)
    frames = size[0] if len(size) == 3 else model.frames
    shape = [1, model.in_channels, *size[-2:]]
    if model.frames_axis and (frames > 1 or len(size) == 3):
        shape.insert(2, frames)
    return shape


def forward_flops_with_routes(model: Any, routes: Optional[Sequence[Mapping[str, Any]]],
                              cond: Optional[Mapping[str, torch.Tensor]] = None, grid: Size = None) -> float:
    """Forward FLOPs per sample of a backbone run with `routes` (None: dense), e.g. a guided-sampling branch or a
    planner candidate, on the default latent size or grid = (H, W)."""
    if model.analytic_flops:
        return float(model.forward_flops(resolve_routes(routes, model.depth) if routes else [], grid=grid))
    with model.routing.override(routes=list(routes or [])):   # [] runs dense even in training mode
        return model_forward_flops(model, cond, grid)


class RouteFlops:
    """Forward FLOPs per sample of a diffusers family for any routes, from three counted forwards (dense and every
    block routed at two ratios): each block's FLOPs are a polynomial of degree <= 2 in its tokens. `exact` is
    False where the rest of the forward grows with the kept tokens; __call__ then counts each route set directly."""

    RATIOS = (0.5, 0.75)

    def __init__(self, model: Any, cond: Optional[Mapping[str, torch.Tensor]] = None, grid: Size = None):
        """grid: the latents' (H, W) to count at (default: the model's default size)."""
        self.model, self.cond, self.depth, self.grid = model, cond, int(model.depth), grid
        self.num_tokens = int(model.num_tokens if grid is None else
                              model.tokens_in(torch.empty(sample_shape(model, grid), device="meta")))
        names = {id(m): name for name, m in model.named_modules()}
        prefix = type(model).__name__
        self.blocks = [f"{prefix}.{names[id(b)]}" for b in model.routable_blocks()]
        points = [self._count(None)] + [self._count(r) for r in self.RATIOS]
        self.ns = [n for n, _, _ in points]
        self.outside = points[0][1]
        self.exact = len(set(self.ns)) == 3 and all(out == self.outside for _, out, _ in points)
        self.per_block = [[blocks[b] for _, _, blocks in points] for b in range(self.depth)]

    def _count(self, ratio: Optional[float]) -> tuple[int, int, list[int]]:
        """(kept tokens, FLOPs outside the blocks, FLOPs per block) of one forward with every block routed."""
        route = Route(selection_ratio=ratio, start_layer_idx=0, end_layer_idx=self.depth - 1) if ratio else None
        with self.model.routing.override(routes=[route.__dict__] if route else []):
            counts = training_flop_counter(self.model, self.cond, self.grid).get_flop_counts()
        per_block = [sum(sum(ops.values()) for name, ops in counts.items() if _outermost_under(name, block, counts))
                     for block in self.blocks]
        total = sum(counts["Global"].values())
        return (route.num_keep(self.num_tokens) if route else self.num_tokens), total - sum(per_block), per_block

    def __call__(self, routes: Optional[Sequence[Mapping[str, Any]]]) -> float:
        if not self.exact:
            return forward_flops_with_routes(self.model, routes, self.cond, self.grid)
        n = tokens_per_block(as_routes(list(routes or []), self.depth), self.depth, self.num_tokens)
        return float(self.outside + sum(_through(self.ns, ys, k) for ys, k in zip(self.per_block, n)))


def _outermost_under(name: str, block: str, counts: Mapping[str, Any]) -> bool:
    """name is the block's module, or a module inside it none of whose ancestors inside the block was counted
    (a block whose own forward is not called, only its parts')."""
    if name == block:
        return True
    if not name.startswith(block + "."):
        return False
    parts = name.split(".")
    return not any(".".join(parts[:i]) in counts for i in range(block.count(".") + 1, len(parts)))


def _through(xs: Sequence[int], ys: Sequence[int], x: int) -> float:
    """The parabola through the points (xs[i], ys[i]) at x (Lagrange, exact on integer counts)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return float(total)
