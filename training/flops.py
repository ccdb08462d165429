"""Theoretical FLOPs of DiT training steps and device peaks, for scripts/benchmark.py.

Counting convention (same as DiT.forward_flops): matmuls only, a multiply-add is 2 FLOPs. Per block
with n tokens, width D and MLP width H: 2 n (4 D^2 + 2 D H) for qkv, proj and the MLP plus 4 n^2 D for
attention scores and values; patch embed + final linear: 2 * (2 N D p^2 C). A training step is taken as
3x the forward (backward = 2x forward) times the batch.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from routing.spec import Route, resolve_routes, routing_from_config

# bf16 dense tensor-core peaks (FLOP/s, no sparsity), matched by substring of the device name, first wins.
DEVICE_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 SXM", 989e12),
    ("H100 80GB HBM3", 989e12),   # how torch names the SXM part
    ("H100", 989e12),             # other H100 names (NVL, ...): SXM figure
    ("A100", 312e12),
)

RoutesLike = Union[None, Sequence[Route], Sequence[Mapping[str, Any]], Mapping[str, Any]]


def parse_dit_arch(arch: str) -> tuple[int, int, int, int]:
    """'DiT-XL/2' -> (depth, hidden, heads, patch)."""
    from models.dit import DIT_ARCHS, DIT_SIZES

    if arch not in DIT_ARCHS:
        raise ValueError(f"{arch!r} is not a known DiT; allowed: {', '.join(DIT_ARCHS)}")
    size, patch = arch[len("DiT-"):].split("/")
    depth, hidden, heads = DIT_SIZES[size]
    return depth, hidden, heads, int(patch)


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


def tokens_per_block(num_tokens: int, depth: int, routes: Sequence[Route]) -> list[int]:
    n = [num_tokens] * depth
    for r in routes:
        for i in range(r.start_layer_idx, r.end_layer_idx + 1):
            n[i] = r.num_keep(num_tokens)
    return n


def transformer_forward_flops(num_tokens: int, depth: int, hidden: int, routes: Sequence[Route] = (),
                              mlp_hidden: Optional[int] = None, io_features: int = 0) -> float:
    """Forward FLOPs per sample of a DiT-like stack; io_features = p*p*C (patch embed and final linear)."""
    D, H = hidden, mlp_hidden if mlp_hidden is not None else 4 * hidden
    block = sum(2 * n * (4 * D * D + 2 * D * H) + 4 * n * n * D
                for n in tokens_per_block(num_tokens, depth, routes))
    io = 2 * (2 * num_tokens * D * io_features)
    return float(block + io)


def dit_forward_flops(arch: str, resolution: int, channels: int, routes: RoutesLike = None) -> float:
    """Forward FLOPs per sample of `arch` on resolution x resolution latents with `channels` channels."""
    depth, hidden, _, patch = parse_dit_arch(arch)
    if resolution % patch:
        raise ValueError(f"resolution {resolution} is not a multiple of the patch size {patch} of {arch}")
    n = (resolution // patch) ** 2
    return transformer_forward_flops(n, depth, hidden, as_routes(routes, depth), io_features=patch * patch * channels)


def train_step_flops(forward_flops_per_sample: float, batch: int) -> float:
    """Forward + backward (2x forward) of a batch."""
    return 3.0 * forward_flops_per_sample * batch


def dit_train_flops(arch: str, resolution: int, channels: int, routes: RoutesLike = None, batch: int = 1) -> float:
    """Theoretical FLOPs of one DiT training step on `batch` samples (3 x forward x batch)."""
    return train_step_flops(dit_forward_flops(arch, resolution, channels, routes), batch)


def speedup_bound(dense_flops: float, routed_flops: float) -> float:
    return dense_flops / routed_flops


def fraction_of_bound(speedup: float, dense_flops: float, routed_flops: float) -> float:
    """Measured speedup / the FLOPs-ratio speedup: 1.0 means the saving is fully realised."""
    return speedup / speedup_bound(dense_flops, routed_flops)


def device_peak_flops(device_name: Optional[str]) -> tuple[Optional[float], str]:
    """(bf16 dense peak FLOP/s, note) for a CUDA device name; (None, note) when unknown."""
    if not device_name:
        return None, "no CUDA device: MFU not defined"
    for key, peak in DEVICE_PEAK_BF16:
        if key.lower() in device_name.lower():
            return peak, f"bf16 dense peak {peak / 1e12:g} TFLOP/s ({key})"
    return None, f"unknown device {device_name!r}: no peak in the table, MFU is null"


def mfu(achieved_flops_per_s: float, peak: Optional[float]) -> Optional[float]:
    return None if not peak else achieved_flops_per_s / peak


__all__ = ["DEVICE_PEAK_BF16", "as_routes", "device_peak_flops", "dit_forward_flops", "dit_train_flops",
           "fraction_of_bound", "mfu", "parse_dit_arch", "speedup_bound", "tokens_per_block",
           "train_step_flops", "transformer_forward_flops"]


def counted_forward_flops(model: Any, x: Any, labels: Any, cond: Optional[Mapping[str, Any]] = None) -> float:
    """Forward FLOPs of `model` on the first sample of x, counted by torch's FlopCounterMode (matmuls and
    attention), with the routes the model applies in grad-enabled training."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, torch.enable_grad():
        extra = {"cond": {k: v[:1] for k, v in cond.items()}} if cond else {}
        model(x[:1], torch.full((1,), 500.0, device=x.device), labels[:1], **extra)
    return float(counter.get_total_flops())


def model_forward_flops(model: Any, cond: Optional[Mapping[str, Any]] = None) -> float:
    """Theoretical forward FLOPs per sample of a backbone with its configured routes: DiT's analytic
    forward_flops, or counted on one sample for the diffusers families (with `cond`, the data's text
    conditioning of one sample, when the data has it)."""
    if hasattr(model, "forward_flops"):
        return float(model.forward_flops())
    import torch
    param = next(model.parameters())
    shape = [1, model.in_channels, model.input_size, model.input_size]
    if getattr(model, "frames_axis", False) and getattr(model, "frames", 1) > 1:
        shape.insert(2, model.frames)
    was_training = model.training
    router = getattr(getattr(model, "routing", None), "router", None)
    saved = router.state_dict() if router is not None else None  # counting must not advance the router's RNG
    compiled = getattr(model, "_compiled_call_impl", None)      # count the eager forward: no extra compile
    model._compiled_call_impl = None
    model.train()
    try:
        return counted_forward_flops(model, torch.zeros(shape, device=param.device),
                                     torch.zeros(1, dtype=torch.long, device=param.device),
                                     {k: v.to(param.device) for k, v in (cond or {}).items()})
    finally:
        model.train(was_training)
        model._compiled_call_impl = compiled
        if router is not None:
            router.load_state_dict(saved)


def forward_flops_with_routes(model: Any, routes: Optional[Sequence[Mapping[str, Any]]],
                              cond: Optional[Mapping[str, Any]] = None) -> float:
    """Forward FLOPs per sample of a backbone run with `routes` (route specs; None: dense), e.g. one
    branch of guided sampling: DiT's analytic count, or counted on one sample for the families."""
    if hasattr(model, "forward_flops"):
        return float(model.forward_flops(resolve_routes(routes, model.depth) if routes else []))
    with model.routing.override(routes=list(routes or [])):   # [] runs dense even in training mode
        return model_forward_flops(model, cond)
