"""Sampling-time guidance and routing as small wrappers over a denoiser `(x, noise, labels, **cond) -> prediction`.

`Guidance` (the sample.py / fid.py / eval.* settings) stacks them in `Guidance.denoiser`: routed, counted, cfg,
path_drop, tread_guidance, null_labels, interval, conditional. CFG passes COND_ROWS to the wrappers below it;
docs/routes.md describes the settings.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from tread.diffusion import Denoiser
from tread.routing import RouteConfigError, resolve_routes
from tread.utils.errors import UserError

UNCOND = "uncond"         # key, inside the per-sample conditioning, of the unconditional branch's own conditioning
PATH_DROP = "path_drop"   # the network's row mask of path-dropped rows, and their stats key (tread/sampling/cost.py)
COND_ROWS = "cond_rows"   # keyword from CFG to the wrappers below it: how many leading rows are conditional


class GuidanceError(UserError):
    """A sampling guidance / inference-routing setting that cannot work (reported before sampling)."""


@dataclass(frozen=True)
class Guidance:
    cfg_scale: float = 1.0                    # classifier-free guidance scale (1 = none)
    selection_ratio: Optional[float] = None   # the main branch's selection ratio at inference (None: dense)
    tread_scale: float = 1.0                  # TREAD guidance weight w (1 = none)
    tread_weak_selection_ratio: float = 0.5   # selection ratio of the weak branch (> the main branch's)
    interval: Optional[tuple[float, float]] = None           # noise levels where guidance applies
    route_spans: Optional[tuple[tuple[int, int], ...]] = None  # spans for inference routing (None: checkpoint's)
    path_drop: bool = False                   # SPRINT: CFG's unconditional branch skips the deep span
    cfg_rule: str = "any"                     # any: CFG for every scale != 1 | above_one: the paper code's rule
    tread_uncond: bool = False                # TREAD guidance's branches with the null label (the paper code's)

    @classmethod
    def from_settings(cls, s: Any) -> "Guidance":
        """From checked sampling settings (configs/sampling/default.yaml's keys: sample.py, fid.py, in-training
        evaluation; tread.schema.sampling.SamplingSettings)."""
        interval, spans, ratio = s.guidance_interval, s.route_spans, s.selection_ratio
        return cls(cfg_scale=float(s.cfg_scale), selection_ratio=None if ratio is None else float(ratio),
                   tread_scale=float(s.tread_scale), tread_weak_selection_ratio=float(s.tread_weak_selection_ratio),
                   interval=None if interval is None else (float(interval[0]), float(interval[1])),
                   route_spans=None if spans is None else tuple((int(a), int(b)) for a, b in spans),
                   path_drop=bool(s.path_drop), cfg_rule=str(s.cfg_rule), tread_uncond=bool(s.tread_uncond))

    @property
    def is_plain(self) -> bool:
        """No guidance and no routing: the model's own conditional prediction."""
        return not self.guides and not self.routes_at_inference

    @property
    def routes_at_inference(self) -> bool:
        return self.selection_ratio is not None or self.tread_scale != 1.0

    @property
    def guides(self) -> bool:
        """Whether CFG applies at this scale: any scale != 1, or with cfg_rule=above_one only scales above 1 and 0 (then
        0 < s < 1 samples the plain conditional prediction)."""
        if self.cfg_rule == "above_one":
            return self.cfg_scale > 1.0 or self.cfg_scale == 0.0
        return self.cfg_scale != 1.0

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
                    "this checkpoint was trained without routes, so inference routing (selection_ratio / tread_scale) "
                    "has no spans to use: give route_spans=[[start, end]], e.g. route_spans=[[2,-4]].")
        return [{"selection_ratio": ratio, "start_layer_idx": a, "end_layer_idx": b} for a, b in spans]

    def check(self, model: Any) -> None:
        """Resolve every branch's routes against the model now, so bad spans fail before sampling."""
        if self.tread_uncond and self.cfg_scale != 1.0:
            raise GuidanceError(f"tread_uncond=true (the paper code's unconditional TREAD guidance) replaces "
                                f"classifier-free guidance; it needs cfg_scale=1 (got {self.cfg_scale}): set the "
                                f"guidance weight with tread_scale.")
        if self.path_drop and model.span is None:
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
        out = [self.selection_ratio]
        if self.tread_scale != 1.0:
            out.append(self.tread_weak_selection_ratio)
        return out

    def describe(self) -> dict[str, Any]:
        return {"cfg_scale": self.cfg_scale, "selection_ratio": self.selection_ratio, "tread_scale": self.tread_scale,
                "tread_weak_selection_ratio": self.tread_weak_selection_ratio if self.tread_scale != 1.0 else None,
                "guidance_interval": list(self.interval) if self.interval else None,
                "route_spans": [list(s) for s in self.route_spans] if self.route_spans else None,
                "path_drop": self.path_drop, "cfg_rule": self.cfg_rule, "tread_uncond": self.tread_uncond}

    def denoiser(self, net: Any, null_label: int, stats: Optional[dict] = None) -> Denoiser:
        """What the samplers call for `net`: the network itself when nothing is guided, routed or counted, else the
        stack of wrappers; `stats` accumulates per-sample forward passes per branch."""
        if stats is None and self.is_plain:
            return net
        model = backbone(net)

        def branch(ratio: Optional[float]) -> Denoiser:
            inner = routed(net, model, self.routes(model, ratio))
            return inner if stats is None else counted(inner, stats, ratio)

        main = branch(self.selection_ratio)
        guided = path_drop(main) if self.path_drop else main
        if self.tread_scale != 1.0:
            guided = tread_guidance(guided, branch(self.tread_weak_selection_ratio), self.tread_scale)
            guided = null_labels(guided, null_label) if self.tread_uncond else guided
        guided = cfg(guided, self.cfg_scale, null_label) if self.guides else conditional(guided)
        return guided if self.interval is None else interval(guided, conditional(main), *self.interval)


