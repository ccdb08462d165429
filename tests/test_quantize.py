"""model.quantize = int8 | int4 | nf4 (tread/models/quantize.py): a quantized frozen base under peft adapters trains
with routing active, never changes, equals dense at selection ratio 0, is shared by the EMA, is left out of
checkpoints (which resume exactly), and bad settings are refused with one error naming the key."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

from family_checks import fixed_selection, inputs, make
from tread.schema import check_train
from tread.schema.builders import build_model
from tread.models.families import build_family
from tread.models.lora import is_adapter_param
from tread.models.quantize import (QUANTIZE_MODES, QuantizeConfigError, frozen_base, quantize_mode, stored_bytes,
                             weight_bytes)
from tread.schema import ConfigError
from tread.training.ema import ema_update
from tread.training.loop import train
from tread.training.setup import build_parts, check_shared_base, make_accelerator
from tread.checkpoint.files import load_model_file

pytestmark = pytest.mark.usefixtures("one_thread", "quanto_unpack_in_torch")


@pytest.fixture(scope="module")
def quanto_unpack_in_torch():
    """int4 weights on the CPU: optimum-quanto unpacks them with a C++ extension that it compiles into its install
    folder the first time (81 s of a fresh CI install, 14 s for the rest of this file). Here that extension is
    its unpack.cpp written in torch (the low bits first, the parts concatenated along dim 0, as quanto's default
    kernel), so what these tests check, our layers over quanto's, does not wait on a compiler. A GPU run and a
    user's CPU run use quanto's kernels as they are."""
    from optimum.quanto.library.extensions import get_extension

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
        return torch.cat([(packed >> (bits * i)) & (2 ** bits - 1) for i in range(8 // bits)]).to(torch.uint8)

    ext = get_extension("quanto_cpp")
    saved, ext._lib = ext._lib, type("TorchUnpack", (), {"unpack": staticmethod(unpack)})
    yield
    ext._lib = saved

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]       # attention: in both FLUX and SD3 blocks
LORA = {"rank": 4, "alpha": 4, "target_modules": TARGETS}
LORA_ARG = "model.lora={rank:4,alpha:4,target_modules:[to_q,to_k,to_v,to_out.0]}"
FAMILY_TINY = ["eval.every_steps=0", "eval.at_end=false", "train.batch_size=8", "optimizer.lr=1e-2",
               "train.log_every_steps=1"]
ROUTE = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]


def quantized_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clones of the plain tensors (codes and scales) the quantized base layers store."""
    out = {}
    for name, p in model.named_parameters():
        if type(p) not in (torch.Tensor, nn.Parameter):
            names, _ = p.__tensor_flatten__()
            out.update({f"{name}.{n}": _plain(getattr(p, n)).clone() for n in names})
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    while type(t) is not torch.Tensor:     # quanto's int4 codes are a packed tensor inside the weight
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


# Every mode on FLUX and SD3; the other families (their Linear layers are the same kind) with int8.
QUANTIZED = [(f, m) for f in ("flux", "sd3") for m in QUANTIZE_MODES] + \
    [(f, "int8") for f in ("chroma", "sana", "flux2", "hidream", "qwen_image", "lumina2", "z_image", "ltx_video",
                              "hunyuan_video", "cosmos",
                              "qwen_image21",
                              "krea2",
                              "ernie_image",
                              "ltx2",
                              "minimax_h3",
                              "flux3",
                              "wan_vace",
                              # -- new families above this line --
                              )]


@pytest.mark.parametrize("family,mode", QUANTIZED)
def test_adapters_learn_over_a_frozen_quantized_base_with_routing(family, mode):
    lora = {**LORA, "target_modules": ["to_q", "to_k", "to_v", "to_out"]} if family == "hidream" else LORA
    model = make(family, ROUTE, quantize=mode, lora=lora).train()
    base = quantized_tensors(model)
    assert quantize_mode(model) == mode and len(base) >= 2 * len(model.routable_blocks())
    adapted = [m.get_base_layer() for m in model.modules() if hasattr(m, "lora_A")]
    assert adapted and all(isinstance(m, nn.Linear) for m in adapted)      # what peft's tuners wrap
    x, t, y = inputs(model, batch=4)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=3e-2)
    loss0 = None
    for _ in range(8):
        loss = model(x, t, y).pow(2).mean()           # the adapters learn to cancel the base's output
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss0 = loss.item() if loss0 is None else loss0
    assert loss.item() < 0.9 * loss0, (loss0, loss.item())
    adapters = [n for n, p in model.named_parameters() if p.requires_grad and is_adapter_param(n)]
    assert adapters and all(not p.requires_grad for n, p in model.named_parameters() if n not in adapters
                            and not n.startswith("conditioner."))
    after = quantized_tensors(model)
    assert after.keys() == base.keys() and all(torch.equal(after[k], v) for k, v in base.items())


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_ratio_zero_equals_dense_exactly_under_quantization(mode):
    routes = [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}]
    model = make("flux", routes, quantize=mode, lora={**LORA, "init": "gaussian"}).train()
    x, t, y = inputs(model)
    with torch.no_grad(), fixed_selection(model, lambda h, k: torch.arange(k).expand(h.shape[0], k)) as calls:
        with torch.enable_grad():          # routes are active in grad-enabled training
            routed = model(x, t, y)
        dense = model.eval()(x, t, y)
    assert calls and torch.equal(routed, dense)


