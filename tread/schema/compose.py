"""Composing a config from configs/ without the command line (Hydra's compose API), as train.py would:
the planner, the benchmark and the tests build their configs here."""
from __future__ import annotations

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


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "train",
            return_hydra_config: bool = False) -> DictConfig:
    """The config `python <config_name>.py <overrides>` would run with (with its `hydra` node if asked)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides or []),
                                 return_hydra_config=return_hydra_config)
    finally:
        GlobalHydra.instance().clear()
