"""What sampling costs: forward passes per image, counted per branch while sampling, times each branch's
theoretical forward FLOPs (the same count as training FLOPs: tread/models/flops.py)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from tread.models.flops import forward_flops_with_routes
from tread.routing import resolve_routes
from tread.sampling.guidance import PATH_DROP, Guidance, backbone


def sampling_flops_per_image(model: Any, guidance: Guidance, stats: dict, num_images: int,
                             cond: Optional[dict] = None) -> float:
    """Forward FLOPs spent per generated image: sum over branch ratios of (forward passes x FLOPs of one
    forward at that ratio) / images."""
    if not num_images:
        return 0.0
    total = sum(n * branch_flops(model, guidance, ratio, cond) for ratio, n in stats.items())
    return total / num_images


def branch_flops(model: Any, guidance: Guidance, ratio: Any, cond: Optional[dict]) -> float:
    """Forward FLOPs of one pass of a branch: at a ratio (None: dense), or path-dropped (PATH_DROP: SPRINT's
    unconditional branch, its deep span skipped, at the main branch's routes)."""
    if ratio == PATH_DROP:
        specs = guidance.routes(model, guidance.selection_ratio)
        return float(model.forward_flops(resolve_routes(specs, model.depth) if specs else [], path_dropped=True))
    return forward_flops_with_routes(model, guidance.routes(model, ratio), cond)


def sampling_cost(net: Any, guidance: Guidance, stats: dict, num_images: int,
                  cond_fn: Optional[Callable[[list[int]], dict]] = None, seed: int = 0) -> dict[str, Any]:
    """What sampling `num_images` images cost per image, from the forward passes `generate` counted in
    `stats`: passes per image, theoretical forward GFLOPs per image, and passes per branch ratio."""
    model = backbone(net)
    cond = None
    if cond_fn is not None:
        param = next(model.parameters())
        cond = {k: v.to(param.device) for k, v in cond_fn([seed]).items()}
    flops = sampling_flops_per_image(model, guidance, stats, num_images, cond)
    passes = sum(stats.values()) / num_images if num_images else 0.0
    return {"forward_passes_per_image": passes, "sample_gflops_per_image": flops / 1e9,
            "passes_by_ratio": {("dense" if r is None else r if r == PATH_DROP else f"{r:g}"): n / max(num_images, 1)
                                for r, n in stats.items()}}
