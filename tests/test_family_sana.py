"""Sana (diffusers SanaTransformer2DModel) with TREAD routing: the proofs only Sana has. Its Mix-FFN runs a 3x3
depthwise conv over the token grid; under a route we run it on a grid that holds the kept tokens at their TRUE
positions and zero where tokens were dropped, as zero padding beyond the border (tread/models/families/sana.py).
Here: (a) dense is bit-identical to diffusers' forward; (b) ratio 0 with a permutation equals dense (also in
tests/test_families.py); (c) the kept tokens after a route equal diffusers' own blocks run on the kept
subsequence with a holey grid built by hand; (d) how that differs from reshaping the kept tokens into a smaller
made-up grid; plus the timestep / guidance conventions and the released geometries."""
from __future__ import annotations

import contextlib

import pytest
import torch

import family_checks as fc
from test_families import SPAN, route
from tread.models.families import FamilyConfigError
from tread.models.families.sana import PRESETS, mix_ffn_kept

FAMILY = "sana"
POS_EMBED = {"config": {"interpolation_scale": 1.0}}                     # 2K / 4K style: sincos table in PatchEmbed
SPRINT = {"config": {"guidance_embeds": True, "qk_norm": "rms_norm_across_heads"}, "guidance": 4.5}

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ (a) dense == diffusers

@pytest.mark.parametrize("kw", [{}, POS_EMBED, SPRINT, {"input_size": 16, "in_channels": 3}],
                         ids=["1024-style", "pos-embed", "sprint", "16px-rgb"])
def test_dense_equals_diffusers(kw):
    """With every token kept, our block loop (the Mix-FFN through the zero grid) is diffusers' forward, with the
    masked text of the data too, to float32 rounding (1e-6, as every family's dense check): our Mix-FFN runs its 1x1
    convolutions on a (1, K) row of tokens where diffusers' run on the (H, W) grid, other shapes that a convolution
    kernel may sum in another order on another CPU."""
    model = fc.make(FAMILY, **kw).eval()
    x, t, y = fc.inputs(model)
    cond = fc.masked_text(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), model.reference_forward(x, t, y), rtol=1e-6, atol=1e-6)
        ours, ref = model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond)
        unmasked = model(x, t, y, cond={"text": cond["text"]})
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours[1:], unmasked[1:])      # the mask is honoured


# ------------------------------------------------------------------ (b) ratio 0 with a permutation == dense

@pytest.mark.parametrize("kw", [{}, SPRINT], ids=["1024-style", "sprint"])
def test_ratio_zero_permuted_equals_dense(kw):
    """All tokens kept but in a random order: grid_pos travels with them, the depthwise conv still sees the
    true grid."""
    fc.check_ratio_zero_permuted_equals_dense(FAMILY, **kw)


# ------------------------------------------------------------------ (c) the kept subsequence, by hand

def _cells(ids: torch.Tensor, W: int) -> list[tuple[int, int]]:
    return [divmod(int(i), W) for i in ids]


@contextlib.contextmanager
def hand_holey_ff(ff, ids: torch.Tensor, grid: tuple[int, int]):
    """While active, diffusers' GLUMBConv `ff` (called by its block with the K kept tokens as a 1 x K image)
    computes its Mix-FFN on a grid built by hand: its own pieces in GLUMBConv.forward's order, the activations of
    each kept token written at its (row, col) of a zero H x W canvas for conv_depth, and read back there."""
    H, W = grid
    cells = _cells(ids, W)

    def forward(image):                                            # (1, C, 1, K), kept order
        a = ff.nonlinearity(ff.conv_inverted(image))               # 1x1: per token
        canvas = torch.zeros(1, a.shape[1], H, W, dtype=a.dtype)
        for k, (r, c) in enumerate(cells):
            canvas[0, :, r, c] = a[0, :, 0, k]
        d = ff.conv_depth(canvas)
        d = torch.stack([d[0, :, r, c] for r, c in cells], dim=-1)[None, :, None, :]   # (1, C', 1, K)
        v, gate = torch.chunk(d, 2, dim=1)
        return ff.conv_point(v * ff.nonlinearity(gate))

    ff.forward = forward
    try:
        yield
    finally:
        del ff.forward


