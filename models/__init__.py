"""Backbones. Each takes (x, noise_level, labels, **cond) and routes tokens internally."""
from models.dit import DIT_ARCHS, DiT, build_dit

__all__ = ["DIT_ARCHS", "DiT", "build_dit"]
