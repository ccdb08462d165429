"""diffusers transformer families with TREAD routing: one registry, one builder (`model=flux|sd3|wan|...`)."""
from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional

from tread.models.families.base import ClassTextEmbedder, Embedded, FamilyConfigError, RoutedFamily
from tread.models.families.pretrained import load_pretrained
from tread.models.lora import apply_lora
from tread.models.quantize import check_base_dtype, check_quantize, load_dtype, quantize_base, store_base

# family name -> module under models.families; each module defines FAMILY (the class) and PRESETS.
FAMILY_MODULES = {"flux": "flux", "sd3": "sd3", "wan": "wan", "auraflow": "auraflow", "pixart": "pixart",
                  "flux2": "flux2", "qwen_image": "qwen_image", "chroma": "chroma", "sana": "sana",
                  "hidream": "hidream", "z_image": "z_image", "lumina2": "lumina2",
                  "ltx_video": "ltx_video", "hunyuan_video": "hunyuan_video", "cosmos": "cosmos"}
FAMILY_MODULES.update({   # the 2026-12 wave: one line each
    "qwen_image21": "qwen_image21",
    "kandinsky5": "kandinsky5",
    "ltx2": "ltx2",
    "krea2": "krea2",
    "flux3": "flux3",
    "ernie_image": "ernie_image",
    "minimax_h3": "minimax_h3",
    "wan_vace": "wan_vace",
    # -- new families above this line --
})
FAMILIES = tuple(FAMILY_MODULES)


def family_module(family: str):
    if family not in FAMILY_MODULES:
        raise FamilyConfigError(f"model.family={family!r} is not supported; allowed: {list(FAMILIES)} "
                                f"(or model=dit / model=tread for DiT).")
    return importlib.import_module(f"tread.models.families.{FAMILY_MODULES[family]}")


def build_family(family: str, *, input_size: int, in_channels: int, num_classes: int, preset: str = "tiny",
                 pretrained: Optional[str] = None, subfolder: Optional[str] = "transformer",
                 config: Optional[Mapping[str, Any]] = None, routing: Optional[Mapping[str, Any]] = None,
                 text_len: int = 8, gradient_checkpointing: bool = False,
                 lora: Optional[Mapping[str, Any]] = None, arch: Optional[str] = None,
                 text_encoders: Optional[str] = None, quantize: Optional[str] = None, base_dtype: str = "fp32",
                 **family_kwargs: Any) -> RoutedFamily:
    """Build a routed family model from a preset's diffusers config (+ `config` overrides) with fresh weights, or
    from `pretrained` weights loaded unchanged. `quantize` quantizes the frozen base before `lora`'s adapters
    are injected; `base_dtype` (bf16 | fp8) stores the frozen base. `text_encoders` plays no part here."""
    check_quantize(quantize, lora)
    check_base_dtype(base_dtype, lora, quantize)
    module = family_module(family)
    cls = module.FAMILY
    if pretrained:
        if config:
            raise FamilyConfigError(f"model.config={dict(config)} cannot be combined with model.pretrained="
                                    f"'{pretrained}': a pretrained transformer keeps its own config.")
        transformer = load_pretrained(cls.transformer_class(), family, str(pretrained), subfolder, cls.hub_hint,
                                      load_dtype(base_dtype))
    else:
        if preset not in module.PRESETS:
            raise FamilyConfigError(f"model.preset={preset!r} is not a {family} preset; allowed: "
                                    f"{sorted(module.PRESETS)} (or model.pretrained=PATH for real weights).")
        chosen = {**module.PRESETS[preset], **dict(config or {})}
        kwargs = {**cls.data_config(int(in_channels), int(input_size), chosen), **chosen}
        try:
            transformer = cls.transformer_class()(**kwargs)
        except TypeError as err:
            raise FamilyConfigError(f"model.config for {family} has a key that "
                                    f"{cls.transformer_class().__name__} does not take: {err}") from None
        cls.init_fresh(transformer)
    model = cls(transformer, input_size=input_size, in_channels=in_channels, num_classes=num_classes,
                routing=routing, text_len=text_len, arch=arch or f"{family}-{'pretrained' if pretrained else preset}",
                gradient_checkpointing=gradient_checkpointing, **family_kwargs)
    quantize_base(model, quantize)
    if lora:
        apply_lora(model.transformer, lora, key="model.lora")
    return store_base(model, base_dtype)


__all__ = ["ClassTextEmbedder", "Embedded", "FAMILIES", "FamilyConfigError", "RoutedFamily", "build_family",
           "family_module"]
