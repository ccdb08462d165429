"""The resume state of a run as one Stateful object (torchtitan's pattern): weights, EMA, optimizer, data
position, step, training time and this process's random streams. tread/training/checkpoint.py writes its
state_dict to disk and hands it back to load_state_dict."""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from tread.data import LatentLoader
from tread.models.lora import load_weights
from tread.training.fsdp import gather_full, is_sharded, shard_optimizer_state, shard_state


def rng_state() -> dict[str, Any]:
    """This process's global random streams (torch, numpy, python, and CUDA when present)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainingState:
    """Everything a resumed run needs to continue exactly where it stopped.

    state_dict() = {"model", "ema" (backbone weights), "optimizer", "loader" (data position), "step",
    "train_sec" (training time over all launches: the time budget), "world_size", "rng" (this process's
    streams, the router's included)}. The weights are the backbones' (model.model), so checkpoints hold no
    wrapper prefixes whatever the preconditioning, compile or DDP. Sharded runs (train.parallel=fsdp) save the
    same full tensors, gathered to rank 0 (other ranks' weights and optimizer entries are None), and load a full
    checkpoint into their shards (tread/training/fsdp.py)."""

    def __init__(self, model: nn.Module, ema_model: nn.Module, optimizer: torch.optim.Optimizer,
                 loader: LatentLoader, world_size: int = 1):
        self.model, self.ema_model, self.optimizer, self.loader = model, ema_model, optimizer, loader
        self.world_size = world_size
        self.step = 0
        self.train_sec = 0.0

    def state_dict(self) -> dict[str, Any]:
        weights = {"model": self.model.state_dict(), "ema": self.ema_model.state_dict(),
                   "optimizer": self.optimizer.state_dict()}
        if is_sharded(self.model):
            weights = gather_full(weights)        # a collective: every process calls state_dict() at a checkpoint
        return {**weights, "loader": self.loader.state_dict(), "step": self.step,
                "train_sec": self.train_sec, "world_size": self.world_size,
                "rng": {**rng_state(), "router": self.model.routing.router.state_dict()}}

    def load_state_dict(self, state: dict[str, Any], adapter_only: bool = False, where: str = "checkpoint") -> None:
        """Restore a state_dict(); `adapter_only` weights load over the freshly built base. Without "rng" (a
        process that did not exist in the saved run), this process keeps the fresh streams it was seeded with."""
        model, ema, optimizer = state["model"], state["ema"], state["optimizer"]
        if is_sharded(self.model):                # full tensors -> this process's shards
            model, ema = shard_state(self.model, model), shard_state(self.ema_model, ema)
            optimizer = shard_optimizer_state(self.optimizer, optimizer)
        load_weights(self.model, model, adapter_only, where)
        load_weights(self.ema_model, ema, adapter_only, where)
        self.optimizer.load_state_dict(optimizer)
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self.train_sec = float(state.get("train_sec", 0.0))
        rng: Optional[dict] = state.get("rng")
        if rng is not None:
            set_rng_state(rng)
            self.model.routing.router.load_state_dict(rng["router"])
