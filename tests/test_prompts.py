"""Prompts in (tread/sampling/prompts.py): sample.py prompts / prompts_file, the negative prompt under CFG
(tread/sampling/guidance.py's per-sample unconditional conditioning), and the in-training validation prompts'
captioned grid (tread/evaluation/validation.py). Text encoders are tiny random ones written offline
(tread.encoders.tiny_text.save_tiny_text_encoders); models are tiny presets trained a couple of steps on data=toy_text."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tread.cli.sample import run as sample_run
from conftest import TINY, compose_cfg, shared_cache
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.schema.builders import build_diffusion, build_model
from tread.evaluation.images import make_captioned_grid
from tread.models.families.base import RoutedFamily
from tread.sampling.generate import generate
from tread.sampling.guidance import UNCOND, Guidance
from tread.sampling.prompts import PromptError, encode_for_model, generate_for_prompts, read_prompts_file
from tread.schema import ConfigError, check_sample, check_train
from tread.training.loop import train

PROMPTS = ["a red disc", "a blue square on a long caption that wraps"]
NEGATIVE = "a green ring"
MAX_LENGTH = 16   # data=toy_text's max_text_length: prompts are encoded at the data's length


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {family: save_tiny_text_encoders(family, root / family) for family in ("flux", "pixart")}


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, encoders):
    """A tiny FLUX trained 2 steps on toy_text, evaluated at both steps with validation prompts (CFG with a
    negative prompt); checkpoint at step 2."""
    run = tmp_path_factory.mktemp("flux") / "run"
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={shared_cache(tmp_path_factory)}", "model=flux", "data=toy_text",
        f"model.text_encoders={encoders['flux']}", "data.builtin_args.num_per_class=4", "train.max_steps=2",
        "eval.every_steps=1", "eval.at_end=false", "eval.num_samples=4", "eval.batch_size=4", "eval.grid_size=4",
        "eval.metrics=[fid]", f"eval.validation_prompts={json.dumps(PROMPTS)}", "eval.validation_per_prompt=2",
        f"eval.negative_prompt='{NEGATIVE}'", "eval.cfg_scale=2.0"])
    train(cfg, run)
    return run


def sample(run, out, *extra):
    return sample_run(compose_cfg("sample", [f"checkpoint={run}", "num_samples=2", "num_steps=2", "batch_size=4",
                                             f"out_dir={out}", *extra]))


def flux_encodings(encoders, texts):
    return encode_prompts("flux", load_text_encoders("flux", encoders["flux"]), texts, max_length=MAX_LENGTH)


@pytest.fixture
def seen(monkeypatch):
    """What reaches the family model's conditioning: (labels, cond in, conditioning out) per call."""
    calls = []
    real = RoutedFamily.conditioning

    def spy(self, labels, cond):
        out = real(self, labels, cond)
        calls.append((labels.clone(), {k: v.clone() for k, v in cond.items()}, {k: v.clone() for k, v in out.items()}))
        return out

    monkeypatch.setattr(RoutedFamily, "conditioning", spy)
    return calls


def test_sample_prompts_reach_the_model_as_encoded(flux_run, encoders, tmp_path, seen):
    info = sample(flux_run, tmp_path / "s", f"prompts={json.dumps(PROMPTS)}")
    want = flux_encodings(encoders, PROMPTS)
    assert len(seen) == 2 * 2 + 1   # two prompts (one batch each) x two Euler steps, + sampling_cost's FLOP count
    for i, (labels, cond, _) in enumerate(seen[:4]):
        p = i // 2
        assert set(cond) == {"text", "pooled"} and len(labels) == 2
        assert torch.equal(cond["text"], torch.from_numpy(want["text"][[p, p]]))
        assert torch.equal(cond["pooled"], torch.from_numpy(want["pooled"][[p, p]]))
    assert info["prompts"] == PROMPTS and info["seeds"] == [0, 1] and info["num_samples"] == 4
    saved = json.loads((tmp_path / "s" / "sampling.json").read_text())
    assert saved["prompts"] == PROMPTS and saved["negative_prompt"] == ""
    with np.load(tmp_path / "s" / "samples.npz") as npz:
        assert npz["arr_0"].shape == (4, 16, 16, 3) and npz["arr_1"].tolist() == [0, 0, 1, 1]
    assert len(list((tmp_path / "s" / "images").glob("*.png"))) == 4


