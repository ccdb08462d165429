"""FLUX (diffusers FluxTransformer2DModel) with TREAD routing: the correctness proofs of issue 4."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc

FAMILY = "flux"
# Tiny preset: 2 double-stream + 6 single-stream blocks. A route over blocks 1..5 crosses the boundary.
CROSS = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 5}]


def test_dense_equals_diffusers():
    fc.check_dense_equals_diffusers(FAMILY)


def test_ratio_zero_permuted_equals_dense():
    fc.check_ratio_zero_permuted_equals_dense(FAMILY)


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}],
                                    [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]],
                         ids=["double-to-single", "single-only-to-end", "double-only"])
def test_kept_tokens_equal_blocks_on_subsequence(routes):
    """3. Kept tokens after the route = diffusers' blocks run on the kept subsequence, per sample, with the
    kept tokens' own position ids (RoPE computed from the sliced ids), diffusers' default processors."""
    r = fc.routed_run(FAMILY, routes)
    model, x, t, y, seen, routed_in, route = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    text = model.conditioning(y, None)
    blocks = [*ref_tr.transformer_blocks, *ref_tr.single_transformer_blocks]
    img_ids = model.image_ids(x.device)
    with torch.no_grad():
        temb = ref_tr.time_text_embed(t / 1000 * 1000, text["pooled"])
        for b in range(x.shape[0]):
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]           # dense route-start tokens, kept subset
            c = seen[route.start_layer_idx][1][b:b + 1]                   # text stream at the route's start
            L = c.shape[1]
            rope = ref_tr.pos_embed(torch.cat([torch.zeros(L, 3), img_ids[ids[b]]]))  # true positions
            for blk in blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                c, h = blk(hidden_states=h, encoder_hidden_states=c, temb=temb[b:b + 1], image_rotary_emb=rope)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                      # the text stream after the route
                torch.testing.assert_close(routed_in[route.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)


def test_set_aside_bit_identical_and_text_untouched():
    fc.check_set_aside_and_text(FAMILY, CROSS)


def test_gradients_reach_every_trained_parameter():
    fc.check_gradients_reach_all(FAMILY, CROSS)


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1},
                                            {"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": 6}]],
                         ids=["crossing", "double-and-single"])
def test_force_keep_in_double_and_single_blocks(routes):
    fc.check_force_keep(FAMILY, routes)


def test_gradient_checkpointing_same_gradients():
    fc.check_checkpointing_same_grads(FAMILY, CROSS)


def test_batched_rope_processor_with_fused_qkv():
    """Fused QKV projections honour per-sample RoPE too (a known weak point elsewhere)."""
    fc.check_fused_projections(FAMILY, CROSS)


def test_text_data_conditioning_and_null_drop():
    """Text embeddings from the data replace the class table; the null label zeroes them (CFG)."""
    fc.check_text_conditioning(FAMILY)


def test_config_errors_name_the_key():
    fc.check_config_errors(FAMILY)
