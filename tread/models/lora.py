"""Adapter fine-tuning through peft (`model.lora`): LoRA, LoKr or LoHa injected in place, base weights frozen.

Base parameter names are kept, so pretrained weights load unchanged and full and adapter-only checkpoints
share names; keys of another adapter type are an error (TYPE_KEYS).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.errors import ModelConfigError
from tread.utils.finite import first_nonfinite

ADAPTER_TYPES = ("lora", "lokr", "loha")
COMMON_KEYS = ("type", "rank", "alpha", "target_modules", "init")
TYPE_KEYS = {"lora": ("dropout",),
             "lokr": ("decompose_factor", "decompose_both", "rank_dropout", "module_dropout"),
             "loha": ("rank_dropout", "module_dropout")}
LORA_KEYS = COMMON_KEYS + tuple(dict.fromkeys(k for keys in TYPE_KEYS.values() for k in keys))
# The names peft gives each type's parameters: what trains, and what an adapter-only checkpoint holds.
ADAPTER_PARAM_MARKERS = (".lora_", ".lokr_", ".hada_")
# `init` values each type takes besides peft's LoRA initialisations (which peft itself checks).
LYCORIS_INITS = {"lokr": (True, False, "lycoris"), "loha": (True, False)}


class LoraConfigError(ModelConfigError):
    """A bad model.lora setting; the message names the key and what is allowed."""


def check_type_keys(given: Iterable[str], adapter_type: str, key: str = "model.lora") -> None:
    """Refuse keys that the chosen adapter type does not take (e.g. decompose_factor with type=lora)."""
    if adapter_type not in ADAPTER_TYPES:
        raise LoraConfigError(f"{key}.type={adapter_type!r} is not allowed; allowed: one of {list(ADAPTER_TYPES)}.")
    foreign = sorted(k for k in given if k not in COMMON_KEYS and k not in TYPE_KEYS[adapter_type])
    if foreign:
        raise LoraConfigError(f"{key} key(s) {foreign} do not apply to {key}.type={adapter_type}; it takes "
                              f"{list(COMMON_KEYS + TYPE_KEYS[adapter_type])}.")


def _fraction(spec: Mapping[str, Any], name: str, key: str) -> float:
    value = spec.get(name, 0.0)
    value = 0.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise LoraConfigError(f"{key}.{name}={value!r} is not allowed; allowed: a number in [0, 1).")
    return float(value)


def lora_settings(spec: Mapping[str, Any], key: str = "model.lora") -> dict[str, Any]:
    """model.lora checked and completed (type, alpha defaults), everything that needs no module."""
    spec = dict(spec)
    unknown = sorted(set(spec) - set(LORA_KEYS))
    if unknown:
        raise LoraConfigError(f"{key} has unknown key(s) {unknown}; allowed: {list(LORA_KEYS)}.")
    adapter_type = spec.get("type") or "lora"
    check_type_keys(spec, adapter_type, key)
    rank, alpha = spec.get("rank"), spec.get("alpha")
    alpha = rank if alpha is None else alpha
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraConfigError(f"{key}.rank={rank!r} must be a positive integer (adapter rank, e.g. 16).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraConfigError(f"{key}.alpha={alpha!r} must be a positive number (scale = alpha / rank).")
    targets = spec.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if not targets:
        raise LoraConfigError(f"{key}.target_modules must list module names to adapt, e.g. "
                              f"[to_q, to_k, to_v, to_out.0]; got {spec.get('target_modules')!r}.")
    init = spec.get("init", True)
    if adapter_type in LYCORIS_INITS and init not in LYCORIS_INITS[adapter_type]:
        raise LoraConfigError(f"{key}.init={init!r} is not allowed for {key}.type={adapter_type}; allowed: one of "
                              f"{list(LYCORIS_INITS[adapter_type])}.")
    factor = spec.get("decompose_factor", -1)
    if isinstance(factor, bool) or not isinstance(factor, int) or not (factor == -1 or factor >= 1):
        raise LoraConfigError(f"{key}.decompose_factor={factor!r} is not allowed; allowed: -1 (near-square "
                              f"Kronecker factors) or an integer >= 1 (the first factor's size where it divides).")
    if not isinstance(spec.get("decompose_both", False), bool):
        raise LoraConfigError(f"{key}.decompose_both={spec['decompose_both']!r} is not allowed; allowed: true or "
                              f"false.")
    fractions = {n: _fraction(spec, n, key) for n in ("dropout", "rank_dropout", "module_dropout")}
    return dict(type=adapter_type, rank=rank, alpha=alpha, target_modules=targets, init=init, **fractions,
                decompose_factor=factor, decompose_both=spec.get("decompose_both", False))


def peft_config(s: Mapping[str, Any]):
    """The peft config (LoraConfig / LoKrConfig / LoHaConfig) of checked settings."""
    # deferred: peft (and the transformers it imports) costs seconds, and only adapter runs need it
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    common = dict(r=s["rank"], target_modules=list(s["target_modules"]))
    if s["type"] == "lora":
        return LoraConfig(lora_alpha=s["alpha"], lora_dropout=s["dropout"], init_lora_weights=s["init"], **common)
    lycoris = dict(alpha=s["alpha"], rank_dropout=s["rank_dropout"], module_dropout=s["module_dropout"],
                   init_weights=s["init"], **common)
    if s["type"] == "lokr":
        return LoKrConfig(decompose_factor=s["decompose_factor"], decompose_both=s["decompose_both"], **lycoris)
    return LoHaConfig(**lycoris)


def _check_targets(module: nn.Module, targets: list[str], key: str) -> None:
    names = [n for n, _ in module.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.split(".")[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
        raise LoraConfigError(f"{key}.target_modules {missing} match no module of {type(module).__name__}; "
                              f"linear layer names there include {linear[:20]}.")


def apply_lora(module: nn.Module, spec: Mapping[str, Any], key: str = "model.lora") -> nn.Module:
    """Inject the adapters model.lora describes into `module` and freeze the rest of it. The targets may be
    nn.Linear or any layer peft's chosen tuner accepts (e.g. a quantized Linear); others are one clear error."""
    from peft import inject_adapter_in_model  # deferred: see peft_config

    settings = lora_settings(spec, key)
    _check_targets(module, settings["target_modules"], key)
    config = peft_config(settings)
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        inject_adapter_in_model(config, module)
    except (TypeError, ValueError) as err:   # peft's words for a layer its tuner cannot wrap
        raise LoraConfigError(f"{key}.type={settings['type']} cannot adapt {key}.target_modules="
                              f"{settings['target_modules']}: {err}") from None
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    module._tread_lora = settings
    return module


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name belongs to a peft adapter (LoRA, LoKr or LoHa)."""
    return any(marker in "." + name for marker in ADAPTER_PARAM_MARKERS)


def has_lora(module: nn.Module) -> bool:
    return any(getattr(m, "_tread_lora", None) for m in module.modules())


def adapter_state_dict(module: nn.Module) -> dict:
    """The adapter weights of an adapter-injected module in peft's own format (no base weights)."""
    from peft import get_peft_model_state_dict  # deferred: see peft_config
    # From the live parameters, not state_dict(): under FSDP (gathered for the export) state_dict() gives shards.
    return get_peft_model_state_dict(module, state_dict=dict(module.named_parameters()))