# ----------------------------------------------------------------------------- the wrappers

def routed(net: Any, model: Any, specs: Optional[list[dict]]) -> Denoiser:
    """`net` with its backbone `model` at inference routes `specs` (None: the model's own behaviour, dense at
    inference). The network underneath every stack: the wrappers' COND_ROWS keyword stops here."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        cond.pop(COND_ROWS, None)
        with model.routing.override(routes=specs) if specs is not None else contextlib.nullcontext():
            return net(x, noise, labels, **cond)
    return call


def counted(inner: Denoiser, stats: dict, key: Any) -> Denoiser:
    """Adds each call's per-sample forward passes to stats[key]; the rows `path_drop` marked (those from COND_ROWS
    on) to stats[PATH_DROP]."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        out = inner(x, noise, labels, **cond)
        # path_drop marks the rows from COND_ROWS on: counted from that, with no device sync to sum its mask
        dropped = x.shape[0] - cond[COND_ROWS] if PATH_DROP in cond else 0
        stats[key] = stats.get(key, 0) + x.shape[0] - dropped
        if dropped:
            stats[PATH_DROP] = stats.get(PATH_DROP, 0) + dropped
        return out
    return call


def conditional(inner: Denoiser) -> Denoiser:
    """The conditional prediction alone: the unconditional branch's conditioning (UNCOND) is not passed on."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        return inner(x, noise, labels, **split_uncond(cond)[0])
    return call


def cfg(inner: Denoiser, scale: float, null_label: int) -> Denoiser:
    """Classifier-free guidance: uncond + scale * (cond - uncond), from one call on [conditional; unconditional] rows.
    The unconditional rows get the null label, or with an UNCOND entry (negative prompts) that conditioning."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        cond, uncond = split_uncond(cond)
        uncond_labels = torch.full_like(labels, null_label) if uncond is None else labels
        out = inner(torch.cat([x, x]), torch.cat([noise, noise]), torch.cat([labels, uncond_labels]),
                    **{COND_ROWS: x.shape[0]}, **_joined(cond, cond if uncond is None else uncond))
        cond_out, uncond_out = out.chunk(2)
        return uncond_out + scale * (cond_out - uncond_out)
    return call


