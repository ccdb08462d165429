"""A run directory between launches: its lock (one launch at a time, every rank agreeing on one directory) and
metrics.jsonl cut back to the resumed step."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from tread.runtime.lock import RunDirLock, RunDirLocked
from tread.utils.distributed import broadcast_object
from tread.utils.io import atomic_write_text
from tread.utils.readers import parse_json


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
