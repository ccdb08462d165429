"""Composing a config from configs/ without the command line (Hydra's compose API), as train.py would:
the planner, the benchmark and the tests build their configs here.

Composition costs about 0.3 s (Hydra searches and merges every group); the planner, the benchmark and the test
suite compose the same overrides many times in one process, so results are kept (a deep copy is handed out, so a
caller may change its config freely). The key holds every config file's size and modification time: an edited
configs/ tree composes afresh.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

COMPOSE_ERRORS = (HydraException, OmegaConfBaseException)   # overrides that do not compose

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

CACHE_SIZE = 256
_cache: "OrderedDict[tuple, DictConfig]" = OrderedDict()


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "train",
            return_hydra_config: bool = False) -> DictConfig:
    """The config `python <config_name>.py <overrides>` would run with (with its `hydra` node if asked: that one
    names the run's output directory and time, so it is never cached)."""
    overrides = list(overrides or [])
    if return_hydra_config:
        return _compose(overrides, config_name, True)
    key = (tuple(overrides), config_name, _configs_stamp())
    if key not in _cache:
        _cache[key] = _compose(overrides, config_name, False)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    return copy.deepcopy(_cache[key])


def _compose(overrides: list[str], config_name: str, return_hydra_config: bool) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides,
                                 return_hydra_config=return_hydra_config)
    finally:
        GlobalHydra.instance().clear()


def _configs_stamp() -> tuple:
    """(path, size, mtime_ns) of every file under configs/: what decides a composition besides its overrides."""
    stamp = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        st = path.stat()
        stamp.append((str(path.relative_to(CONFIG_DIR)), st.st_size, st.st_mtime_ns))
    return tuple(stamp)
