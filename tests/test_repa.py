"""REPA with routing: the backbone's auxiliary output (asked for with return_aux; no module state), which tokens are
aligned (the ones the block computed; inside a route only the kept ones, with the encoder features of their own
positions), the head's gradients, ratio 0 equals dense, the target grid, the training loss against a hand
computation, torch.compile, the config errors, and training end to end with the offline toy encoder (resume,
sampling from the checkpoint)."""
from __future__ import annotations

import json

import pytest
import torch

import torch.nn as nn
import torch.nn.functional as F

from tread.diffusion import EDM, RectifiedFlow
from tread.models.dit import build_dit
from tread.models.errors import ModelConfigError
from tread.models.repa import REPA_AUX, alignment_loss, patch_targets
from tread.routing import TokenRouter
from tread.schema import ConfigError
from tread.training.loop import train
from tread.training.repa import Repa
from tread.training.run_log import read_metrics

ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}
QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]


def model(block: int, ratio=0.5, routed=True, dim=8):
    torch.manual_seed(0)
    routing = {"enabled": routed, "routes": [{**ROUTE, "selection_ratio": ratio}] if routed else []}
    return build_dit("DiT-T/2", 16, 3, 10, routing=routing, repa={"block": block, "encoder_dim": dim,
                                                                  "projector_dim": 32}).train()


def forward(net, seed=0, **kwargs):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(4, 3, 16, 16, generator=g), torch.rand(4, generator=g)
    return net(x, t, torch.arange(4), **kwargs)


def aligned(net, seed=0):
    """(output, (projected tokens, ids)) of a forward asked for its auxiliary output."""
    out, aux = forward(net, seed, return_aux=True)
    return out, aux[REPA_AUX]


def test_a_block_outside_routes_aligns_every_token():
    net = model(block=1)
    _, (projected, ids) = aligned(net)
    assert projected.shape == (4, 64, 8) and ids is None


def test_the_head_runs_only_when_asked_and_leaves_nothing_on_the_model():
    plain, asked = model(block=3), model(block=3)
    before = set(vars(plain))
    out = forward(plain)
    assert isinstance(out, torch.Tensor)                              # a plain training forward: no head
    out.square().mean().backward()
    assert all(p.grad is None for p in plain.repa_head.parameters())
    out_aux, (projected, ids) = aligned(asked)
    assert torch.equal(out, out_aux)                                  # asking changes nothing else
    assert set(vars(plain)) - before == {"last_route_plan"} and set(vars(asked)) - before == {"last_route_plan"}
    assert not any(isinstance(v, torch.Tensor) for v in vars(asked).values())
    dense = build_dit("DiT-T/2", 16, 3, 10)                           # no model.repa: an empty aux
    assert forward(dense, return_aux=True)[1] == {}


def test_a_block_inside_a_route_aligns_the_kept_tokens_with_their_own_features(monkeypatch):
    chosen = []
    select = TokenRouter.select
    monkeypatch.setattr(TokenRouter, "select", lambda self, *a, **k: chosen.append(select(self, *a, **k)) or chosen[-1])
    net = model(block=3)
    _, (projected, ids) = aligned(net)
    assert projected.shape == (4, 32, 8) and torch.equal(ids, chosen[0])
    targets = torch.randn(4, 64, 8)
    manual = torch.stack([torch.nn.functional.cosine_similarity(projected[b], targets[b, ids[b]], dim=-1)
                          for b in range(4)])
    assert alignment_loss(projected, targets, ids).item() == pytest.approx(-manual.mean().item(), abs=1e-6)


def test_ratio_zero_aligns_like_dense():
    targets = torch.randn(4, 64, 8)
    losses = []
    for routed in (True, False):
        out, (projected, ids) = aligned(model(block=3, ratio=0.0, routed=routed))
        losses.append((out, alignment_loss(projected, targets, ids)))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-5)
    assert losses[0][1].item() == pytest.approx(losses[1][1].item(), abs=1e-6)


def test_the_alignment_loss_reaches_the_head_and_the_blocks_up_to_its_block():
    net = model(block=3)
    _, (projected, ids) = aligned(net)
    alignment_loss(projected, torch.randn(4, 64, 8), ids).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.repa_head.parameters())
    assert net.blocks[0].adaLN_modulation[-1].weight.grad.abs().sum() > 0   # adaLN-Zero: the gates move first
    assert net.blocks[4].adaLN_modulation[-1].weight.grad is None         # after the aligned block: untouched


def test_inference_forwards_have_no_head():
    net = model(block=3).eval()
    with torch.no_grad():
        out = forward(net)
    assert isinstance(out, torch.Tensor) and not hasattr(net, "aligned")


@pytest.mark.parametrize("objective", [EDM(), RectifiedFlow()])
def test_the_objectives_pass_the_tokens_through_unchanged(objective):
    """EDM and RF preconditioning and losses hand the backbone's aux on as it came, and their loss is the plain
    one (same draws from the global RNG)."""
    net = objective.precondition(model(block=3))
    x, y = torch.randn(4, 3, 16, 16), torch.arange(4)
    torch.manual_seed(1)
    plain = objective.loss(net, x, y)
    torch.manual_seed(1)
    loss, aux = objective.loss(net, x, y, return_aux=True)
    assert torch.equal(loss, plain) and aux[REPA_AUX][0].shape == (4, 32, 8) and aux[REPA_AUX][1].shape == (4, 32)


class PoolEncoder(nn.Module):
    """A stand-in frozen encoder: a fixed 2x2-stride convolution, images (B, 3, 16, 16) -> (B, 8, 8, 8)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(3, 8, 2, stride=2)

    def forward(self, images):
        return self.conv(images)


def test_the_training_loss_equals_a_hand_computation():
    """Repa.loss: the clean latents decoded to images (identity data), encoded, and each projected token compared
    with the encoder feature at its own position (token id n = row 8 r + column c)."""
    _, (projected, ids) = aligned(model(block=3))
    x = torch.rand(4, 3, 16, 16) * 2 - 1
    encoder = PoolEncoder()
    loss = Repa(encoder, 0.5, {}, patch=(2, 2)).loss(projected, ids, x, {"decode": {"type": "identity"}})
    with torch.no_grad():
        features = encoder(((x + 1) * 127.5).round().clamp(0, 255) / 127.5 - 1)            # (B, 8, 8, 8)
    manual = [-F.cosine_similarity(projected[b, k], features[b, :, n // 8, n % 8], dim=0)
              for b in range(4) for k, n in enumerate(ids[b].tolist())]
    assert loss.item() == pytest.approx(torch.stack(manual).mean().item(), abs=1e-6)


def test_compiled_forward_returns_the_same_tokens_in_one_graph():
    """train.compile with REPA: the head runs inside the compiled routed forward, with no graph break."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    eager, compiled = model(block=3), model(block=3)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile(backend="aot_eager")
    (a, (pa, ia)), (b, (pb, ib)) = aligned(eager), aligned(compiled)
    assert counters["stats"].get("unique_graphs", 0) == 1 and sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(pa, pb, atol=1e-6) and torch.equal(ia, ib)


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
