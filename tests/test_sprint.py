"""SPRINT-style sparse-dense residual fusion (tread/models/sprint.py) and path-drop guidance: shapes, gradients reach
every parameter, ratio 0 equals the fused dense forward, routes other than the span are refused, the path-dropped
prediction skips the deep blocks and equals the mask-token forward, the guidance algebra, training path drop,
REPA's aligned tokens, FLOPs, and a tiny training run with a dense fine-tuning phase."""
from __future__ import annotations

import pytest
import torch

from tread.models.repa import REPA_AUX
from tread.models.sprint import SprintDiT, build_sprint
from tread.routing import RouteConfigError, TokenRouter
from tread.sampling.guidance import PATH_DROP, Guidance, GuidanceError
from tread.training.loop import train
from tread.training.run_log import read_metrics

SPAN = {"start": 2, "end": -3}


def model(ratio=0.75, routed=True, path_drop_prob=0.0, perturb=True, **routing):
    torch.manual_seed(0)
    routes = [{"selection_ratio": ratio, "start_layer_idx": 2, "end_layer_idx": -3}] if routed else []
    net = build_sprint("DiT-T/2", 16, 3, 10, routing={"enabled": routed, "routes": routes, **routing},
                       sprint={**SPAN, "path_drop_prob": path_drop_prob})
    if perturb:   # leave adaLN-Zero: every weight then gets a gradient
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.02 * torch.randn_like(p))
    return net


def inputs(B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, 16, 16, generator=g), torch.rand(B, generator=g), torch.arange(B) % 10


def shallow_and_final(net, x, t, y, deep):
    """The forward with a given deep output (B, N, D) in place of the span's."""
    h = net.x_embedder(x) + net.pos_embed
    c = net.t_embedder(t) + net.y_embedder(y)
    for blk in net.blocks[:2]:
        h = blk(h, c)
    h = net.fuse(torch.cat([deep(h), h], dim=-1))
    for blk in net.blocks[10:]:
        h = blk(h, c)
    return net.unpatchify(net.final_layer(h, c))


def test_shapes_and_gradients_reach_every_parameter():
    net = model().train()
    x, t, y = inputs()
    out = net(x, t, y)
    assert out.shape == x.shape and net.span == (2, 9)
    assert net.last_route_plan.keep == [16]                          # 64 tokens, 75% dropped
    out.square().mean().backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == ["y_embedder.embedding_table.weight"] or missing == []   # the null row is never used


def test_ratio_zero_equals_the_fused_dense_forward():
    net = model(ratio=0.0).train()
    x, t, y = inputs()
    routed = net(x, t, y)
    with net.routing.override(routes=[]):
        dense = net(x, t, y)
    assert torch.allclose(routed, dense, atol=1e-5)


def test_inference_fuses_the_full_deep_span():
    net = model().eval()
    x, t, y = inputs()

    def deep(h):
        c = net.t_embedder(t) + net.y_embedder(y)
        for blk in net.blocks[2:10]:
            h = blk(h, c)
        return h
    with torch.no_grad():
        assert torch.allclose(net(x, t, y), shallow_and_final(net, x, t, y, deep), atol=1e-6)


@pytest.mark.parametrize("routing", [
    {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}]},
    {"schedule": [{"start_step": 0}, {"start_step": 5, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 3,
                                                                   "end_layer_idx": 9}]}]}])
def test_routes_other_than_the_span_are_refused(routing):
    routes = routing.get("routes", [{"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": -3}])
    with pytest.raises(RouteConfigError, match="allowed is one route with start_layer_idx=2, end_layer_idx=9"):
        build_sprint("DiT-T/2", 16, 3, 10, routing={"enabled": True, **routing, "routes": routes}, sprint=SPAN)


