"""model.lora.type = lora | lokr | loha (tread/models/lora.py): LoKr and LoHa train in the loop with the base frozen,
their adapter-only checkpoints round-trip and resume exactly, and keys of another type or bad values are
refused with one error naming the key."""
from __future__ import annotations

import json

import pytest
import torch

from family_checks import make
from tread.schema.builders import build_model
from tread.models.lora import LoraConfigError, apply_lora, is_adapter_param
from tread.sampling import load_for_inference
from tread.schema import ConfigError
from tread.checkpoint.save import DIFFUSERS_LORA_FILE, PEFT_ADAPTER_FILE
from tread.training.loop import train
from tread.checkpoint.files import load_model_file

FAMILY_TINY = ["eval.every_steps=0", "eval.at_end=false", "train.batch_size=16", "optimizer.lr=1e-2"]
TARGETS = "target_modules:[to_q,to_k,to_v,to_out.0,proj_mlp,proj_out]"
TYPES = {"lokr": f"model.lora={{type:lokr,rank:4,alpha:4,{TARGETS}}}",
         "loha": f"model.lora={{type:loha,rank:4,alpha:4,{TARGETS}}}"}
MARKER = {"lokr": ".lokr_", "loha": ".hada_"}


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_adapter_type_trains_alone_and_round_trips(adapter, tiny_cfg, tmp_path):
    run = tmp_path / adapter
    cfg = tiny_cfg("model=flux", TYPES[adapter], "checkpoint.adapter_only=true", "train.max_steps=16",
                   "train.log_every_steps=4", *FAMILY_TINY)
    torch.manual_seed(cfg.train.seed)
    model0 = build_model(cfg.model)
    base0 = {k: v.clone() for k, v in model0.state_dict().items()
             if not is_adapter_param(k) and not k.startswith("conditioner.")}
    train(cfg, run)
    loss = losses(run)
    assert loss[-1] < loss[0] * 0.9, loss
    step = run / "checkpoints" / "step_0000016"
    state = load_model_file(step)
    assert state["adapter_only"] and state["ema"].keys() == state["model"].keys()
    assert all(MARKER[adapter] in k or k.startswith("conditioner.") for k in state["model"])
    assert (step / DIFFUSERS_LORA_FILE).is_file() and (step / PEFT_ADAPTER_FILE).is_file()
    # The base did not move, and a fresh seeded build plus the adapter-only checkpoint is the trained model.
    net, _, _, _ = load_for_inference(run, use_ema=False)
    after = net.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base0.items())
    assert all(torch.equal(after[k], v) for k, v in state["model"].items())
    assert any(not torch.equal(after[k], model0.state_dict()[k]) for k in state["model"] if MARKER[adapter] in k)


def test_lokr_adapter_only_resume_is_exact(tiny_cfg, tmp_path):
    common = ["model=flux", TYPES["lokr"], "checkpoint.adapter_only=true", *FAMILY_TINY,
              "checkpoint.every_steps=3", "train.log_every_steps=1"]
    train(tiny_cfg(*common, "train.max_steps=6"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=3"), tmp_path / "part")
    train(tiny_cfg(*common, "train.max_steps=6", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")


@pytest.mark.parametrize("override,needle", [
    ("model.lora={type:lokr,rank:4,dropout:0.1,target_modules:[to_q]}",
     r"model.lora key\(s\) \['dropout'\] do not apply to model.lora.type=lokr"),
    ("model.lora={rank:4,decompose_factor:4,target_modules:[to_q]}",
     r"\['decompose_factor'\] do not apply to model.lora.type=lora"),
    ("model.lora={type:loha,rank:4,decompose_both:true,target_modules:[to_q]}",
     r"\['decompose_both'\] do not apply to model.lora.type=loha"),
    ("model.lora={type:dora,rank:4,target_modules:[to_q]}", "model.lora.type='dora' is not allowed"),
    ("model.lora={type:lokr,rank:4,decompose_factor:0,target_modules:[to_q]}",
     "model.lora.decompose_factor=0 is not allowed"),
    ("model.lora={type:loha,rank:4,rank_dropout:1.5,target_modules:[to_q]}",
     "model.lora.rank_dropout=1.5 is not allowed"),
])
def test_bad_keys_are_refused_before_work(override, needle, tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        train(tiny_cfg("model=flux", override, *FAMILY_TINY), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("cfg,needle", [
    ({"type": "lokr", "rank": 2, "module_dropout": 0.1, "dropout": 0.1}, r"\['dropout'\] do not apply"),
    ({"type": "loha", "rank": 2, "init": "lycoris"}, r"model.lora.init='lycoris' is not allowed for "
                                                     r"model.lora.type=loha"),
    ({"type": "lokr", "rank": 2, "decompose_factor": 0}, "model.lora.decompose_factor=0 is not allowed"),
    ({"type": "lokr", "rank": 2, "target_modules": ["norm_out.norm"]},
     r"model.lora.type=lokr cannot adapt model.lora.target_modules=\['norm_out.norm'\]"),
])
def test_apply_lora_names_the_bad_key(cfg, needle):
    """Callers without the schema (tests, notebooks) get the same kind of error from tread/models/lora.py."""
    model = make("flux")
    with pytest.raises(LoraConfigError, match=needle):
        apply_lora(model.transformer, {"target_modules": ["to_q"], **cfg})


@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_only_the_adapter_trains(adapter):
    model = make("flux", lora={"type": adapter, "rank": 2, "target_modules": ["to_q", "proj_mlp"]})
    trainable = {n for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert trainable and all(MARKER[adapter] in "." + n for n in trainable)
    assert all(not p.requires_grad for n, p in model.transformer.named_parameters() if n not in trainable)
