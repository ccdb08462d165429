"""FLUX (diffusers FluxTransformer2DModel) with TREAD routing: the proofs only FLUX has (RoPE on the kept
subsequence, the batched RoPE processor); the shared checks run for FLUX in tests/test_families.py."""
from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

import family_checks as fc
from test_families import CROSS

FAMILY = "flux"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.75, "start_layer_idx": 3, "end_layer_idx": -1}],
                                    [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]],
                         ids=["double-to-single", "single-only-to-end", "double-only"])
def test_kept_tokens_equal_blocks_on_subsequence(routes):
    check_kept_tokens(routes)


def check_kept_tokens(routes, size=None, **kw) -> None:
    """3. Kept tokens after the route = diffusers' blocks run on the kept subsequence, per sample, with the
    kept tokens' own position ids (the pipeline's _prepare_latent_image_ids(H/2, W/2), sliced; RoPE computed from
    them), diffusers' default processors; on latents of the default size or of size = (H, W)."""
    r = fc.routed_run(FAMILY, routes, size=size, **kw)
    model, x, t, y, seen, routed_in, route = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    text = model.conditioning(y, None)
    blocks = [*ref_tr.transformer_blocks, *ref_tr.single_transformer_blocks]
    H, W = x.shape[-2:]
    img_ids = FluxPipeline._prepare_latent_image_ids(1, H // 2, W // 2, x.device, x.dtype)
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


def test_batched_rope_processor_with_fused_qkv():
    """Fused QKV projections honour per-sample RoPE too (a known weak point elsewhere)."""
    fc.check_fused_projections(FAMILY, CROSS)
