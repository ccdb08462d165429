"""The resume state of a run as one Stateful object (torchtitan's pattern): weights, EMA, optimizer, data
position, step, training time and this process's random streams. tread/checkpoint/save.py writes its
state_dict to disk and hands it back to load_state_dict."""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from tread.data import LatentLoader
from tread.models.lora import load_weights
from tread.utils.dtensor import gather_full, is_sharded, shard_optimizer_state, shard_state
from tread.checkpoint.sharded import ShardedFileError, load_sharded, tensor_index


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

    state_dict() = {"model", "ema" (backbone weights), "optimizer", "loader", "step", "train_sec",
    "tokens_sum"/"tokens_steps", "world_size", "rng" (this process's streams)}. Sharded runs save full
    tensors gathered to rank 0 (None on other ranks) and load them into their shards."""

    def __init__(self, model: nn.Module, ema_model: nn.Module, optimizer: torch.optim.Optimizer,
                 loader: LatentLoader, world_size: int = 1):
        self.model, self.ema_model, self.optimizer, self.loader = model, ema_model, optimizer, loader
        self.world_size = world_size
        self.step = 0
        self.train_sec = 0.0
        self.tokens_sum, self.tokens_steps = 0.0, 0   # measured token shares over all launches (summary.json)

    def state_dict(self) -> dict[str, Any]:
        weights = {"model": self.model.state_dict(), "ema": self.ema_model.state_dict(),
                   "optimizer": plain_optimizer_state(self.optimizer.state_dict())}
        if is_sharded(self.model):
            weights = gather_full(weights)        # a collective: every process calls state_dict() at a checkpoint
        return {**weights, **self.resume_state()}

    def resume_state(self) -> dict[str, Any]:
        """state_dict() without the weights and the optimizer: what a sharded checkpoint keeps beside its shards."""
        return {"loader": self.loader.state_dict(), "step": self.step, "train_sec": self.train_sec,
                "tokens_sum": self.tokens_sum, "tokens_steps": self.tokens_steps, "world_size": self.world_size,
                "rng": {**rng_state(), "router": self.model.routing.router.state_dict()}}

    def sharded_state(self, trainable: Optional[set[str]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the tensors of a sharded checkpoint as this process holds them: {"model", "ema", "optimizer": {index:
        {exp_avg, ...}}}, with the optimizer's state keyed by parameter index as in its own state_dict; and its
        param groups, with the parameters' names). `trainable` limits the weights (adapter-only). No communication."""
        keep = (lambda name: True) if trainable is None else (lambda name: name in trainable)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        named = optimizer_params(self.model, inner)
        tensors = {"model": {k: v for k, v in self.model.state_dict().items() if keep(k)},
                   "ema": {k: v for k, v in self.ema_model.state_dict().items() if keep(k)},
                   "optimizer": {str(i): {k: v for k, v in inner.state[p].items() if torch.is_tensor(v)}
                                 for i, (_, p) in enumerate(named) if p in inner.state}}
        groups = inner.state_dict()["param_groups"]          # parameters as indices, in the optimizer's order
        return tensors, {"optimizer_groups": groups, "optimizer_params": [n for n, _ in named]}

    def load_sharded(self, folder: Path, plain: dict[str, Any], adapter_only: bool, where: str) -> None:
        """Weights, EMA and optimizer moments from a sharded folder into this process's tensors (its shards, or
        full tensors in a single process): each process reads only the slices it holds. An adapter-only folder
        fills what it holds (load_sharded checks it is this model's)."""
        index = tensor_index(folder)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        named = optimizer_params(self.model, inner)
        groups, names = plain["optimizer_groups"], plain.get("optimizer_params")
        if sum(len(g["params"]) for g in groups) != len(named) or names not in (None, [n for n, _ in named]):
            raise ShardedFileError(f"{where}: its optimizer holds other parameters than this model trains; was "
                                   f"model.lora or the model changed?")

        def weights(top: str, sd: dict) -> dict:
            return {k: v for k, v in sd.items() if not adapter_only or (top, k) in index}

        moments = {str(i): {path[2]: _like(p, shape_dtype) for path, shape_dtype in index.items()
                            if len(path) == 3 and path[:2] == ("optimizer", str(i))} for i, (_, p) in enumerate(named)}
        moments = {i: entries for i, entries in moments.items() if entries}
        ema = {} if self.ema_model is self.model else weights("ema", self.ema_model.state_dict())   # ema.mode=off
        load_sharded({"model": weights("model", self.model.state_dict()), "ema": ema, "optimizer": moments},
                     folder, index)
        self.optimizer.load_state_dict({"state": {int(i): m for i, m in moments.items()}, "param_groups": groups})

    def load_state_dict(self, state: dict[str, Any], adapter_only: bool = False, where: str = "checkpoint") -> None:
        """Restore a state_dict() (or, from a sharded checkpoint, what read_checkpoint gives: "sharded" names its
        folder); `adapter_only` weights load over the freshly built base. Without "rng" (a process that did not
        exist in the saved run), this process keeps the fresh streams it was seeded with."""
        if state.get("sharded") is not None:
            self.load_sharded(state["sharded"], state, adapter_only, where)
        else:
            self.load_full(state, adapter_only, where)
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self.train_sec = float(state.get("train_sec", 0.0))
        self.tokens_sum = float(state.get("tokens_sum", 0.0))     # 0, 0 from a checkpoint written before them
        self.tokens_steps = int(state.get("tokens_steps", 0))
        rng: Optional[dict] = state.get("rng")
        if rng is not None:
            set_rng_state(rng)
            self.model.routing.router.load_state_dict(rng["router"])

    def load_full(self, state: dict[str, Any], adapter_only: bool, where: str) -> None:
        """Weights, EMA and optimizer from full tensors (a single-file checkpoint), cut into shards under FSDP."""
        model, ema, optimizer = state["model"], state["ema"], state["optimizer"]
        if is_sharded(self.model):                # full tensors -> this process's shards
            model, ema = shard_state(self.model, model), shard_state(self.ema_model, ema)
            optimizer = shard_optimizer_state(self.optimizer, optimizer)
        load_weights(self.model, model, adapter_only, where)
        if self.ema_model is not self.model:       # ema.mode=off: the model is its own EMA
            load_weights(self.ema_model, ema, adapter_only, where)
        self.optimizer.load_state_dict(live_optimizer_state(optimizer))


def _state8bit() -> Optional[type]:
    """torchao's OptimState8bit where torchao's optimizers were imported (optimizer=adamw8bit), else None."""
    return getattr(sys.modules.get("torchao.optim.subclass_8bit"), "OptimState8bit", None)


def plain_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict for the state file: each 8-bit moment of optimizer=adamw8bit (torchao's OptimState8bit
    tensor subclass) as the plain data it holds, {"codes": uint8 of the parameter's shape, "scale": one fp32 per
    block of codes, "qmap": (256,) fp32 code values, "signed": bool}; everything else as it is."""
    cls = _state8bit()
    if cls is None:
        return state
    plain = {i: {k: {"codes": v.codes, "scale": v.scale, "qmap": v.qmap, "signed": bool(v.signed)}
                 if isinstance(v, cls) else v for k, v in entries.items()} for i, entries in state["state"].items()}
    return {**state, "state": plain}


def live_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """plain_optimizer_state's inverse: its 8-bit moments as OptimState8bit again (copies: never the state file's
    tensors), for optimizer.load_state_dict (which moves them to the parameters' device)."""
    cls = _state8bit()
    if cls is None:
        return state
    live = {i: {k: cls(v["codes"].clone(), v["scale"].clone(), v["qmap"].clone(), v["signed"], dtype=torch.float32)
                if isinstance(v, dict) else v for k, v in entries.items()} for i, entries in state["state"].items()}
    return {**state, "state": live}


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """The optimizer's parameters with their names in `model` (the backbone), in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _like(param: torch.Tensor, shape_dtype: tuple) -> torch.Tensor:
    """A template for one optimizer entry: sharded like the parameter when it has the parameter's shape (moments),
    a plain tensor otherwise (the step count)."""
    shape, dtype = shape_dtype
    if tuple(shape) == tuple(param.shape):
        return torch.zeros_like(param.detach(), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)
