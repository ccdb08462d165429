"""The config a checkpoint carries (checkpoint.json), checked through the same schema as a launch before anything
is built from it: the sections a checkpoint's reader builds (model, diffusion) and the seed it initialises with.
Other sections describe the run that wrote it (paths, logging) and are not used to build anything."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from tread.schema.base import SEED_LIMIT, ConfigError, check, show
from tread.schema.builders import section_types
from tread.schema.model import DiTModel, EDMConfig, FamilyModel, RFConfig
from tread.schema.tree import pick
from tread.checkpoint.files import META_FILE, CheckpointError, find_checkpoint, read_meta

BUILT = ("model", "diffusion")


@dataclass(frozen=True)
class SavedConfig:
    """A checkpoint's config, checked: the sections a reader builds (model, diffusion), the seed the model was
    initialised with, and the whole config as saved (`resolved`: the data it trained on, its caption settings)."""

    model: Union[DiTModel, FamilyModel]
    diffusion: Union[EDMConfig, RFConfig]
    seed: int
    resolved: dict[str, Any]

    @property
    def data(self) -> dict[str, Any]:
        """The data section as saved (plain data: what build_dataset takes)."""
        return dict(self.resolved.get("data") or {})

    @property
    def caption_dropout(self) -> tuple[float, str]:
        """(train.caption_dropout, train.caption_dropout_mode) of the run; a checkpoint written before these keys
        trained without caption dropout."""
        train = self.resolved.get("train") or {}
        return float(train.get("caption_dropout") or 0.0), str(train.get("caption_dropout_mode") or "auto")


def check_saved_config(saved: Any, ckpt: Path) -> SavedConfig:
    """The checked config of a checkpoint (`saved`: its plain data), or a CheckpointError naming checkpoint.json and
    the key when it could not build what it describes (an unknown model key, a seed of 'abc' or 2**70, a missing
    section)."""
    where = Path(ckpt) / META_FILE
    try:
        built = {}
        for name in BUILT:
            if name not in saved:
                raise ConfigError(f"{name} is missing")
            built[name] = check(pick(section_types(name), saved[name], name), saved[name], name)
        seed = (saved.get("train") or {}).get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
            raise ConfigError(f"train.seed={show(seed)} is not allowed; allowed: an integer in [0, 2**32)")
    except ConfigError as err:
        raise CheckpointError(f"'{where}': its config is not one this version builds: {err}") from None
    return SavedConfig(built["model"], built["diffusion"], seed, saved)


def check_checkpoint_config(spec: Any) -> None:
    """check_saved_config of the checkpoint a user named (a run dir, a step dir or a file in it)."""
    ckpt = find_checkpoint(spec)
    check_saved_config(read_meta(ckpt)["config"], ckpt)