def test_cfg_uncond_branch_gets_the_negative_prompt(flux_run, encoders, tmp_path, seen):
    want = flux_encodings(encoders, PROMPTS[:1] + [NEGATIVE])
    sample(flux_run, tmp_path / "neg", "prompts=[a red disc]", f"negative_prompt='{NEGATIVE}'", "cfg_scale=3.0")
    labels, cond, _ = seen[0]                            # one batched call: [conditional, unconditional]
    assert len(labels) == 4 and torch.equal(labels[:2], labels[2:]) and (labels < 10).all()   # no null label
    assert torch.equal(cond["text"][:2], torch.from_numpy(want["text"][[0, 0]]))
    assert torch.equal(cond["text"][2:], torch.from_numpy(want["text"][[1, 1]]))
    assert torch.equal(cond["pooled"][2:], torch.from_numpy(want["pooled"][[1, 1]]))
    seen.clear()
    sample(flux_run, tmp_path / "empty", "prompts=[a red disc]", "cfg_scale=3.0")   # empty: label dropout's zeros
    labels, cond, out = seen[0]
    assert labels[2:].tolist() == [10, 10] and torch.equal(cond["text"][2:], cond["text"][:2])
    assert not out["text"][2:].any() and not out["pooled"][2:].any() and out["text"][:2].any()


def test_cfg_scale_1_ignores_the_negative_prompt(flux_run, tmp_path):
    (tmp_path / "prompts.txt").write_text("\na red disc\n\n", encoding="utf-8")
    sample(flux_run, tmp_path / "a", f"prompts_file={tmp_path / 'prompts.txt'}")
    sample(flux_run, tmp_path / "b", "prompts=[a red disc]", f"negative_prompt='{NEGATIVE}'")
    with np.load(tmp_path / "a" / "samples.npz") as a, np.load(tmp_path / "b" / "samples.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"])


class TextProbe(torch.nn.Module):
    """Output = sum of the text embedding + 100 * label, per sample: tells which conditioning each row got."""

    text_conditioned = True         # what generate() reads of a backbone (tread.models.backbone)

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, noise, labels, cond=None):
        self.calls.append(sorted(cond))
        value = cond["text"].flatten(1).sum(1) + 100.0 * labels.float()
        return torch.zeros_like(x) + value.view(-1, 1, 1, 1)


def test_guidance_algebra_with_per_sample_uncond():
    net = TextProbe()
    x, t, labels = torch.zeros(2, 1, 2, 2), torch.ones(2), torch.tensor([1, 2])
    text, negative = torch.tensor([[1.0], [2.0]]), torch.tensor([[5.0], [7.0]])
    cond = {"cond": {"text": text, UNCOND: {"text": negative}}}
    plain = Guidance(cfg_scale=1.0).denoiser(net, null_label=9, stats={})(x, t, labels, **cond)
    assert torch.equal(plain[:, 0, 0, 0], torch.tensor([101.0, 202.0]))          # cfg 1: the conditional
    assert net.calls == [["text"]]                                               # UNCOND never reaches the net
    out = Guidance(cfg_scale=3.0).denoiser(net, null_label=9)(x, t, labels, **cond)
    c, u = torch.tensor([101.0, 202.0]), torch.tensor([105.0, 207.0])            # uncond: real labels, negative
    assert torch.equal(out[:, 0, 0, 0], u + 3.0 * (c - u))
    null = Guidance(cfg_scale=3.0).denoiser(net, null_label=9)(x, t, labels, cond={"text": text})
    u = torch.tensor([901.0, 902.0])                                             # no UNCOND: the null label
    assert torch.equal(null[:, 0, 0, 0], u + 3.0 * (c - u))
    # generate() passes uncond_fn's conditioning only where CFG uses it
    diffusion = build_diffusion(compose_cfg("train", ["model=flux"]).diffusion)
    net.calls.clear()
    batches = list(generate(net, diffusion, [0, 1], (1, 2, 2), 10, torch.device("cpu"), batch_size=2, num_steps=1,
                            cond_fn=lambda s: {"text": text}, uncond_fn=lambda s: {"text": negative}))
    assert net.calls == [["text"]] and len(batches) == 1


