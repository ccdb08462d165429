"""The one model builder (training, inference, the benchmark and the route planner all build here).

Only the allowlisted builders may be named by the `model` config's `_target_`, so a config read back from a
checkpoint cannot call anything else; routes are validated against the model's depth while it is built.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch.nn as nn

from tread.models.dit import build_dit
from tread.models.families import build_family
from tread.models.sprint import build_sprint
from tread.utils.targets import build_target

BUILDERS = {"tread.models.build_dit": build_dit, "tread.models.build_sprint": build_sprint,
            "tread.models.families.build_family": build_family}


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """The backbone a `model` config describes (DiT or a diffusers family), with its routing."""
    return build_target(spec, BUILDERS, "model")
