"""Correctness checks shared by every diffusers family (tiny configs, fp32).

Each family's test file calls these with its family name; the per-family "kept subsequence" reference
(check 3) is written in that file, by slicing inputs and position ids and calling diffusers' blocks
directly, independently of our forward loop: only its setup (routed_run) is shared.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch

import tread.routing.controller as controller
from tread.models.families import FamilyConfigError, build_family
from tread.models.flops import RouteFlops, forward_flops_with_routes
from tread.routing import RouteConfigError

ROUTES = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]
PAPER_ROUTE = [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]
RATIO_ZERO = [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}]


def routing_cfg(routes=None, seed: int = 0) -> dict:
    return {"enabled": bool(routes), "routes": routes or [], "seed": seed,
            "selection": {"mode": "random", "importance_weight": 0.5}}


def make(family: str, routes=None, *, input_size: int = 8, in_channels: int = 4, num_classes: int = 5,
         seed: int = 0, **kw: Any):
    torch.manual_seed(seed)
    model = build_family(family, input_size=input_size, in_channels=in_channels, num_classes=num_classes,
                         routing=routing_cfg(routes), **kw)
    return model


def inputs(model, batch: int = 3, seed: int = 1, frames: Optional[int] = None, size: Optional[tuple] = None):
    """(x, noise_level, labels): latents of the model's default size, or of size = (H, W) (a bucket's)."""
    g = torch.Generator().manual_seed(seed)
    shape = [batch, model.in_channels, *(size or (model.input_size, model.input_size))]
    if frames is not None:
        shape.insert(2, frames)
    x = torch.randn(shape, generator=g)
    noise_level = torch.rand(batch, generator=g) * 1000
    labels = torch.randint(0, model.num_classes + 1, (batch,), generator=g)
    return x, noise_level, labels


def per_token_timesteps(model, batch: int = 3, seed: int = 4) -> torch.Tensor:
    """(B, N) timesteps, different per token; for video the first frame's tokens at 0 (the I2V pipeline's)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(batch, model.num_tokens, generator=g) * 1000
    if model.token_grid[0] > 1:
        t[:, : model.num_tokens // model.token_grid[0]] = 0.0
    return t


@contextlib.contextmanager
def capture_routes():
    """Record every gather (x_full, ids) and scatter (x_start, x_kept, ids, out) that run_blocks does."""
    log: dict[str, list] = {"select": [], "scatter": []}
    real_scatter = controller.scatter_tokens

    def scatter(x_full, x_kept, ids):
        out = real_scatter(x_full, x_kept, ids)
        log["scatter"].append((x_full.detach().clone(), x_kept.detach().clone(), ids.clone(), out.detach().clone()))
        return out

    controller.scatter_tokens = scatter
    try:
        yield log
    finally:
        controller.scatter_tokens = real_scatter


@contextlib.contextmanager
def fixed_selection(model, pick: Callable[[torch.Tensor, int], torch.Tensor]):
    """Replace the router's choice by pick(x, num_keep) -> ids (B, K), recording every call."""
    router = model.routing.router
    real = router.select
    calls = []

    def select(x, num_keep, force_keep=None, noise=None, shards=1):
        assert shards == 1, "fixed_selection replaces the choice of an unsplit sequence"
        ids = pick(x, num_keep) if force_keep is None else real(x, num_keep, force_keep, noise=noise)
        calls.append(ids.clone())
        return ids

    router.select = select
    try:
        yield calls
    finally:
        router.select = real


def random_permutation(seed: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A pick(x, num_keep) for fixed_selection: the first num_keep of a random permutation, per sample."""
    g = torch.Generator().manual_seed(seed)
    return lambda h, k: torch.stack([torch.randperm(h.shape[1], generator=g)[:k] for _ in range(h.shape[0])])


def block_inputs(model, x, noise_level, labels, cond=None):
    """Dense forward of our loop, returning the (x, context) that enters every routable block."""
    seen = []
    real = model.block_fns

    def wrapped(emb):
        fns = real(emb)

        def spy(fn):
            def call(h, ctx, tok):
                seen.append((h.detach().clone(), None if ctx is None else _clone(ctx)))
                return fn(h, ctx, tok)
            return call
        return [spy(f) for f in fns]

    model.block_fns = wrapped
    try:  # routes are active only in grad-enabled training
        with torch.enable_grad() if model.training else torch.no_grad():
            out = model(x, noise_level, labels, cond=cond)
    finally:
        del model.block_fns
    return seen, out


def _clone(ctx):
    if isinstance(ctx, torch.Tensor):
        return ctx.detach().clone()
    if isinstance(ctx, (tuple, list)):
        return type(ctx)(_clone(c) for c in ctx)
    if isinstance(ctx, dict):
        return {k: _clone(v) for k, v in ctx.items()}
    return ctx


@dataclass
class RoutedRun:
    """What routed_run gives a family's own check-3 reference: the model, its inputs, the (x, context) entering
    every block in the dense forward and in the routed one, and the route's one scatter."""

    model: Any
    x: torch.Tensor
    t: torch.Tensor
    y: torch.Tensor
    cond: Optional[dict]
    dense: list
    routed: list
    log: dict

    @property
    def route(self):
        return self.model.routing.routes[0]

    @property
    def scatter(self):
        """(x_start, x_kept, ids, out) of the route (a single route is expected)."""
        (scatter,) = self.log["scatter"]
        return scatter


def routed_run(family: str, routes, *, seed: int = 5, cond: Optional[Callable[[Any], dict]] = None,
               timesteps: Optional[Callable[[Any], torch.Tensor]] = None, size: Optional[tuple] = None,
               **kw: Any) -> RoutedRun:
    """Build `family` with `routes`, run it dense (eval) and routed (training, the kept tokens a fixed random
    permutation's first K per sample), recording every block's inputs. cond(model) / timesteps(model), when
    given, make the text conditioning / the timesteps (default: the class table / inputs()' noise levels); size:
    the latents' (H, W) (default: the model's square input_size)."""
    model = make(family, routes, **kw).train()
    x, t, y = inputs(model, frames=kw.get("frames"), size=size)
    t = timesteps(model) if timesteps is not None else t
    c = cond(model) if cond is not None else None
    dense, _ = block_inputs(model.eval(), x, t, y, cond=c)
    with capture_routes() as log, torch.no_grad(), fixed_selection(model, random_permutation(seed)):
        with torch.enable_grad():
            routed, _ = block_inputs(model.train(), x, t, y, cond=c)
    return RoutedRun(model, x, t, y, c, dense, routed, log)


# ----------------------------------------------------------------------------- the checks

def check_dense_equals_diffusers(family: str, size: Optional[tuple] = None, batch: int = 3, **kw: Any) -> None:
    """1. With no routes, our forward equals diffusers' own model(...) (pristine processors), on latents of the
    model's default size or of size = (H, W)."""
    model = make(family, **kw).eval()
    x, t, y = inputs(model, batch=batch, frames=kw.get("frames"), size=size)
    with torch.no_grad():
        ours, ref = model(x, t, y), model.reference_forward(x, t, y)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def check_ratio_zero_permuted_equals_dense(family: str, size: Optional[tuple] = None, batch: int = 3,
                                           **kw: Any) -> None:
    """2. selection_ratio 0 with a random permutation of the tokens equals dense (1e-5), on latents of the model's
    default size or of size = (H, W)."""
    model = make(family, RATIO_ZERO, **kw)
    check_ratio_zero_model(model, inputs(model, batch=batch, frames=kw.get("frames"), size=size))


def check_ratio_zero_model(model, xty, cond: Optional[dict] = None) -> None:
    """A model built with RATIO_ZERO: its routed training forward, the kept tokens a random permutation, equals its
    dense forward on (x, t, y) and `cond` (1e-5)."""
    x, t, y = xty
    extra = {"cond": cond} if cond else {}
    model.train()
    with torch.no_grad(), fixed_selection(model, random_permutation(7)) as calls:
        with torch.enable_grad():  # routes are active in grad-enabled training
            routed = model(x, t, y, **extra)
        dense = model.eval()(x, t, y, **extra)
    assert calls and not torch.equal(calls[0], torch.arange(calls[0].shape[1]).expand_as(calls[0]))
    torch.testing.assert_close(routed, dense, rtol=1e-5, atol=1e-5)


def masked_text(model, batch: int = 3, length: int = 6, seed: int = 2) -> dict:
    """Text embeddings as the data gives them, with a keep-mask of a different prompt length per sample."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, 3, 1, 4][:batch])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return {"text": torch.randn(batch, length, model.text_dim, generator=g), "text_mask": mask}


def check_set_aside_and_text(family: str, routes=ROUTES, **kw: Any) -> None:
    """4. Set-aside tokens come back bit-identical to their route-start values; text is never routed."""
    model = make(family, routes, **kw).train()
    x, t, y = inputs(model, frames=kw.get("frames"))
    seen_dense, _ = block_inputs(model.eval(), x, t, y)
    model.train()
    with capture_routes() as log, torch.no_grad(), fixed_selection(
            model, lambda h, k: torch.rand(h.shape[:2]).topk(k, dim=1).indices):
        with torch.enable_grad():
            seen_routed, _ = block_inputs(model.train(), x, t, y)
    route = model.routing.routes[0]
    (x_full, x_kept, ids, out), = log["scatter"]
    dropped = torch.ones(out.shape[:2], dtype=torch.bool)
    dropped[torch.arange(out.shape[0])[:, None], ids] = False
    # Route-start values are the dense values entering the start block (blocks before it are unrouted).
    assert torch.equal(x_full, seen_dense[route.start_layer_idx][0])
    assert torch.equal(out[dropped], x_full[dropped])
    assert _kept_match(out, x_kept, ids)
    # Text/context: full length in every block; identical to dense in every block up to the route's start.
    for i, ((h_d, c_d), (h_r, c_r)) in enumerate(zip(seen_dense, seen_routed)):
        for a, b in zip(_tensors(c_d), _tensors(c_r)):
            assert a.shape == b.shape, f"block {i}: context shape {tuple(b.shape)} != dense {tuple(a.shape)}"
            if i <= route.start_layer_idx:
                assert torch.equal(a, b)
        expected = route.num_keep(h_d.shape[1]) if route.start_layer_idx <= i <= route.end_layer_idx else h_d.shape[1]
        assert h_r.shape[1] == expected


def _kept_match(out, x_kept, ids) -> bool:
    return all(torch.equal(out[b, ids[b]], x_kept[b]) for b in range(out.shape[0]))


def _tensors(ctx):
    if ctx is None:
        return []
    if isinstance(ctx, torch.Tensor):
        return [ctx]
    if isinstance(ctx, dict):
        return [v for v in ctx.values() if isinstance(v, torch.Tensor)]
    return [c for c in ctx if isinstance(c, torch.Tensor)]


def check_gradients_reach_all(family: str, routes=ROUTES, **kw: Any) -> None:
    """5. Every parameter that the dense model trains gets a (non-zero) gradient under routing."""
    def grads(model):
        x, t, y = inputs(model, frames=kw.get("frames"))
        model.train().zero_grad()
        model(x, t, y).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    dense = grads(make(family, **kw))
    routed = grads(make(family, routes, **kw))
    trained = [n for n, g in dense.items() if g is not None and g.abs().sum() > 0]
    assert trained
    missing = [n for n in trained if routed.get(n) is None or routed[n].abs().sum() == 0]
    assert not missing, f"no gradient under routing for {missing[:10]}"


def check_force_keep(family: str, routes, **kw: Any) -> None:
    """6. Force-kept tokens are never dropped, in every kind of block; more than the budget grows K."""
    model = make(family, routes, **kw).train()
    x, t, y = inputs(model, frames=kw.get("frames"))
    N = model.num_tokens
    g = torch.Generator().manual_seed(3)
    for n_forced in (2, N - 1):  # below and above the keep budget
        force = torch.zeros(x.shape[0], N, dtype=torch.bool)
        for b in range(x.shape[0]):
            force[b, torch.randperm(N, generator=g)[:n_forced]] = True
        with capture_routes() as log:
            out = model(x, t, y, force_keep=force)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert len(log["scatter"]) == len(model.routing.routes)
        for (_, _, ids, _), route in zip(log["scatter"], model.routing.routes):
            kept = torch.zeros_like(force)
            kept[torch.arange(x.shape[0])[:, None], ids] = True
            assert (kept | ~force).all(), "a force-kept token was dropped"
            assert ids.shape[1] == max(route.num_keep(N), n_forced)
        stats = model.last_route_stats
        assert [s[2] for s in stats] == [max(r.num_keep(N), n_forced) for r in model.routing.routes]


def check_checkpointing_same_grads(family: str, routes=ROUTES, **kw: Any) -> None:
    """8. Gradient checkpointing with routing gives the same gradients as without."""
    def grads(ckpt: bool):
        model = make(family, routes, gradient_checkpointing=ckpt, **kw).train()
        model.routing.router.manual_seed(11)
        x, t, y = inputs(model, frames=kw.get("frames"))
        model(x, t, y).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads(False), grads(True)
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def check_text_conditioning(family: str, routes=None, *, with_mask: bool = False, **kw: Any):
    """Text embeddings from the data (+ pooled where the family has them, + a keep-mask with_mask) replace the
    class table and give diffusers' own forward; the null label zeroes them (CFG), keeping the mask; a family
    with pooled embeddings refuses text without them. Returns (model, x, t, y, cond, out) for more checks."""
    model = make(family, routes, **kw).eval()
    x, t, _ = inputs(model, batch=2, frames=kw.get("frames"))
    cond = {"text": torch.randn(2, 5, model.text_dim)}
    if model.pooled_dim:
        cond["pooled"] = torch.randn(2, model.pooled_dim)
    if with_mask:   # prompts of 3 and 4 tokens: both samples padded
        cond["text_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    y = torch.tensor([0, model.num_classes])
    with torch.no_grad():
        out = model(x, t, y, cond=cond)
        zero = {k: v[1:] if k == "text_mask" else torch.zeros_like(v[1:]) for k, v in cond.items()}
        torch.testing.assert_close(out[1:], model(x[1:], t[1:], torch.tensor([0]), cond=zero))
        first = {k: v[:1] for k, v in cond.items()}
        torch.testing.assert_close(out[:1], model.reference_forward(x[:1], t[:1], y[:1], cond=first),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, model.reference_forward(x, t, y, cond=cond), rtol=1e-6, atol=1e-6)
    if model.pooled_dim:
        with pytest.raises(FamilyConfigError, match="pooled"):
            model(x, t, y, cond={"text": cond["text"]})
    return model, x, t, y, cond, out


def check_paper_route_on_toy_data(family: str, batch: int = 3):
    """The tiny preset builds for the built-in 3x16x16 data with the paper route (blocks 2..-4) and trains.
    Returns (model, (x, t, y))."""
    model = make(family, PAPER_ROUTE, input_size=16, in_channels=3, num_classes=10).train()
    assert model.depth == 8 and model.token_grid == (1, 8, 8) and model.arch == f"{family}-tiny"
    assert [(r.start_layer_idx, r.end_layer_idx) for r in model.routing.routes] == [(2, 4)]
    x, t, y = inputs(model, batch=batch)
    out = model(x, t, y)
    assert out.shape == x.shape and model.last_route_stats == [(2, 4, 32, 64)]
    out.square().mean().backward()
    return model, (x, t, y)


def check_meta_flops(family: str) -> None:
    """Built on the meta device (shapes only: how a released preset is planned), the forward counts the FLOPs of
    the CPU-built model, dense and routed; RouteFlops' per-block polynomials from three counts equal a direct count
    for route sets it was not fitted on (the paper route, two routes)."""
    with torch.device("meta"):
        meta = make(family, input_size=16, in_channels=3, num_classes=10)
    cpu = make(family, input_size=16, in_channels=3, num_classes=10)
    fitted = RouteFlops(meta)
    assert fitted.exact and fitted.ns == [64, 32, 16]
    two = [{"selection_ratio": 0.25, "start_layer_idx": 1, "end_layer_idx": 3},
           {"selection_ratio": 0.6, "start_layer_idx": 5, "end_layer_idx": 7}]
    for routes in (None, PAPER_ROUTE, two):
        counted = forward_flops_with_routes(meta, routes)
        assert fitted(routes) == counted, routes
        if routes is not two:
            assert forward_flops_with_routes(cpu, routes) == counted, routes
    assert fitted(PAPER_ROUTE) < fitted(None)


def check_config_errors(family: str, *cases: tuple[str, dict]) -> None:
    """Errors name the key and the value: data channels != config.in_channels, an unknown preset, a resolution
    the patches do not divide, a route past the depth; then the family's own cases (match, build_family kwargs)."""
    common = [("in_channels=8", {"config": {"in_channels": 8}}), ("model.preset='huge'", {"preset": "huge"}),
              ("resolution=9", {"input_size": 9})]
    for match, kw in [*common, *cases]:
        with pytest.raises(FamilyConfigError, match=match):
            build_family(family, **{"input_size": 8, "in_channels": 4, "num_classes": 3, **kw})
    with pytest.raises(RouteConfigError, match="depth 8"):
        make(family, [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}])


def check_fused_projections(family: str, routes, *, timesteps: Optional[Callable[[Any], torch.Tensor]] = None,
                            **kw: Any) -> None:
    """diffusers' fuse_qkv_projections() fuses every attention and leaves the routed output (same router seed)
    unchanged. timesteps(model), when given, makes the timesteps."""
    model = make(family, routes, **kw).train()
    x, t, y = inputs(model, frames=kw.get("frames"))
    t = timesteps(model) if timesteps is not None else t
    model.routing.router.manual_seed(3)
    ref = model(x, t, y)
    model.transformer.fuse_qkv_projections()
    assert all(getattr(m, "fused_projections", False) for m in model.transformer.modules() if hasattr(m, "norm_q"))
    model.routing.router.manual_seed(3)
    torch.testing.assert_close(model(x, t, y), ref, rtol=1e-5, atol=1e-5)
