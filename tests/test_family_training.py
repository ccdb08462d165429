"""The diffusers families in the training loop: flow-matching training, LoRA, adapter checkpoints,
text conditioning through sampling, and resume."""
from __future__ import annotations

import json

import pytest
import torch

from tread.models.families import FAMILIES
from tread.sampling import load_for_inference
from tread.checkpoint.files import load_model_file
from tread.training.loop import train

FAMILY_TINY = ["eval.every_steps=0", "eval.at_end=false", "train.batch_size=16", "optimizer.lr=1e-3"]
LORA = "model.lora={rank:8,alpha:8,target_modules:[to_q,to_k,to_v,to_out.0,proj_mlp,proj_out]}"


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.mark.parametrize("family", ["flux"])
def test_family_trains_with_routes_and_evaluates(family, tiny_cfg, tmp_path):
    run = tmp_path / "run"
    summary = train(tiny_cfg(f"model={family}", "train.max_steps=3", "eval.every_steps=3",
                             "train.batch_size=8", "eval.num_samples=10", "eval.batch_size=10"), run)
    assert summary["final_step"] == 3 and summary["final_fid"] is not None
    rec = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["tokens_fraction"] < 1 for r in rec if r["type"] == "train")
    net, diffusion, meta, config = load_for_inference(run)
    assert config.model.family == family and type(diffusion).__name__ == "RectifiedFlow"


def test_lora_trains_adapters_only_and_saves_them_alone(tiny_cfg, tmp_path):
    run = tmp_path / "lora"
    cfg = tiny_cfg("model=flux", LORA, "checkpoint.adapter_only=true", "train.max_steps=30",
                   "train.log_every_steps=10", *FAMILY_TINY)
    from tread.schema.builders import build_model
    torch.manual_seed(cfg.train.seed)
    model0 = build_model(cfg.model)
    base0 = {k: v.clone() for k, v in model0.state_dict().items() if "lora_" not in k and "conditioner" not in k}
    train(cfg, run)
    loss = losses(run)
    assert loss[-1] < loss[0] * 0.9, loss
    state = load_model_file(run / "checkpoints" / "step_0000030")
    assert state["adapter_only"] and state["ema"].keys() == state["model"].keys()
    assert all("lora_" in k or k.startswith("conditioner.") for k in state["model"])
    assert (run / "checkpoints" / "step_0000030" / "adapter_model.safetensors").is_file()
    # The base weights did not move: a fresh, seeded build plus the adapter gives the trained model.
    net, _, _, _ = load_for_inference(run, use_ema=False)
    after = net.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base0.items())
    assert any(not torch.equal(after[k], model0.state_dict()[k]) for k in state["model"] if "lora_B" in k)


