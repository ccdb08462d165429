"""Structured selection (routing.selection.mode=structured, tread/routing/structured.py): SPRINT's one kept token
per k x k group at a random offset, for the router alone and end to end in DiT, FLUX and Wan (video)."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from tread.models import build_dit
from tread.models.families import build_family
from tread.routing import RouteConfigError, TokenRouter
from tread.routing.structured import group_side
from tread.schema import ConfigError, check_train

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def group_ids(grid, k):
    """(N,) group index of every token of a (t, h, w) grid (row-major), k x k groups per frame from the top-left."""
    t, h, w = grid
    gw = -(-w // k)
    f, y, x = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return (f * (-(-h // k) * gw) + (y // k) * gw + x // k).flatten()


def kept_per_group(ids, grid, k):
    """(B, groups) how many of each row's kept tokens `ids` (B, K) fall in each group."""
    g = group_ids(grid, k)
    return torch.stack([torch.bincount(g[row], minlength=int(g.max()) + 1) for row in ids])


def choose(router, grid, ratio, B=8, force_keep=None):
    """The router's kept ids (B, K) on a (t, h, w) grid at `ratio`, drawn as a plan does."""
    N = grid[0] * grid[1] * grid[2]
    x = torch.zeros(B, N, 4)
    keep = max(1, N - int(N * ratio))
    return router.select(x, keep, force_keep, grid=grid)


@pytest.mark.parametrize("grid,ratio,k", [((1, 8, 8), 0.75, 2), ((1, 6, 10), 0.75, 2), ((1, 9, 12), 8 / 9, 3),
                                          ((3, 4, 6), 0.75, 2)])
def test_exactly_one_kept_token_per_group_for_every_sample(grid, ratio, k):
    assert group_side(ratio) == k
    counts = kept_per_group(choose(TokenRouter(seed=3, mode="structured"), grid, ratio, B=16), grid, k)
    assert torch.equal(counts, torch.ones_like(counts))


def test_every_offset_occurs_in_every_group():
    """Over 400 samples each of the 16 groups of an 8x8 grid keeps each of its 4 positions at least once (a missed
    offset has probability < 1e-48 per group); and the offsets are not one per sample: rows differ across groups."""
    grid, ids = (1, 8, 8), choose(TokenRouter(seed=0, mode="structured"), (1, 8, 8), 0.75, B=400)
    hits = torch.zeros(64, dtype=torch.long).index_add_(0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.long))
    assert (hits > 0).all() and hits.sum() == 400 * 16
    y, x = ids // 8, ids % 8
    offset = (y % 2) * 2 + x % 2                                                   # (B, 16) per kept token
    assert (offset != offset[:, :1]).any(dim=1).float().mean() > 0.9


def test_partial_groups_at_a_grid_not_divisible_by_the_side():
    """5x7 at 0.75: 12 groups (edge ones smaller), 9 kept tokens: at most one per group, never two."""
    ids = choose(TokenRouter(seed=1, mode="structured"), (1, 5, 7), 0.75, B=64)
    counts = kept_per_group(ids, (1, 5, 7), 2)
    assert ids.shape[1] == 9 and counts.max() == 1 and (counts.sum(1) == 9).all()
    single = torch.tensor([4 * 7 + 6])                                             # the 1-token corner group
    assert (ids == single).any()


def test_same_seed_same_choice_other_seed_other_choice_and_resume_exact():
    a, b, c = (TokenRouter(seed=s, mode="structured") for s in (7, 7, 8))
    assert torch.equal(choose(a, (1, 8, 8), 0.75), choose(b, (1, 8, 8), 0.75))
    assert not torch.equal(choose(a, (1, 8, 8), 0.75), choose(c, (1, 8, 8), 0.75))
    state = a.state_dict()
    resumed = TokenRouter(seed=0, mode="structured")
    resumed.load_state_dict(state)
    assert torch.equal(choose(a, (1, 8, 8), 0.75), choose(resumed, (1, 8, 8), 0.75))


