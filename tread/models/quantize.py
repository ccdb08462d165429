"""A quantized frozen base under adapters (`model.quantize: int8 | int4 | nf4`, QLoRA-style training).

The Linear layers of the routable blocks (attention projections, MLPs, the blocks' modulation layers: nearly
all of a transformer's weights) are quantized in place; the embedders, the final norm and output projection
stay in full precision: they are a small share of the weights, and the first and last layers are the most
sensitive to quantization error (the usual choice of QLoRA and of diffusers' quantizers). Every quantized layer
stays an nn.Linear subclass with the same in/out features, so peft's LoRA, LoKr and LoHa tuners wrap it
like any Linear (tread/models/lora.py) and routing (which only reorders tokens between blocks) is unaffected.

Libraries, one per mode where it is best (both small pure-Python/abi3 wheels, CPU and CUDA, autograd through
the frozen weight so upstream adapters get gradients):
- int8, int4: optimum-quanto (qint8 per output row; qint4 packed two per byte, groups of up to 128 input
  features, per row where the width does not divide). On CUDA quanto picks its fast kernels itself
  (int8 matmuls; int4 through torch's tinygemm for bf16 on sm80+).
- nf4: torchao's NF4Tensor (QLoRA's 4-bit NormalFloat, blocks of 64 with double-quantized scales), whose
  F.linear dequantizes on the fly (fused by torch.compile on GPU).

Quantization is a pure function of the weights, so a seeded rebuild (resume, sampling) reproduces the same base.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.errors import ModelConfigError

QUANTIZE_MODES = ("int8", "int4", "nf4")
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
    from optimum.quanto import freeze, qint4, qint8, quantize

    quantize(block, weights=qint8 if mode == "int8" else qint4)
    freeze(block)


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


def quantize_mode(module: nn.Module) -> Optional[str]:
    """The model.quantize mode a built model was quantized with (None: full precision)."""
    return next((m._tread_quantize for m in module.modules() if getattr(m, "_tread_quantize", None)), None)


def frozen_base(module: nn.Module) -> dict[int, nn.Parameter]:
    """The frozen parameters of a quantized model as a deepcopy memo: a copy made with it (the EMA) shares
    them instead of holding a second quantized base (they never change; quantized tensors cannot deepcopy)."""
    if quantize_mode(module) is None:
        return {}
    return {id(p): p for p in module.parameters() if not p.requires_grad}


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of the plain tensors a (possibly quantized, nested subclass) tensor stores: codes and scales."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, nn.Parameter):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(stored_bytes(getattr(t, n)) for n in names)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's stored weights (parameters and buffers, quantized codes and their scales counted as
    stored), each shared tensor once: the weight-memory figure of tread/perf/memory.py's table."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += stored_bytes(t.data if isinstance(t, nn.Parameter) else t)
    return total
