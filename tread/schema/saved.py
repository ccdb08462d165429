"""The config a checkpoint carries (checkpoint.json), checked through the same schema as a launch before anything
is built from it: the sections a checkpoint's reader builds (model, diffusion) and the seed it initialises with.
Other sections describe the run that wrote it (paths, logging) and are not used to build anything."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tread.schema.base import SEED_LIMIT, ConfigError, check, show
from tread.schema.model import DIFFUSIONS, MODELS
from tread.schema.tree import pick
from tread.utils.checkpoints import META_FILE, CheckpointError, find_checkpoint, read_meta

BUILT = {"model": MODELS, "diffusion": DIFFUSIONS}


def check_saved_config(config: Any, ckpt: Path) -> None:
    """CheckpointError naming checkpoint.json and the key when the saved config could not build what it
    describes (an unknown model key, a seed of 'abc' or 2**70, a missing section)."""
    where = Path(ckpt) / META_FILE
    try:
        for name, kind in BUILT.items():
            if name not in config:
                raise ConfigError(f"{name} is missing")
            check(pick(kind, config[name], name), config[name], name)
        seed = (config.get("train") or {}).get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
            raise ConfigError(f"train.seed={show(seed)} is not allowed; allowed: an integer in [0, 2**32)")
    except ConfigError as err:
        raise CheckpointError(f"'{where}': its config is not one this version builds: {err}") from None


def check_checkpoint_config(spec: Any) -> None:
    """check_saved_config of the checkpoint a user named (a run dir, a step dir or a file in it)."""
    ckpt = find_checkpoint(spec)
    check_saved_config(read_meta(ckpt)["config"], ckpt)
