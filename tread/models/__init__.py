"""Backbones. Each takes (x, noise_level, labels, **cond) and routes tokens internally; tread.schema.builders
builds the one a `model` config describes."""
from tread.models.dit import DIT_ARCHS, DiT, build_dit, parse_arch
from tread.models.errors import ModelConfigError
from tread.models.sprint import build_sprint

__all__ = ["DIT_ARCHS", "DiT", "ModelConfigError", "build_dit", "build_sprint", "parse_arch"]
