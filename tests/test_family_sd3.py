"""SD3 / SD3.5 (diffusers SD3Transformer2DModel) with TREAD routing: the proofs only SD3 has (its two block
kinds, the kept subsequence through them, the position table); the shared checks run for SD3 in
tests/test_families.py."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from test_families import SD30, SPAN, TO_LAST

FAMILY = "sd3"
# Tiny preset: 8 joint blocks, dual attention (SD3.5) in blocks 0..3, block 7 context_pre_only.
CROSS = SPAN                                                                        # dual -> plain blocks

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_preset_has_both_block_kinds():
    model = fc.make(FAMILY)
    blocks = model.routable_blocks()
    assert len(blocks) == model.depth == 8
    assert [b.attn2 is not None for b in blocks] == [True] * 4 + [False] * 4
    assert [b.context_pre_only for b in blocks] == [False] * 7 + [True]


@pytest.mark.parametrize("routes,kw", [(CROSS, {}), (TO_LAST, {}), ([{"selection_ratio": 0.5, "start_layer_idx": 0,
                                                                     "end_layer_idx": 2}], {}), (CROSS, SD30)],
                         ids=["dual-to-plain", "to-context-pre-only-last", "dual-only", "sd30"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, kw):
    check_kept_tokens(routes, **kw)


def check_kept_tokens(routes, size=None, **kw) -> None:
    """3. Kept tokens after the route = diffusers' blocks (pristine copy) run on the kept subsequence, per sample,
    with the text stream at the route's start and the sample's own temb (SD3: timestep = t * 1000 as given); the
    positions are in the route-start tokens (PatchEmbed's crop); latents of the default size or size = (H, W)."""
    r = fc.routed_run(FAMILY, routes, size=size, **kw)
    model, x, t, y, seen, routed_in, route = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    text = model.conditioning(y, None)
    blocks = list(ref_tr.transformer_blocks)
    with torch.no_grad():
        temb = ref_tr.time_text_embed(t, text["pooled"])
        for b in range(x.shape[0]):
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]          # dense route-start tokens, kept subset
            c = seen[route.start_layer_idx][1][b:b + 1]                  # full text stream at the route's start
            for blk in blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                c, h = blk(hidden_states=h, encoder_hidden_states=c, temb=temb[b:b + 1])
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                     # the text stream after the route
                torch.testing.assert_close(routed_in[route.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)
            else:
                assert c is None                                         # context_pre_only: no text afterwards


def test_patch_size_one_sizes_the_position_table():
    """model.config.patch_size=1 (4x the tokens): the position table follows the preset's patch size."""
    fc.check_dense_equals_diffusers(FAMILY, config={"patch_size": 1})
