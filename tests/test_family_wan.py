"""Wan (diffusers WanTransformer3DModel) with TREAD routing: the proofs only Wan has, for images (T = 1) and
video (T = 3), with per-sample and per-token (Wan 2.2 TI2V) timesteps; the shared checks run for Wan (image,
video and per-token cases) in tests/test_families.py."""
from __future__ import annotations

import pytest
import torch

from tread.models.families import FamilyConfigError
import family_checks as fc
from test_families import SPAN, VIDEO

FAMILY = "wan"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("frames", [1, 3])
def test_dense_per_token_timesteps_equal_diffusers(frames):
    model = fc.make(FAMILY, frames=frames).eval()
    x, _, y = fc.inputs(model, frames=frames)
    t = fc.per_token_timesteps(model)
    with torch.no_grad():
        ours, ref = model(x, t, y), model.reference_forward(x, t, y)
        uniform = model(x, t.mean(1), y)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, uniform)    # the per-token timesteps matter


def test_ratio_zero_permuted_per_token_timesteps_equals_dense():
    """A permutation moves each token's own timestep modulation with it."""
    model = fc.make(FAMILY, [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}], **VIDEO).train()
    x, _, y = fc.inputs(model, frames=3)
    t = fc.per_token_timesteps(model)
    with torch.no_grad(), fc.fixed_selection(model, fc.random_permutation(7)) as calls:
        with torch.enable_grad():
            routed = model(x, t, y)
        dense = model.eval()(x, t, y)
    assert calls
    torch.testing.assert_close(routed, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frames,per_token", [(1, False), (3, False), (1, True), (3, True)],
                         ids=["T1", "T3", "T1-per-token-t", "T3-per-token-t"])
@pytest.mark.parametrize("routes", [SPAN, [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]],
                         ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, frames, per_token):
    """3. Kept tokens after the route = diffusers' blocks (default WanAttnProcessor) run on the kept
    subsequence, per sample, with the RoPE rows of the kept tokens' true (t, h, w) positions sliced from
    diffusers' full table and, for per-token timesteps, the modulation computed from their own timesteps."""
    r = fc.routed_run(FAMILY, routes, frames=frames, timesteps=fc.per_token_timesteps if per_token else None)
    model, x, t, y, seen, route = r.model, r.x, r.t, r.y, r.dense, r.route
    _, x_kept, ids, _ = r.scatter
    K = ids.shape[1]
    ref_tr = model.pristine_transformer()
    text = model.conditioning(y, None)["text"]
    x5 = x if x.dim() == 5 else x.unsqueeze(2)
    assert x5.shape[2] == frames
    with torch.no_grad():
        cos, sin = ref_tr.rope(x5)                                              # (1, N, 1, Dh): all positions
        assert cos.shape[1] == model.num_tokens
        for b in range(x.shape[0]):
            if frames > 1:   # the kept set spans several frames, so the temporal positions are exercised
                assert len(set((ids[b] // (model.num_tokens // frames)).tolist())) > 1
            if per_token:
                ts = t[b, ids[b]]
                assert len(set(ts.tolist())) > 1
                _, proj, ctx, _ = ref_tr.condition_embedder(ts, text[b:b + 1], timestep_seq_len=K)
                proj = proj.unflatten(2, (6, -1))                               # (1, K, 6, D)
            else:
                _, proj, ctx, _ = ref_tr.condition_embedder(t[b:b + 1], text[b:b + 1])
                proj = proj.unflatten(1, (6, -1))                               # (1, 6, D)
            # embedded for 1 sample here, for the whole batch in the model: other matmul shapes, float32 tolerance
            torch.testing.assert_close(seen[route.start_layer_idx][1][b:b + 1], ctx)
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]                 # dense route-start tokens, kept
            rope = (cos[:, ids[b]], sin[:, ids[b]])                             # their true (t, h, w) rows
            for blk in ref_tr.blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                h = blk(h, ctx, proj, rope)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if per_token and b == 0:   # the check has teeth: other tokens' timesteps give other values
                wrong = ref_tr.condition_embedder(ts.flip(0), text[b:b + 1], timestep_seq_len=K)[1].unflatten(2, (6, -1))
                h2 = seen[route.start_layer_idx][0][b:b + 1, ids[b]]
                for blk in ref_tr.blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                    h2 = blk(h2, ctx, wrong, rope)
                assert not torch.allclose(x_kept[b:b + 1], h2, rtol=1e-3, atol=1e-3)


def test_fused_projections_same_routed_output():
    """diffusers' fused QKV / KV projections go through the same (unreplaced) processor."""
    fc.check_fused_projections(FAMILY, SPAN, timesteps=fc.per_token_timesteps, **VIDEO)


def test_masked_text_positions_are_zeroed():
    """Masked text positions are zeroed (the Wan pipeline's padding), on top of the shared text check (text
    from the data replaces the class table, the null label zeroes it)."""
    model, x, t, y, cond, out = fc.check_text_conditioning(FAMILY, with_mask=True, **VIDEO)
    padded = {"text": cond["text"][:1] * cond["text_mask"][:1, :, None]}
    with torch.no_grad():
        torch.testing.assert_close(out[:1], model(x[:1], t[:1], y[:1], cond=padded), rtol=1e-6, atol=1e-6)


def test_per_token_timesteps_of_the_wrong_length_are_refused():
    model = fc.make(FAMILY)
    x, _, y = fc.inputs(model, batch=2)
    with pytest.raises(FamilyConfigError, match="per-token timestep"):
        model(x, torch.zeros(2, model.num_tokens + 1), y)
