"""Sampling-time guidance and routing: classifier-free guidance, inference-time routing and TREAD guidance.

Samplers (diffusion/) call a plain denoiser; this module turns a network into one (`denoiser`). One wrapper
serves both samplers (EDM Heun and rectified-flow Euler). Per call, with noise level s (EDM: sigma,
rectified flow: t) and conditional inputs c:

* main branch: the model at `route_ratio` (None: dense, as trained models are sampled by default; r: the
  route spans of the checkpoint, or `route_spans`, at selection ratio r, the training router's semantics);
* TREAD guidance (`tread_scale` = w != 1): a second conditional prediction of the same model at the higher
  ratio `tread_weak_ratio`; cond = weak + w * (strong - weak). w = 0 gives the weak branch, w = 1 the strong
  one. Both branches are conditional (the paper repo runs both unconditionally, so its guidance ignores the
  class);
* classifier-free guidance (`cfg_scale` != 1) on top: uncond + cfg * (cond - uncond), uncond taken at the
  main branch's ratio in the same batched call as the strong conditional. The unconditional branch gets the
  null label (the model's own unconditional input, as in training label dropout: text models zero their text
  embeddings), or, where the per-sample conditioning carries an UNCOND entry (negative prompts), the real
  labels with that entry's conditioning instead;
* `interval` = (lo, hi): both guidances apply only where lo <= s <= hi (Kynkaenniemi et al. 2024); outside
  it a step costs one conditional evaluation of the main branch.

The wrapper counts the per-sample forward passes at each ratio into `stats`, from which
tread/sampling/cost.py gives the sampled FLOPs per image.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from tread.diffusion import Denoiser
from tread.routing import RouteConfigError, resolve_routes
from tread.utils.errors import UserError


class GuidanceError(UserError):
    """A sampling guidance / inference-routing setting that cannot work (reported before sampling)."""


@dataclass(frozen=True)
class Guidance:
    cfg_scale: float = 1.0                    # classifier-free guidance scale (1 = none)
    route_ratio: Optional[float] = None       # inference routing of the main branch (None: dense)
    tread_scale: float = 1.0                  # TREAD guidance weight w (1 = none)
    tread_weak_ratio: float = 0.5             # selection ratio of the weak branch (> the main branch's)
    interval: Optional[tuple[float, float]] = None           # noise levels where guidance applies
    route_spans: Optional[tuple[tuple[int, int], ...]] = None  # spans for inference routing (None: checkpoint's)
    path_drop: bool = False                   # SPRINT: CFG's unconditional branch skips the deep span
    cfg_rule: str = "any"                     # any: CFG for every scale != 1 | above_one: the paper code's rule
    tread_uncond: bool = False                # TREAD guidance's branches with the null label (the paper code's)

    @classmethod
    def from_settings(cls, cfg: Any) -> "Guidance":
        """From a config node's cfg_scale / route_ratio / tread_scale / tread_weak_ratio / guidance_interval /
        route_spans keys (sample.py, fid.py, in-training evaluation), already checked by the schema
        (tread.schema.sampling.SamplingSettings)."""
        def number(key: str, default: Any) -> Any:
            value = cfg.get(key, default)
            return None if value is None else float(value)

        interval = cfg.get("guidance_interval")
        spans = cfg.get("route_spans")
        return cls(cfg_scale=number("cfg_scale", 1.0), route_ratio=number("route_ratio", None),
                   tread_scale=number("tread_scale", 1.0), tread_weak_ratio=number("tread_weak_ratio", 0.5),
                   interval=None if interval is None else (float(interval[0]), float(interval[1])),
                   route_spans=None if spans is None else tuple((int(a), int(b)) for a, b in spans),
                   path_drop=bool(cfg.get("path_drop", False)), cfg_rule=str(cfg.get("cfg_rule", "any")),
                   tread_uncond=bool(cfg.get("tread_uncond", False)))

    @property
    def is_plain(self) -> bool:
        """No guidance and no routing: the model's own conditional prediction."""
        return not self.guides and not self.routes_at_inference

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
        if self.tread_uncond and self.cfg_scale != 1.0:
            raise GuidanceError(f"tread_uncond=true (the paper code's unconditional TREAD guidance) replaces "
                                f"classifier-free guidance; it needs cfg_scale=1 (got {self.cfg_scale}): set the "
                                f"guidance weight with tread_scale.")
        if self.path_drop and not hasattr(model, "span"):
            raise GuidanceError(f"path_drop=true needs a SPRINT model (model=sprint: a deep span to skip); this "
                                f"checkpoint's backbone is {type(model).__name__}. Allowed here: path_drop=false.")
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
                "route_spans": [list(s) for s in self.route_spans] if self.route_spans else None,
                "path_drop": self.path_drop, "cfg_rule": self.cfg_rule, "tread_uncond": self.tread_uncond}

    @property
    def guides(self) -> bool:
        """Whether classifier-free guidance applies at this scale: any scale != 1, or with cfg_rule=above_one (the
        paper code's rectified-flow sampler) only scales above 1 and 0 (the unconditional prediction; 0 < s < 1
        then samples the plain conditional prediction)."""
        if self.cfg_rule == "above_one":
            return self.cfg_scale > 1.0 or self.cfg_scale == 0.0
        return self.cfg_scale != 1.0


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



