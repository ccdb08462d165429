"""A run directory between launches: which checkpoint to continue, what an interrupted launch left behind,
and what changed in the config since.

- A run dir with checkpoints is never started over: resume=auto continues it (a requeued SLURM job does so
  with resume=null too); a corrupt newest checkpoint is reported and the previous complete one used.
- Leftovers of a crash (temp dirs of unfinished checkpoint writes, half-pruned checkpoints) are removed.
- metrics.jsonl is cut back to the resumed step, so each step is logged once.
- A resume that changes the architecture (any model key but its routes and gradient checkpointing) is
  refused naming the keys; other changes (routes, batch size, lr, ...) are allowed and listed.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from tqdm.auto import tqdm

from tread.runtime.lock import RunDirLock, RunDirLocked
from tread.runtime.preempt import requeued
from tread.utils.checkpoints import (LEGACY_FILE, META_FILE, TMP_SUFFIX, TRASH_SUFFIX, CheckpointError, latest_legacy,
                                     list_checkpoints, read_checkpoint, resume_candidates, step_of)
from tread.utils.distributed import broadcast_object
from tread.utils.errors import UserError
from tread.utils.io import atomic_write_text
from tread.utils.readers import parse_json

# Model keys a resume may change: they do not change the weights' shapes or meaning.
# Keys a resume may change: routes (e.g. a dense fine-tuning phase), memory settings, and the initialisation
# (weights come from the checkpoint), plus REPA's loss weight.
MUTABLE_MODEL_KEYS = ("model.routing", "model.gradient_checkpointing", "model.init", "model.repa.weight")


class ResumeError(UserError):
    """A resume that cannot continue the run (another architecture, no usable checkpoint)."""


def shared_run_dir(run_dir: Path) -> Path:
    """Rank 0's run dir on every rank: Hydra's ${now:...} dirs differ between ranks started in different seconds."""
    return Path(broadcast_object(str(run_dir), src=0))


@contextlib.contextmanager
def lock_run_dir(run_dir: Path, is_main: bool) -> Iterator[None]:
    """Hold the run dir's lock (tread/runtime/lock.py) for the block: the main process takes it, and every process
    fails alike when it is held by another launch."""
    lock, failure = RunDirLock(run_dir), None
    if is_main:
        try:
            note = lock.acquire()
            if note:
                tqdm.write(note)
        except RunDirLocked as err:
            failure = err
    failed = broadcast_object(str(failure) if failure else None)
    if failed:
        raise failure if failure else RunDirLocked(failed)
    try:
        yield
    finally:
        if is_main:
            lock.release()


def clean_run_dir(run_dir: Path) -> list[str]:
    """Remove what interrupted launches leave in checkpoints/: temp dirs of unfinished writes, *.trash dirs of
    unfinished pruning and step dirs without checkpoint.json (nor an old-format model.pt). Returns their names."""
    root = Path(run_dir) / "checkpoints"
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        leftover = path.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)) or (
            step_of(path) is not None and not (path / META_FILE).exists() and not (path / LEGACY_FILE).exists())
        if leftover and path.is_dir():
            shutil.rmtree(path)
            removed.append(path.name)
    return removed


def resume_plan(run_dir: Path, resume: Any) -> list[Path]:
    """Checkpoints to try, newest first ([]: a fresh run). A directory with checkpoints needs resume=auto (or
    is a requeued SLURM job's); every process checks before any collective, so none waits at a barrier."""
    if resume in (None, "", "null", "none") and requeued() and list_checkpoints(run_dir):
        tqdm.write("requeued SLURM job: continuing the run's latest checkpoint (as resume=auto)")
        resume = "auto"
    candidates = resume_candidates(resume, run_dir)
    if not candidates and (list_checkpoints(run_dir) or latest_legacy(run_dir)):
        raise FileExistsError(
            f"Run directory '{run_dir}' already holds checkpoints and resume={resume or 'null'}. Use resume=auto to "
            f"continue it, or a new hydra.run.dir to start fresh; nothing was overwritten.")
    return candidates


def read_resume(candidates: list[Path], rank: int, check: Callable[[dict, Path], None] = lambda read, ckpt: None
                ) -> tuple[Optional[Path], Optional[dict]]:
    """(checkpoint dir, its contents) of the newest candidate that reads and passes `check` (CheckpointError:
    values that do not fit the run built; any other UserError, e.g. ResumeError for another architecture, ends
    the launch on every process); rank 0 chooses, the others read (and check) the same one. A corrupt checkpoint
    is reported and the previous one tried; none usable -> CheckpointError."""
    chosen, read, errors, fatal = None, None, [], None
    if rank == 0:
        for ckpt in candidates:
            try:
                read = read_checkpoint(ckpt, rank)
                check(read, ckpt)
                chosen = ckpt
                break
            except CheckpointError as err:
                errors.append(str(err))
                tqdm.write(f"warning: {err}" + ("; trying the previous checkpoint" if ckpt != candidates[-1] else ""))
            except UserError as err:
                fatal = err
                break
    chosen_name, failed = broadcast_object((str(chosen) if chosen else None, str(fatal) if fatal else None))
    if failed is not None:
        raise fatal if fatal is not None else ResumeError(failed)
    if candidates and chosen_name is None:
        raise CheckpointError(f"no checkpoint of the run can be read: {'; '.join(errors)}")
    if chosen_name is not None and rank != 0:
        chosen = Path(chosen_name)
        read = read_checkpoint(chosen, rank)
        check(read, chosen)
    return chosen, read


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a.b[0].c': value} of a nested config."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items()
                for k, v in flatten(sub, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(tree, list) and tree and any(isinstance(v, (dict, list)) for v in tree):
        return {k: v for i, sub in enumerate(tree) for k, v in flatten(sub, f"{prefix}[{i}]").items()}
    return {prefix: tree}


def config_changes(saved: dict, now: dict) -> dict[str, list]:
    """{key: [saved value, new value]} for every key that differs (resume itself left out)."""
    a, b = flatten(saved), flatten(now)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if k != "resume" and a.get(k) != b.get(k)}


def check_changes(changes: dict[str, list], ckpt: Path) -> None:
    """Refuse architecture and optimizer changes, naming the keys; the others are the user's choice."""
    arch = [k for k in changes if k.startswith("model.") and not k.startswith(MUTABLE_MODEL_KEYS)]
    if arch:
        shown = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in arch[:5])
        raise ResumeError(f"resume from '{ckpt}' would change the architecture ({shown}); a checkpoint only "
                          f"continues the model it was trained with. Resume with the checkpoint's model keys, or start "
                          f"a new run (another hydra.run.dir).")
    if "optimizer._target_" in changes:
        was, now = changes["optimizer._target_"]
        raise ResumeError(f"resume from '{ckpt}' would change the optimizer ({was} -> {now}); its saved state only "
                          f"loads into the optimizer that wrote it. Resume with the checkpoint's optimizer (e.g. "
                          f"optimizer=adamw for torch.optim.AdamW, adamw8bit for torchao.optim.AdamW8bit), or start a "
                          f"new run (another hydra.run.dir).")


def describe_changes(changes: dict[str, list]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop the records after `step` (logged by a launch that stopped before its next checkpoint) and any torn
    last line, so the resumed run logs each step once. Returns how many records were dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = parse_json(line, f"{path} line {number}")
        except ValueError:
            dropped += bool(line.strip())
            continue
        if isinstance(record, dict) and (record.get("step") or 0) > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
