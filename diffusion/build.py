"""The objective a `diffusion` config describes (configs/diffusion/*.yaml)."""
from __future__ import annotations

from typing import Any, Mapping, Union

from diffusion.edm import EDM
from diffusion.rf import RectifiedFlow
from utils.targets import build_target

OBJECTIVES = {"diffusion.EDM": EDM, "diffusion.RectifiedFlow": RectifiedFlow}


def build_diffusion(cfg: Mapping[str, Any]) -> Union[EDM, RectifiedFlow]:
    return build_target(cfg, OBJECTIVES, "diffusion")
