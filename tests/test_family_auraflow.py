"""AuraFlow (diffusers AuraFlowTransformer2DModel) with TREAD routing: the family's correctness proofs."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc

FAMILY = "auraflow"
# Tiny preset: 2 joint (MMDiT) + 6 single (DiT) blocks. A route over blocks 1..5 crosses the boundary.
CROSS = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 5}]
REGISTERS = 8


def test_dense_equals_diffusers():
    fc.check_dense_equals_diffusers(FAMILY)


def test_dense_equals_diffusers_16px_rgb():
    fc.check_dense_equals_diffusers(FAMILY, input_size=16, in_channels=3)


def test_ratio_zero_permuted_equals_dense():
    fc.check_ratio_zero_permuted_equals_dense(FAMILY)


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}],
                                    [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]],
                         ids=["joint-to-single", "single-only-to-end", "joint-only"])
def test_kept_tokens_equal_blocks_on_subsequence(routes):
    """3. Kept tokens after the route = diffusers' blocks (pristine copy) run on the kept subsequence, per sample.
    Joint blocks get (kept image, [registers, text]); at the first single block the reference concatenates
    [registers, text, kept image] once, as diffusers' forward does, runs the single blocks on it and splits at
    the end. temb follows the AuraFlow pipeline: timestep t = noise_level / 1000, scaled by 1000 inside."""
    r = fc.routed_run(FAMILY, routes)
    model, x, t, y, seen, routed_in, route = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    n_joint = len(ref_tr.joint_transformer_blocks)
    blocks = [*ref_tr.joint_transformer_blocks, *ref_tr.single_transformer_blocks]
    with torch.no_grad():
        temb = ref_tr.time_step_proj(ref_tr.time_step_embed(t / 1000))
        for b in range(x.shape[0]):
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]          # dense route-start tokens, kept subset
            c = seen[route.start_layer_idx][1][b:b + 1]                  # [registers, text] at the route's start
            L = c.shape[1]
            assert L == REGISTERS + model.text_len
            combined = None
            for i in range(route.start_layer_idx, route.end_layer_idx + 1):
                if i < n_joint:
                    c, h = blocks[i](hidden_states=h, encoder_hidden_states=c, temb=temb[b:b + 1])
                else:
                    combined = torch.cat([c, h], dim=1) if combined is None else combined
                    combined = blocks[i](hidden_states=combined, temb=temb[b:b + 1])
            if combined is not None:
                c, h = combined[:, :L], combined[:, L:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                     # registers + text after the route
                torch.testing.assert_close(routed_in[route.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)


def test_single_blocks_see_all_text_and_registers_but_only_kept_image_tokens():
    """In the single blocks diffusers' concatenation holds [registers, text, kept image tokens] only."""
    model = fc.make(FAMILY, CROSS).train()
    lengths = []
    hooks = [blk.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["hidden_states"].shape[1]),
                                           with_kwargs=True) for blk in model.transformer.single_transformer_blocks]
    x, t, y = fc.inputs(model)
    model(x, t, y)
    for hk in hooks:
        hk.remove()
    N, ctx = model.num_tokens, REGISTERS + model.text_len
    K = model.routing.routes[0].num_keep(N)
    assert lengths == [ctx + K] * 4 + [ctx + N] * 2      # single blocks 2..5 routed, 6..7 dense


def test_set_aside_bit_identical_and_text_untouched():
    fc.check_set_aside_and_text(FAMILY, CROSS)


def test_gradients_reach_every_trained_parameter():
    fc.check_gradients_reach_all(FAMILY, CROSS)


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1},
                                            {"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": 6}]],
                         ids=["crossing", "joint-and-single"])
def test_force_keep_in_joint_and_single_blocks(routes):
    fc.check_force_keep(FAMILY, routes)


def test_gradient_checkpointing_same_gradients():
    fc.check_checkpointing_same_grads(FAMILY, CROSS)


def test_text_data_conditioning_and_null_drop():
    """Text embeddings from the data replace the class table (AuraFlow has no pooled text); the null label
    zeroes them (CFG)."""
    model, *_ = fc.check_text_conditioning(FAMILY)
    assert model.pooled_dim is None


def test_toy_data_with_paper_route():
    """The tiny preset builds for the built-in 3x16x16 data with the paper route (blocks 2..-4) and trains."""
    model, (_, t, _) = fc.check_paper_route_on_toy_data(FAMILY)
    torch.testing.assert_close(model.timestep(t), t / 1000)   # the AuraFlow pipeline feeds t in [0, 1]


def test_config_errors_name_the_key():
    fc.check_config_errors(FAMILY, ("pos_embed_max_size=9", {"config": {"pos_embed_max_size": 9}}),
                           ("caption_projection_dim=32", {"config": {"caption_projection_dim": 32}}))


def test_patch_size_one_sizes_the_position_table():
    """model.config.patch_size=1 (4x the tokens): the position table follows the preset's patch size."""
    fc.check_dense_equals_diffusers(FAMILY, config={"patch_size": 1})
