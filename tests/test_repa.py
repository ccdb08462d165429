"""REPA with routing: which tokens are aligned (the ones the block computed; inside a route only the kept ones,
with the encoder features of their own positions), the head's gradients, ratio 0 equals dense, the target grid,
the config errors, and training end to end with the offline toy encoder (resume, sampling from the checkpoint)."""
from __future__ import annotations

import json

import pytest
import torch

from tread.models.dit import build_dit
from tread.models.errors import ModelConfigError
from tread.models.repa import alignment_loss, patch_targets
from tread.routing import TokenRouter
from tread.schema import ConfigError
from tread.training.loop import train
from tread.training.run_log import read_metrics

ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}
QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]


def model(block: int, ratio=0.5, routed=True, dim=8):
    torch.manual_seed(0)
    routing = {"enabled": routed, "routes": [{**ROUTE, "selection_ratio": ratio}] if routed else []}
    return build_dit("DiT-T/2", 16, 3, 10, routing=routing, repa={"block": block, "encoder_dim": dim,
                                                                  "projector_dim": 32}).train()


def forward(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(4, 3, 16, 16, generator=g), torch.rand(4, generator=g)
    return net(x, t, torch.arange(4))


def test_a_block_outside_routes_aligns_every_token():
    net = model(block=1)
    forward(net)
    projected, ids = net.aligned
    assert projected.shape == (4, 64, 8) and ids is None


def test_a_block_inside_a_route_aligns_the_kept_tokens_with_their_own_features(monkeypatch):
    chosen = []
    select = TokenRouter.select
    monkeypatch.setattr(TokenRouter, "select", lambda self, *a, **k: chosen.append(select(self, *a, **k)) or chosen[-1])
    net = model(block=3)
    forward(net)
    projected, ids = net.aligned
    assert projected.shape == (4, 32, 8) and torch.equal(ids, chosen[0])
    targets = torch.randn(4, 64, 8)
    manual = torch.stack([torch.nn.functional.cosine_similarity(projected[b], targets[b, ids[b]], dim=-1)
                          for b in range(4)])
    assert alignment_loss(projected, targets, ids).item() == pytest.approx(-manual.mean().item(), abs=1e-6)


def test_ratio_zero_aligns_like_dense():
    targets = torch.randn(4, 64, 8)
    losses = []
    for routed in (True, False):
        net = model(block=3, ratio=0.0, routed=routed)
        out = forward(net)
        losses.append((out, alignment_loss(*net.aligned[:1], targets, net.aligned[1])))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-5)
    assert losses[0][1].item() == pytest.approx(losses[1][1].item(), abs=1e-6)


def test_the_alignment_loss_reaches_the_head_and_the_blocks_up_to_its_block():
    net = model(block=3)
    forward(net)
    projected, ids = net.aligned
    alignment_loss(projected, torch.randn(4, 64, 8), ids).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.repa_head.parameters())
    assert net.blocks[0].adaLN_modulation[-1].weight.grad.abs().sum() > 0   # adaLN-Zero: the gates move first
    assert net.blocks[4].adaLN_modulation[-1].weight.grad is None         # after the aligned block: untouched


def test_inference_forwards_have_no_head():
    net = model(block=3).eval()
    with torch.no_grad():
        out = forward(net)
    assert isinstance(out, torch.Tensor) and net.aligned is None


def test_patch_targets_follow_the_token_order_and_pool_finer_grids():
    feats = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    same = patch_targets(feats, (4, 4))
    assert same.shape == (2, 16, 3) and torch.equal(same[:, 5], feats[:, :, 1, 1])   # row-major tokens
    pooled = patch_targets(feats, (2, 2))
    assert torch.allclose(pooled[:, 0], feats[:, :, :2, :2].mean(dim=(-1, -2)))
    assert patch_targets(feats, (8, 8)).shape == (2, 64, 3)


@pytest.mark.parametrize("repa,match", [({"block": 12, "encoder_dim": 8}, "model.repa.block=12"),
                                        ({"block": 2, "encoder_dim": None}, "model.repa.encoder_dim=None")])
def test_bad_head_settings_are_clear_errors(repa, match):
    with pytest.raises(ModelConfigError, match=match):
        build_dit("DiT-T/2", 16, 3, 10, repa=repa)


def test_repa_on_a_family_model_is_refused(tiny_cfg):
    from tread.schema import check_train
    with pytest.raises(ConfigError, match="REPA alignment is implemented for DiT models"):
        check_train(tiny_cfg("model=flux", "repa=toy"))


def test_training_with_the_toy_encoder_resumes_exactly_and_samples(tiny_cfg, tmp_path):
    common = [*QUIET, "repa=toy", "train.lr_warmup_steps=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    summary = train(tiny_cfg(*common, "train.max_steps=4"), full)
    train(tiny_cfg(*common, "train.max_steps=2"), part)
    train(tiny_cfg(*common, "train.max_steps=4", "resume=auto"), part)
    a = [r["loss"] for r in read_metrics(full) if r["type"] == "train"]
    b = [r["loss"] for r in read_metrics(part) if r["type"] == "train"]
    assert a == b and len(a) == 4
    repa = [r["repa_loss"] for r in read_metrics(full) if r["type"] == "train"]
    assert all(-1 <= v <= 1 for v in repa)                           # a mean negative cosine, logged per record
    weight = 0.5                                     # configs/repa/toy.yaml
    for r in (r for r in read_metrics(full) if r["type"] == "train"):   # loss = diffusion term + weight x REPA term
        assert r["diffusion_loss"] == pytest.approx(r["loss"] - weight * r["repa_loss"]) and r["diffusion_loss"] > 0
    saved = json.loads((full / "checkpoints" / "step_0000004" / "checkpoint.json").read_text())["config"]
    assert saved["model"]["repa"]["encoder_dim"] >= 1                 # filled in from the encoder
    assert summary["train_flops_per_step"] > 0
