"""The plain values of a checkpoint's resume state (step, training time, world size, data position, random
streams), checked before any is used: a wrong value is a corrupt checkpoint (CheckpointError naming the file
and key), and a resume falls back to the previous one.
"""
from __future__ import annotations

import math
import random
from typing import Any, Optional

import numpy as np
import torch

from tread.utils.errors import UserError

STEP_LIMIT = 10**12            # more optimizer steps than any run takes: a larger step is a corrupt file
EPOCH_LIMIT = 2**40            # the sampler seeds epoch e with seed + 1_000_003 * e: this stays inside int64
BATCH_LIMIT = 2**40
OPTIONAL_RNG = ("cuda",)       # present when the saving process had CUDA; ignored without it


class ResumeValueError(UserError):
    """A resume-state value of the wrong type, size or range (caught and named by the checkpoint reader)."""


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(value: Any, name: str, low: int, high: int) -> int:
    if not is_int(value) or not low <= int(value) < high:
        raise ResumeValueError(f"{name}={value!r}: allowed an integer in [{low}, {high})")
    return int(value)


def check_step(train: dict, saved_step: int) -> int:
    """The step of train_state, the same as checkpoint.json's (which read_meta has checked against the step its
    directory names)."""
    step = check_int(train.get("step"), "step", 0, STEP_LIMIT)
    if step != saved_step:
        raise ResumeValueError(f"step={step} but checkpoint.json step says {saved_step!r}")
    return step


def check_plain(train: dict) -> None:
    """train_sec, world_size and the loader position (its settings too, when saved)."""
    seconds = train.get("train_sec", 0.0)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ResumeValueError(f"train_sec={seconds!r}: allowed a finite number of seconds >= 0")
    check_int(train.get("world_size", 1), "world_size", 1, 2**20)
    steps = check_int(train.get("tokens_steps", 0), "tokens_steps", 0, STEP_LIMIT)
    share = train.get("tokens_sum", 0.0)
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= steps:
        raise ResumeValueError(f"tokens_sum={share!r}: allowed a number in [0, tokens_steps={steps}]")
    loader = train.get("loader")
    if not isinstance(loader, dict):
        raise ResumeValueError(f"loader={loader!r}: allowed a mapping with epoch and batch")
    check_int(loader.get("epoch"), "loader.epoch", 0, EPOCH_LIMIT)
    check_int(loader.get("batch"), "loader.batch", 0, BATCH_LIMIT)
    for key, low in (("index", 0), ("phase", 0), ("seed", 0), ("batch_size", 1), ("world_size", 1),
                     ("num_samples", 1)):
        if key in loader:
            check_int(loader[key], f"loader.{key}", low, 2**63)


def check_rng(rng: Any, template: dict, name: str = "rng") -> None:
    """`rng` has `template`'s structure: the same keys (CUDA's optional), sequence lengths, and tensors and
    arrays of the same dtype and shape, ints where it has ints."""
    problem = mismatch(rng, template, name)
    if problem:
        raise ResumeValueError(problem)
    trials = {"python": lambda s: random.Random().setstate(s), "numpy": lambda s: np.random.RandomState().set_state(s),
              "torch": lambda s: torch.Generator().set_state(s)}
    for key, trial in trials.items():
        try:
            trial(rng[key])          # on a scratch generator: its values are in range too
        except (ValueError, TypeError, OverflowError, RuntimeError) as err:
            raise ResumeValueError(f"{name}.{key} is not a valid generator state ({err})") from None


def mismatch(value: Any, like: Any, name: str) -> Optional[str]:
    """The first place where `value` differs in structure from `like` (None: none)."""
    if isinstance(like, dict):
        if not isinstance(value, dict):
            return f"{name} is a {type(value).__name__}, expected a mapping"
        lacking = [k for k in like if k not in value and k not in OPTIONAL_RNG]
        if lacking:
            return f"{name} lacks {lacking[0]!r}"
        return next((m for k in like if k in value for m in [mismatch(value[k], like[k], f"{name}.{k}")] if m), None)
    if isinstance(like, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(like):
            return f"{name} is not a sequence of {len(like)} items"
        return next((m for i, (v, w) in enumerate(zip(value, like)) for m in [mismatch(v, w, f"{name}[{i}]")] if m),
                    None)
    if isinstance(like, (torch.Tensor, np.ndarray)):
        if type(value) is not type(like) or value.dtype != like.dtype or tuple(value.shape) != tuple(like.shape):
            return f"{name} is not a {type(like).__name__} of {like.dtype} and shape {tuple(like.shape)}"
        return None
    if is_int(like):
        return None if is_int(value) else f"{name}={value!r} is not an integer"
    if isinstance(like, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else f"{name} is not a number"
    return None if value == like or isinstance(value, type(like)) else f"{name}={value!r} is not a {type(like).__name__}"


def check_router(router: Any) -> None:
    """The router's streams: {"seed": int, "states": {device: uint8 generator state}}."""
    if not isinstance(router, dict):
        raise ResumeValueError(f"rng.router={router!r}: allowed a mapping with seed and states")
    check_int(router.get("seed"), "rng.router.seed", 0, 2**64)
    states = router.get("states", {})
    bad = [k for k, v in states.items() if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8 or v.dim() != 1] \
        if isinstance(states, dict) else ["(not a mapping)"]
    if bad:
        raise ResumeValueError(f"rng.router.states[{bad[0]!r}] is not a generator state (a 1-D uint8 tensor)")
    for key, value in states.items():
        if str(key) == "cpu":
            try:
                torch.Generator().set_state(value)
            except RuntimeError as err:
                raise ResumeValueError(f"rng.router.states['cpu'] is not a valid generator state ({err})") from None
