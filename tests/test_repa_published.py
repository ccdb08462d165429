"""REPA as published and its controls: the aligned block from the model's depth by REPA's rule (model.repa.block
null), and the control encoders toy_random (the toy encoder's architecture, untrained) and toy_fid (the FID feature
network itself), built as training builds them."""
from __future__ import annotations

import pytest
import torch

from tread.evaluation.evaluator import decode_options
from tread.encoders.patch import REPA_TOY_SEED, build_patch_encoder, random_toy_classifier
from tread.evaluation.extractors import feature_extractor
from tread.models.dit import build_dit
from tread.models.repa import published_repa_block
from tread.schema import ConfigError, check_train
from tread.training.repa import build_repa, with_resolved

pytestmark = pytest.mark.usefixtures("one_thread")


def images(n=4, side=16, seed=0):
    """uint8 (n, 3, side, side) images and the same in [-1, 1] as the REPA encoders take them."""
    x = torch.randint(0, 256, (n, 3, side, side), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return x, x.float() / 127.5 - 1


def repa_of(cfg):
    """The run's Repa as training builds it, and the checked config."""
    c = check_train(cfg)
    return build_repa(c.model, c.data.resolution, c.paths.cache_dir, decode_options(c.eval), torch.device("cpu")), c


def encoder_of(tiny_cfg, name):
    cfg = tiny_cfg(f"repa={name}")
    return repa_of(cfg)[0].encoder, cfg                       # configs/repa/<name>.yaml passes the schema


@pytest.mark.parametrize("name", ["toy", "toy_random", "toy_fid"])
def test_each_toy_encoder_builds_frozen_with_its_configured_width(tiny_cfg, name):
    encoder, cfg = encoder_of(tiny_cfg, name)
    side = int(cfg.data.resolution)
    out = encoder(images(side=side)[1])
    assert encoder.dim == cfg.model.repa.encoder_dim == 128 and out.shape == (4, 128, side // 4, side // 4)
    assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())


def test_toy_fid_is_the_fid_feature_network(tiny_cfg, cache_dir):
    """Same weights as eval.features=toy_classifier's network, and its feature map is the one the FID features pool:
    FID feature = embed(spatial mean of the map)."""
    encoder, cfg = encoder_of(tiny_cfg, "toy_fid")
    fid = feature_extractor("toy_classifier", cache_dir=cache_dir, resolution=int(cfg.data.resolution))
    ours, theirs = encoder.classifier.state_dict(), fid.classifier.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    raw, x = images(side=int(cfg.data.resolution))
    with torch.no_grad():
        fmap = encoder(x)
        assert torch.equal(fmap, fid.classifier.trunk[:encoder.LAST_CONV + 1](x))
        assert torch.allclose(fid(raw), fid.classifier.embed(fmap.mean(dim=(2, 3))), atol=1e-6)
    toy, _ = encoder_of(tiny_cfg, "toy")                      # REPA's own toy encoder is another network
    assert not torch.equal(toy(x), fmap)


def test_toy_random_is_deterministic_untrained_and_leaves_the_global_rng_alone(tiny_cfg):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a, cfg = encoder_of(tiny_cfg, "toy_random")
    assert torch.equal(torch.rand(3), expected)               # building it draws nothing from the global RNG
    b = build_patch_encoder("toy_random", resolution=int(cfg.data.resolution))
    x = images(side=int(cfg.data.resolution))[1]
    assert torch.equal(a(x), b(x))
    sa, sb = a.classifier.state_dict(), b.classifier.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.manual_seed(REPA_TOY_SEED)                          # the toy encoder's own starting point, untrained
    fresh = type(a.classifier)(resolution=int(cfg.data.resolution)).state_dict()
    assert all(torch.equal(sa[k], fresh[k]) for k in sa)
    assert not torch.equal(random_toy_classifier(16, seed=1).trunk[0].weight, a.classifier.trunk[0].weight)
    toy, _ = encoder_of(tiny_cfg, "toy")
    assert not torch.allclose(toy(x), a(x), atol=1e-3)


def test_an_unknown_encoder_is_refused_by_the_schema(tiny_cfg):
    with pytest.raises(ConfigError, match="model.repa.encoder.*toy_random.*toy_fid"):
        check_train(tiny_cfg("repa=toy", "model.repa.encoder=toy_rand"))


@pytest.mark.parametrize("depth,block", [(1, 0), (2, 0), (6, 1), (12, 3), (24, 7), (28, 7), (40, 7)])
def test_the_published_block_rule(depth, block):
    """REPA aligns after block 4 of SiT-B (depth 12) and block 8 of SiT-L/XL (24, 28): max(1, min(8, depth // 3))."""
    assert published_repa_block(depth) == block
    head = build_dit("DiT-T/2", 16, 3, 10, depth=depth, repa={"block": None, "encoder_dim": 8}).repa_head
    assert head.block == block


@pytest.mark.parametrize("extra,block", [([], 3), (["+model.depth=24"], 7), (["+model.depth=6"], 1),
                                         (["model.repa.block=5"], 5), (["model.repa.block=-1"], -1)])
def test_a_null_block_resolves_from_depth_into_the_config_and_an_explicit_one_wins(tiny_cfg, extra, block):
    cfg = tiny_cfg("repa=toy_random", *extra)
    assert cfg.model.repa.block == (None if not any("repa.block" in e for e in extra) else block)
    repa, config = repa_of(cfg)
    saved = with_resolved(config.resolved, repa)["model"]["repa"]
    assert repa.resolved["block"] == saved["block"] == block  # saved with the run: sample.py and resume rebuild it
    assert config.resolved["model"]["repa"]["block"] == cfg.model.repa.block     # the checked config is not changed


def test_the_encoder_forward_flops_are_its_convolutions():
    """PatchEncoder.flops (for the run's FLOPs when the encoder runs online): the toy trunk's five 3x3 convolutions
    at 16 px, 2 x Cin x Cout x 9 per output position."""
    convs = [(3, 32, 16), (32, 32, 8), (32, 64, 8), (64, 64, 4), (64, 128, 4)]    # (Cin, Cout, output side)
    expected = sum(2 * cin * cout * 9 * side * side for cin, cout, side in convs)
    assert build_patch_encoder("toy_random", resolution=16).flops(16) == expected
