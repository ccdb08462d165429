"""Route specs, the router, and routing inside the DiT forward pass."""
import pytest
import torch

from tread.models import build_dit
from tread.routing import (
    NO_ROUTES_MESSAGE, Route, RouteConfigError, TokenRouter, gather_tokens, resolve_routes, routing_from_config,
    scatter_tokens, tokens_processed_fraction,
)


def routes_cfg(*routes, **extra):
    return {"enabled": True, "routes": [dict(selection_ratio=r, start_layer_idx=s, end_layer_idx=e) for r, s, e in routes],
            **extra}


def tiny(routing=None, depth=6, seed=0):
    torch.manual_seed(seed)
    model = build_dit("DiT-T/4", 16, 3, 10, routing=routing, depth=depth, hidden_size=64, num_heads=4)
    with torch.no_grad():  # leave adaLN-Zero so every block does work
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def inputs(b=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 16, 16, generator=g), torch.rand(b, generator=g), torch.randint(0, 10, (b,), generator=g)


# ---- spec validation --------------------------------------------------------------

def test_negative_indices_resolve_inclusive():
    assert resolve_routes([dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=-4)], 12) == [Route(0.5, 2, 8)]
    assert resolve_routes([dict(selection_ratio=0.5, start_layer_idx=-3, end_layer_idx=-1)], 28) == [Route(0.5, 25, 27)]


@pytest.mark.parametrize("route,needle", [
    (dict(selection_ratio=1.5, start_layer_idx=2, end_layer_idx=5), "routing.routes[0].selection_ratio=1.5"),
    (dict(selection_ratio=1.0, start_layer_idx=2, end_layer_idx=5), "[0, 1)"),
    (dict(selection_ratio=-0.1, start_layer_idx=2, end_layer_idx=5), "selection_ratio=-0.1"),
    (dict(selection_ratio="half", start_layer_idx=2, end_layer_idx=5), "must be a number"),
    (dict(selection_ratio=0.5, start_layer_idx=12, end_layer_idx=5), "start_layer_idx=12 is out of range"),
    (dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=-13), "end_layer_idx=-13 is out of range"),
    (dict(selection_ratio=0.5, start_layer_idx=2.5, end_layer_idx=5), "must be an integer"),
    (dict(selection_ratio=0.5, start_layer_idx=6, end_layer_idx=3), "comes after"),
    (dict(selection_ratio=0.5, start_layer_idx=2), "end_layer_idx is missing"),
    (dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=4, ratio=1), "unknown field"),
])
def test_each_bad_route_names_index_field_value(route, needle):
    with pytest.raises(RouteConfigError) as err:
        resolve_routes([route], 12)
    assert needle in str(err.value)
    assert "routing.routes[0]" in str(err.value)


def test_out_of_range_message_gives_allowed_range():
    with pytest.raises(RouteConfigError, match=r"allowed block indices are -12\.\.11"):
        resolve_routes([dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=12)], 12)


def test_overlapping_and_unsorted_routes_rejected():
    with pytest.raises(RouteConfigError, match=r"routing.routes\[1\].start_layer_idx=4 .*must be greater than"):
        resolve_routes([dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=4),
                        dict(selection_ratio=0.5, start_layer_idx=4, end_layer_idx=6)], 12)
    with pytest.raises(RouteConfigError, match="overlap"):
        resolve_routes([dict(selection_ratio=0.5, start_layer_idx=6, end_layer_idx=8),
                        dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=3)], 12)


def test_enabled_without_routes_is_the_documented_error():
    with pytest.raises(RouteConfigError) as err:
        routing_from_config({"enabled": True, "routes": []}, 12)
    assert "TREAD training requires you to configure the routes" in str(err.value)
    assert str(err.value) == NO_ROUTES_MESSAGE
    assert routing_from_config({"enabled": False, "routes": []}, 12) == []


def test_validation_happens_at_model_build():
    with pytest.raises(RouteConfigError, match="out of range for a model with depth 6"):
        tiny(routes_cfg((0.5, 2, 8)))


def test_tokens_fraction():
    assert tokens_processed_fraction([], 12, 64) == 1.0
    assert tokens_processed_fraction([Route(0.5, 2, 8)], 12, 64) == pytest.approx((5 + 7 * 0.5) / 12)


# ---- router -------------------------------------------------------------------------

