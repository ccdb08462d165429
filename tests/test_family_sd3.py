"""SD3 / SD3.5 (diffusers SD3Transformer2DModel) with TREAD routing: the family's correctness proofs."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc

FAMILY = "sd3"
# Tiny preset: 8 joint blocks, dual attention (SD3.5) in blocks 0..3, block 7 context_pre_only.
CROSS = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]        # dual -> plain blocks
TO_LAST = [{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}]     # ends in the last block
SD30 = {"config": {"dual_attention_layers": [], "qk_norm": None}}                   # SD3.0-style blocks


def test_tiny_preset_has_both_block_kinds():
    model = fc.make(FAMILY)
    blocks = model.routable_blocks()
    assert len(blocks) == model.depth == 8
    assert [b.attn2 is not None for b in blocks] == [True] * 4 + [False] * 4
    assert [b.context_pre_only for b in blocks] == [False] * 7 + [True]


@pytest.mark.parametrize("kw", [{}, SD30, {"input_size": 16, "in_channels": 3}], ids=["sd35", "sd30", "16px-rgb"])
def test_dense_equals_diffusers(kw):
    fc.check_dense_equals_diffusers(FAMILY, **kw)


def test_ratio_zero_permuted_equals_dense():
    fc.check_ratio_zero_permuted_equals_dense(FAMILY)


@pytest.mark.parametrize("routes,kw", [(CROSS, {}), (TO_LAST, {}), ([{"selection_ratio": 0.5, "start_layer_idx": 0,
                                                                     "end_layer_idx": 2}], {}), (CROSS, SD30)],
                         ids=["dual-to-plain", "to-context-pre-only-last", "dual-only", "sd30"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, kw):
    """3. Kept tokens after the route = diffusers' blocks (pristine copy) run on the kept subsequence, per sample,
    with the text stream at the route's start and the sample's own temb (SD3: timestep = t * 1000 as given)."""
    r = fc.routed_run(FAMILY, routes, **kw)
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


@pytest.mark.parametrize("routes", [CROSS, TO_LAST], ids=["crossing", "to-last"])
def test_set_aside_bit_identical_and_text_untouched(routes):
    fc.check_set_aside_and_text(FAMILY, routes)


def test_gradients_reach_every_trained_parameter():
    fc.check_gradients_reach_all(FAMILY, TO_LAST)


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 2},
                                            {"selection_ratio": 0.75, "start_layer_idx": 4, "end_layer_idx": 7}]],
                         ids=["crossing", "dual-and-plain"])
def test_force_keep_in_dual_and_plain_blocks(routes):
    fc.check_force_keep(FAMILY, routes)


def test_gradient_checkpointing_same_gradients():
    fc.check_checkpointing_same_grads(FAMILY, TO_LAST)


def test_text_data_conditioning_and_null_drop():
    """Text embeddings from the data replace the class table; the null label zeroes them (CFG); text data
    without pooled embeddings is refused."""
    fc.check_text_conditioning(FAMILY)


def test_toy_data_with_paper_route():
    """The tiny preset builds for the built-in 3x16x16 data with the paper route (blocks 2..-4) and trains."""
    model, (_, t, _) = fc.check_paper_route_on_toy_data(FAMILY)
    assert model.timestep(t) is t   # the SD3 pipeline feeds sigma * 1000: no conversion


def test_config_errors_name_the_key():
    fc.check_config_errors(FAMILY, ("pos_embed_max_size=2", {"config": {"pos_embed_max_size": 2}}),
                           ("caption_projection_dim=32", {"config": {"caption_projection_dim": 32}}),
                           ("does not take", {"config": {"num_single_layers": 2}}))


def test_patch_size_one_sizes_the_position_table():
    """model.config.patch_size=1 (4x the tokens): the position table follows the preset's patch size."""
    fc.check_dense_equals_diffusers(FAMILY, config={"patch_size": 1})