def test_validation_grid_per_eval_step_matches_sample_py(flux_run, tmp_path):
    samples = flux_run / "samples"
    assert sorted(p.name for p in samples.glob("validation_step_*.png")) == \
        ["validation_step_0000001.png", "validation_step_0000002.png"]
    grid = np.asarray(Image.open(samples / "validation_step_0000002.png").convert("RGB"))
    captions = [p for p in PROMPTS for _ in range(2)]
    assert grid.shape == make_captioned_grid(np.zeros((4, 16, 16, 3), np.uint8), captions, nrow=2).shape
    assert grid.shape == (grid.shape[0], 2 + 2 * (128 + 2), 3) and grid.shape[0] > 2 + 2 * (128 + 2)
    # the same prompts, seeds, guidance and EMA weights through sample.py give the same captioned grid
    sample(flux_run, tmp_path / "v", f"prompts={json.dumps(PROMPTS)}", f"negative_prompt='{NEGATIVE}'",
           "cfg_scale=2.0")
    assert np.array_equal(np.asarray(Image.open(tmp_path / "v" / "grid.png").convert("RGB")), grid)
    records = [json.loads(line) for line in (flux_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("type") == "eval"]
    assert [r["validation_grid"] for r in evals] == [str(samples / f"validation_step_000000{s}.png") for s in (1, 2)]


def test_missing_encoders_fail_before_training(tmp_path, encoders, cache_dir):
    base = TINY + [f"paths.cache_dir={cache_dir}", "model=flux", "data=toy_text", "data.builtin_args.num_per_class=4",
                   f"data.builtin_args.text_encoders={encoders['flux']}", "eval.validation_prompts=[a red disc]"]
    for extra, match in ((["model.text_encoders=null"], r"model.text_encoders is not set.*hf download"),
                         ([f"model.text_encoders={tmp_path / 'none'}"],
                          r"model.text_encoders='.*none': flux text encoders: the pipeline folder .* does not exist")):
        with pytest.raises(PromptError, match=match) as err:
            train(compose_cfg("train", base + extra), tmp_path / "run")
        assert "\n" not in str(err.value)
        assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prompts_need_a_text_model(encoders):
    dit = build_model(compose_cfg("train", TINY).model)
    with pytest.raises(PromptError, match=r"prompts need a text-conditioned model .* class-conditional DiT model"):
        encode_for_model(dit, {}, ["a red disc"], "", encoders["flux"], key="text_encoders")
    flux = build_model(compose_cfg("train", TINY + ["model=flux"]).model)
    with pytest.raises(PromptError, match=r"this flux model was trained on class-conditional data"):
        encode_for_model(flux, {"conditioning": {}}, ["a red disc"], "", encoders["flux"], key="text_encoders")
    meta = {"conditioning": {"text": {"seq_len": 8, "dim": 32, "mask": False, "max_length": 8}}}
    with pytest.raises(PromptError, match=r"text_encoders='.*pixart': flux text encoder 'text_encoder_2'"):
        encode_for_model(flux, meta, ["a red disc"], "", encoders["pixart"], key="text_encoders")
    wide = build_model(compose_cfg("train", TINY + ["model=flux", "model.config={joint_attention_dim: 64}"]).model)
    with pytest.raises(PromptError, match=r"text_encoders='.*flux' gives 32-wide text embeddings, but the model "
                                          r"takes 64 \(model.config.joint_attention_dim, flux\)"):
        encode_for_model(wide, meta, ["a red disc"], "", encoders["flux"], key="text_encoders")


def test_pixart_prompts_with_mask_under_cfg(encoders, seen):
    """A second family: T5 with an attention mask; the mask travels with the negative prompt's rows."""
    cfg = compose_cfg("train", TINY + ["model=pixart"])
    model, diffusion = build_model(cfg.model), build_diffusion(cfg.diffusion)
    net = diffusion.precondition(model).eval()
    meta = {"conditioning": {"text": {"seq_len": 8, "dim": 32, "mask": True, "max_length": 8}}}
    emb = encode_for_model(model, meta, PROMPTS, NEGATIVE, encoders["pixart"], key="text_encoders")
    want = encode_prompts("pixart", load_text_encoders("pixart", encoders["pixart"]), PROMPTS + [NEGATIVE],
                          max_length=8)
    assert torch.equal(emb.cond["text"], torch.from_numpy(want["text"][:2]))
    assert torch.equal(emb.negative["text_mask"], torch.from_numpy(want["text_mask"][2:]))
    shape = (model.in_channels, model.input_size, model.input_size)
    out = list(generate_for_prompts(net, diffusion, emb, [3], shape, 10, torch.device("cpu"), batch_size=1,
                                    num_steps=1, guidance=Guidance(cfg_scale=2.0)))
    assert [(i, s) for i, s, _ in out] == [(0, [3]), (1, [3])]
    _, cond, _ = seen[1]
    assert torch.equal(cond["text_mask"], torch.from_numpy(want["text_mask"][[1, 2]]))


def test_prompt_keys_and_prompts_file(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("a red disc\n\n   \nune île bleue\n", encoding="utf-8")
    assert read_prompts_file(good) == ["a red disc", "une île bleue"]
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "latin1.txt").write_bytes("une île".encode("latin-1"))
    for name, match in (("none.txt", r"prompts_file='.*none.txt' does not exist"),
                        ("blank.txt", r"holds no prompts \(only empty lines\)"),
                        ("latin1.txt", r"is not UTF-8 text")):
        with pytest.raises(PromptError, match=match):
            read_prompts_file(tmp_path / name)
    base = ["checkpoint=x"]
    for extra, match in ((["prompts=[a]", f"prompts_file={good}"], r"prompts=\['a'\] and prompts_file=.* both set"),
                         (["prompts=[a]", "classes=[1]"], r"classes=\[1\] cannot be combined with prompts"),
                         (["prompts=[]"], r"prompts=\[\] is not allowed"),
                         (["prompts=['a',' ']"], r"prompts\[1\]=' ' is not allowed"),
                         (["negative_prompt=[a]"], r"negative_prompt=\['a'\] is not allowed")):
        with pytest.raises(ConfigError, match=match):
            check_sample(compose_cfg("sample", base + extra))
    for extra, match in ((["eval.validation_prompts=[]"], r"eval.validation_prompts=\[\] is not allowed"),
                         (["eval.validation_per_prompt=0"], r"eval.validation_per_prompt=0 is not allowed")):
        with pytest.raises(ConfigError, match=match):
            check_train(compose_cfg("train", TINY + extra))


def test_a_run_trained_on_the_empty_prompt_gets_it_as_the_unconditional_input(encoders):
    """Caption dropout to the encoded "" (train.caption_dropout > 0, mode empty): an empty negative prompt is that
    encoding, not label dropout's zeros; mode zeros (and no caption dropout) keeps the null label."""
    from tread.sampling.prompts import learned_unconditional

    cfg = compose_cfg("train", TINY + ["model=pixart"])
    model = build_model(cfg.model)
    meta = {"conditioning": {"text": {"seq_len": 8, "dim": 32, "mask": True, "max_length": 8}}}
    emb = encode_for_model(model, meta, PROMPTS, "", encoders["pixart"], key="text_encoders", unconditional="empty")
    want = encode_prompts("pixart", load_text_encoders("pixart", encoders["pixart"]), [""], max_length=8)
    assert torch.equal(emb.negative["text"], torch.from_numpy(want["text"]))
    assert encode_for_model(model, meta, PROMPTS, "", encoders["pixart"], key="text_encoders").negative is None
    assert learned_unconditional(0.1, "auto", "pixart") == "empty"
    assert learned_unconditional(0.1, "auto", "flux2") == "zeros"
    assert learned_unconditional(0.1, "zeros", "sd3") == "zeros"
    assert learned_unconditional(0.0, "empty", "sd3") == "zeros"