def path_drop(inner: Denoiser) -> Denoiser:
    """SPRINT's path-drop guidance: the unconditional rows of CFG's batch (from COND_ROWS on) skip the model's deep
    span (its `path_drop` row mask); without CFG every row is conditional and nothing is dropped."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        if cond.get(COND_ROWS) is None:
            return inner(x, noise, labels, **cond)
        mask = torch.arange(x.shape[0], device=x.device) >= cond[COND_ROWS]
        return inner(x, noise, labels, **{PATH_DROP: mask}, **cond)
    return call


def tread_guidance(strong: Denoiser, weak: Denoiser, w: float) -> Denoiser:
    """TREAD guidance: weak + w * (strong - weak) on the conditional rows (all rows without CFG), the weak branch run
    on those rows only, after the strong one; w = 0 gives the weak branch, w = 1 the strong one."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        out = strong(x, noise, labels, **cond)
        rows = cond.pop(COND_ROWS, None)
        if rows is not None:   # CFG's batch: its conditional rows
            x, noise, labels, cond = x[:rows], noise[:rows], labels[:rows], _rows(cond, rows)
        weak_out = weak(x, noise, labels, **cond)
        guided = weak_out + w * (out[:len(x)] - weak_out)
        return guided if rows is None else torch.cat([guided, out[rows:]])
    return call


def null_labels(inner: Denoiser, null_label: int) -> Denoiser:
    """Every row with the null label (the paper code's TREAD guidance: both branches unconditional)."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        return inner(x, noise, torch.full_like(labels, null_label), **cond)
    return call


def interval(guided: Denoiser, plain: Denoiser, lo: float, hi: float) -> Denoiser:
    """`guided` where lo <= noise level <= hi (the batch shares one level), else `plain`."""
    def call(x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, **cond: Any) -> torch.Tensor:
        inside = lo <= float(noise.reshape(-1)[0]) <= hi
        return (guided if inside else plain)(x, noise, labels, **cond)
    return call


# ----------------------------------------------------------------------------- rows and conditioning

def backbone(net: Any) -> Any:
    """The routed backbone inside a preconditioner (EDMPrecond / RFModel) or the backbone itself."""
    return getattr(net, "model", net)


def _joined(first: dict, second: dict) -> dict:
    """Per-sample conditioning of the batched [conditional, unconditional] call: `first`'s rows, then `second`'s,
    key by key; where `second` lacks a key, `first`'s rows are repeated."""
    return {k: (torch.cat([v, second.get(k, v)]) if isinstance(v, torch.Tensor) else
                _joined(v, second.get(k, v)) if isinstance(v, dict) else v)
            for k, v in first.items()}


def _rows(cond: dict, n: int) -> dict:
    """The first n rows of per-sample conditioning (nested dicts key by key): the conditional half of _joined's."""
    return {k: v[:n] if isinstance(v, torch.Tensor) else _rows(v, n) if isinstance(v, dict) else v
            for k, v in cond.items()}


def split_uncond(cond: dict) -> tuple[dict, Optional[dict]]:
    """(conditional, unconditional) keyword arguments of the denoiser: an UNCOND entry in cond={...} is the
    unconditional branch's conditioning (negative prompts); (cond, None) without one."""
    inner = cond.get("cond")
    if not isinstance(inner, dict) or UNCOND not in inner:
        return cond, None
    inner = dict(inner)
    uncond = inner.pop(UNCOND)
    return {**cond, "cond": inner}, {**cond, "cond": uncond}


# ----------------------------------------------------------------------------- entry points

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


def classifier_free_guidance(net: Any, cfg_scale: float, null_label: int) -> Denoiser:
    """net(x, noise, labels, **cond) -> uncond + cfg_scale * (cond - uncond), both branches in one batched call;
    cfg_scale == 1 is the plain conditional model. Unconditional rows: see cfg."""
    return Guidance(cfg_scale=cfg_scale).denoiser(net, null_label)
