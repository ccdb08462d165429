"""The parameter-free TREAD token router: pick kept tokens, gather them, scatter them back.

Shaped like MAE's `random_masking`: top-K per sample with one gather, restored with one scatter; set-aside
tokens come back unchanged, with gradients through that identity path.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from tread.routing.shards import top_per_shard
from tread.routing.structured import group_side, order_size, structured_scores, token_grid3

SELECTION_MODES = ("random", "importance", "structured")


class TokenRouter:
    """Chooses which tokens a route keeps, drawing from its own generator (one per device, seeded from the run seed
    and rank), so routing never shifts the training RNG stream; its state is checkpointed."""

    def __init__(self, seed: int = 0, mode: str = "random", importance_weight: float = 0.5):
        # mode is one of SELECTION_MODES and importance_weight in [0, 1]: the config's schema checks both (Selection)
        self.mode = mode                                # "random" (paper), "importance" (L1 score + noise) or
                                                        # "structured" (SPRINT's groups, tread/routing/structured.py)
        self.importance_weight = float(importance_weight)  # weight of the L1 score against the noise
        self._seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._per_sample: Optional[list[torch.Generator]] = None   # inference: one generator per sample

    # -- generator state -------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._seed = int(seed)
        self._generators.clear()

    def _generator(self, device: torch.device) -> Optional[torch.Generator]:
        """The router's generator on `device`; None on the meta device (shapes only: FLOPs of a model built there,
        whose scores have no values), which is never cached, so a real device's lookup stays one dict hit."""
        key = str(device)
        if key not in self._generators:
            if torch.device(device).type == "meta":
                return None
            self._generators[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[key]

    def state_dict(self) -> dict:
        return {"seed": self._seed, "states": {k: g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.manual_seed(state["seed"])
        for key, gen_state in state.get("states", {}).items():
            self._generator(torch.device(key)).set_state(gen_state)

    @contextlib.contextmanager
    def per_sample(self, generators: Sequence[torch.Generator]) -> Iterator[None]:
        """Draw each sample's scores from its own generator; rows i, i + G, i + 2G, ... use generator i, so both halves
        of a CFG batch route the same tokens."""
        previous, self._per_sample = self._per_sample, list(generators)
        try:
            yield
        finally:
            self._per_sample = previous

    @property
    def needs_grid(self) -> bool:
        """Whether draw needs the batch's token grid (structured mode)."""
        return self.mode == "structured"

    def draw(self, B: int, N: int, device: torch.device, grid: Optional[Sequence[int]] = None, ratio: float = 0.0,
             force_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores (B, N) in [0, 1] from the router's own stream (or the per-sample generators), drawn eagerly before a
        (possibly compiled) forward; structured mode uses `grid`, `ratio` and the force-keep mask."""
        if not self.needs_grid:
            return self._uniform(B, [N], device)[0]
        grid3 = token_grid3(grid, N)
        k = group_side(ratio)
        order, jitter = self._uniform(B, [order_size(grid3, k), N], device)
        return structured_scores(order, jitter, grid3, k, force_keep)

    def _uniform(self, B: int, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """One (B, size) uniform tensor per size, drawn in that order (per generator, with per-sample ones)."""
        if self._per_sample is None:
            return [torch.rand(B, n, device=device, generator=self._generator(device)) for n in sizes]
        gens = self._per_sample
        if B % len(gens):
            raise ValueError(f"per-sample routing has {len(gens)} generators but the batch has {B} rows "
                             f"(must be a multiple).")
        rows = [[torch.rand(n, device=device, generator=g) for n in sizes] for g in gens]
        return [torch.stack([r[i] for r in rows]).repeat(B // len(gens), 1) for i in range(len(sizes))]

    # -- selection -------------------------------------------------------------------
    def select(self, x: torch.Tensor, num_keep: int, force_keep: Optional[torch.Tensor] = None,
               noise: Optional[torch.Tensor] = None, grid: Optional[Sequence[int]] = None,
               shards: int = 1) -> torch.Tensor:
        """Indices (B, K) of the tokens to keep from `x` (B, N, D); force-kept tokens are never dropped.

        `noise` (B, N): scores drawn beforehand (then num_keep is final: no host sync); without it they are
        drawn here and K grows for the batch when a sample force-keeps more (keep_count). `grid`: structured mode.
        `shards`: pick K / shards in each of that many contiguous shards, as a split sequence does (shards.py; the
        importance score is then normalised per shard, as each process of a context group sees only its own).
        """
        B, N, _ = x.shape
        if noise is None:
            noise = self.draw(B, N, x.device, grid, 1.0 - num_keep / N, force_keep)
            num_keep = keep_count(num_keep, force_keep)
        score = noise                                                                   # (B, N) in [0, 1]
        if self.mode == "importance":
            with torch.no_grad():
                l1 = x.detach().float().abs().mean(dim=-1).view(B, shards, N // shards)  # (B, P, N / P)
                lo, hi = l1.amin(dim=2, keepdim=True), l1.amax(dim=2, keepdim=True)
                l1 = ((l1 - lo) / (hi - lo).clamp_min(1e-12)).view(B, N)                 # per-shard [0, 1]
            w = self.importance_weight
            score = w * l1 + (1.0 - w) * score
        if force_keep is not None:
            if force_keep.shape != (B, N):
                raise ValueError(f"force_keep mask must have shape (B, N) = {(B, N)}, got {tuple(force_keep.shape)}.")
            # Scores lie in [0, 1]; +2 puts every forced token above every free one.
            score = score + 2.0 * force_keep.to(device=x.device, dtype=score.dtype)
        return top_per_shard(score, num_keep, shards)                                   # (B, K)


def keep_count(num_keep: int, force_keep: Optional[torch.Tensor]) -> int:
    """The route's keep count, grown to the most tokens any sample force-keeps. One host sync, only when a
    mask is given: the keep count must be static for the batch."""
    if force_keep is None:
        return num_keep
    return max(num_keep, int(force_keep.to(torch.bool).sum(dim=1).max()))


def gather_tokens(x: torch.Tensor, ids_keep: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...), ids_keep (B, K) -> (B, K, ...): the kept tokens with all their trailing dims."""
    index = ids_keep.reshape(*ids_keep.shape, *([1] * (x.dim() - 2))).expand(*ids_keep.shape, *x.shape[2:])
    return torch.gather(x, 1, index)


def scatter_tokens(x_full: torch.Tensor, x_kept: torch.Tensor, ids_keep: torch.Tensor) -> torch.Tensor:
    """Put processed kept tokens (B, K, D) back into x_full (B, N, D) out of place; other positions keep the
    route-start values, an identity path that carries gradients."""
    index = ids_keep.unsqueeze(-1).expand(-1, -1, x_full.shape[-1])
    return x_full.scatter(1, index, x_kept.to(x_full.dtype))
