"""The paper-code mode (repro=paper | paper_rf): each switch reproduces CompVis/tread's behaviour where it differs
from ours: its initialisation, its in-training evaluation protocol (seeds, labels), its CFG rule, its
unconditional TREAD guidance, its rectified-flow time input, and the presets that set them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from conftest import compose_cfg
from tread.schema.builders import build_diffusion
from tread.models.dit import build_dit
from tread.routing import Route, RoutingController
from tread.sampling.generate import generate
from tread.sampling.guidance import Guidance, GuidanceError

ZEROED = ["final_layer.linear.weight", "final_layer.adaLN_modulation.1.weight"] + \
         [f"blocks.{i}.adaLN_modulation.1.weight" for i in range(12)]


def weights(init):
    torch.manual_seed(0)
    return dict(build_dit("DiT-S/2", 16, 4, 10, init=init).named_parameters())


def test_paper_init_undoes_adaln_zero_with_xavier_statistics():
    ours, paper = weights("adaln_zero"), weights("paper")
    for name in ZEROED:
        assert torch.count_nonzero(ours[name]) == 0
        w = paper[name]
        fan_out, fan_in = w.shape
        bound = math.sqrt(6 / (fan_in + fan_out))                     # Xavier-uniform
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
        assert w.var().item() == pytest.approx(bound ** 2 / 3, rel=0.05)
        assert torch.count_nonzero(paper[name.replace("weight", "bias")]) == 0
    assert torch.equal(ours["blocks.0.attn.qkv.weight"], paper["blocks.0.attn.qkv.weight"])   # the rest unchanged


def test_random_class_labels_are_the_paper_codes_draw():
    seeds = list(range(100000, 100010))
    K, shape = 1000, (4, 8, 8)
    got = []

    class Echo:                                      # a diffusion whose "sample" returns its noise
        def sample(self, denoise, noise, labels, **kwargs):
            return noise
    for batch, labels, noise in generate(nn.Identity(), Echo(), seeds, shape, K, torch.device("cpu"), batch_size=4,
                                         class_labels="random"):
        got += list(zip(batch, labels.tolist(), noise))
    for seed, label, noise in got:                   # EDM's generate.py order: the noise, then the class
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(noise, torch.randn(shape, generator=g))
        assert label == torch.randint(0, K, size=[], generator=g).item()
    cycled = [y for _, ys, _ in generate(nn.Identity(), Echo(), seeds, shape, K, torch.device("cpu"), batch_size=4)
              for y in ys.tolist()]
    assert cycled == [s % K for s in seeds]


def test_the_evaluator_uses_the_seed_offset_and_class_labels(tiny_cfg, tmp_path, monkeypatch):
    import tread.evaluation.evaluator as evaluator
    from tread.training.loop import train
    seen = {}
    real = evaluator.generate

    def spy(net, diffusion, seeds, *args, **kwargs):
        seen.setdefault("seeds", []).extend(seeds)
        seen["class_labels"] = kwargs.get("class_labels")
        return real(net, diffusion, seeds, *args, **kwargs)
    monkeypatch.setattr(evaluator, "generate", spy)
    train(tiny_cfg("repro=paper", "train.max_steps=1", "eval.every_steps=0", "eval.num_samples=6",
                   "eval.num_steps=2", "checkpoint.every_steps=0"), tmp_path / "run")
    assert seen == {"seeds": list(range(100000, 100006)), "class_labels": "random"}


class Recorder(nn.Module):
    """A backbone whose output depends on its labels only, recording each call's labels."""

    def __init__(self):
        super().__init__()
        self.routing = RoutingController([Route(0.5, 1, 2)], depth=4)
        self.calls: list[list[int]] = []

    def forward(self, x, noise, labels, **cond):
        self.calls.append(labels.tolist())
        return x * (1 + labels.float().view(-1, 1, 1, 1))


@pytest.mark.parametrize("scale", [0.5, 0.0, 1.5])
def test_cfg_rule_above_one_guides_only_above_one(scale):
    x, noise, labels = torch.ones(2, 1, 2, 2), torch.ones(2), torch.tensor([1, 2])
    cond, uncond = x * (1 + labels.float().view(-1, 1, 1, 1)), x * 11
    ours = Guidance(cfg_scale=scale).denoiser(Recorder(), null_label=10)(x, noise, labels)
    paper = Guidance(cfg_scale=scale, cfg_rule="above_one").denoiser(Recorder(), null_label=10)(x, noise, labels)
    assert torch.allclose(ours, uncond + scale * (cond - uncond))
    expected = cond if 0 < scale <= 1 else uncond + scale * (cond - uncond)   # 0: unconditional in both
    assert torch.allclose(paper, expected)


def test_tread_uncond_gives_both_routed_branches_the_null_label():
    x, noise, labels = torch.ones(2, 1, 2, 2), torch.ones(2), torch.tensor([1, 2])
    for uncond, expect in ((False, [[1, 2], [1, 2]]), (True, [[10, 10], [10, 10]])):
        net = Recorder()
        Guidance(tread_scale=2.0, selection_ratio=0.0, tread_uncond=uncond).denoiser(net, null_label=10)(
            x, noise, labels)
        assert net.calls == expect
    with pytest.raises(GuidanceError, match="tread_uncond=true .* needs cfg_scale=1"):
        Guidance(cfg_scale=2.0, tread_scale=2.0, tread_uncond=True).check(Recorder())


def test_the_presets_set_every_switch_and_our_defaults_stay():
    ours, paper, rf = (compose_cfg("train", o) for o in ([], ["repro=paper"], ["repro=paper_rf"]))
    assert (ours.model.init, ours.routing.fp32_after_route, ours.eval.seed_offset, ours.eval.class_labels,
            ours.eval.cfg_rule, ours.eval.tread_uncond) == ("adaln_zero", False, 0, "cycle", "any", False)
    assert (paper.model.init, paper.routing.fp32_after_route, paper.eval.seed_offset, paper.eval.num_samples,
            paper.eval.class_labels, paper.eval.num_steps, paper.eval.cfg_scale, paper.eval.cfg_rule,
            paper.eval.tread_uncond) == ("paper", True, 100000, 5000, "random", 40, 1.0, "above_one", True)
    assert paper.diffusion._target_ == "tread.diffusion.EDM" and paper.optimizer.lr == ours.optimizer.lr
    assert (ours.train.step_offset, ours.eval.decode_rule, ours.data.get("latent_draw", "sample")) == (0, "ours", "sample")
    assert (paper.train.step_offset, paper.eval.decode_rule, paper.data.latent_draw) == (1, "paper", "stored")
    xl = compose_cfg("train", ["experiment=imagenet256_dit_xl2_tread", "repro=paper"])
    assert xl.train.mixed_precision == "no" and xl.data.latent_draw == "stored"     # repro has the last word
    assert compose_cfg("train", ["experiment=imagenet256_dit_xl2_tread"]).train.mixed_precision == "bf16"
    assert rf.diffusion._target_ == "tread.diffusion.RectifiedFlow" and rf.diffusion.t_scale == 1.0
    assert build_diffusion(rf.diffusion).precondition(nn.Identity()).t_scale == 1.0   # the raw t in [0, 1]
    assert compose_cfg("train", ["diffusion=rf"]).diffusion.t_scale == 1000.0
