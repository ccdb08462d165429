"""SPRINT-style sparse-dense residual fusion (Park et al. 2025, arXiv 2510.21986), from the paper's description.

Dense shallow blocks, a deep span on the kept tokens, a Linear(2D, D) fusion with the shallow features, dense
final blocks; path drop trains the no-deep-path prediction for path-drop guidance (docs/research.md).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint

from tread.models.backbone import Backbone
from tread.models.dit import DiT, build_dit
from tread.models.errors import ModelConfigError
from tread.models.repa import repa_output, repa_tap
from tread.routing import Route, RoutePlan, RouteConfigError, gather_tokens, scatter_tokens, tokens_per_block


class SprintDiT(DiT):
    """DiT with a dense shallow path, a sparse deep span and their residual fusion (module docstring)."""

    def __init__(self, *args: Any, sprint: Mapping[str, Any], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.span = sprint_span(sprint, self.depth)
        self.path_drop_prob = float(sprint.get("path_drop_prob", 0.1))
        if not 0 <= self.path_drop_prob < 1:
            raise ModelConfigError(f"model.sprint.path_drop_prob={self.path_drop_prob} must lie in [0, 1).")
        D = self.pos_embed.shape[-1]
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D))
        self.fuse = nn.Linear(2 * D, D)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.xavier_uniform_(self.fuse.weight)
        nn.init.zeros_(self.fuse.bias)
        for routes in [self.routing.routes, *(self.routing.schedule.route_lists() if self.routing.schedule else [])]:
            self.check_routes(routes)

    def use_context_parallel(self, split: Any) -> None:
        """Refused: the deep span routes outside the split block loop (Backbone's one-line error)."""
        Backbone.use_context_parallel(self, split)

    def check_routes(self, routes: Sequence[Route]) -> None:
        """A SPRINT model routes its deep span only: no route (dense) or exactly one route over the span."""
        start, end = self.span
        if not routes or (len(routes) == 1 and (routes[0].start_layer_idx, routes[0].end_layer_idx) == (start, end)):
            return
        got = ", ".join(f"{r.start_layer_idx}..{r.end_layer_idx}" for r in routes)
        raise RouteConfigError(f"routing.routes (or a routing.schedule phase) route blocks {got}, but a SPRINT model "
                               f"(model.sprint) drops tokens only over its deep span: allowed is one route with "
                               f"start_layer_idx={start}, end_layer_idx={end} (any selection_ratio), or none.")

    def forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor,
                force_keep: Optional[torch.Tensor] = None, *, return_aux: bool = False, **cond: Any) -> Any:
        """As DiT's, plus `path_drop` (B,) bool: rows whose deep path is dropped (path-drop guidance). Training
        forwards draw it per sample with probability path_drop_prob from the training stream, eagerly."""
        if cond.get("path_drop") is None and self.training and torch.is_grad_enabled() and self.path_drop_prob > 0:
            cond["path_drop"] = torch.rand(x.shape[0], device=x.device) < self.path_drop_prob
        return super().forward(x, noise_level, labels, force_keep, return_aux=return_aux, **cond)

    def routed_forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor, plan: RoutePlan,
                       force_keep: Optional[torch.Tensor] = None, path_drop: Optional[torch.Tensor] = None,
                       return_aux: bool = False) -> Any:
        grid = self.grid_of(x)
        x = self.x_embedder(x) + self.pos_embed_at(grid)                         # (B, N, D)
        c = self.t_embedder(noise_level) + self.y_embedder(labels)                # (B, D)
        start, end = self.span
        tap = repa_tap(self.repa_head, return_aux)
        x = self._blocks(range(0, start), x, c, None, tap)                        # dense shallow path
        deep = self._deep(x, c, plan, force_keep, path_drop, tap)                 # (B, N, D), mask-filled
        x = self.fuse(torch.cat([deep, x], dim=-1))                               # residual fusion
        x = self._blocks(range(end + 1, self.depth), x, c, None, tap)             # dense final blocks
        x = self.unpatchify(self.final_layer(x, c), grid)                         # (B, C, H, W)
        return repa_output(x, self.repa_head, tap, return_aux)

    def _deep(self, x: torch.Tensor, c: torch.Tensor, plan: RoutePlan, force_keep: Optional[torch.Tensor],
              path_drop: Optional[torch.Tensor], tap: Optional[dict]) -> torch.Tensor:
        """The deep span's output on all positions: computed tokens where kept, the mask token elsewhere; rows in
        `path_drop` are all mask tokens (at inference those rows are not computed at all)."""
        B, N, D = x.shape
        mask = self.mask_token.to(x.dtype).expand(B, N, D)
        rows = None
        if path_drop is not None and not self.training:          # sampling: compute only the rows that keep the path
            rows = (~path_drop).nonzero().flatten()
            if rows.numel() == 0:
                return mask
        h, cc = (x, c) if rows is None else (x[rows], c[rows])
        ids = None
        if plan.routes:
            keep = force_keep if force_keep is None or rows is None else force_keep[rows]
            ids = self.routing.router.select(h, plan.keep[0], keep,
                                             noise=plan.noise[0] if rows is None else plan.noise[0][rows])
            h = gather_tokens(h, ids)                                             # (B, K, D)
        h = self._blocks(range(self.span[0], self.span[1] + 1), h, cc, ids, tap)
        deep = h if ids is None else scatter_tokens(mask[:h.shape[0]], h, ids)
        if rows is not None:
            deep = mask.index_copy(0, rows, deep)
        if path_drop is not None and self.training:
            deep = torch.where(path_drop[:, None, None], mask, deep)
        return deep

    def _blocks(self, indices: range, x: torch.Tensor, c: torch.Tensor, ids: Optional[torch.Tensor],
                tap: Optional[dict]) -> torch.Tensor:
        checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i in indices:
            block = self.blocks[i]
            x = (torch.utils.checkpoint.checkpoint(block, x, c, use_reentrant=False) if checkpoint else block(x, c))
            if tap is not None and i == tap["block"]:
                tap["tokens"], tap["ids"] = x, ids
        return x

    def forward_flops(self, routes=None, path_dropped: bool = False, grid: Optional[tuple[int, int]] = None) -> float:
        """DiT's count with the deep span at its kept tokens plus the fusion (2 N 2D D); `path_dropped`: the deep
        span is skipped (path-drop guidance's unconditional branch); grid: latents (H, W)."""
        routes = routes if routes is not None else self.routing.routes
        N, D = self._tokens(grid), self.pos_embed.shape[-1]
        H = self.blocks[0].mlp.fc1.out_features
        n = tokens_per_block(routes, self.depth, N)
        skip = range(self.span[0], self.span[1] + 1) if path_dropped else range(0)
        block = sum(2 * k * (4 * D * D + 2 * D * H) + 4 * k * k * D for i, k in enumerate(n) if i not in skip)
        io = 2 * N * D * (self.patch_size ** 2 * self.in_channels) * 2
        return float(block + io + 2 * N * 2 * D * D)


