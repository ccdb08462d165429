"""train.context_parallel against the launch, and the split of a run's backbone over its context groups
(docs/scaling.md, "Context parallelism with routing"). The processes of one context group are one data-parallel
replica: they read the same batch and draw the same noise and routes (train.py seeds them by data rank)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from tread.routing.shards import check_split
from tread.runtime.context_parallel import ContextParallel, build_context_parallel
from tread.schema import ConfigError


def check_context_parallel(t: Any, world_size: int, cuda: bool) -> None:
    """train.context_parallel (of the train section `t`) against the launch, before any work: the degree divides
    the processes, and ring attention has a CUDA backend that returns the log-sum-exp it merges with (the checks
    against other keys are the schema's: tread/schema/train.py)."""
    cp = t.context_parallel
    if cp.degree == 1:
        return
    if world_size % cp.degree:
        raise ConfigError(f"train.context_parallel.degree={cp.degree} must divide the number of processes "
                          f"({world_size}): each context group of {cp.degree} processes holds one replica; allowed: a "
                          f"divisor of {world_size}, or launch a multiple of {cp.degree} processes.")
    if cp.mode == "ring" and not cuda:
        raise ConfigError("train.context_parallel.mode=ring merges partial attentions by their log-sum-exp, which "
                          "only diffusers' CUDA backends return; this run is on the CPU (allowed here: ulysses).")


def split_backbone(t: Any, model: nn.Module, device: torch.device) -> Optional[ContextParallel]:
    """Split `model`'s sequences over this process's context group (None at degree 1); the model refuses in one
    line where it cannot, and the default grid must cut into equal shards."""
    cp = t.context_parallel
    if cp.degree == 1:
        return None
    check_split(model.num_tokens, cp.degree)
    split = build_context_parallel(cp.degree, cp.mode, device)
    model.use_context_parallel(split)
    return split
