"""The objective a `diffusion` config describes (configs/diffusion/*.yaml)."""
from __future__ import annotations

from typing import Any, Mapping, Union

from tread.diffusion.edm import EDM
from tread.diffusion.rf import RectifiedFlow
from tread.utils.targets import build_target

OBJECTIVES = {"tread.diffusion.EDM": EDM, "tread.diffusion.RectifiedFlow": RectifiedFlow}


def build_diffusion(spec: Mapping[str, Any]) -> Union[EDM, RectifiedFlow]:
    return build_target(spec, OBJECTIVES, "diffusion")
