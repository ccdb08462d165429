"""Loading a family's diffusers transformer from a hub id or a local diffusers folder, offline-aware, with an error
that says how to provide the weights."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def load_pretrained(cls: type, family: str, path: str, subfolder: Optional[str], hub_hint: str,
                    dtype: torch.dtype = torch.float32) -> nn.Module:
    """cls.from_pretrained(path) in `dtype` (model.base_dtype: quantize.load_dtype) with an error that says how to
    provide the weights offline."""
    local = Path(os.path.expanduser(path))
    looks_local = local.exists() or path.startswith((".", "/", "~"))
    if looks_local and not local.exists():
        raise FileNotFoundError(f"model.pretrained='{path}' ({family}) does not exist. Point it at a diffusers "
                                f"folder (with {subfolder + '/' if subfolder else ''}config.json and weights).")
    try:
        return cls.from_pretrained(str(local) if looks_local else path, subfolder=subfolder or None,
                                   torch_dtype=dtype, local_files_only=_offline() or None)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"cannot load {cls.__name__} weights for model.pretrained='{path}' (subfolder "
            f"{subfolder!r}): {str(err).splitlines()[0]}\nNo network here? Download them once elsewhere, e.g. "
            f"`hf download {hub_hint} --include '{subfolder or ''}{'/' if subfolder else ''}*' --local-dir "
            f"/models/{family}`, copy the folder over and pass model.pretrained=/models/{family} (or set "
            f"HF_HOME to a cache that holds them).") from None
