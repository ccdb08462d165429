"""Sampling-time guidance and routing: classifier-free guidance, inference-time routing and TREAD guidance.

One denoiser wrapper serves both samplers (EDM Heun and rectified-flow Euler). Per call, with noise level s
(EDM: sigma, rectified flow: t) and conditional inputs c:

* main branch: the model at `route_ratio` (None: dense, as trained models are sampled by default; r: the
  route spans of the checkpoint, or `route_spans`, at selection ratio r, the training router's semantics);
* TREAD guidance (`tread_scale` = w != 1): a second conditional prediction of the same model at the higher
  ratio `tread_weak_ratio`; cond = weak + w * (strong - weak). w = 0 gives the weak branch, w = 1 the strong
  one. Both branches are conditional (the paper repo runs both unconditionally, so its guidance ignores the
  class);
* classifier-free guidance (`cfg_scale` != 1) on top: uncond + cfg * (cond - uncond), uncond taken at the
  main branch's ratio in the same batched call as the strong conditional;
* `interval` = (lo, hi): both guidances apply only where lo <= s <= hi (Kynkaenniemi et al. 2024); outside
  it a step costs one conditional evaluation of the main branch.

The wrapper counts the per-sample forward passes at each ratio into `stats`, from which
`sampling_flops_per_image` gives the sampled FLOPs per image.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch


class GuidanceError(ValueError):
    """A sampling guidance / inference-routing setting that cannot work (reported before sampling)."""


@dataclass(frozen=True)
class Guidance:
    cfg_scale: float = 1.0                    # classifier-free guidance scale (1 = none)
    route_ratio: Optional[float] = None       # inference routing of the main branch (None: dense)
    tread_scale: float = 1.0                  # TREAD guidance weight w (1 = none)
    tread_weak_ratio: float = 0.5             # selection ratio of the weak branch (> the main branch's)
    interval: Optional[tuple[float, float]] = None           # noise levels where guidance applies
    route_spans: Optional[tuple[tuple[int, int], ...]] = None  # spans for inference routing (None: checkpoint's)

    @classmethod
    def from_config(cls, cfg: Any, prefix: str = "") -> "Guidance":
        """From a config node's cfg_scale / route_ratio / tread_scale / tread_weak_ratio / guidance_interval /
        route_spans keys (sample.py, fid.py), checked; errors name `prefix + key`."""
        def number(key: str, default: Any) -> Any:
            value = cfg.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GuidanceError(f"{prefix}{key}={value!r} must be a number.")
            return float(value)

        cfg_scale, tread_scale = number("cfg_scale", 1.0), number("tread_scale", 1.0)
        if cfg_scale is None or cfg_scale < 0:
            raise GuidanceError(f"{prefix}cfg_scale={cfg_scale} must be >= 0 (1 = no guidance).")
        if tread_scale is None:
            raise GuidanceError(f"{prefix}tread_scale=None must be a number (1 = no TREAD guidance).")
        route_ratio, weak = number("route_ratio", None), number("tread_weak_ratio", 0.5)
        if route_ratio is not None and not 0.0 <= route_ratio < 1.0:
            raise GuidanceError(f"{prefix}route_ratio={route_ratio} must be null (dense sampling) or lie in [0, 1).")
        if tread_scale != 1.0:
            if weak is None or not 0.0 < weak < 1.0:
                raise GuidanceError(f"{prefix}tread_weak_ratio={weak} must lie in (0, 1) with tread_scale != 1.")
            if weak <= (route_ratio or 0.0):
                raise GuidanceError(f"{prefix}tread_weak_ratio={weak} must be above the main branch's ratio "
                                    f"({prefix}route_ratio={route_ratio}): the weak branch drops more tokens.")
        interval = cfg.get("guidance_interval")
        if interval is not None:
            try:
                lo, hi = (float(v) for v in interval)
            except (TypeError, ValueError):
                raise GuidanceError(f"{prefix}guidance_interval={interval!r} must be null or [lo, hi], two noise "
                                    f"levels (EDM sigma, rectified-flow t).") from None
            if not 0.0 <= lo < hi:
                raise GuidanceError(f"{prefix}guidance_interval={[lo, hi]} needs 0 <= lo < hi.")
            interval = (lo, hi)
        spans = cfg.get("route_spans")
        if spans is not None:
            try:
                spans = tuple((int(a), int(b)) for a, b in spans)
            except (TypeError, ValueError):
                raise GuidanceError(f"{prefix}route_spans={spans!r} must be null or a list of [start, end] block "
                                    f"indices (inclusive; negative counts from the end).") from None
            if not spans:
                raise GuidanceError(f"{prefix}route_spans=[] names no span; use null for the checkpoint's spans.")
        return cls(cfg_scale, route_ratio, tread_scale, weak if weak is not None else 0.5, interval, spans)

    @property
    def is_plain(self) -> bool:
        """No guidance and no routing: the model's own conditional prediction."""
        return self.cfg_scale == 1.0 and not self.routes_at_inference

    @property
    def routes_at_inference(self) -> bool:
        return self.route_ratio is not None or self.tread_scale != 1.0

    def routes(self, model: Any, ratio: Optional[float]) -> Optional[list[dict]]:
        """Route specs for a branch at `ratio` on `model` (a backbone with `.routing`); None: dense."""
        if ratio is None:
            return None
        if self.route_spans is not None:
            spans = self.route_spans
        else:
            spans = tuple((r.start_layer_idx, r.end_layer_idx) for r in model.routing.routes)
            if not spans:
                raise GuidanceError(
                    "this checkpoint was trained without routes, so inference routing (route_ratio / tread_scale) "
                    "has no spans to use: give route_spans=[[start, end]], e.g. route_spans=[[2,-4]].")
        return [{"selection_ratio": ratio, "start_layer_idx": a, "end_layer_idx": b} for a, b in spans]

    def check(self, model: Any) -> None:
        """Resolve every branch's routes against the model now, so bad spans fail before sampling."""
        from routing import RouteConfigError, resolve_routes
        prefix = "route_spans" if self.route_spans is not None else "the checkpoint's routes"
        for ratio in self.ratios():
            specs = self.routes(model, ratio)
            if specs is not None:
                try:
                    resolve_routes(specs, model.routing.depth)
                except RouteConfigError as err:
                    raise GuidanceError(f"{prefix} at ratio {ratio}: {err}") from None

    def ratios(self) -> list[Optional[float]]:
        """The branch ratios this guidance evaluates (None: dense)."""
        out = [self.route_ratio]
        if self.tread_scale != 1.0:
            out.append(self.tread_weak_ratio)
        return out

    def describe(self) -> dict[str, Any]:
        return {"cfg_scale": self.cfg_scale, "route_ratio": self.route_ratio, "tread_scale": self.tread_scale,
                "tread_weak_ratio": self.tread_weak_ratio if self.tread_scale != 1.0 else None,
                "guidance_interval": list(self.interval) if self.interval else None,
                "route_spans": [list(s) for s in self.route_spans] if self.route_spans else None}