def weights_mismatch(weights: Any, expected: Mapping[str, torch.Tensor], adapter_only: bool) -> Optional[str]:
    """The first tensor of `weights` missing from `expected` (a model's state_dict), unexpected, of another shape,
    or holding non-finite values (None: they fit). Adapter-only weights need only the adapters."""
    if not isinstance(weights, Mapping):
        return "holds no weights"
    unexpected = [k for k in weights if k not in expected]
    lacking = [k for k in expected if k not in weights and (not adapter_only or is_adapter_param(k))]
    if unexpected or lacking:
        return f"tensor '{(unexpected or lacking)[0]}' is {'not in the model' if unexpected else 'missing'}"
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(expected[name].shape):
            return f"tensor '{name}' has shape {list(getattr(tensor, 'shape', []))}, the model's is " \
                   f"{list(expected[name].shape)}"
        if tensor.is_floating_point() != expected[name].is_floating_point():
            return f"tensor '{name}' is {tensor.dtype}, the model's is {expected[name].dtype}"
    bad = first_nonfinite(weights)
    return None if bad is None else f"tensor '{bad}' holds non-finite values"


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
    lacking = [k for k in missing if is_adapter_param(k)]
    if lacking:
        raise LoraConfigError(f"{where}: adapter-only checkpoint lacks adapter weights {sorted(lacking)[:5]}.")
