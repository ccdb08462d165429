"""PixArt (diffusers PixArtTransformer2DModel) with TREAD routing: the proofs only PixArt has (masked text from
the data, learned sigma, additional conditions, the kept subsequence with class or masked text); the shared
checks run for PixArt in tests/test_families.py."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from test_families import SPAN

FAMILY = "pixart"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dense_with_text_mask_equals_diffusers():
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = fc.masked_text(model)
    with torch.no_grad():
        ours, ref = model(x, t, y, cond=cond), model.reference_forward(x, t, y, cond=cond)
        unmasked = model(x, t, y, cond={"text": cond["text"]})
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours[1:], unmasked[1:])      # the mask is honoured


def test_learned_sigma_dropped_and_plain_output_accepted():
    """out_channels = 2C (learned sigma): we return the first C channels of diffusers' output."""
    model = fc.make(FAMILY).eval()
    assert model.transformer.config.out_channels == 2 * model.in_channels
    x, t, y = fc.inputs(model)
    text = model.conditioning(y, None)
    with torch.no_grad():
        full = model.pristine_transformer()(hidden_states=x, encoder_hidden_states=text["text"], timestep=t,
                                            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                            return_dict=False)[0]
        assert full.shape[1] == 2 * model.in_channels
        torch.testing.assert_close(model(x, t, y), full[:, :model.in_channels], rtol=1e-6, atol=1e-6)
    fc.check_dense_equals_diffusers(FAMILY, config={"out_channels": 4})


def test_additional_conditions_equal_diffusers():
    """PixArt-alpha 1024 conditions on resolution and aspect ratio (pixels), as its pipeline passes them."""
    cfg = {"use_additional_conditions": True, "attention_head_dim": 12, "cross_attention_dim": 48}  # width 48
    fc.check_dense_equals_diffusers(FAMILY, config=cfg)
    model = fc.make(FAMILY, config=cfg, vae_scale_factor=8)
    res = model._added_cond(torch.zeros(2, 4, 8, 8))
    assert res["resolution"].tolist() == [[64.0, 64.0]] * 2 and res["aspect_ratio"].tolist() == [[1.0]] * 2


@pytest.mark.parametrize("masked", [False, True], ids=["class-text", "masked-text"])
@pytest.mark.parametrize("routes", [SPAN, [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]],
                         ids=["inner", "all-blocks"])
def test_kept_tokens_equal_blocks_on_subsequence(routes, masked):
    """3. Kept tokens after the route = diffusers' BasicTransformerBlocks run on the kept subsequence, per
    sample: the dense route-start tokens (absolute position embedding already added) sliced by the kept ids,
    the sample's own adaLN-single modulation, its projected text and its text mask."""
    r = fc.routed_run(FAMILY, routes, cond=fc.masked_text if masked else None)
    model, x, t, y, cond, seen, routed_in, route = r.model, r.x, r.t, r.y, r.cond, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref = model.pristine_transformer()
    text = cond["text"] if masked else model.conditioning(y, None)["text"]
    with torch.no_grad():
        for b in range(x.shape[0]):
            t6, _ = ref.adaln_single(t[b:b + 1], {"resolution": None, "aspect_ratio": None}, batch_size=1,
                                     hidden_dtype=x.dtype)
            ctx = ref.caption_projection(text[b:b + 1])
            # projected for 1 sample here, for the whole batch in the model: other matmul shapes, float32 tolerance
            torch.testing.assert_close(seen[route.start_layer_idx][1][b:b + 1], ctx)
            bias = None
            if masked:
                bias = torch.where(cond["text_mask"][b:b + 1], 0.0, -10000.0)[:, None, :]   # (1, 1, L)
            h = seen[route.start_layer_idx][0][b:b + 1, ids[b]]          # dense route-start tokens, kept subset
            for blk in ref.transformer_blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                h = blk(h, encoder_hidden_states=ctx, encoder_attention_mask=bias, timestep=t6)
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
        # the text stream enters every block unchanged, full length
        assert all(torch.equal(c, seen[0][1]) for _, c in routed_in)
