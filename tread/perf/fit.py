"""The largest batch whose training step fits in a CUDA device's memory (scripts/benchmark.py --fit-batch), found by
trying it: candidates largest first, two eager steps each (the second holds the optimizer state), the first that
does not run out of memory wins. Eager, because a compiled step needs no more memory than the eager one (fusion
drops intermediates) and compiling every candidate would cost minutes."""
from __future__ import annotations

import gc
from typing import Callable, Optional, Sequence

import torch


def largest_fitting(candidates: Sequence[int], try_batch: Callable[[int], None]) -> tuple[Optional[int], list[int]]:
    """(the largest candidate for which try_batch(b) returns, the candidates that ran out of memory before it);
    None as the batch when every candidate did. try_batch builds and steps; its objects are freed between tries."""
    too_big = []
    for batch in sorted(set(candidates), reverse=True):
        try:
            try_batch(batch)
            return batch, too_big
        except torch.OutOfMemoryError:
            too_big.append(batch)
        finally:
            release()
    return None, too_big


def release() -> None:
    """Free what a try left behind (its bench goes out of scope on return or raise)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
