"""LoRA fine-tuning through peft: adapters injected into a module in place, base weights frozen.

peft's `inject_adapter_in_model` keeps every base parameter name (adapters add `.lora_A.default.weight`
and `.lora_B.default.weight` beside them), so pretrained diffusers weights still load unchanged and the
adapter can be saved alone in peft's format (`adapter_state_dict`), which diffusers pipelines load with
`load_lora_weights` / `transformer.load_lora_adapter`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch.nn as nn

from models.errors import ModelConfigError

LORA_KEYS = ("rank", "alpha", "target_modules", "dropout", "init")


class LoraConfigError(ModelConfigError):
    """A bad model.lora setting; the message names the key and what is allowed."""


def apply_lora(module: nn.Module, cfg: Mapping[str, Any], key: str = "model.lora") -> nn.Module:
    """Inject LoRA adapters into `module` per cfg {rank, alpha, target_modules, dropout}; freeze the rest of it."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:  # pragma: no cover - peft is a dependency
        raise LoraConfigError(f"{key} needs the peft package ({err}); pip install peft.") from None
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(LORA_KEYS))
    if unknown:
        raise LoraConfigError(f"{key} has unknown key(s) {unknown}; allowed: {list(LORA_KEYS)}.")
    rank, alpha = cfg.get("rank"), cfg.get("alpha", cfg.get("rank"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraConfigError(f"{key}.rank={rank!r} must be a positive integer (adapter rank, e.g. 16).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraConfigError(f"{key}.alpha={alpha!r} must be a positive number (scale = alpha / rank).")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise LoraConfigError(f"{key}.target_modules must list module names to adapt, e.g. "
                              f"[to_q, to_k, to_v, to_out.0]; got {targets!r}.")
    names = [n for n, _ in module.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.split(".")[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
        raise LoraConfigError(f"{key}.target_modules {missing} match no module of {type(module).__name__}; "
                              f"linear layer names there include {linear[:20]}.")
    dropout = float(cfg.get("dropout", 0.0) or 0.0)
    if not 0.0 <= dropout < 1.0:
        raise LoraConfigError(f"{key}.dropout={dropout} must lie in [0, 1).")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout,
                        init_lora_weights=cfg.get("init", True))
    for p in module.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(config, module)
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
    module._tread_lora = dict(cfg, rank=rank, alpha=alpha, target_modules=list(targets))
    return module


def has_lora(module: nn.Module) -> bool:
    return any(getattr(m, "_tread_lora", None) for m in module.modules())


def adapter_state_dict(module: nn.Module) -> dict:
    """The adapter weights of a LoRA-injected module in peft's format (no base weights)."""
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(module)


def load_weights(model: nn.Module, weights: dict, adapter_only: bool = False, where: str = "checkpoint") -> None:
    """Load full weights strictly, or adapter-only weights over a freshly built base (model.pretrained or the
    seeded initialisation); every key of an adapter-only checkpoint must exist in the model."""
    if not adapter_only:
        model.load_state_dict(weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise LoraConfigError(f"{where}: adapter weights {sorted(unexpected)[:5]} do not exist in the model built "
                              f"from its config; was model.lora changed?")
    lora = [k for k in missing if "lora_" in k]
    if lora:
        raise LoraConfigError(f"{where}: adapter-only checkpoint lacks adapter weights {sorted(lora)[:5]}.")
