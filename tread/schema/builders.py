"""Each built section's table: a `_target_` name to its builder and its section type. The schema checks a section
by its type, the builders build from the same entry, and a checkpoint's config may name these builders only."""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Union

import torch
import torch.nn as nn

from tread.diffusion.edm import EDM
from tread.diffusion.rf import RectifiedFlow
from tread.models.dit import build_dit
from tread.models.families import build_family
from tread.models.sprint import build_sprint
from tread.schema.base import Section
from tread.schema.model import AdamW, AdamW8bit, DiTModel, EDMConfig, FamilyModel, RFConfig
from tread.utils.optim import adamw8bit
from tread.utils.targets import build_target


class Choice(NamedTuple):
    """One name a section's `_target_` may take."""

    build: Callable[..., Any]
    section: type[Section]


MODELS = {"tread.models.build_dit": Choice(build_dit, DiTModel),
          "tread.models.build_sprint": Choice(build_sprint, DiTModel),
          "tread.models.families.build_family": Choice(build_family, FamilyModel)}
DIFFUSIONS = {"tread.diffusion.EDM": Choice(EDM, EDMConfig),
              "tread.diffusion.RectifiedFlow": Choice(RectifiedFlow, RFConfig)}
OPTIMIZERS = {"torch.optim.AdamW": Choice(torch.optim.AdamW, AdamW),
              "torchao.optim.AdamW8bit": Choice(adamw8bit, AdamW8bit)}
CHOICES = {"model": MODELS, "diffusion": DIFFUSIONS, "optimizer": OPTIMIZERS}
TARGETS = {section: tuple(table) for section, table in CHOICES.items()}   # what a checkpoint may name


def section_types(section: str) -> dict[str, type[Section]]:
    """The section's `_target_` names and the type each is checked as."""
    return {name: choice.section for name, choice in CHOICES[section].items()}


def build(section: str, spec: Mapping[str, Any]) -> Any:
    """What `spec` (a `section` config: its `_target_` and arguments) describes, built by its table's builder."""
    return build_target(spec, {name: choice.build for name, choice in CHOICES[section].items()}, section)


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """The backbone a `model` config describes (DiT or a diffusers family), its routes checked against its depth."""
    return build("model", spec)


def build_diffusion(spec: Mapping[str, Any]) -> Union[EDM, RectifiedFlow]:
    """The objective a `diffusion` config describes."""
    return build("diffusion", spec)
