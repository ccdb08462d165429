"""The memory options a fine-tuner expects (issue 27 item 5): model.base_dtype (bf16 / fp8 storage of an adapter
run's frozen Linear weights), ema.mode (full | trained | cpu | off) and optimizer=adamw8bit (torchao's 8-bit AdamW).
Each stores what it says (counted, and equal to the memory table's figure), computes what the fp32 path computes
where it must (bf16 under autocast: bit for bit), resumes bit-exactly from its checkpoints (8-bit moments
included), exports its adapter, and refuses bad values with one error line."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bad_input_table import refused, train as train_case
from conftest import TINY, compose_cfg, shared_cache
from family_checks import inputs, make
from tread.cli.memory_table import measure
from tread.models.families import build_family
from tread.models.lora_export import diffusers_lora
from tread.models.quantize import LowPrecisionLinear, QuantizeConfigError, quantize_mode, weight_bytes
from tread.perf.memory import base_bytes, count_params, static_bytes, unique_bytes
from tread.sampling import load_for_inference
from tread.schema import ConfigError, check_train
from tread.checkpoint.save import DIFFUSERS_LORA_FILE
from tread.training.ema import EMA_NOTES, HostEma, ModelAsEma
from tread.training.loop import train
from tread.checkpoint.resume import check_optimizer
from tread.training.setup import build_parts, make_accelerator
from tread.utils.optim import adamw8bit
from tread.checkpoint.state import live_optimizer_state, plain_optimizer_state
from tread.checkpoint.files import TRAIN_FILE, load_model_file
from tread.checkpoint.values import ResumeValueError
from tread.checkpoint.tensorfile import load_state, load_tensors, save_state

pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LORA = {"rank": 4, "alpha": 4, "target_modules": TARGETS}
LORA_ARG = "model.lora={rank:4,alpha:4,target_modules:[to_q,to_k,to_v,to_out.0]}"
FLUX_TINY = ["model=flux", LORA_ARG, "eval.every_steps=0", "eval.at_end=false", "train.batch_size=8",
             "optimizer.lr=1e-2", "train.log_every_steps=1", "checkpoint.every_steps=2"]


def randomize_adapters(*models: nn.Module, seed: int = 3) -> None:
    """The same random values in the trainable parameters of each model (adapters start at B = 0)."""
    for model in models:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (p for p in model.parameters() if p.requires_grad):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- model.base_dtype

@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_the_frozen_linears_are_stored_low_and_the_rest_stays_fp32(base_dtype):
    """Adapters (and the class table) as the fp32 build makes them, in fp32; every frozen Linear a LowPrecisionLinear
    (fp8: the blocks' weights float8 e4m3 codes with per-row scales); the stored bytes are the memory table's."""
    model, full = make("flux", lora=LORA, base_dtype=base_dtype), make("flux", lora=LORA)
    assert {n: (p.dtype, p.tolist()) for n, p in trainable(model).items()} == \
        {n: (p.dtype, p.tolist()) for n, p in trainable(full).items()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    assert linears and all(type(m) is LowPrecisionLinear and m.weight.dtype == torch.bfloat16 for m in linears)
    codes = [p.qdata for p in model.parameters() if hasattr(p, "qdata")]
    blocks = sum(isinstance(m, nn.Linear) and not m.weight.requires_grad for b in model.routable_blocks()
                 for m in b.modules())
    assert len(codes) == (blocks if base_dtype == "fp8" else 0) and all(c.dtype == torch.float8_e4m3fn for c in codes)
    others = [p for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)]
    assert others and all(p.dtype == torch.float32 for p in others)
    assert quantize_mode(model) == ("fp8" if base_dtype == "fp8" else None)
    plain = make("flux")
    counts = count_params(plain, 4, TARGETS)
    buffers = sum(b.numel() * b.element_size() for b in plain.buffers())
    assert weight_bytes(model) == base_bytes(counts, None, base_dtype) + 4 * counts.lora + buffers


def test_a_bf16_base_under_autocast_computes_what_the_fp32_base_does():
    """bf16 autocast multiplies an fp32 Linear's weight rounded to bf16: a base stored in bf16 gives the same bits,
    adapters included. Outside autocast a stored layer computes in bf16 and returns the input's dtype."""
    fp32, bf16 = make("flux", lora=LORA).eval(), make("flux", lora=LORA, base_dtype="bf16").eval()
    randomize_adapters(fp32, bf16)
    x, t, y = inputs(fp32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fp32(x, t, y), bf16(x, t, y))
    layer = bf16.transformer.proj_out
    h = torch.randn(2, layer.in_features)
    assert torch.equal(layer(h), F.linear(h.bfloat16(), layer.weight, layer.bias).float())


def test_an_fp8_layer_is_the_dequantized_linear_and_keeps_no_copy_for_backward():
    """A float8 block Linear computes F.linear over its dequantized weight (gradient included), and autograd keeps
    none of the weight between forward and backward (it is dequantized again)."""
    layer = make("flux", lora=LORA, base_dtype="fp8").transformer.single_transformer_blocks[0].proj_mlp
    weight = layer.weight.dequantize()
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = layer(x)
    expected = F.linear(ref.bfloat16(), weight, layer.bias).float()
    assert torch.equal(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert tuple(weight.shape) not in [tuple(s) for s in saved]


def test_pretrained_weights_load_in_bf16(tmp_path):
    """model.pretrained with base_dtype=bf16 loads in bf16 (half the host memory): the frozen Linears keep the
    bf16 values, the other weights are those values in fp32, the adapters fp32."""
    source = make("flux").transformer
    source.save_pretrained(tmp_path / "transformer")
    model = build_family("flux", input_size=8, in_channels=4, num_classes=5, pretrained=str(tmp_path), lora=LORA,
                         base_dtype="bf16")
    saved = source.state_dict()
    for name, p in model.transformer.named_parameters():
        key = name.replace(".base_layer", "")
        if p.requires_grad:
            assert p.dtype == torch.float32
        else:
            want = saved[key].bfloat16()
            assert torch.equal(p, want if p.dtype == torch.bfloat16 else want.float()), name


def test_bad_base_dtype_settings_name_the_key(tiny_cfg):
    with pytest.raises(QuantizeConfigError, match=r"model.base_dtype='fp16' is not allowed; allowed: one of \['fp32'"):
        build_family("flux", input_size=8, in_channels=4, num_classes=5, lora=LORA, base_dtype="fp16")
    with pytest.raises(QuantizeConfigError, match=r"model.base_dtype=bf16 needs adapters to train"):
        build_family("flux", input_size=8, in_channels=4, num_classes=5, base_dtype="bf16")
    with pytest.raises(QuantizeConfigError, match="model.base_dtype=fp8 cannot be combined with model.quantize=nf4"):
        build_family("flux", input_size=8, in_channels=4, num_classes=5, lora=LORA, quantize="nf4", base_dtype="fp8")
    with pytest.raises(ConfigError, match="model.base_dtype=bf16 cannot be combined with train.parallel=fsdp"):
        check_train(tiny_cfg(*FLUX_TINY, "model.base_dtype=bf16", "train.parallel=fsdp"))
    with pytest.raises(ConfigError, match="model.base_dtype is not a known key"):          # DiT: no adapters
        check_train(tiny_cfg("+model.base_dtype=bf16"))


# ----------------------------------------------------------------------------- ema.mode

@pytest.fixture(scope="module")
def parts_by_mode(tmp_path_factory):
    """build_parts of the tiny FLUX LoRA run in each ema.mode."""
    cache = shared_cache(tmp_path_factory)
    out = {}
    for mode in ("full", "trained", "cpu", "off"):
        cfg = check_train(compose_cfg("train", TINY + [f"paths.cache_dir={cache}", *FLUX_TINY, f"ema.mode={mode}"]))
        out[mode] = build_parts(cfg, make_accelerator(cfg.train))
    return out


def test_each_ema_mode_holds_what_it_says(parts_by_mode):
    """full copies the frozen base; trained and cpu share it (the very parameters) and copy the trained ones; off
    holds nothing: the static bytes differ by exactly the frozen base and the trained parameters."""
    full, trained, cpu, off = (parts_by_mode[m] for m in ("full", "trained", "cpu", "off"))
    frozen = [p for p in trained.model.parameters() if not p.requires_grad]
    ema_params = {id(p) for p in trained.ema.model.parameters()}
    assert frozen and all(id(p) in ema_params for p in frozen)
    assert not ema_params & {id(p) for p in trained.model.parameters() if p.requires_grad}
    cpu_frozen = {id(p) for p in cpu.model.parameters() if not p.requires_grad}
    assert isinstance(cpu.ema, HostEma) and {id(p) for p in cpu.ema.model.parameters()} >= cpu_frozen
    assert isinstance(off.ema, ModelAsEma) and off.ema.model is off.model and not list(off.ema.parameters())
    own = unique_bytes([p for p in trained.model.parameters() if p.requires_grad]) + \
        unique_bytes(list(trained.ema.buffers()))
    assert static_bytes(full) - static_bytes(trained) == unique_bytes(frozen)
    assert static_bytes(cpu) == static_bytes(trained) == static_bytes(off) + own


def test_off_samples_the_model_in_eval_mode_and_leaves_it_training(parts_by_mode):
    """ema.mode=off: sampling through the EMA is sampling the trained net in eval mode (routes off); the net is still
    in training mode afterwards."""
    p = parts_by_mode["off"]
    x, _, y = inputs(p.model, batch=2)
    noise = torch.randn_like(x)
    p.net.train()
    with torch.no_grad():
        got = p.diffusion.sample(p.ema, noise, y, num_steps=2)
        assert p.net.training
        want = p.diffusion.sample(p.net.eval(), noise, y, num_steps=2)
    assert torch.equal(got, want)


def test_host_ema_moves_its_weights_only_for_the_call():
    """ema.mode=cpu's EMA computes on the input's device (here: the meta device, shapes only) with copies of its
    host-memory weights, which stay where they are; .to() leaves them too (the meta device frees them)."""
    ema = HostEma(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval())
    before = [(t, t.data_ptr()) for t in (*ema.parameters(), *ema.buffers())]
    out = ema(torch.randn(2, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3)
    assert ema.to("cpu") is ema and [(t, t.data_ptr()) for t in (*ema.parameters(), *ema.buffers())] == before
    x = torch.randn(2, 4)
    assert torch.equal(ema(x), ema.ema(x))
    assert ema.to("meta").ema[0].weight.device.type == "meta"


def losses(run: Path) -> list[float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["type"] == "train"]


def final(run: Path, key: str) -> dict[str, torch.Tensor]:
    return load_model_file(run / "checkpoints" / "step_0000004")[key]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """The tiny FLUX LoRA run in the default ema.mode=full, 4 steps uninterrupted."""
    cache, run = shared_cache(tmp_path_factory), tmp_path_factory.mktemp("ema_full") / "run"
    train(compose_cfg("train", TINY + [f"paths.cache_dir={cache}", *FLUX_TINY, "train.max_steps=4"]), run)
    return run


@pytest.mark.parametrize("mode", ["trained", "cpu", "off"])
def test_ema_modes_resume_exactly_and_average_as_full_does(mode, reference_run, tiny_cfg, tmp_path, capsys):
    """2 steps, then a resume to 4, in each mode: the losses of the uninterrupted full-mode run, and its EMA weights
    (trained, cpu); off writes the model's own weights as the EMA. The start-up lines say where the EMA is."""
    common = [*FLUX_TINY, f"ema.mode={mode}"]
    train(tiny_cfg(*common, "train.max_steps=2"), tmp_path / "run")
    assert EMA_NOTES[mode] in capsys.readouterr().out
    train(tiny_cfg(*common, "train.max_steps=4", "resume=auto"), tmp_path / "run")
    assert losses(tmp_path / "run") == losses(reference_run)
    ema, want = final(tmp_path / "run", "ema"), final(reference_run, "model" if mode == "off" else "ema")
    assert ema.keys() == want.keys() and all(torch.equal(ema[k], want[k]) for k in ema)


# ----------------------------------------------------------------------------- optimizer=adamw8bit

def eight_bit_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 8))      # 8192 weights: 8-bit moments; the rest fp32
    return model, adamw8bit(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)


def eight_bit_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, lr: float = 1e-2) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 128, generator=g)).pow(2).mean().backward()
    for group in opt.param_groups:
        group["lr"] = lr                         # as the loop's set_lr does: a plain float every step
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_adamw8bit_state_round_trips_through_the_state_file(tmp_path):
    """Save the 8-bit moments (as plain codes, scales and code tables), check them as a resume does, load them into
    a fresh optimizer: its next step equals the uninterrupted one bit for bit."""
    model, opt = eight_bit_setup()
    for i in range(3):
        eight_bit_step(model, opt, i, lr=1e-2 * (i + 1))
    save_state({"optimizer": plain_optimizer_state(opt.state_dict())}, tmp_path / "state.safetensors")
    saved = load_state(tmp_path / "state.safetensors")["optimizer"]
    assert type(opt.state[model[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert saved["state"][0]["exp_avg"]["codes"].dtype == torch.uint8 and torch.is_tensor(saved["state"][1]["exp_avg"])
    fresh, fresh_opt = eight_bit_setup(seed=1)
    fresh.load_state_dict(model.state_dict())
    check_optimizer(SimpleNamespace(model=fresh, optimizer=fresh_opt), saved)
    fresh_opt.load_state_dict(live_optimizer_state(saved))
    eight_bit_step(model, opt, 3)
    eight_bit_step(fresh, fresh_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_damaged_8bit_moment_is_refused_naming_it(tmp_path):
    model, opt = eight_bit_setup()
    eight_bit_step(model, opt, 0)
    state = SimpleNamespace(model=model, optimizer=opt)
    saved = plain_optimizer_state(opt.state_dict())
    bad = {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": {
        **saved["state"][0]["exp_avg"], "scale": saved["state"][0]["exp_avg"]["scale"] * float("nan")}}}}
    with pytest.raises(ResumeValueError, match=r"optimizer.state\[0\].exp_avg.scale \(0.weight\) holds non-finite"):
        check_optimizer(state, bad)
    codes = {**saved["state"][0]["exp_avg"], "codes": torch.zeros(3, dtype=torch.uint8)}
    with pytest.raises(ResumeValueError, match=r"optimizer.state\[0\].exp_avg \(0.weight\) is not an 8-bit moment"):
        check_optimizer(state, {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": codes}}})


def test_adamw8bit_full_fine_tuning_resumes_exactly(tiny_cfg, tmp_path):
    """DiT-T/4 trained in full with 8-bit moments and a cosine schedule: 2 steps + a resume to 4 give the losses and
    weights of 4 uninterrupted steps, and the checkpoint holds 8-bit moments."""
    common = ["optimizer=adamw8bit", "eval.every_steps=0", "eval.at_end=false", "train.lr_warmup_steps=2",
              "train.lr_schedule=cosine"]
    train(tiny_cfg(*common, "train.max_steps=4"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=2"), tmp_path / "part")
    train(tiny_cfg(*common, "train.max_steps=4", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")
    a, b = final(tmp_path / "full", "model"), final(tmp_path / "part", "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = load_state(tmp_path / "part" / "checkpoints" / "step_0000004" / TRAIN_FILE)["optimizer"]["state"]
    assert any(isinstance(v, dict) for entries in saved.values() for v in entries.values())


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_the_lean_lora_run_resumes_exactly_and_exports_its_adapter(base_dtype, tiny_cfg, tmp_path):
    """The issue's "after": a bf16 (or fp8) base, the EMA of the trained parameters only and 8-bit moments (rank 64:
    its adapters have 4096 values): exact resume; bf16 writes full checkpoints (its frozen weights in bf16), fp8
    adapter-only ones (like model.quantize: a seeded rebuild makes the same base); the exported LoRA file is the EMA
    adapter of the model sample.py builds from the checkpoint."""
    common = [*FLUX_TINY, "model.lora.rank=64", "model.lora.alpha=64", f"model.base_dtype={base_dtype}",
              "ema.mode=trained", "optimizer=adamw8bit"]
    train(tiny_cfg(*common, "train.max_steps=4"), tmp_path / "full")
    train(tiny_cfg(*common, "train.max_steps=2"), tmp_path / "part")
    train(tiny_cfg(*common, "train.max_steps=4", "resume=auto"), tmp_path / "part")
    assert losses(tmp_path / "full") == losses(tmp_path / "part")
    ckpt = tmp_path / "part" / "checkpoints" / "step_0000004"
    state = load_model_file(ckpt)
    assert state["adapter_only"] == (base_dtype == "fp8")
    if base_dtype == "bf16":
        assert state["model"]["transformer.proj_out.weight"].dtype == torch.bfloat16
    saved = load_state(ckpt / TRAIN_FILE)["optimizer"]["state"]
    assert any(isinstance(v, dict) for entries in saved.values() for v in entries.values())
    net = load_for_inference(ckpt, use_ema=True)[0]
    exported, _ = diffusers_lora(net.model.transformer)
    on_disk = load_tensors(ckpt / DIFFUSERS_LORA_FILE)
    assert on_disk.keys() == exported.keys() and all(torch.equal(on_disk[k], exported[k]) for k in on_disk)


def test_bad_optimizer_and_ema_settings_name_the_key(tiny_cfg):
    with pytest.raises(ConfigError, match=r"ema.mode='gpu' is not allowed; allowed: one of full, trained, cpu, off"):
        check_train(tiny_cfg("ema.mode=gpu"))
    with pytest.raises(ConfigError, match="ema.mode=trained cannot be combined with train.parallel=fsdp"):
        check_train(tiny_cfg("ema.mode=trained", "train.parallel=fsdp"))
    with pytest.raises(ConfigError, match="optimizer=adamw8bit cannot be combined with checkpoint.layout=sharded"):
        check_train(tiny_cfg("optimizer=adamw8bit", "checkpoint.layout=sharded"))
    with pytest.raises(ConfigError, match="optimizer.block_size=0 is not allowed; allowed: a positive integer"):
        check_train(tiny_cfg("optimizer=adamw8bit", "optimizer.block_size=0"))


# ----------------------------------------------------------------------------- the memory table, measured

@pytest.mark.parametrize("sets", [[], ["model.base_dtype=bf16", "ema.mode=trained", "optimizer=adamw8bit"],
                                  ["model.base_dtype=fp8", "ema.mode=off"]])
def test_the_table_counts_what_a_run_holds(sets):
    """tread.perf.memory's estimate for a run's settings equals the bytes the built run holds between steps,
    counted tensor by tensor (FLUX has no buffers), after a training step."""
    m = measure("flux", "tiny", sets, lora_rank=4, steps=1, batch=2, resolution=8)
    assert m["static"] == m["estimate"] and m["peak"] >= m["built"] > 0 and m["loss_finite"] and m["params_moved"]


# ----------------------------------------------------------------------------- bad inputs, as a user meets them

LORA_CASE = LORA_ARG.replace("{", "{{").replace("}", "}}")    # case arguments are str.format templates
BAD_INPUTS = [
    train_case("ema_mode_unknown", "ema.mode=gpu",
               needles=("ema.mode='gpu' is not allowed", "full, trained, cpu, off")),
    train_case("base_dtype_unknown", "model=flux", LORA_CASE, "model.base_dtype=fp16",
               needles=("model.base_dtype='fp16' is not allowed", "fp32, bf16, fp8")),
    train_case("base_dtype_without_adapters", "model=flux", "model.base_dtype=bf16",
               needles=("model.base_dtype=bf16 needs adapters to train",)),
    train_case("base_dtype_over_quantize", "model=flux", LORA_CASE, "model.quantize=nf4", "model.base_dtype=fp8",
               needles=("model.base_dtype=fp8 cannot be combined with model.quantize=nf4",)),
    train_case("base_dtype_on_dit", "+model.base_dtype=bf16", needles=("model.base_dtype is not a known key",)),
    train_case("ema_trained_fsdp", "ema.mode=trained", "train.parallel=fsdp",
               needles=("ema.mode=trained cannot be combined with train.parallel=fsdp",)),
    train_case("adamw8bit_sharded", "optimizer=adamw8bit", "checkpoint.layout=sharded",
               needles=("optimizer=adamw8bit cannot be combined with checkpoint.layout=sharded",)),
    train_case("adamw8bit_block_zero", "optimizer=adamw8bit", "optimizer.block_size=0",
               needles=("optimizer.block_size=0 is not allowed",)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.param() for c in BAD_INPUTS])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
