"""Process ranks and collectives that work with or without an initialised process group (EDM's
torch_utils/distributed.py is the model): one process is rank 0 of a world of 1, and every collective
is then a no-op."""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tread.utils.errors import USER_ERRORS

T = TypeVar("T")


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def comm_device() -> torch.device:
    """Where tensors must be for a collective: NCCL only moves CUDA tensors, gloo CPU ones."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any (a collective: every rank must call it)."""
    if not is_distributed():
        return bool(flag)
    value = torch.tensor([int(flag)], device=comm_device())
    dist.all_reduce(value)
    return bool(value.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (itself without a process group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank_zero_call(fn: Callable[[], T]) -> T:
    """fn() on rank 0 only, its result on every rank; a user error it raises is raised on every rank, so none waits
    in a later collective. A collective: every rank must call it. Without a process group: fn()."""
    if not is_distributed():
        return fn()
    outcome: Any = None
    if dist.get_rank() == 0:
        try:
            outcome = ("value", fn())
        except USER_ERRORS as err:
            outcome = ("error", err)
    kind, value = broadcast_object(outcome, src=0)
    if kind == "error":
        raise value
    return value


def all_gather_rows(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather tensors whose row counts differ per rank (possibly 0): padded, gathered, trimmed and concatenated in
    rank order on the CPU. A collective; without a process group, the tensors themselves."""
    if not is_distributed():
        return [t.cpu() for t in tensors]
    dev, world = comm_device(), dist.get_world_size()
    n = tensors[0].shape[0]
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.int64, device=dev))
    counts = [int(s.item()) for s in sizes]
    most = max(counts)
    out = []
    for t in tensors:
        if most == 0:
            out.append(t.cpu())
            continue
        padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=dev)
        padded[:n] = t.to(dev)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        out.append(torch.cat([p[:c].cpu() for p, c in zip(parts, counts)]))
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks, returned on t's device (t itself without a process group)."""
    if not is_distributed():
        return t
    moved = t.to(comm_device())
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    return moved.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks, returned on t's device (t itself without a process group)."""
    if not is_distributed():
        return t
    moved = t.to(comm_device())
    dist.all_reduce(moved)
    return moved.to(t.device)
