"""Any of our adapters (LoRA, LoKr, LoHa) as an exact plain LoRA in the format diffusers pipelines load.

Each adapter becomes factors (B, A) with delta W = B @ A exactly, the scale folded into B (no SVD, no
tolerance); docs/design.md ("Exact LoRA export") gives the identities and what diffusers reads.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Optional

import torch
import torch.nn as nn

PIPELINE_PREFIX = "transformer"          # the pipelines' name for the denoiser component
METADATA_KEY = "lora_adapter_metadata"   # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
ADAPTER = "default"                      # the adapter name peft's inject_adapter_in_model gives


def _as_product(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full matrix as L @ R with the smaller inner size: I @ X (rows) or X @ I (columns)."""
    rows, cols = x.shape
    eye = torch.eye(min(rows, cols), dtype=x.dtype, device=x.device)
    return (eye, x) if rows <= cols else (x, eye)


def _factor(layer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LoKr factor `name` (w1 or w2) of `layer` as (L, R) with factor = L @ R."""
    full = getattr(layer, f"lokr_{name}")
    if ADAPTER in full:
        return _as_product(full[ADAPTER].detach().float())
    if name == "w2" and ADAPTER in layer.lokr_t2:
        raise ValueError("LoKr's CP-decomposed conv factor (lokr_t2) has no LoRA form here: Linear targets only.")
    return (getattr(layer, f"lokr_{name}_a")[ADAPTER].detach().float(),
            getattr(layer, f"lokr_{name}_b")[ADAPTER].detach().float())


def _lokr(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    (l1, r1), (l2, r2) = _factor(layer, "w1"), _factor(layer, "w2")
    return torch.kron(l1, l2), torch.kron(r1, r2)


def _loha(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if ADAPTER in layer.hada_t1:
        raise ValueError("LoHa's CP-decomposed conv factors (hada_t1/t2) have no LoRA form here: Linear targets only.")
    p, q = layer.hada_w1_a[ADAPTER].detach().float(), layer.hada_w1_b[ADAPTER].detach().float()
    u, v = layer.hada_w2_a[ADAPTER].detach().float(), layer.hada_w2_b[ADAPTER].detach().float()
    b = (p[:, :, None] * u[:, None, :]).reshape(p.shape[0], -1)      # row-wise Kronecker (face-splitting)
    a = (q[:, None, :] * v[None, :, :]).reshape(-1, q.shape[1])      # column-wise Kronecker
    return b, a


def lora_factors(layer: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(B, A) in float32 with B @ A = the layer's adapter update including its scale; None if `layer` is no
    adapter layer of ours."""
    scale = getattr(layer, "scaling", {}).get(ADAPTER)
    if scale is None:
        return None
    if ADAPTER in getattr(layer, "lora_A", {}):
        b, a = layer.lora_B[ADAPTER].weight.detach().float(), layer.lora_A[ADAPTER].weight.detach().float()
    elif hasattr(layer, "lokr_w1"):
        b, a = _lokr(layer)
    elif hasattr(layer, "hada_w1_a"):
        b, a = _loha(layer)
    else:
        return None
    b = b * scale
    out_dim, in_dim = b.shape[0], a.shape[1]
    if b.shape[1] >= min(out_dim, in_dim):      # no smaller than dense: write the update itself
        delta = b @ a
        eye = torch.eye(min(out_dim, in_dim), dtype=delta.dtype, device=delta.device)
        b, a = (eye, delta) if out_dim <= in_dim else (delta, eye)
    return b, a


def diffusers_lora(module: nn.Module, prefix: str = PIPELINE_PREFIX) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter of `module` (a diffusers transformer with our adapters) as diffusers' LoRA state dict
    ({prefix}.<module>.lora_A/B.weight) and the safetensors metadata that describes it as a peft LoraConfig."""
    tensors, ranks = {}, {}
    for name, layer in module.named_modules():
        factors = lora_factors(layer)
        if factors is None:
            continue
        b, a = factors
        dtype = next(p.dtype for n, p in layer.named_parameters() if "base_layer" not in n)
        tensors[f"{prefix}.{name}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"{prefix}.{name}.lora_B.weight"] = b.to(dtype).contiguous()
        ranks[name] = b.shape[1]
    if not ranks:
        raise ValueError(f"{type(module).__name__} holds no LoRA, LoKr or LoHa adapter to export.")
    r = Counter(ranks.values()).most_common(1)[0][0]
    pattern = {f"^{n}": k for n, k in ranks.items() if k != r}    # "^": diffusers' anchored module names
    config = {"r": r, "lora_alpha": r, "rank_pattern": pattern, "alpha_pattern": dict(pattern),
              "target_modules": sorted(ranks)}
    metadata = {"format": "pt", METADATA_KEY: json.dumps({f"{prefix}.{k}": v for k, v in config.items()},
                                                         sort_keys=True)}
    return tensors, metadata