UNCOND = "uncond"   # key, inside the per-sample conditioning, of the unconditional branch's own conditioning
PATH_DROP = "path_drop"   # the stats key of path-dropped passes (SPRINT path-drop guidance; tread/sampling/cost.py)


def _joined(first: dict, second: dict) -> dict:
    """Per-sample conditioning of the batched [conditional, unconditional] call: `first`'s rows, then
    `second`'s (nested dicts, such as the samplers' cond={...}, joined key by key; where `second` lacks a
    key, `first`'s rows are repeated: the unconditional branch replaces only what it has)."""
    return {k: (torch.cat([v, second.get(k, v)]) if isinstance(v, torch.Tensor) else
                _joined(v, second.get(k, v)) if isinstance(v, dict) else v)
            for k, v in first.items()}


def split_uncond(cond: dict) -> tuple[dict, Optional[dict]]:
    """(conditional, unconditional) keyword arguments of the denoiser: the samplers pass the per-sample
    conditioning as cond={...}; an UNCOND entry in it is the unconditional branch's conditioning (negative
    prompts), removed from the conditional one. (cond, None) where there is none (the null label then)."""
    inner = cond.get("cond")
    if not isinstance(inner, dict) or UNCOND not in inner:
        return cond, None
    inner = dict(inner)
    uncond = inner.pop(UNCOND)
    return {**cond, "cond": inner}, {**cond, "cond": uncond}


def guided_denoiser(net: Any, guidance: Guidance, null_label: int,
                    stats: Optional[dict] = None) -> Denoiser:
    """Wrap net(x, noise, labels, **cond) with `guidance` (see the module docstring). `stats`, when given,
    accumulates per-sample forward passes per branch ratio ({ratio or None: count})."""
    model = backbone(net)
    strong = guidance.routes(model, guidance.route_ratio)
    weak = guidance.routes(model, guidance.tread_weak_ratio) if guidance.tread_scale != 1.0 else None
    w, cfg_scale, interval = guidance.tread_scale, guidance.cfg_scale, guidance.interval

    def count(ratio: Optional[float], n: int) -> None:
        if stats is not None:
            stats[ratio] = stats.get(ratio, 0) + n

    def denoise(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        inside = interval is None or interval[0] <= float(noise.reshape(-1)[0]) <= interval[1]
        use_cfg, use_tread = inside and guidance.guides, inside and w != 1.0
        if use_tread and guidance.tread_uncond:   # the paper code's TREAD guidance: both branches unconditional
            labels = torch.full_like(labels, null_label)
        cond, uncond_cond = split_uncond(cond)
        with routed(model, strong):
            if use_cfg:   # one batched call: [conditional, unconditional]
                if uncond_cond is None:   # the null label: the model's own unconditional input
                    uncond_labels, uncond_cond = torch.full_like(labels, null_label), cond
                else:                     # the unconditional branch's own conditioning (negative prompts)
                    uncond_labels = labels
                drop = {"path_drop": torch.arange(2 * x.shape[0], device=x.device) >= x.shape[0]} \
                    if guidance.path_drop else {}   # SPRINT path-drop guidance: the unconditional rows skip the span
                out = net(torch.cat([x, x]), torch.cat([noise, noise]), torch.cat([labels, uncond_labels]),
                          **drop, **_joined(cond, uncond_cond))
                cond_out, uncond = out.chunk(2)
            else:
                cond_out = net(x, noise, labels, **cond)
        count(guidance.route_ratio, x.shape[0] * (1 if guidance.path_drop or not use_cfg else 2))
        if use_cfg and guidance.path_drop:
            count(PATH_DROP, x.shape[0])
        if use_tread:
            with routed(model, weak):
                weak_out = net(x, noise, labels, **cond)
            count(guidance.tread_weak_ratio, x.shape[0])
            cond_out = weak_out + w * (cond_out - weak_out)
        if use_cfg:
            return uncond + cfg_scale * (cond_out - uncond)
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


def denoiser(net: Any, guidance: Guidance, null_label: int, stats: Optional[dict] = None) -> Denoiser:
    """What the samplers call for `net` under `guidance`: the network itself when there is nothing to
    guide, route or count, else guided_denoiser."""
    if stats is None and guidance.is_plain:
        return net
    return guided_denoiser(net, guidance, null_label, stats)


def classifier_free_guidance(net: Any, cfg_scale: float, null_label: int) -> Denoiser:
    """net(x, noise, labels, **cond) -> uncond + cfg_scale * (cond - uncond), both branches in one batched
    call; cfg_scale == 1 is the plain conditional model. Per-sample conditioning tensors in `cond` (text
    embeddings, ...) are repeated for the unconditional half, whose null label tells the model to drop them,
    unless `cond` carries the unconditional half's own conditioning (UNCOND, see split_uncond)."""
    return denoiser(net, Guidance(cfg_scale=cfg_scale), null_label)
