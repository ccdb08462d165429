"""Context parallelism (train.context_parallel): one sample's sequence split over a group of processes, on one
device mesh (data x ring x ulysses) with data parallelism or FSDP over all of it (docs/scaling.md, "Context
parallelism with routing").

What is diffusers' and what is ours: attention across the group is diffusers' own (its ContextParallelConfig on
our mesh, and `dispatch_attention_fn`'s templated Ulysses all-to-all or ring pass, with their backward); the
families' self-attention processors already hand it their `_parallel_config`, and DiT calls the same function.
Ours is what routing needs: the routable tokens cut into contiguous shards after the embedding, each shard
routing its own tokens with the whole sequence's scores (tread/routing/shards.py), and the whole sequence
gathered back before the head. diffusers' `_cp_plan` hooks split a transformer's own forward, which our
families do not call (they run its blocks through the route loop), so its split is not used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tread.utils.errors import UserError

MODES = ("ulysses", "ring")


@dataclass
class ContextParallel:
    """This process's place in its context group and the means to use it (implements routing's SequenceSplit)."""

    degree: int                 # processes per context group: shards of every sequence
    index: int                  # this process's shard
    mode: str                   # ulysses (heads exchanged by all-to-all) or ring (key/value blocks passed round)
    group: Any                  # the context group's ProcessGroup
    parallel_config: Any        # diffusers' ParallelConfig over the mesh's ring and ulysses dimensions
    backend: str                # diffusers' attention backend (native SDPA; cudnn for ring, which needs the LSE)
    data_rank: int              # this process's data-parallel replica: ranks of one group share batch and draws
    data_world: int             # data-parallel replicas

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> this process's contiguous (B, N / degree, ...) share."""
        n = t.shape[1] // self.degree
        return t.narrow(1, self.index * n, n)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N / degree, ...) from every process -> (B, N, ...) in shard order. Backward is the reduce-scatter:
        every process computes the same loss from the same gathered output, so each shard's gradient arrives
        `degree` times, which the data-parallel mean over all processes (degree per replica) divides out."""
        return funcol.all_gather_single_autograd(x.contiguous(), gather_dim=1, group=self.group)

    def check_heads(self, heads: int, model: str) -> None:
        """Ulysses hands each process heads / degree of every attention's heads: a one-line error otherwise."""
        if self.mode == "ulysses" and heads % self.degree:
            raise UserError(f"train.context_parallel.degree={self.degree}: Ulysses gives each process 1/{self.degree} "
                            f"of the attention heads, but {model} has {heads}; allowed: a degree dividing {heads}, "
                            f"or train.context_parallel.mode=ring.")

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention of this shard's queries over the whole group's keys and values, (B, N / degree, H, Dh) each."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn   # deferred: diffusers takes ~2 s
        return dispatch_attention_fn(query, key, value, backend=self.backend, parallel_config=self.parallel_config)


def build_context_parallel(degree: int, mode: str, device: torch.device) -> Optional[ContextParallel]:
    """The context group of this process for train.context_parallel (degree, mode), on a mesh of (data, ring,
    ulysses) over every process; None for degree 1 (nothing split). The checks of the schema and the launch
    (check_context_parallel) have passed."""
    if degree == 1:
        return None
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    ring, ulysses = (degree, 1) if mode == "ring" else (1, degree)
    mesh = init_device_mesh(device.type, (world // degree, ring, ulysses), mesh_dim_names=("data", "ring", "ulysses"))
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    config.setup(rank, world, device, mesh)
    backend = "_native_cudnn" if mode == "ring" else "native"
    return ContextParallel(degree, config._flattened_mesh.get_local_rank(), mode, config._flattened_mesh.get_group(),
                           ParallelConfig(context_parallel_config=config), backend, rank // degree, world // degree)


def ulysses_bytes(batch: int, tokens: int, width: int, degree: int, bytes_per_value: int = 2) -> float:
    """Bytes one process sends in one attention forward under Ulysses: query, key, value and output, each
    (batch, tokens / degree, width), of which (degree - 1) / degree go to other processes."""
    if degree <= 1:
        return 0.0
    return 4.0 * batch * (tokens / degree) * width * bytes_per_value * (degree - 1) / degree
