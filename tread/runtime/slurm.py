"""Process-group environment for train.py runs whose processes SLURM starts itself: `export_slurm_env()` turns
srun's step variables into the torch.distributed ones Accelerator() reads (docs/scaling.md, "SLURM").
"""
from __future__ import annotations

import logging
import os
import re
from typing import MutableMapping, Optional

log = logging.getLogger(__name__)

# Set by `accelerate launch` / `torchrun` (or by an earlier call): the process group is someone else's business.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK")
MIN_PORT, PORT_SPAN = 20000, 40000  # MASTER_PORT = MIN_PORT + job id % PORT_SPAN (same range as submitit's helper)
DEFAULT_PORT = 29500                # torch.distributed's usual port, when SLURM gives no job id


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[007-010,012],cpu01' -> 'gpu007', 'n[1-2]-ib[3-4]' -> 'n1-ib3'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first group
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    group = nodelist[:end].strip()
    if not group:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    # every [a-b,c,...] range expands in order, so the first host takes the first value of each
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0].strip(), group)


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node notation: '8(x4)' -> [8, 8, 8, 8], '2(x2),1' -> [2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot read SLURM tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def master_port(job_id: Optional[str]) -> int:
    """A port every task of a job agrees on, different for jobs that may share a node (ids < 40000 apart)."""
    if not job_id:
        return DEFAULT_PORT
    digits = re.sub(r"\D", "", job_id)
    return MIN_PORT + int(digits or 0) % PORT_SPAN


def slurm_dist_env(env: MutableMapping[str, str]) -> Optional[dict[str, str]]:
    """The torch.distributed variables for this srun task, or None where none should be set: not a SLURM
    step, a single task, or already set by a launcher (RANK or LOCAL_RANK present)."""
    if any(var in env for var in LAUNCHER_VARS):
        return None
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    world = int(env["SLURM_STEP_NUM_TASKS"])
    if world <= 1:
        return None
    rank = int(env["SLURM_PROCID"])
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError(f"SLURM task {rank} of {world}: no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST to find the "
                           f"rank-0 host; set MASTER_ADDR.")
    out = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),  # srun's block layout puts rank 0 there
        "MASTER_PORT": env.get("MASTER_PORT") or str(master_port(env.get("SLURM_JOB_ID"))),
    }
    per_node = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"]) if env.get("SLURM_STEP_TASKS_PER_NODE") else []
    if per_node and len(set(per_node)) == 1:  # uneven layouts: leave it unset (only gloo on CPU reads it)
        out["LOCAL_WORLD_SIZE"] = str(per_node[0])
    return out


def export_slurm_env(env: MutableMapping[str, str] = os.environ) -> Optional[dict[str, str]]:
    """Inside a multi-task srun step without RANK set, export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT (keeping ones you exported); a no-op otherwise. Returns what it set."""
    values = slurm_dist_env(env)
    if values is None:
        return None
    env.update(values)
    log.info("SLURM task %s/%s on %s: exported %s", values["RANK"], values["WORLD_SIZE"],
             env.get("SLURMD_NODENAME", "?"), " ".join(f"{k}={v}" for k, v in values.items()))
    return values
