"""From the tools' flags to training-config overrides: the benchmark and the planner compose the config
`python train.py <overrides>` would run, checked (tread.schema.check_train), with a one-line error when it does not
compose. Only this module holds composed configs unchecked: data_geometry reads a data config's shape alone."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch
from omegaconf import DictConfig

from tread.schema import check_train, compose
from tread.schema.compose import COMPOSE_ERRORS
from tread.schema.model import AdamW, AdamW8bit
from tread.schema.train import Train, TrainConfig
from tread.training.setup import mixed_precision
from tread.utils.device import why_unavailable
from tread.utils.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


class OverrideError(UserError):
    """Overrides that do not compose, or a --set that is not a Hydra override."""


def compose_or_raise(overrides: Sequence[str], error: type[UserError] = OverrideError) -> TrainConfig:
    """The composed training config, checked; `error` with Hydra's first line when it does not compose (a value
    check_train refuses is its one-line ConfigError)."""
    return check_train(_composed(overrides, error), unset_ok=("data.path",))   # synthetic batches: no data read


def data_geometry(name: str, error: type[UserError] = OverrideError) -> tuple[int, int]:
    """(channels, resolution) of the data config `name` (configs/data/<name>.yaml), read from the config composed
    with it unchecked: it may leave keys mandatory (data.path=???) that a shape does not need."""
    data = _composed([f"data={name}"], error).data
    return int(data.channels), int(data.resolution)


def _composed(overrides: Sequence[str], error: type[UserError]) -> DictConfig:
    try:
        return compose(list(overrides))
    except COMPOSE_ERRORS as err:
        raise error(f"the overrides {' '.join(overrides)} do not compose: {str(err).splitlines()[0]}") from None


def check_sets(sets: Sequence[str], reserved: Mapping[str, str], error: type[UserError] = OverrideError) -> None:
    """Every --set is KEY=VALUE, and none sets a key a flag owns (`reserved`: key -> the flag to use; a key
    under routing.* is reserved with its parent)."""
    for item in sets:
        key = item.split("=", 1)[0].lstrip("+~")
        if "=" not in item or not key:
            raise error(f"--set {item!r} is not a Hydra override; allowed: KEY=VALUE, e.g. --set train.seed=1")
        for owned, flag in reserved.items():
            if key == owned or (owned.startswith("routing.") and key.startswith(owned)):
                raise error(f"--set {item} is not allowed: {key} is set by {flag}")


def check_device(device: str, error: type[UserError] = OverrideError) -> None:
    if device not in DEVICES:
        raise error(f"--device {device} is not a device; allowed: {', '.join(DEVICES)}")
    if why_unavailable(device):
        raise error(f"--device {device} is not available here (no CUDA device); allowed: auto, cpu")


def run_overrides(precision: Optional[str] = None, device: str = "auto", compile: bool = False,
                  compile_backend: Optional[str] = None) -> list[str]:
    """train.* overrides of how the step runs: --precision fp32|bf16 (None: the config's), --device
    (auto: accelerate's choice), --compile (train.compile, else eager) and its backend (None: the config's)."""
    ov = [f"train.compile={'true' if compile else 'false'}"]
    if precision is not None:
        ov.append(f"train.mixed_precision={'bf16' if precision == 'bf16' else 'no'}")
    if compile_backend:
        ov.append(f"train.compile_backend={compile_backend}")
    if device != "auto":
        ov.append(f"train.cpu={'true' if device == 'cpu' else 'false'}")
    return ov


def precision_name(train: Train, device: torch.device) -> str:
    """The step's precision on `device`: fp32 for mixed_precision=no, else bf16 or fp16 (auto resolved as training
    resolves it)."""
    value = mixed_precision(train.mixed_precision, device)[0]
    return "fp32" if value == "no" else value


def fused_adamw(optimizer: Union[AdamW, AdamW8bit]) -> bool:
    """optimizer.fused of optimizer=adamw (null: false); true for an optimizer without the key (adamw8bit)."""
    return bool(optimizer.fused) if isinstance(optimizer, AdamW) else True
