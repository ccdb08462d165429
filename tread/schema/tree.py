"""From a composed OmegaConf config to plain data the sections validate, with mandatory (???) keys and
interpolation failures reported as config errors."""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tread.schema.base import MISSING, ConfigError, Section, missing_keys, show

# What to pass for a mandatory key, where the config cannot say it itself.
HINTS = {"data.path": "/path/to/dataset (a directory with meta.json, latents.npy, labels.npy, or .tar shards)",
         "eval.reference": "/path/to/ref.npz (built with `python fid.py mode=ref ...`)",
         "checkpoint": "a run directory, checkpoints/step_XXXXXXX directory or a file in it"}


def container(cfg: Union[DictConfig, Mapping[str, Any]], required_ok: Sequence[str] = ()) -> dict[str, Any]:
    """cfg resolved to plain data. Raises ConfigError for a ??? key (except those in required_ok, left as
    ???) and for an interpolation that cannot be resolved."""
    try:
        tree = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{getattr(err, 'full_key', None) or 'the config'} cannot be resolved: "
                          f"{str(err).splitlines()[0]}") from None
    missing = [k for k in missing_keys(tree) if k not in required_ok]
    if missing:
        name = missing[0]
        raise ConfigError(f"{name} is not set (the config leaves it {MISSING}): pass {name}="
                          f"<{HINTS.get(name, 'a value')}>.")
    return tree


def to_yaml(tree: Mapping[str, Any]) -> str:
    """A plain config as the YAML text config.yaml and the trackers keep (OmegaConf's layout)."""
    return OmegaConf.to_yaml(tree)


def pick(kind: Any, value: Any, name: str) -> type[Section]:
    """The section class: `kind` itself, or from a {_target_ or format: class} table by the value's own key."""
    if isinstance(kind, type):
        return kind
    field = "format" if name == "data" else "_target_"
    tag = value.get(field) if isinstance(value, dict) else None
    if tag not in kind:
        raise ConfigError(f"{name}.{field}={show(tag)} is not allowed; allowed: {' or '.join(kind)}.")
    return kind[tag]