KEPT_ROUTES = {"inner": SPAN, "all-blocks": [route(0.75, 0, -1)]}


@pytest.mark.parametrize("kw", [{}, SPRINT], ids=["1024-style", "sprint"])
@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "masked-text"])
@pytest.mark.parametrize("routes", list(KEPT_ROUTES.values()), ids=list(KEPT_ROUTES))
def test_kept_tokens_equal_blocks_on_subsequence(routes, masked, kw):
    """3. Kept tokens after the route = diffusers' SanaTransformerBlock.forward run per sample on the kept
    subsequence (height 1, width K), with the sample's own adaLN-single modulation, its projected and normed text
    and text mask, and its Mix-FFN on the hand-built holey grid (kept tokens at their true cells, zero elsewhere)."""
    r = fc.routed_run(FAMILY, routes, cond=fc.masked_text if masked else None, **kw)
    model, x, t, y, cond, seen, routed_in, route_ = r.model, r.x, r.t, r.y, r.cond, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    text = cond["text"] if masked else model.conditioning(y, None)["text"]
    H, W = model.token_grid[1:]
    with torch.no_grad():
        for b in range(x.shape[0]):
            if kw:   # Sana-Sprint: t in [0, 1], guidance 4.5 x guidance_embeds_scale (SanaSprintPipeline)
                t6, _ = ref.time_embed(t[b:b + 1] / 1000, guidance=torch.tensor([4.5 * 0.1]), hidden_dtype=x.dtype)
            else:
                t6, _ = ref.time_embed(t[b:b + 1], batch_size=1, hidden_dtype=x.dtype)
            ctx = ref.caption_norm(ref.caption_projection(text[b:b + 1]))
            # projected for 1 sample here, for the whole batch in the model: other matmul shapes, float32 tolerance
            torch.testing.assert_close(seen[route_.start_layer_idx][1][b:b + 1], ctx)
            bias = torch.where(cond["text_mask"][b:b + 1], 0.0, -10000.0)[:, None, :] if masked else None
            h = seen[route_.start_layer_idx][0][b:b + 1, ids[b]]          # dense route-start tokens, kept subset
            K = h.shape[1]
            for blk in ref.transformer_blocks[route_.start_layer_idx:route_.end_layer_idx + 1]:
                with hand_holey_ff(blk.ff, ids[b], (H, W)):
                    h = blk(h, None, ctx, bias, t6, 1, K)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
        # the text stream enters every block unchanged, full length
        assert all(torch.equal(c, seen[0][1]) for _, c in routed_in)


# ------------------------------------------------------------------ (d) the holey grid vs alternatives

def _ff_and_tokens(seed: int = 0, grid: tuple[int, int] = (8, 8)):
    model = fc.make(FAMILY, input_size=2 * grid[0], in_channels=3)
    torch.manual_seed(seed)
    ff = model.transformer.transformer_blocks[3].ff
    for conv in (ff.conv_inverted, ff.conv_depth):   # non-trivial biases and kernels
        torch.nn.init.normal_(conv.weight, std=0.3)
        torch.nn.init.normal_(conv.bias, std=0.3)
    n = torch.randn(2, grid[0] * grid[1], ff.conv_inverted.in_channels)
    return ff, n


