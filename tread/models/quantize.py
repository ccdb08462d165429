"""A quantized frozen base under adapters (`model.quantize: int8 | int4 | nf4`, QLoRA-style), and the lighter
`model.base_dtype: bf16 | fp8` storage of the frozen base.

The routable blocks' Linear layers are quantized in place and stay nn.Linear subclasses, so peft wraps them and
routing is unaffected. docs/families.md ("Quantized base") gives the libraries and why.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.models.errors import ModelConfigError

QUANTIZE_MODES = ("int8", "int4", "nf4")
BASE_DTYPES = ("fp32", "bf16", "fp8")     # model.base_dtype: how an adapter run stores its frozen Linear weights
NF4_BLOCK = 64            # weights per NF4 absmax block (QLoRA's value)
NF4_SCALER_BLOCK = 256    # absmax values per double-quantization block (QLoRA's value; smaller where it must)


class QuantizeConfigError(ModelConfigError):
    """A bad model.quantize setting; the message names the key, the value and what is allowed."""


def check_mode(mode: Optional[str], key: str = "model.quantize") -> None:
    if mode is not None and mode not in QUANTIZE_MODES:
        raise QuantizeConfigError(f"{key}={mode!r} is not allowed; allowed: null (full precision) or one of "
                                  f"{list(QUANTIZE_MODES)}.")


def check_quantize(mode: Optional[str], lora: Optional[Mapping[str, Any]], key: str = "model.quantize") -> None:
    """A known mode, and adapters to train on top (a quantized base itself cannot be trained)."""
    check_mode(mode, key)
    if mode is not None and not lora:
        raise QuantizeConfigError(f"{key}={mode} needs adapters to train (model.lora={{rank: ..., target_modules: "
                                  f"[...]}}): a quantized base is frozen and cannot be trained itself.")


def check_base_dtype(base_dtype: str, lora: Optional[Mapping[str, Any]], quantize: Optional[str],
                     key: str = "model.base_dtype") -> None:
    """A known base dtype; bf16 / fp8 only under adapters (full fine-tuning trains fp32 master weights) and not
    over a quantized base (model.quantize stores those weights already)."""
    if base_dtype not in BASE_DTYPES:
        raise QuantizeConfigError(f"{key}={base_dtype!r} is not allowed; allowed: one of {list(BASE_DTYPES)}.")
    if base_dtype != "fp32" and not lora:
        raise QuantizeConfigError(f"{key}={base_dtype} needs adapters to train (model.lora={{rank: ..., "
                                  f"target_modules: [...]}}): full fine-tuning trains fp32 master weights; allowed "
                                  f"without model.lora: {key}=fp32.")
    if base_dtype != "fp32" and quantize is not None:
        raise QuantizeConfigError(f"{key}={base_dtype} cannot be combined with model.quantize={quantize}, which "
                                  f"stores the base blocks' Linear weights itself; allowed: {key}=fp32 with "
                                  f"model.quantize, or model.quantize=null.")


def load_dtype(base_dtype: str) -> torch.dtype:
    """The torch_dtype pretrained weights load in: bf16 for a bf16 / fp8 base (half the host memory of fp32;
    store_base then brings the non-Linear weights back to fp32), else fp32."""
    return torch.float32 if base_dtype == "fp32" else torch.bfloat16


def quantize_base(model: nn.Module, mode: Optional[str], key: str = "model.quantize") -> nn.Module:
    """Quantize, in place, the Linear layers of `model.routable_blocks()` (a RoutedFamily) and freeze them.
    Call it before the adapters are injected (build_family does)."""
    check_mode(mode, key)
    if mode is None:
        return model
    quantize_blocks(model.routable_blocks(), mode, key)
    model._tread_quantize = mode
    return model


def quantize_blocks(blocks: list[nn.Module], mode: str, key: str = "model.quantize") -> None:
    """Quantize the Linear layers of `blocks` in place and freeze them (quantize_base's work; also used on a
    diffusers pipeline's copy of the transformer, tread/cli/diffusers_pipeline.py)."""
    check_mode(mode, key)
    for block in blocks:
        if mode == "nf4":
            _to_nf4(block, key)
        else:
            _quanto(block, mode)
        block.requires_grad_(False)


def _quanto(block: nn.Module, mode: str) -> None:
    """qint8 / qint4 weights through optimum-quanto: its Linear layers become frozen QLinear modules."""
    # deferred: quanto (and the extension loader it imports) is needed by quantized runs only
    from optimum.quanto import QModuleMixin, freeze, qint4, qint8, quantize

    quantize(block, weights=qint8 if mode == "int8" else qint4)
    freeze(block)
    for module in block.modules():
        if isinstance(module, QModuleMixin):
            module.register_forward_pre_hook(_input_in_stored_dtype)


def _input_in_stored_dtype(module: nn.Module, args: tuple) -> tuple:
    """A quanto layer's input in the dtype its scales are stored in: under bf16 autocast a bf16 activation met fp32
    scales, which torch._weight_int8pack_mm refuses ("expected scalar type BFloat16 but found Float")."""
    x, *rest = args
    return (x.to(module.weight.dtype), *rest) if torch.is_tensor(x) and x.is_floating_point() else args


def _to_nf4(block: nn.Module, key: str) -> None:
    """NF4 weights through torchao: each Linear keeps its class, its weight becomes an NF4Tensor."""
    # deferred: torchao is needed by quantized runs only
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for name, layer in _linears(block):
        weight = layer.weight.detach().contiguous()
        if weight.numel() % NF4_BLOCK:
            raise QuantizeConfigError(f"{key}=nf4 needs Linear weights of a multiple of {NF4_BLOCK} elements; "
                                      f"{name} has shape {tuple(weight.shape)} (use int8 or int4 for this model).")
        scalers = math.gcd(weight.numel() // NF4_BLOCK, NF4_SCALER_BLOCK)
        layer.weight = nn.Parameter(to_nf4(weight, block_size=NF4_BLOCK, scaler_block_size=scalers),
                                    requires_grad=False)


def _linears(module: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    return ((n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear))


def store_base(model: nn.Module, base_dtype: str = "fp32", key: str = "model.base_dtype") -> nn.Module:
    """Store, in place, the frozen nn.Linear layers of `model` (adapters already injected) in bf16, and with fp8 those
    of its routable blocks as float8 e4m3 (one fp32 scale per output row); other floating tensors in fp32. fp32:
    as built."""
    if base_dtype not in BASE_DTYPES:
        raise QuantizeConfigError(f"{key}={base_dtype!r} is not allowed; allowed: one of {list(BASE_DTYPES)}.")
    if base_dtype == "fp32":
        return model
    frozen = [m for m in model.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    stored = {id(p) for m in frozen for p in m.parameters(recurse=False)}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in stored and t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    blocks = {id(m) for b in model.routable_blocks() for m in b.modules()} if base_dtype == "fp8" else set()
    for layer in frozen:
        layer.to(torch.bfloat16)
        layer.__class__ = LowPrecisionLinear
        if id(layer) in blocks:
            layer.weight = nn.Parameter(_to_fp8(layer.weight.detach()), requires_grad=False)
    if base_dtype == "fp8":
        model._tread_quantize = "fp8"
    return model


def _to_fp8(weight: torch.Tensor) -> torch.Tensor:
    """A weight as torchao's Float8Tensor: e4m3 codes and one fp32 scale per output row, dequantized to bf16."""
    # deferred: torchao takes seconds to import and only fp8 bases need it here
    from torchao.quantization import Float8Tensor, PerRow

    return Float8Tensor.from_hp(weight, float8_dtype=torch.float8_e4m3fn, granularity=PerRow())


class LowPrecisionLinear(nn.Linear):
    """A frozen Linear stored in bf16 (or float8 weights dequantized to bf16) that computes in bf16 and, outside
    autocast, casts its output back; autograd keeps the 1-byte float8 weight, not a bf16 copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.weight.dtype)
        plain = type(self.weight) in (torch.Tensor, nn.Parameter)
        out = F.linear(h, self.weight, self.bias) if plain else _DequantLinear.apply(h, self.weight, self.bias)
        autocast = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)   # meta: shapes only
        return out if autocast else out.to(x.dtype)


class _DequantLinear(torch.autograd.Function):
    """x @ dequantize(W)^T + b for a frozen quantized W (no gradient for W or b): the backward dequantizes W again
    instead of keeping the dequantized copy between the passes (torchao's linear_nf4 does the same for NF4)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.weight = weight
        return F.linear(x, weight.dequantize(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        return grad @ ctx.weight.dequantize().to(grad.dtype), None, None


def quantize_mode(module: nn.Module) -> Optional[str]:
    """How a built model stores its frozen base in integer / float8 codes (model.quantize's mode, or "fp8"), else
    None. Such a base is shared by the EMA and left out of checkpoints."""
    return next((m._tread_quantize for m in module.modules() if getattr(m, "_tread_quantize", None)), None)


def frozen_base(module: nn.Module) -> dict[int, nn.Parameter]:
    """The frozen parameters of a quantized model as a deepcopy memo: a copy made with it (the EMA) shares
    them instead of holding a second quantized base (they never change; quantized tensors cannot deepcopy)."""
    if quantize_mode(module) is None:
        return {}
    return {id(p): p for p in module.parameters() if not p.requires_grad}


def plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors a (possibly quantized, nested subclass) tensor stores: itself, or its codes and scales
    (torchao's NF4 / Float8 weights and 8-bit optimizer moments, quanto's weights)."""
    if getattr(type(t), "__tensor_flatten__", None) is None or type(t) in (torch.Tensor, nn.Parameter):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from plain_tensors(getattr(t, name))


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of the plain tensors a (possibly quantized, nested subclass) tensor stores: codes and scales."""
    return sum(x.numel() * x.element_size() for x in plain_tensors(t))


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's stored weights (parameters and buffers, quantized codes and their scales counted as
    stored), each shared tensor once: the weight-memory figure of tread/perf/memory.py's table."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += stored_bytes(t.data if isinstance(t, nn.Parameter) else t)
    return total