def test_gather_scatter_round_trip():
    x = torch.randn(3, 20, 8)
    ids = TokenRouter(seed=0).select(x, 7)
    assert ids.shape == (3, 7)
    assert all(len(set(row.tolist())) == 7 for row in ids)
    kept = gather_tokens(x, ids)
    assert torch.equal(scatter_tokens(x, kept, ids), x)
    changed = scatter_tokens(x, kept + 1.0, ids)
    mask = torch.zeros(3, 20, dtype=torch.bool).scatter(1, ids, True)
    assert torch.equal(changed[~mask], x[~mask])          # set-aside tokens bit-identical
    assert torch.equal(changed[mask], x[mask] + 1.0)


def test_router_has_own_generator_and_is_reproducible():
    x = torch.randn(2, 16, 4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = TokenRouter(seed=5).select(x, 8)
    assert torch.equal(torch.get_rng_state(), before)      # global stream untouched
    assert torch.equal(a, TokenRouter(seed=5).select(x, 8))
    r = TokenRouter(seed=5)
    r.select(x, 8)
    state = r.state_dict()
    nxt = r.select(x, 8)
    r2 = TokenRouter(seed=0)
    r2.load_state_dict(state)
    assert torch.equal(r2.select(x, 8), nxt)


def test_selection_is_roughly_uniform():
    x = torch.zeros(4000, 10, 2)
    ids = TokenRouter(seed=0).select(x, 5)
    counts = torch.bincount(ids.flatten(), minlength=10).float() / 4000
    assert torch.allclose(counts, torch.full((10,), 0.5), atol=0.03)


def test_force_keep_never_dropped_and_grows_keep_count():
    x = torch.randn(3, 12, 4)
    force = torch.zeros(3, 12, dtype=torch.bool)
    force[0, :2] = True
    force[1, 3:10] = True                                  # 7 forced > budget of 4
    ids = TokenRouter(seed=1).select(x, 4, force_keep=force)
    assert ids.shape == (3, 7)
    for b in range(3):
        assert set(force[b].nonzero().flatten().tolist()) <= set(ids[b].tolist())


def test_importance_mode_prefers_large_tokens():
    x = torch.randn(64, 16, 8) * 0.01
    x[:, :4] += 10.0
    ids = TokenRouter(seed=0, mode="importance", importance_weight=0.9).select(x, 4)
    assert (ids < 4).float().mean() > 0.95
    ids = TokenRouter(seed=0, mode="importance", importance_weight=0.0).select(x, 4)
    assert (ids < 4).float().mean() < 0.5


@pytest.mark.parametrize("override, needle", [
    ("routing.selection.mode=topk", "routing.selection.mode='topk'"),
    ("routing.selection.importance_weight=1.5", "routing.selection.importance_weight=1.5"),
    ("routing.fp32_after_route=yes", "routing.fp32_after_route="),
])
def test_bad_selection_settings_are_one_line_from_the_schema(tiny_cfg, override, needle):
    from tread.schema import ConfigError, check_train
    with pytest.raises(ConfigError) as err:
        check_train(tiny_cfg(override))
    assert needle in str(err.value) and "\n" not in str(err.value)


# ---- routing in the DiT forward ------------------------------------------------------

def test_ratio_zero_equals_dense():
    x, t, y = inputs()
    dense = tiny(None)
    routed = tiny(routes_cfg((0.0, 1, 3), (0.0, 4, -1)))
    routed.load_state_dict(dense.state_dict())
    routed.train()
    dense.train()
    torch.testing.assert_close(routed(x, t, y), dense(x, t, y), rtol=1e-5, atol=1e-5)


def test_routing_changes_output_only_in_training_with_grad():
    x, t, y = inputs()
    model = tiny(routes_cfg((0.5, 1, 3)))
    dense = tiny(None)
    dense.load_state_dict(model.state_dict())
    model.eval()
    torch.testing.assert_close(model(x, t, y), dense(x, t, y))          # eval: dense
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), dense(x, t, y))      # no grad: dense
    assert not torch.allclose(model(x, t, y), dense(x, t, y), atol=1e-4)  # training: routed