def test_force_kept_tokens_are_kept_and_fill_their_group():
    """Forced tokens are kept; a group holding one keeps nothing else; the keep count is max(num_keep, forced)."""
    B, grid = 6, (1, 8, 8)
    force = torch.zeros(B, 64, dtype=torch.bool)
    force[:, [0, 18, 36]] = True                     # three tokens in three groups (0, 5, 10: the diagonal)
    force[:3, [1, 8]] = True                         # rows 0..2: group 0 holds three forced tokens
    ids = choose(TokenRouter(seed=2, mode="structured"), grid, 0.75, B=B, force_keep=force)
    assert ids.shape[1] == 16
    assert all(set(torch.nonzero(force[b]).flatten().tolist()) <= set(ids[b].tolist()) for b in range(B))
    counts = kept_per_group(ids, grid, 2)
    assert torch.equal(counts[3:], torch.ones_like(counts[3:]))                    # forced in distinct groups
    assert (counts[:3, 0] == 3).all() and (counts[:3, 1:].max() == 1)             # no extra token in group 0


def test_ratio_zero_keeps_all_and_random_mode_draws_are_unchanged():
    ids = choose(TokenRouter(seed=0, mode="structured"), (1, 4, 4), 0.0, B=2)
    assert all(sorted(row.tolist()) == list(range(16)) for row in ids)
    expected = torch.rand(3, 20, generator=torch.Generator().manual_seed(5))
    assert torch.equal(TokenRouter(seed=5).draw(3, 20, CPU), expected)


def test_per_sample_generators_give_rows_their_own_choice():
    router = TokenRouter(seed=0, mode="structured")
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    with router.per_sample(gens):
        both = router.draw(4, 64, CPU, (8, 8), 0.75)                               # a CFG batch: rows i, i + 2
    with router.per_sample([torch.Generator().manual_seed(12)]):
        alone = router.draw(1, 64, CPU, (8, 8), 0.75)
    assert torch.equal(both[0], both[2]) and torch.equal(both[1], alone[0])


def test_structured_mode_is_validated_and_needs_a_grid():
    check_train(compose_cfg(overrides=["routing=sprint", "model=sprint", "routing.selection.mode=structured"]))
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=["routing.selection.mode=grid"]))
    assert "allowed: one of random, importance, structured" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RouteConfigError, match="routing.selection.mode=structured needs the batch's token grid"):
        TokenRouter(mode="structured").draw(1, 16, CPU)


def routing(ratio=0.75, start=1, end=-2):
    return {"enabled": True, "routes": [{"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}],
            "seed": 0, "selection": {"mode": "structured", "importance_weight": 0.5}}


def recorded_ids(model, x):
    """The kept ids (B, K) of model's one route on latents x, from a training forward."""
    seen, real = [], model.routing.router.select

    def select(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    model.routing.router.select = select
    model.train()(x, torch.rand(x.shape[0]) * 1000, torch.zeros(x.shape[0], dtype=torch.long))
    model.routing.router.select = real
    return seen[0]


@pytest.mark.parametrize("family,size,frames,grid", [("dit", (16, 24), None, (1, 4, 6)),
                                                      ("flux", (8, 12), None, (1, 4, 6)),
                                                      ("wan", (8, 12), 3, (3, 4, 6))])
def test_one_token_per_group_in_the_models_at_a_non_square_grid(family, size, frames, grid):
    torch.manual_seed(0)
    model = build_dit("DiT-T/4", 16, 3, 10, routing=routing()) if family == "dit" else \
        build_family(family, input_size=8, in_channels=4, num_classes=5, routing=routing(), frames=frames or 1)
    shape = [3, model.in_channels, *size] if frames is None else [3, model.in_channels, frames, *size]
    ids = recorded_ids(model, torch.randn(shape))
    assert model.grid_of(torch.zeros(shape)) in (grid, grid[1:])
    counts = kept_per_group(ids, grid, 2)
    assert torch.equal(counts, torch.ones_like(counts))


def test_compiled_structured_forward_is_one_graph():
    import torch._dynamo                  # slow to import: only this test compiles
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = build_dit("DiT-T/4", 16, 3, 10, routing=routing(0.75, 2, -4))
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend="aot_eager")
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    for _ in range(2):
        model.train()(x, torch.rand(4) * 1000, y).mean().backward()
    assert dict(counters["stats"]).get("unique_graphs", 0) == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()