def test_lokr_adapts_a_quantized_base():
    model = make("flux", ROUTE, quantize="int4", lora={**LORA, "type": "lokr", "init": False}).train()
    x, t, y = inputs(model)
    model(x, t, y).pow(2).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if ".lokr_" in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_ema_shares_the_quantized_base_and_skips_frozen_weights(tiny_cfg):
    cfg = check_train(tiny_cfg("model=flux", LORA_ARG, "model.quantize=nf4", *FAMILY_TINY))
    parts = build_parts(cfg, make_accelerator(cfg.train))
    shared = frozen_base(parts.model)
    ema_weights = {id(p) for p in parts.ema.model.parameters()}
    assert shared and set(shared) <= ema_weights
    assert weight_bytes(parts.ema.model) == weight_bytes(parts.model)    # one base, counted in each
    assert not frozen_base(build_model(check_train(tiny_cfg("model=flux", LORA_ARG)).model.plain()))   # full precision: copied


def test_ema_update_is_unchanged_for_dense_runs_and_skips_frozen_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    reference = copy.deepcopy(ema)
    with torch.no_grad():
        torch._foreach_lerp_(list(reference.parameters()), [p.detach() for p in model.parameters()], 1 - 0.9)
    ema_update(ema, model, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), reference.parameters()))
    model[0].requires_grad_(False)          # frozen: its EMA stays where it is, whatever the model holds
    before = [p.clone() for p in ema[0].parameters()]
    ema_update(ema, model, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(ema[0].parameters(), before))
    assert not torch.equal(ema[2].weight, reference[2].weight)


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.mark.parametrize("mode", ["int4", "nf4"])
def test_checkpoint_holds_adapters_only_and_resumes_exactly(mode, tiny_cfg, tmp_path):
    common = ["model=flux", LORA_ARG, f"model.quantize={mode}", *FAMILY_TINY, "checkpoint.every_steps=2"]
    train(tiny_cfg(*common, "train.max_steps=4"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=2"), tmp_path / "part")
    state = load_model_file(tmp_path / "part" / "checkpoints" / "step_0000002")
    assert state["adapter_only"] and state["ema"].keys() == state["model"].keys()
    assert all(is_adapter_param(k) or k.startswith("conditioner.") for k in state["model"])
    train(tiny_cfg(*common, "train.max_steps=4", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")


def test_rebuild_quantizes_the_same_base():
    a, b = (quantized_tensors(make("sd3", quantize="int8", lora=LORA)) for _ in range(2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weight_bytes_counts_codes_and_scales():
    full = make("flux")
    sizes = {mode: weight_bytes(make("flux", quantize=mode, lora=LORA)) for mode in QUANTIZE_MODES}
    lora = weight_bytes(make("flux", lora=LORA)) - weight_bytes(full)
    assert weight_bytes(full) == sum(p.numel() * 4 for p in full.parameters()) + sum(
        b.numel() * b.element_size() for b in full.buffers())
    assert weight_bytes(full) + lora > sizes["int8"] > sizes["int4"] and sizes["int8"] > sizes["nf4"]
    w = make("flux", quantize="nf4", lora=LORA).transformer.transformer_blocks[0].ff.net[2].weight
    assert stored_bytes(w) < w.numel() // 2 + w.numel() // 64 * 2      # 4-bit codes + int8 double-quantized scales


def test_bad_quantize_settings_name_the_key(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="model.quantize"):
        train(tiny_cfg("model=flux", LORA_ARG, "model.quantize=int3", *FAMILY_TINY), tmp_path / "x")
    with pytest.raises(ConfigError, match=r"model.quantize=int8 needs adapters to train \(model.lora"):
        train(tiny_cfg("model=flux", "model.quantize=int8", *FAMILY_TINY), tmp_path / "x")
    with pytest.raises(ConfigError, match="model.quantize=nf4 cannot be combined with train.parallel=fsdp"):
        config = check_train(tiny_cfg("model=flux", LORA_ARG, "model.quantize=nf4", "train.parallel=fsdp"))
        check_shared_base(config.model, config.train)
    with pytest.raises(QuantizeConfigError, match=r"model.quantize='int2' is not allowed; allowed: null .*'int8'"):
        build_family("flux", input_size=8, in_channels=4, num_classes=5, quantize="int2", lora=LORA)
    with pytest.raises(ConfigError):                       # DiT has no adapters, so no quantized base either
        train(tiny_cfg("+model.quantize=int8", *FAMILY_TINY), tmp_path / "x")
    assert not (tmp_path / "x").exists()
