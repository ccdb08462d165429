"""Which latent geometry (channels x resolution^2) the planner and the benchmark work on: the one the user names,
else the data the model's size is usually trained on (only channels and resolution are taken from it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from tread.models import parse_arch
from tread.schema.builders import build_model
from tread.perf.overrides import data_geometry
from tread.schema.model import DiTModel
from tread.schema.train import DataSection, ModelSection
from tread.utils.errors import UserError

NAMED = "as named by --resolution/--channels"
USUAL_DATA = {"T": "toy", "S": "imagenet256", "B": "imagenet256", "L": "imagenet256", "XL": "imagenet256"}
DATA_TEXT = {"toy": "the built-in toy data (configs/data/toy.yaml)",
             "imagenet256": "ImageNet-256 SD-VAE latents (configs/data/imagenet256.yaml)"}


class GeometryError(UserError):
    """A geometry that cannot be built (e.g. a token count that is not a square)."""


@dataclass(frozen=True)
class Geometry:
    """The latent geometry chosen, the data overrides that give a composed config that geometry, and why."""

    channels: int
    resolution: int
    why: str                                             # where the geometry comes from (for the first line)
    overrides: list[str] = field(default_factory=list)   # data.* overrides (empty: the config's data as is)
    train_overrides: list[str] = field(default_factory=list)   # the same for a train command (names the data)
    usual_data: Optional[str] = None     # the data config whose geometry is used (when it is not the config's)

    def line(self, num_tokens: int, doing: str = "planning for",
             hint: str = "--resolution/--channels plan for others") -> str:
        """'planning for 4x32x32 latents (256 tokens): <why>; --resolution/--channels plan for others'."""
        r = self.resolution
        tail = "" if self.why == NAMED else f"; {hint}"
        return f"{doing} {self.channels}x{r}x{r} latents ({num_tokens} tokens): {self.why}{tail}"


def is_dit(model: ModelSection) -> bool:
    return isinstance(model, DiTModel)     # model=dit|tread|sprint


def usual_data_name(model: ModelSection) -> Optional[str]:
    """The data config a DiT of this size trains on (None for the families and unknown archs)."""
    if not is_dit(model):
        return None
    arch = str(model.arch)
    size = arch[len("DiT-"):].split("/")[0] if arch.startswith("DiT-") else None
    return USUAL_DATA.get(size)


def choose_geometry(model: ModelSection, data: DataSection, resolution: Optional[int] = None,
                    channels: Optional[int] = None, data_named: Optional[str] = None) -> Geometry:
    """The geometry for a config's `model` and `data` (composed without geometry overrides): named values win; the
    rest from the arch's usual data (unless --data names the data) or the config's data."""
    usual = None if data_named else usual_data_name(model)
    base = data_geometry(usual, GeometryError) if usual else (data.channels, data.resolution)
    c = channels if channels is not None else base[0]
    r = resolution if resolution is not None else base[1]
    named = [f for f, v in (("--resolution", resolution), ("--channels", channels)) if v is not None]
    source = (f"the usual data of {model.arch}, {DATA_TEXT[usual]}" if usual else
              f"the data of the composed config ({describe_data(data, data_named)})")
    if len(named) == 2:
        why = NAMED
    elif named:
        why = f"{named[0]} as named, the rest from {source}"
    else:
        why = source
    overrides = []
    if resolution is not None or r != data.resolution:
        key = "data.builtin_args.resolution" if data.builtin else "data.resolution"
        overrides.append(f"{key}={r}")
    if channels is not None or c != data.channels:
        overrides.append(f"data.channels={c}")
    # a train command for the usual data names it (data=imagenet256) and what was named on top of it
    from_usual = usual is not None and len(named) < 2 and base != (data.channels, data.resolution)
    train_overrides = ([f"data={usual}"] + [f"data.resolution={resolution}"] * (resolution is not None)
                       + [f"data.channels={channels}"] * (channels is not None)) if from_usual else overrides
    return Geometry(c, r, why, overrides, train_overrides, usual if from_usual else None)


def describe_data(data: DataSection, data_named: Optional[str]) -> str:
    if data_named:
        return f"data={data_named}"
    return "the built-in toy data" if data.builtin else "its data"


def resolution_for_tokens(model: ModelSection, tokens: int) -> int:
    """The latent side that gives `tokens` square tokens with the model's patch size (built on the meta
    device: shapes only)."""
    side = math.isqrt(tokens)
    if tokens < 1 or side * side != tokens:
        raise GeometryError(f"--tokens {tokens} is not a square number of tokens; allowed: 1, 4, 16, 64, 256, ...")
    return side * token_patch(model)


def token_patch(model: ModelSection) -> int:
    """Latent cells per token along H (DiT: the arch's patch; families: their latent patch)."""
    if is_dit(model):
        return parse_arch(str(model.arch))[3]
    with torch.device("meta"):
        return int(build_model(model.plain()).latent_patch()[1])