def test_adapter_only_without_lora_is_refused(tiny_cfg, tmp_path):
    from tread.schema import ConfigError
    with pytest.raises(ConfigError, match="adapter_only"):
        train(tiny_cfg("model=flux", "checkpoint.adapter_only=true", *FAMILY_TINY), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_bad_lora_config_names_the_key(tiny_cfg, tmp_path):
    from tread.models.lora import LoraConfigError
    from tread.schema import ConfigError
    with pytest.raises(LoraConfigError, match=r"model.lora.target_modules \['nope'\]"):   # against the model
        train(tiny_cfg("model=flux", "model.lora={rank:4,target_modules:[nope]}", *FAMILY_TINY), tmp_path / "x")
    with pytest.raises(ConfigError, match="model.lora.rank=0 is not allowed"):            # the schema
        train(tiny_cfg("model=flux", "model.lora={rank:0,target_modules:[to_q]}", *FAMILY_TINY), tmp_path / "x")


def test_resume_is_exact_for_a_family(tiny_cfg, tmp_path):
    common = ["model=flux", *FAMILY_TINY, "checkpoint.every_steps=4", "train.log_every_steps=1"]
    train(tiny_cfg(*common, "train.max_steps=8"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=4"), tmp_path / "part")
    train(tiny_cfg(*common, "train.max_steps=8", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_weights_load_unchanged(family, tmp_path):
    """model.pretrained loads a diffusers folder with from_pretrained; names and values are diffusers' own."""
    from tread.models.families import build_family
    torch.manual_seed(0)
    kw = dict(input_size=8, in_channels=4, num_classes=3)
    src = build_family(family, **kw)
    src.save_pretrained(str(tmp_path / "pipe"))
    torch.manual_seed(1)
    loaded = build_family(family, pretrained=str(tmp_path / "pipe"), **kw)
    a, b = src.transformer.state_dict(), loaded.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        ours = loaded.eval()(x, torch.tensor([3.0, 700.0]), torch.tensor([0, 1]))
        ref = loaded.reference_forward(x, torch.tensor([3.0, 700.0]), torch.tensor([0, 1]))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_missing_pretrained_weights_say_how_to_get_them(tmp_path):
    from tread.models.families import build_family
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_family("flux", input_size=8, in_channels=4, num_classes=3, pretrained=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="hf download black-forest-labs/FLUX.1-dev"):
        build_family("flux", input_size=8, in_channels=4, num_classes=3, pretrained="black-forest-labs/FLUX.1-dev")


@pytest.mark.parametrize("model", ["tread", "flux"])
def test_masked_loss_force_keeps_masked_tokens(model, tiny_cfg, tmp_path):
    """Loss masks from the data: the loss is masked, masked tokens are force-kept, the logged fraction rises."""
    # Shapes cover 11..22 of the 64 tokens: at ratio 0.75 (16 kept) some batches force more than the budget.
    common = [f"model={model}", "data=toy_masked", "data.dit_arch=DiT-T/2",
              *FAMILY_TINY, "train.max_steps=2", "train.log_every_steps=1", "routing.routes.0.selection_ratio=0.75"]
    train(tiny_cfg(*common), tmp_path / "masked")
    train(tiny_cfg(*common, "train.mask_force_keep=false"), tmp_path / "free")
    rec = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    masked, free = rec(tmp_path / "masked"), rec(tmp_path / "free")
    nominal = 1 - 7 * 48 / (12 * 64) if model == "tread" else 1 - 3 * 48 / (8 * 64)  # blocks 2..-4, 48 dropped
    assert all(r["tokens_fraction"] == pytest.approx(nominal) for r in free)
    assert all(r["tokens_fraction"] >= nominal - 1e-9 for r in masked)
    assert max(r["tokens_fraction"] for r in masked) > nominal + 0.01


def test_masked_loss_weights_only_covered_cells():
    from tread.training.step import reduce_loss
    loss = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    mask = torch.zeros(2, 1, 8, 8)
    mask[:, :, :4, :4] = 1.0                                   # the top-left latent cells 0..1 x 0..1
    expected = loss[:, :, :2, :2].mean()
    torch.testing.assert_close(reduce_loss(loss, mask), expected)
    assert reduce_loss(loss, None) == loss.mean()


def test_masked_loss_true_without_masks_is_refused(tiny_cfg, tmp_path):
    from tread.schema import ConfigError
    with pytest.raises(ConfigError, match="train.masked_loss=true"):
        train(tiny_cfg("model=flux", "train.masked_loss=true", *FAMILY_TINY), tmp_path / "x")


def _text_dataset(path, n=48, L=6, D=32, P=32, seed=0):
    """A tiny text-conditioned dataset: 3x8x8 'images' whose colour follows the first text embedding."""
    import numpy as np
    from tread.data import write_latent_dataset
    rng = np.random.default_rng(seed)
    text = rng.standard_normal((n, L, D)).astype(np.float32)
    colour = np.tanh(text[:, 0, :3])                                            # what the text "says"
    latents = np.broadcast_to(colour[:, :, None, None], (n, 3, 8, 8)) + 0.05 * rng.standard_normal((n, 3, 8, 8))
    mask = np.ones((n, L), dtype=bool)
    mask[::2, -2:] = False
    extras = {"text": text, "text_mask": mask, "pooled": rng.standard_normal((n, P)).astype(np.float32)}
    write_latent_dataset(path, latents.astype(np.float32), np.zeros(n, dtype=np.int64), num_classes=1,
                         extras=extras, conditioning_meta={"text": {"seq_len": L, "dim": D, "mask": True},
                                                           "pooled": {"dim": P}})
    return path


def test_text_conditioned_data_trains_evaluates_and_samples(tiny_cfg, tmp_path, monkeypatch):
    """Text embeddings from the data reach the model in training, in-training evaluation and sample.py."""
    data = _text_dataset(tmp_path / "text_ds")
    seen = []
    from tread.models.families.base import RoutedFamily
    real = RoutedFamily.conditioning

    def spy(self, labels, cond):
        seen.append(None if not cond else tuple(cond["text"].shape))
        return real(self, labels, cond)

    monkeypatch.setattr(RoutedFamily, "conditioning", spy)
    run = tmp_path / "run"
    cfg = tiny_cfg("model=flux", f"data.path={data}", "data.builtin=null", "data.resolution=8",
                   "data.num_classes=1", "train.max_steps=2", "train.batch_size=8", "eval.every_steps=2",
                   "eval.num_samples=10", "eval.batch_size=10", "eval.grid_size=10", "eval.cfg_scale=2.0")
    train(cfg, run)
    assert seen and all(s is not None and s[1:] == (6, 32) for s in seen), seen[:5]
    seen.clear()
    from tread.cli.sample import run as sample_run
    from conftest import compose_cfg
    sample_run(compose_cfg("sample", [f"checkpoint={run}", "num_samples=4", "num_steps=2", "batch_size=4",
                                      f"out_dir={tmp_path / 'samples'}"]))
    assert seen and all(s is not None for s in seen)
    assert (tmp_path / "samples" / "samples.npz").is_file()


