"""Dtype discipline under bf16 autocast, proved on the CPU: in a routed training step of DiT and of every family
(and of adapters over bf16, fp8 and int8 bases), no matmul, convolution, attention or RMS norm gets floating
inputs of two dtypes, and torch warns of no dtype mismatch. On CUDA such a mix is an error, or a fallback from the
fused kernel (torch.rms_norm: "Mismatch dtype between input and weight ... Cannot dispatch to fused
implementation", the last warning before FLUX's CUDA failure in issue 29's gpu-check); on the CPU the same operators
are dispatched, so recording them finds the mix without a GPU. A finding names the module that ran it."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tread.models.families import FAMILIES
from tread.perf.benchmark import StepBench
from tread.perf.benchmark_run import BenchRequest, config_overrides
from tread.perf.overrides import compose_or_raise

# operators whose floating inputs must share one dtype (their backward ones included)
WATCHED = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear", "aten.convolution",
           "aten.convolution_backward", "aten._convolution", "aten.scaled_dot_product_attention",
           "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_attention_math",
           "aten._fused_rms_norm", "aten.rms_norm")
MISMATCH_WARNINGS = ("Mismatch dtype", "dtype mismatch", "Cannot dispatch to fused")


class MixedDtypes(TorchDispatchMode):
    """The watched operators called with floating inputs of several dtypes, each with the module running it."""

    def __init__(self, where: "ModuleStack"):
        super().__init__()
        self.where, self.found = where, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func.overloadpacket) in WATCHED:
            dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) > 1:
                self.found.append(f"{self.where.top()}: {func} on {sorted(str(d) for d in dtypes)}")
        return func(*args, **kwargs)


class ModuleStack:
    """The qualified name of the module whose forward is running (backward: 'backward')."""

    def __init__(self, model: nn.Module):
        self.names = {m: n or type(model).__name__ for n, m in model.named_modules()}
        self.stack: list[str] = []

    def top(self) -> str:
        return self.stack[-1] if self.stack else "backward"

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        def enter(module: nn.Module, _args: tuple) -> None:
            self.stack.append(self.names.get(module, type(module).__name__))

        def leave(module: nn.Module, _args: tuple, _out: object) -> None:   # None: the output stays
            self.stack.pop()

        pre = nn.modules.module.register_module_forward_pre_hook(enter)
        post = nn.modules.module.register_module_forward_hook(leave)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def findings(bench: StepBench) -> list[str]:
    """Mixed-dtype operators and dtype-mismatch warnings of one training step (the second: the first initialised
    the optimizer's state)."""
    bench.step()
    where = ModuleStack(bench.model)
    warned: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if any(s in str(message) for s in MISMATCH_WARNINGS):
            warned.append(f"{where.top()}: warning: {str(message).splitlines()[0]}")

    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)                   # torch's warn-once warnings, every time
    try:
        with warnings.catch_warnings(), where.hooks(), MixedDtypes(where) as mixed:
            warnings.simplefilter("always")
            warnings.showwarning = show
            stats = bench.step()
    finally:
        torch.set_warn_always(always)
    assert torch.isfinite(stats.loss), stats.loss
    return mixed.found + warned


def bf16_step(family: str, *sets: str) -> StepBench:
    """THE training step of a family's tiny preset (DiT-T/2 for dit) with the paper route, bf16 autocast on the CPU."""
    args = BenchRequest(family=family, arch="DiT-T/2", preset="tiny", batch=2, precision="bf16", device="cpu",
                        routes=("paper",), sets=tuple(sets))
    configs, *_ = config_overrides(args, None if family == "dit" else family)
    return StepBench(compose_or_raise(next(ov for _, ov, dense in configs if not dense)))


@pytest.mark.parametrize("family", ["dit", *FAMILIES])
def test_a_bf16_routed_step_mixes_no_dtypes(family):
    bench = bf16_step(family)
    assert bench.model.routing.routes and bench.accelerator.mixed_precision == "bf16"
    assert findings(bench) == []


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("base", ["model.base_dtype=bf16", "model.base_dtype=fp8", "model.quantize=int8"])
def test_an_adapter_over_a_low_precision_base_mixes_no_dtypes(family, base):
    bench = bf16_step(family, "model.lora={rank:4,alpha:4,target_modules:[to_q,to_k,to_v,to_out.0]}", base)
    assert findings(bench) == []