def _image(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) -> (B, C, h, w) as SanaTransformerBlock.forward reshapes them for its ff."""
    return tokens.unflatten(1, (h, w)).permute(0, 3, 1, 2)


def _tokens(image: torch.Tensor) -> torch.Tensor:
    return image.flatten(2, 3).permute(0, 2, 1)


@pytest.mark.parametrize("dropped", ["last-column", "first-row"])
def test_dropped_tokens_are_seen_like_the_image_border(dropped):
    """Dropping a whole border column (row) of tokens is the same, for the kept tokens, as cropping the image
    to the remaining columns (rows): diffusers' GLUMBConv on the cropped image, whose zero padding now sits where
    the dropped tokens were. The kept tokens come in a shuffled order."""
    ff, n = _ff_and_tokens()
    H = W = 8
    cells = torch.arange(H * W).view(H, W)
    kept_cells = cells[:, :-1] if dropped == "last-column" else cells[1:, :]
    crop = kept_cells.shape
    perm = torch.randperm(kept_cells.numel(), generator=torch.Generator().manual_seed(1))
    ids = kept_cells.flatten()[perm]                                         # (K,) shuffled true positions
    pos = ids.view(1, -1, 1).expand(n.shape[0], -1, -1)
    with torch.no_grad():
        ours = mix_ffn_kept(ff, n[:, ids], pos, (H, W))                       # (B, K, C), shuffled order
        cropped = _tokens(ff(_image(n[:, kept_cells.flatten()], *crop)))     # diffusers on the cropped image
    torch.testing.assert_close(ours, cropped[:, perm], rtol=1e-6, atol=1e-6)


def _neighbours(a: int, b: int, W: int) -> bool:
    (ra, ca), (rb, cb) = divmod(a, W), divmod(b, W)
    return max(abs(ra - rb), abs(ca - cb)) <= 1


def test_holey_grid_vs_reshaped_small_grid():
    """Reshaping the K kept tokens (in raster order) into a made-up (H/2, W) grid would put tokens next to each
    other that are not neighbours in the image, and gives a different Mix-FFN. Ours equals diffusers' GLUMBConv
    on the FULL grid when the dropped tokens are zero at its depthwise conv's input (whatever they hold before),
    and a kept token's output depends only on its true 3x3 neighbourhood."""
    ff, n = _ff_and_tokens()
    B, H, W = n.shape[0], 8, 8
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(H * W, generator=g)[:H * W // 2].sort().values     # 32 kept, raster order
    K = ids.numel()
    pos = ids.view(1, K, 1).expand(B, -1, -1)
    keep = torch.zeros(H * W, dtype=torch.bool)
    keep[ids] = True

    def made_up(tokens):                                                     # the rejected alternative
        return _tokens(ff(_image(tokens, H // 2, W)))

    with torch.no_grad():
        ours = mix_ffn_kept(ff, n[:, ids], pos, (H, W))
        small = made_up(n[:, ids])
        # diffusers' own GLUMBConv.forward on the full grid, dropped cells zeroed at conv_depth's input only
        hook = ff.conv_depth.register_forward_pre_hook(lambda m, a: (a[0] * keep.view(1, 1, H, W),))
        try:
            junk = n.clone()
            junk[:, ~keep] = 100 * torch.randn(B, int((~keep).sum()), n.shape[-1])   # dropped tokens: anything
            full = _tokens(ff(_image(junk, H, W)))[:, ids]
        finally:
            hook.remove()
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, small, rtol=1e-3, atol=1e-3)

    # The made-up grid's 3x3 neighbours of a kept token that are not its neighbours in the image:
    small_cells = torch.arange(K).view(H // 2, W)
    wrong = [(int(small_cells[i, j]), int(small_cells[i + di, j + dj]))
             for i in range(H // 2) for j in range(W) for di in (-1, 0, 1) for dj in (-1, 0, 1)
             if (di or dj) and 0 <= i + di < H // 2 and 0 <= j + dj < W
             and not _neighbours(int(ids[small_cells[i, j]]), int(ids[small_cells[i + di, j + dj]]), W)]
    assert wrong, "the made-up grid happened to keep every neighbourhood"
    k, other = wrong[0]
    bumped = n.clone()
    bumped[:, ids[other]] += 1.0                # change a kept token that is not a true neighbour of token k
    with torch.no_grad():
        ours2 = mix_ffn_kept(ff, bumped[:, ids], pos, (H, W))
        small2 = made_up(bumped[:, ids])
    assert torch.equal(ours2[:, k], ours[:, k])                  # ours: token k does not see it
    assert not torch.allclose(small2[:, k], small[:, k])         # the made-up grid mixes it into token k


def test_isolated_kept_token_sees_only_itself():
    """A kept token whose 8 true neighbours are all dropped: its depthwise conv output is the kernel's centre
    tap times its own activation plus the bias, as for a 1x1 image."""
    ff, n = _ff_and_tokens()
    B, H, W = n.shape[0], 8, 8
    ids = torch.tensor([0, 18, 29, 63])           # cells (0, 0), (2, 2), (3, 5), (7, 7): no two are neighbours
    pos = ids.view(1, -1, 1).expand(B, -1, -1)
    with torch.no_grad():
        ours = mix_ffn_kept(ff, n[:, ids], pos, (H, W))
        alone = torch.cat([_tokens(ff(_image(n[:, [int(i)]], 1, 1))) for i in ids], dim=1)
    torch.testing.assert_close(ours, alone, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ conventions and configs

def test_timestep_scale_and_sprint_conventions():
    """SanaPipeline: timestep = scheduler timestep (sigma * 1000) x config.timestep_scale; SanaSprintPipeline:
    the sCM time in [0, 1] and guidance = guidance_scale x guidance_embeds_scale; the guidance value matters."""
    t = torch.tensor([250.0, 900.0])
    assert fc.make(FAMILY).timestep(t) is t
    teacher = fc.make(FAMILY, config={"timestep_scale": 0.001})
    torch.testing.assert_close(teacher.timestep(t), t * 0.001)
    fc.check_dense_equals_diffusers(FAMILY, config={"timestep_scale": 0.001})
    sprint = fc.make(FAMILY, **SPRINT).eval()
    torch.testing.assert_close(sprint.timestep(t), t / 1000)
    g = sprint._guidance(2, t.device, torch.float32)
    torch.testing.assert_close(g, torch.full((2,), 4.5 * 0.1))
    x, tt, y = fc.inputs(sprint)
    with torch.no_grad():
        a = sprint(x, tt, y)
        sprint.guidance = 1.0
        assert not torch.allclose(a, sprint(x, tt, y))
    with pytest.raises(FamilyConfigError, match="model.guidance must be set"):
        fc.make(FAMILY, config=SPRINT["config"])
    with pytest.raises(FamilyConfigError, match="model.guidance=4.5"):
        fc.make(FAMILY, guidance=4.5)


def test_grid_pos_is_a_per_token_tensor():
    """Each token's flat grid position (B, N, 1) long travels with it through run_blocks' gather."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    emb = model.embed(x, model.timestep(t), model.conditioning(y, None))
    pos = emb.per_token["grid_pos"]
    assert pos.dtype == torch.long and pos.shape == (3, model.num_tokens, 1)
    assert torch.equal(pos[1, :, 0], torch.arange(model.num_tokens)) and emb.grid == (1, 4, 4)


def test_released_geometries_on_meta():
    """The released presets build on the meta device with their parameter counts; no position embedding at
    512 / 1024 px (interpolation_scale None), the sincos table at 4K; Sprint has the guidance embedder."""
    from diffusers import SanaTransformer2DModel

    expect = {"sana-600m-1024": 0.59, "sana-1600m-1024": 1.60, "sana-1600m-4k": 1.60, "sana1.5-1600m-1024": 1.60,
              "sana-sprint-1600m-1024": 1.61, "mid": 0.34}
    for name, billions in expect.items():
        with torch.device("meta"):
            tr = SanaTransformer2DModel(**{"in_channels": 4, **PRESETS[name]})
        assert round(sum(p.numel() for p in tr.parameters()) / 1e9, 2) == billions, name
        assert (tr.patch_embed.pos_embed is None) == (name != "sana-1600m-4k"), name
        assert (type(tr.time_embed).__name__ == "SanaCombinedTimestepGuidanceEmbeddings") == ("sprint" in name)