def backbone(net: Any) -> Any:
    """The routed backbone inside a preconditioner (EDMPrecond / RFModel) or the backbone itself."""
    return getattr(net, "model", net)


@contextlib.contextmanager
def routed(model: Any, specs: Optional[list[dict]]) -> Iterator[None]:
    """Run `model` with inference routes `specs` (None: the model's own behaviour, dense at inference)."""
    if specs is None:
        yield
        return
    with model.routing.override(routes=specs):
        yield


Denoiser = Callable[..., torch.Tensor]


def _both(cond: dict) -> dict:
    """Per-sample conditioning repeated for the batched [conditional, unconditional] call."""
    return {k: (torch.cat([v, v]) if isinstance(v, torch.Tensor) else
                {kk: torch.cat([vv, vv]) for kk, vv in v.items()} if isinstance(v, dict) else v)
            for k, v in cond.items()}


def guided_denoiser(net: Any, guidance: Guidance, null_label: int,
                    stats: Optional[dict] = None) -> Denoiser:
    """Wrap net(x, noise, labels, **cond) with `guidance` (see the module docstring). `stats`, when given,
    accumulates per-sample forward passes per branch ratio ({ratio or None: count})."""
    model = backbone(net)
    strong = guidance.routes(model, guidance.route_ratio)
    weak = guidance.routes(model, guidance.tread_weak_ratio) if guidance.tread_scale != 1.0 else None
    w, cfg, interval = guidance.tread_scale, guidance.cfg_scale, guidance.interval

    def count(ratio: Optional[float], n: int) -> None:
        if stats is not None:
            stats[ratio] = stats.get(ratio, 0) + n

    def denoise(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        inside = interval is None or interval[0] <= float(noise.reshape(-1)[0]) <= interval[1]
        use_cfg, use_tread = inside and cfg != 1.0, inside and w != 1.0
        with routed(model, strong):
            if use_cfg:   # one batched call: [conditional, unconditional]
                null = torch.full_like(labels, null_label)
                out = net(torch.cat([x, x]), torch.cat([noise, noise]), torch.cat([labels, null]), **_both(cond))
                cond_out, uncond = out.chunk(2)
            else:
                cond_out = net(x, noise, labels, **cond)
        count(guidance.route_ratio, x.shape[0] * (2 if use_cfg else 1))
        if use_tread:
            with routed(model, weak):
                weak_out = net(x, noise, labels, **cond)
            count(guidance.tread_weak_ratio, x.shape[0])
            cond_out = weak_out + w * (cond_out - weak_out)
        if use_cfg:
            return uncond + cfg * (cond_out - uncond)
        return cond_out

    return denoise


@contextlib.contextmanager
def per_sample_routing(net: Any, seeds: Sequence[int], device: Any, guidance: Optional[Guidance]) -> Iterator[None]:
    """While sampling with inference routing, draw each sample's token choice from its own generator
    (seeded from the sample's seed), so routed samples do not depend on the batch size or process count."""
    if guidance is None or not guidance.routes_at_inference:
        yield
        return
    gens = [torch.Generator(device).manual_seed((int(s) + (1 << 31)) % (1 << 32)) for s in seeds]
    with backbone(net).routing.router.per_sample(gens):
        yield


def sampling_flops_per_image(model: Any, guidance: Guidance, stats: dict, num_images: int,
                             cond: Optional[dict] = None) -> float:
    """Forward FLOPs spent per generated image: sum over branch ratios of (forward passes x FLOPs of one
    forward at that ratio) / images. Same convention as training/flops.py (matmuls, multiply-add = 2)."""
    from training.flops import forward_flops_with_routes
    if not num_images:
        return 0.0
    total = sum(n * forward_flops_with_routes(model, guidance.routes(model, ratio), cond)
                for ratio, n in stats.items())
    return total / num_images
