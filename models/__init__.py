"""Backbones. Each takes (x, noise_level, labels, **cond) and routes tokens internally; build_model builds
the one a `model` config describes."""
from models.build import build_model
from models.dit import DIT_ARCHS, DiT, build_dit, parse_arch
from models.errors import ModelConfigError

__all__ = ["DIT_ARCHS", "DiT", "ModelConfigError", "build_dit", "build_model", "parse_arch"]
