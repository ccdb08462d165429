"""The step's precision per device: train.mixed_precision=auto (bf16 autocast where the device multiplies bf16
natively, else fp32) and train.tf32 (CUDA's fp32 matmuls in TensorFloat-32), resolved once when the accelerator is
made and said at start-up."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import compose_cfg
from tread.schema import ConfigError, check_train
from tread.training import setup
from tread.training.loop import train

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_an_explicit_precision_is_taken_as_given_on_every_device(setting, monkeypatch):
    monkeypatch.setattr(setup, "native_cpu_bf16", lambda: True)
    assert setup.mixed_precision(setting, CPU) == (setting, "train.mixed_precision")
    assert setup.mixed_precision(setting, CUDA)[0] == setting


def test_auto_is_bf16_only_where_the_device_multiplies_bf16_natively(monkeypatch):
    monkeypatch.setattr(setup, "native_cpu_bf16", lambda: True)
    value, why = setup.mixed_precision("auto", CPU)
    assert value == "bf16" and "native bf16" in why and "train.mixed_precision=no" in why
    monkeypatch.setattr(setup, "native_cpu_bf16", lambda: False)
    assert setup.mixed_precision("auto", CPU) == ("no", "auto: this CPU has no native bf16 matmuls")
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(
        including_emulation) or not including_emulation and gpu_has_bf16)
    gpu_has_bf16 = True
    assert setup.mixed_precision("auto", CUDA)[0] == "bf16"
    gpu_has_bf16 = False                     # e.g. a V100: bf16 only emulated, so fp32
    assert setup.mixed_precision("auto", CUDA)[0] == "no"
    assert asked == [False, False]           # emulated bf16 never counts


def test_native_cpu_bf16_is_the_cpus_avx512_bf16_or_amx(monkeypatch):
    expected = torch.backends.mkldnn.is_available() and (torch.cpu._is_avx512_bf16_supported()
                                                         or torch.cpu._is_amx_tile_supported())
    assert setup.native_cpu_bf16() == expected
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not setup.native_cpu_bf16()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert setup.native_cpu_bf16() == torch.backends.mkldnn.is_available()


def test_tf32_is_set_for_cuda_runs_and_cpu_runs_leave_the_flags_alone():
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        setup.set_tf32(True, CUDA)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        setup.set_tf32(False, CPU)                                   # a CPU run: untouched
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        setup.set_tf32(False, CUDA)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
    finally:
        matmul.fp32_precision, conv.fp32_precision = before


def test_defaults_auto_with_tf32_and_the_short_cpu_runs_pin_fp32():
    base = compose_cfg("train", ["~experiment"]).train                     # train.yaml's own defaults
    assert base.tf32 is True and base.mixed_precision == "auto"
    assert compose_cfg("train", []).train.mixed_precision == "no"               # experiment=toy (make train)
    assert compose_cfg("train", ["experiment=imagenet256_dit_b2"]).train.mixed_precision == "bf16"
    assert compose_cfg("train", ["debug=tiny"]).train.mixed_precision == "no"


def test_a_bad_precision_is_one_error_naming_auto():
    cfg = compose_cfg("train", ["debug=tiny", "train.mixed_precision=fp8"])
    with pytest.raises(ConfigError, match=r"train.mixed_precision.*'fp8'.*one of auto, no, bf16, fp16"):
        check_train(cfg)


def test_the_accelerator_and_the_run_record_the_resolved_precision(tiny_cfg, tmp_path, capsys):
    expected, why = setup.mixed_precision("auto", CPU)
    cfg = tiny_cfg("train.mixed_precision=auto", "train.cpu=true", "eval.every_steps=0", "eval.at_end=false",
                   "train.max_steps=1", "checkpoint.every_steps=0")
    assert setup.make_accelerator(cfg.train).mixed_precision == expected
    train(cfg, tmp_path / "run")
    assert f"mixed precision {expected} ({why})" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mixed_precision"] == expected and summary["compiled"] is False    # debug=tiny: eager
