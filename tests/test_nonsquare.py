"""Every model at non-square and other-size latent grids (aspect-ratio buckets): the token grid comes from the batch's
shape, positions are the true (row, col) ones diffusers' pipelines make at that height and width, keep counts follow
the batch's token count, sizes a model cannot position are refused in one line, and a compiled model makes one graph
per bucket shape."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import family_checks as fc
import test_family_flux
import test_family_qwen_image
import test_family_sd3
from test_compile import compiled_routed_net
from test_families import CROSS, SPAN
from tread.models import build_dit
from tread.models.dit import get_2d_sincos_pos_embed
from tread.models.errors import ModelConfigError
from tread.models.families import FAMILIES, FamilyConfigError
from tread.models.flops import (RouteFlops, counted_forward_flops, dit_forward_flops, forward_flops_with_routes,
                                transformer_forward_flops)
from tread.models.sprint import build_sprint
from tread.routing import resolve_routes
from tread.routing.masks import token_keep_mask

pytestmark = pytest.mark.usefixtures("one_thread")

BUCKETS = [(16, 12), (12, 16)]       # latents H x W around the default 16 x 16 (token grids 8 x 6, 6 x 8)
WIDE, TALL, BIG = (16, 24), (24, 16), (24, 24)   # FLUX / Qwen-Image: 8 x 12, 12 x 8 and a larger square 12 x 12
# HiDream pads non-square latents to max_resolution / p^2 tokens (128 x 128 by default: 4096); 16 x 16 -> 64.
BUILD = {"hidream": {"config": {"max_resolution": [16, 16]}}}


def build_kw(family: str) -> dict:
    return {"input_size": 16, **BUILD.get(family, {})}


# ----------------------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_at_non_square_grids(family):
    """At 16x12 and 12x16 latents (default 16x16): our dense forward returns the input's shape and equals diffusers'
    own forward on the same latents; ratio 0 with the tokens permuted equals dense; a routed training forward keeps
    route.num_keep(N) of the batch's N tokens."""
    kw = build_kw(family)
    for size in BUCKETS:
        fc.check_dense_equals_diffusers(family, size=size, batch=2, **kw)
        fc.check_ratio_zero_permuted_equals_dense(family, size=size, batch=2, **kw)
    model = fc.make(family, SPAN, **kw).train()
    for size in [*BUCKETS, (16, 16)]:
        x, t, y = fc.inputs(model, batch=2, size=size)
        assert model(x, t, y).shape == x.shape
        n = (size[0] // 2) * (size[1] // 2)                      # every tiny preset: 2x2 latent cells per token
        assert model.tokens_in(x) == n and model.last_route_stats == [(1, 6, n - n // 2, n)]   # SPAN: ratio 0.5


@pytest.mark.parametrize("size", [WIDE, TALL, BIG], ids=["16x24", "24x16", "24x24"])
def test_flux_at_other_grids_equals_diffusers_and_its_blocks_on_the_kept_subsequence(size):
    """FLUX at 16x24, 24x16 and 24x24 latents (default 16x16): dense equals diffusers' forward; the kept tokens after
    routes equal diffusers' blocks on the kept subsequence with the pipeline's true non-square ids."""
    fc.check_dense_equals_diffusers("flux", size=size, batch=2, input_size=16)
    test_family_flux.check_kept_tokens(CROSS, size=size, input_size=16)


@pytest.mark.parametrize("size", [WIDE, TALL, BIG], ids=["16x24", "24x16", "24x24"])
def test_qwen_image_at_other_grids_equals_diffusers_and_its_blocks_on_the_kept_subsequence(size):
    """Qwen-Image (centred scale_rope over (h, w), text positions after max(h//2, w//2)) likewise, with a text mask."""
    fc.check_dense_equals_diffusers("qwen_image", size=size, batch=2, input_size=16)
    test_family_qwen_image.check_kept_tokens(SPAN, True, size=size, input_size=16)


@pytest.mark.parametrize("size", BUCKETS, ids=["16x12", "12x16"])
def test_sd3_kept_subsequence_at_non_square_grids(size):
    """SD3 (PatchEmbed's centre crop of its position table, in the route-start tokens): the kept subsequence check."""
    test_family_sd3.check_kept_tokens(SPAN, size=size, input_size=16)


def test_kontext_reference_takes_the_batch_shape():
    """FLUX Kontext at 16x24: the reference of the target's non-square shape gives diffusers' forward
    ([target, reference] with ids (0|1, row, col)); a reference of the default square shape is refused."""
    model = fc.make("flux", kontext=True, input_size=16).eval()
    x, t, y = fc.inputs(model, batch=2, size=WIDE)
    ref = torch.randn_like(x)
    with torch.no_grad():
        ours, theirs = model(x, t, y, cond={"reference": ref}), model.reference_forward(x, t, y, {"reference": ref})
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    with pytest.raises(FamilyConfigError, match=r"target's shape \[2, 4, 16, 24\].*got shape \[2, 4, 16, 16\]"):
        model(x, t, y, cond={"reference": torch.randn(2, 4, 16, 16)})


@pytest.mark.parametrize("family,kw,size,needle", [
    ("flux", {}, (15, 16), r"model.family=flux: latents 15x16 are not whole tokens; allowed: height a positive "
                           r"multiple of 2 and width of 2"),
    ("sd3", {}, WIDE, r"model.family=sd3: latents 16x24 make a 8x12 token grid, beyond the 8x8 position table "
                      r"\(model.config.pos_embed_max_size=8\); allowed: token grid sides <= 8"),
    ("auraflow", {}, TALL, r"model.family=auraflow: latents 24x16 make a 12x8 token grid, beyond the 8x8 position "
                           r"table \(model.config.pos_embed_max_size=64\)"),
    ("hidream", BUILD["hidream"], (16, 20), r"model.family=hidream: non-square latents 16x20 make 8x10 = 80 tokens, "
                                            r"more than the 64"),
    ("z_image", {"config": {"axes_lens": [1024, 8, 8]}}, WIDE, r"model.family=z_image: latents 16x24 make a 8x12 "
                                                               r"token grid, beyond the RoPE tables"),
    ("lumina2", {"config": {"axes_lens": [300, 8, 8]}}, WIDE, r"model.family=lumina2: latents 16x24 .* columns <= "
                                                              r"axes_lens\[2\]=8"),
    ("wan", {"config": {"rope_max_seq_len": 8}}, WIDE, r"model.family=wan: latents 16x24 x 1 frames make a 8x12 x 1 "
                                                       r"token grid, beyond the RoPE table \(model.config."
                                                       r"rope_max_seq_len=8\)"),
])
def test_sizes_a_family_cannot_position_are_refused_in_one_line(family, kw, size, needle):
    """A size beyond the family's position / RoPE table (or not whole tokens) is refused before any block runs, in one
    line naming the family, the size and what is allowed; check_size says the same for a bucket at start-up."""
    model = fc.make(family, **{"input_size": 16, **kw})
    x, t, y = fc.inputs(model, batch=1, size=size)
    with pytest.raises(FamilyConfigError, match=needle) as err:
        model(x, t, y)
    assert "\n" not in str(err.value)
    with pytest.raises(FamilyConfigError, match=needle):
        model.check_size(*size)


def test_hidream_square_grids_are_never_padded():
    """HiDream: a square grid larger than max_resolution allows is diffusers' square path (no padding): taken."""
    fc.check_dense_equals_diffusers("hidream", size=BIG, batch=2, **build_kw("hidream"))


def test_tokens_from_mask_at_the_batch_grid():
    """A loss mask gives force-keep tokens on the batch's grid (size), and they are never dropped there."""
    model = fc.make("flux", SPAN, input_size=16).train()
    x, t, y = fc.inputs(model, batch=2, size=WIDE)
    mask = torch.zeros(2, 1, 32, 48)
    mask[..., :16, :24] = 1                                       # the top-left quarter
    keep = model.tokens_from_mask(mask, x.shape[2:])
    assert torch.equal(keep, token_keep_mask(mask, (8, 12))) and int(keep[0].sum()) == 24
    with fc.capture_routes() as log:
        model(x, t, y, force_keep=keep)
    (_, _, ids, _), = log["scatter"]
    assert all(set(keep[b].nonzero().flatten().tolist()) <= set(ids[b].tolist()) for b in range(2))
    assert model.tokens_from_mask(mask).shape == (2, 64)         # default: the 16x16 grid


def test_auraflow_bound_is_diffusers_window():
    """AuraFlow's refusal bound is diffusers' own window: every grid up to isqrt(pos_embed_max_size) a side gets
    in-range indices from pe_selection_index_based_on_dim, the next side does not."""
    model = fc.make("auraflow", input_size=16)
    embed = model.transformer.pos_embed
    side = math.isqrt(int(model.transformer.config.pos_embed_max_size))
    for h in range(1, side + 1):
        for w in (1, side // 2 + 1, side):
            idx = embed.pe_selection_index_based_on_dim(2 * h, 2 * w)
            assert idx.min() >= 0 and idx.max() < side * side and len(set(idx.tolist())) == h * w
    idx = embed.pe_selection_index_based_on_dim(2 * (side + 1), 2)
    assert idx.min() < 0 or idx.max() >= side * side or len(set((idx // side).tolist())) < side + 1


# ----------------------------------------------------------------------------- FLOPs at a grid


def test_family_flops_at_a_bucket_grid_equal_a_counted_forward():
    """forward_flops_with_routes and RouteFlops at grid (H, W) equal a counted forward on latents of that size."""
    model = fc.make("flux", input_size=16)
    routes = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 5}]
    x, _, y = fc.inputs(model, batch=1, size=WIDE)
    with model.routing.override(routes=routes):
        counted = counted_forward_flops(model.train(), torch.zeros_like(x), torch.zeros_like(y))
    assert forward_flops_with_routes(model, routes, grid=WIDE) == counted
    assert RouteFlops(model, grid=WIDE)(routes) == counted
    assert forward_flops_with_routes(model, routes) < counted          # the default grid: 64 tokens, not 96


def test_dit_flops_at_a_grid():
    """DiT's analytic count at grid (H, W): N = (H/p)(W/p); the default is unchanged."""
    model = build_dit("DiT-T/2", 16, 4, 10)
    routes = resolve_routes([{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}], model.depth)
    for grid, n in [(None, 64), (WIDE, 96), ((8, 12), 24)]:
        want = transformer_forward_flops(n, 12, 96, routes, io_features=2 * 2 * 4)
        assert model.forward_flops(routes, grid=grid) == want == dit_forward_flops("DiT-T/2", 16, 4, routes, grid)
    assert model.forward_flops(routes) == dit_forward_flops("DiT-T/2", 16, 4, routes)


# ----------------------------------------------------------------------------- DiT


def sincos_reference(dim: int, rows: int, cols: int) -> torch.Tensor:
    """MAE's 2-D sin-cos table written out per token (row-major): [sin(c w), cos(c w), sin(r w), cos(r w)] with
    w_k = 10000^(-k / (dim / 4)), in float64."""
    omega = 10000.0 ** (-torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    r, c = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                          indexing="ij")
    r, c = r.reshape(-1, 1) * omega, c.reshape(-1, 1) * omega
    return torch.cat([c.sin(), c.cos(), r.sin(), r.cos()], dim=1)


def test_dit_sincos_table_at_any_grid():
    """The generalised table: the square form equals the registered buffer bit for bit; any (h, w) equals the
    per-token formula; the model keeps one table per grid."""
    model = build_dit("DiT-T/2", 16, 4, 10)
    square = get_2d_sincos_pos_embed(96, 8)
    assert np.array_equal(square, get_2d_sincos_pos_embed(96, (8, 8)))
    assert torch.equal(model.pos_embed[0], torch.from_numpy(square).float())
    assert model.pos_embed_at((8, 8)) is model.pos_embed
    for rows, cols in [(8, 12), (12, 8), (3, 5)]:
        table = torch.from_numpy(get_2d_sincos_pos_embed(96, (rows, cols)))
        torch.testing.assert_close(table, sincos_reference(96, rows, cols), rtol=0, atol=1e-12)
        assert torch.equal(model.pos_embed_at((rows, cols))[0], table.float())
        assert model.pos_embed_at((rows, cols)) is model.pos_embed_at((rows, cols))
    assert not torch.equal(model.pos_embed_at((8, 12))[0, 8], model.pos_embed_at((12, 8))[0, 8])   # (0, 8) vs (1, 0)


def manual_dit(model, x, noise_level, labels):
    """DiT's dense forward written out: patch embed + the registered pos_embed buffer, blocks, final layer,
    unpatchify of a square grid (what the square path always computed)."""
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(noise_level) + model.y_embedder(labels)
    for blk in model.blocks:
        h = blk(h, c)
    return model.unpatchify(model.final_layer(h, c))


def test_dit_square_input_is_unchanged_and_other_grids_run():
    """The default square grid computes exactly what it always did (the buffer, the square unpatchify); the same
    model runs 8x8, 8x12 and 12x8 token grids (16x24 latents = a patchify / unpatchify round trip at (h, w)), and
    ratio 0 with the tokens permuted equals dense there."""
    torch.manual_seed(0)
    model = build_dit("DiT-T/2", 16, 4, 10, routing=fc.routing_cfg(fc.RATIO_ZERO)).eval()
    for block in model.blocks:                    # adaLN-Zero would make every block the identity
        torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.02)
    torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    x, t, y = torch.randn(2, 4, 16, 16), torch.rand(2) * 1000, torch.tensor([1, 10])
    with torch.no_grad():
        assert torch.equal(model(x, t, y), manual_dit(model, x, t, y))
    for size in [(16, 16), WIDE, TALL]:
        x = torch.randn(2, 4, *size)
        with torch.no_grad():
            assert model(x, t, y).shape == x.shape
        fc.check_ratio_zero_model(model, (x, t, y))
    tokens = torch.randn(2, 96, 2 * 2 * 4)
    image = model.unpatchify(tokens, (8, 12))                              # (B, C, 16, 24)
    patches = image.reshape(2, 4, 8, 2, 12, 2).permute(0, 2, 4, 3, 5, 1).reshape(2, 96, 16)   # (p, q, C) order
    assert torch.equal(patches, tokens)


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_dit_keep_counts_follow_the_grid(ratio):
    """Per forward the route keeps N - int(N * ratio) of the batch's N tokens (64 at 8x8, 96 at 8x12, 80 at 8x10)."""
    model = build_dit("DiT-T/2", 16, 4, 10, routing=fc.routing_cfg(
        [{"selection_ratio": ratio, "start_layer_idx": 2, "end_layer_idx": -4}])).train()
    for size, n in [((16, 16), 64), (WIDE, 96), (TALL, 96), ((16, 20), 80)]:
        x = torch.randn(2, 4, *size)
        assert model(x, torch.rand(2) * 1000, torch.tensor([0, 1])).shape == x.shape
        assert model.last_route_stats == [(2, 8, max(1, n - int(n * ratio)), n)]
        assert model.processed_fraction() == pytest.approx((12 - 7 * (1 - max(1, n - int(n * ratio)) / n)) / 12)


def test_dit_refuses_latents_that_are_not_whole_patches():
    model = build_dit("DiT-T/4", 16, 4, 10)
    with pytest.raises(ModelConfigError, match=r"DiT \(patch 4\): latents 16x18 are not whole patches; allowed: "
                                               r"height and width positive multiples of 4"):
        model(torch.randn(1, 4, 16, 18), torch.rand(1), torch.tensor([0]))


def test_sprint_at_a_non_square_grid():
    """SPRINT (dense shallow and final blocks, sparse deep span, fusion) at 16x24 latents: runs with its route and
    path drop, its FLOPs at that grid count 96 tokens."""
    model = build_sprint("DiT-T/2", 16, 4, 10, routing=fc.routing_cfg(
        [{"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": 9}]), sprint={"start": 2, "end": 9}).train()
    x = torch.randn(2, 4, *WIDE)
    out = model(x, torch.rand(2) * 1000, torch.tensor([0, 1]), path_drop=torch.tensor([True, False]))
    assert out.shape == x.shape and model.last_route_stats == [(2, 9, 24, 96)]
    assert model.forward_flops(grid=WIDE) > model.forward_flops() > model.forward_flops(grid=(8, 8))


# ----------------------------------------------------------------------------- torch.compile over buckets


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dit"])     # FLUX gives the same counts (docs/buckets.md): 19 s more of CI
def test_compiled_model_one_graph_per_bucket_shape(family):
    """model.compile (as train.compile does it: RoutedBackbone.compile, aot_eager here) over two bucket shapes: one
    graph per shape, no graph break, and no recompile when a shape comes back."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    rf, net = compiled_routed_net(family)

    def step(size):
        x, y = torch.randn(2, 3, *size), torch.randint(0, 10, (2,))
        rf.loss(net, x, y).mean().backward()
        net.zero_grad()

    graphs = []
    for size in [(16, 16), WIDE, (16, 16), WIDE]:
        step(size)
        graphs.append(counters["stats"].get("unique_graphs", 0))
    assert graphs == [1, 2, 2, 2], graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch._dynamo.reset()