def test_routed_forward_matches_manual_reference():
    """Kept tokens run the span alone; set-aside tokens re-enter with route-start values."""
    x, t, y = inputs(b=2)
    model = tiny(routes_cfg((0.5, 2, 3)))
    model.train()
    model.routing.router.manual_seed(7)
    out = model(x, t, y)

    ref_router = TokenRouter(seed=7)
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for blk in model.blocks[:2]:
        h = blk(h, c)
    ids = ref_router.select(h, model.routing.routes[0].num_keep(h.shape[1]))
    kept = torch.stack([h[b, ids[b]] for b in range(2)])
    for blk in model.blocks[2:4]:
        kept = blk(kept, c)
    h2 = h.clone()
    for b in range(2):
        h2[b, ids[b]] = kept[b]
    for blk in model.blocks[4:]:
        h2 = blk(h2, c)
    ref = model.unpatchify(model.final_layer(h2, c))
    torch.testing.assert_close(out, ref)


def test_gradients_reach_every_token_and_parameter():
    x, t, y = inputs()
    x.requires_grad_(True)
    model = tiny(routes_cfg((0.75, 1, 4)))
    model.train()
    model(x, t, y).square().sum().backward()
    assert (x.grad.abs().sum(dim=1) > 0).all()             # every pixel, hence every token
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []


def test_multiple_routes_and_force_keep_in_forward():
    x, t, y = inputs()
    model = tiny(routes_cfg((0.5, 1, 2), (0.25, 3, -2)))
    model.train()
    force = torch.zeros(4, model.num_tokens, dtype=torch.bool)
    force[:, :3] = True
    assert model(x, t, y, force_keep=force).shape == x.shape


def test_inference_override_routes_in_eval():
    x, t, y = inputs()
    model = tiny(routes_cfg((0.5, 1, 3)))
    model.eval()
    dense = model(x, t, y)
    with model.routing.override(selection_ratio=0.5):
        routed = model(x, t, y)
    assert not torch.allclose(routed, dense, atol=1e-4)
    with model.routing.override(selection_ratio=0.0):
        torch.testing.assert_close(model(x, t, y), dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x, t, y), dense)      # override is scoped
    with pytest.raises(RouteConfigError, match="no routes configured"):
        with tiny(None).routing.override(selection_ratio=0.5):
            pass


def test_full_keep_in_random_order_equals_dense():
    """Gather/scatter with every token kept but shuffled is the dense model (attention is permutation-equivariant)."""
    x, t, y = inputs()
    dense = tiny(None)
    routed = tiny(routes_cfg((0.0, 1, 4)))
    routed.load_state_dict(dense.state_dict())
    g = torch.Generator().manual_seed(0)
    routed.routing.router.select = lambda h, k, force_keep=None, noise=None, shards=1: torch.stack(
        [torch.randperm(h.shape[1], generator=g) for _ in range(h.shape[0])])
    routed.train()
    out = routed(x, t, y)
    torch.testing.assert_close(out, dense.train()(x, t, y), rtol=1e-5, atol=1e-5)


def _fp32_routing(flag):
    return {"enabled": True, "fp32_after_route": flag, "seed": 0,
            "routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]}


@pytest.mark.parametrize("family", ["dit", "flux", "sd3", "wan", "auraflow", "pixart"])
def test_fp32_block_after_route_runs_outside_autocast(family):
    """routing.fp32_after_route: the block after a route's end computes in float32 under bf16 autocast."""
    from tread.models import build_dit
    from tread.models.families import build_family
    dtypes = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = build_dit("DiT-T/4", 16, 3, 10, routing=_fp32_routing(flag)) if family == "dit" else \
            build_family(family, input_size=8, in_channels=3, num_classes=10, routing=_fp32_routing(flag))
        blocks = model.blocks if family == "dit" else model.routable_blocks()
        seen = {}
        for i, blk in enumerate(blocks):
            lin = next(m for m in blk.modules() if isinstance(m, torch.nn.Linear))
            lin.register_forward_hook(lambda m, a, out, i=i: (seen.setdefault(i, out.dtype), None)[1])
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 3, model.input_size, model.input_size), torch.tensor([1.0, 500.0]),
                        torch.tensor([0, 3]))
        out.float().mean().backward()
        dtypes[flag] = seen
    assert dtypes[False][3] == torch.bfloat16 and dtypes[False][2] == torch.bfloat16
    assert dtypes[True][3] == torch.float32                      # block 3 follows the route 1..2
    assert dtypes[True][2] == torch.bfloat16 and dtypes[True][4] == torch.bfloat16