def sprint_span(sprint: Mapping[str, Any], depth: int) -> tuple[int, int]:
    """(start, end) of model.sprint's deep span, negative indices resolved; at least one dense block each side."""
    ends = []
    for name in ("start", "end"):
        value = sprint.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not -depth <= value < depth:
            raise ModelConfigError(f"model.sprint.{name}={value!r} must be a block index in {-depth}..{depth - 1} "
                                   f"for a model of depth {depth} (negative counts from the end).")
        ends.append(value % depth)
    start, end = ends
    if not 0 < start <= end < depth - 1:
        raise ModelConfigError(f"model.sprint: start={sprint.get('start')}, end={sprint.get('end')} give the deep span "
                               f"{start}..{end}; SPRINT needs dense blocks before and after it: 1 <= start <= end <= "
                               f"{depth - 2}.")
    return start, end


def build_sprint(arch: str, input_size: int, in_channels: int, num_classes: int,
                 routing: Optional[Mapping[str, Any]] = None, sprint: Optional[Mapping[str, Any]] = None,
                 **overrides: Any) -> SprintDiT:
    """A named DiT size with SPRINT's fusion over model.sprint's span (models.build_dit's arguments)."""
    return build_dit(arch, input_size, in_channels, num_classes, routing, cls=SprintDiT, sprint=dict(sprint or {}),
                     **overrides)