def test_path_dropped_rows_skip_the_deep_blocks_and_use_the_mask_token():
    net = model().eval()
    x, t, y = inputs()
    rows = []
    hooks = [b.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0])) for b in net.blocks[2:10]]
    drop = torch.tensor([False, True, False, True])
    with torch.no_grad():
        out = net(x, t, y, path_drop=drop)
        none = net(x, t, y, path_drop=torch.ones(4, dtype=torch.bool))
    for h in hooks:
        h.remove()
    assert rows == [2] * 8                                           # only the two kept rows ran the span
    with torch.no_grad():
        masked = shallow_and_final(net, x, t, y, lambda h: net.mask_token.expand_as(h))
        full = net(x, t, y)
    assert torch.allclose(none, masked, atol=1e-6)
    assert torch.allclose(out[drop], masked[drop], atol=1e-6) and torch.allclose(out[~drop], full[~drop], atol=1e-6)


def test_training_drops_whole_paths_with_its_probability():
    net = model(routed=False, path_drop_prob=0.5).train()
    x, t, y = inputs(B=8)
    torch.manual_seed(3)
    out = net(x, t, y)
    torch.manual_seed(3)
    drop = torch.rand(8) < 0.5
    assert 0 < drop.sum() < 8
    with torch.no_grad():
        masked = shallow_and_final(net, x, t, y, lambda h: net.mask_token.expand_as(h))
    assert torch.allclose(out[drop].detach(), masked[drop], atol=1e-6)
    assert not torch.allclose(out[~drop].detach(), masked[~drop], atol=1e-3)


@pytest.mark.parametrize("block,ids", [(1, None), (5, "kept"), (11, None)])
def test_repa_aligns_the_tokens_each_block_computed(block, ids, monkeypatch):
    """REPA on SPRINT (return_aux): a dense block aligns all 64 tokens (ids None); a deep-span block only the
    router's kept tokens, with their positions as ids."""
    chosen = []
    select = TokenRouter.select
    monkeypatch.setattr(TokenRouter, "select", lambda self, *a, **k: chosen.append(select(self, *a, **k)) or chosen[-1])
    torch.manual_seed(0)
    net = build_sprint("DiT-T/2", 16, 3, 10, routing={"enabled": True, "routes": [
        {"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": -3}]}, sprint={**SPAN, "path_drop_prob": 0.0},
        repa={"block": block, "encoder_dim": 8, "projector_dim": 16}).train()
    out, aux = net(*inputs(), return_aux=True)
    projected, got = aux[REPA_AUX]
    assert out.shape == (4, 3, 16, 16) and projected.shape == (4, 16 if ids else 64, 8)
    assert got is None if ids is None else torch.equal(got, chosen[0])


def test_path_drop_guidance_algebra_and_cost():
    net = model().eval()
    x, t, y = inputs()
    stats: dict = {}
    with torch.no_grad():
        guided = Guidance(cfg_scale=3.0, path_drop=True).denoiser(net, null_label=10, stats=stats)(x, t, y)
        cond = net(x, t, y)
        uncond = net(x, t, torch.full_like(y, 10), path_drop=torch.ones(4, dtype=torch.bool))
    assert torch.allclose(guided, uncond + 3.0 * (cond - uncond), atol=1e-5)
    assert stats == {None: 4, PATH_DROP: 4}
    assert net.forward_flops([], path_dropped=True) < 0.5 * net.forward_flops([])


def test_path_drop_needs_a_sprint_model():
    from tread.models.dit import build_dit
    with pytest.raises(GuidanceError, match="path_drop=true needs a SPRINT model"):
        Guidance(cfg_scale=2.0, path_drop=True).check(build_dit("DiT-T/2", 16, 3, 10))


def test_flops_count_the_fusion_and_the_kept_tokens():
    net = model(perturb=False)
    assert isinstance(net, SprintDiT)
    dense, routed = net.forward_flops([]), net.forward_flops()
    N, D = 64, 96
    assert dense - routed > 0
    assert dense == pytest.approx(net.__class__.__mro__[1].forward_flops(net, []) + 2 * N * 2 * D * D)


def test_tiny_run_with_a_dense_fine_tuning_phase(tiny_cfg, tmp_path):
    summary = train(tiny_cfg("model=sprint", "eval.every_steps=0", "checkpoint.every_steps=0",
                             "routing.schedule=[{start_step:0},{start_step:2,routes:[]}]"), tmp_path / "run")
    recs = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert [r["tokens_fraction"] for r in recs] == pytest.approx([0.5, 0.5, 1.0, 1.0])
    assert summary["status"] == "completed" and summary["final_fid"] is not None
