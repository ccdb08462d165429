"""AuraFlow (diffusers AuraFlowTransformer2DModel) with TREAD routing: the proofs only AuraFlow has (registers,
joint -> single blocks on the kept subsequence, the position table); the shared checks run for AuraFlow in
tests/test_families.py."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from test_families import CROSS   # tiny preset: 2 joint (MMDiT) + 6 single (DiT) blocks; CROSS: blocks 1..5

FAMILY = "auraflow"
REGISTERS = 8

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_patch_size_one_sizes_the_position_table():
    """model.config.patch_size=1 (4x the tokens): the position table follows the preset's patch size."""
    fc.check_dense_equals_diffusers(FAMILY, config={"patch_size": 1})
