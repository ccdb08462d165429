"""Precomputing latents, the work (docs/data.md "Precomputing latents"): `prepare(request)` (the checks, the plan
every process agrees on, this process's device), then `encode_dataset(run)` (check the images decode, load the
encoders once, encode this process's shards into the parts folder, merge), returning {"out", "num_images",
"shards", "encoded_here"}. Every failing step is agreed on by all processes, so no one waits at a barrier. The main
process locks --out for the run (lock_out); SIGINT and SIGTERM stop it before its next shard (stop_at_shards)."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

from tread.encoders.text import load_text_encoders
from tread.encoders.image_vaes import image_vae_info, spatial_factor
from tread.encoders.vae import downsample_factor, load_vae
from tread.runtime.lock import RunDirLock, RunDirLocked, read_lock
from tread.runtime.preempt import handling, stop_exit_status, stop_status
from tread.utils.device import why_unavailable
from tread.utils.distributed import any_rank

from tread.data.buckets import histogram
from tread.data.builtin.toy import load_repa_encoder
from tread.data.images import short_list, unreadable_images
from tread.data.repa_features import encoder_meta

from .encode import Encoder, TextEncoder, dataset_meta, encode_shard, merge_shards
from .plan import (Plan, check_parts_settings, make_plan, parts_dir_of, read_shard, skipped_note,
                   unfinished_images, unreadable_images_error, write_parts_settings)
from .request import PrecomputeError, PrecomputeRequest, bad_value, check_request
from .vae_class import image_kind, image_vae_class
from .video import load_video_encoder


def collective(work: Callable[[], Any]) -> Any:
    """Run work() here, then agree across processes: an error anywhere stops every process (no one is left at a
    barrier)."""
    error = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other processes have been told
        error, result = err, None
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise PrecomputeError("another process failed (see its error above); nothing was merged")
    return result


# ----------------------------------------------------------------------------- stopping at a shard

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the run before its next shard; the finished shards are kept, a rerun resumes."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """train.py's: 130 after Ctrl-C, 75 (try again later) after SIGTERM."""
        return stop_exit_status(stop_status(signal.Signals(self.signum).name))


class ShardStop:
    """The first stop signal this process got (None: none yet); the run checks it before each shard. The same
    signal again takes its default action: it ends the process at once (finished shards are kept)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def handle(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            os.write(2, f"\n{signal.Signals(signum).name}: stopping before the next shard; send it again to stop at "
                        f"once\n".encode())   # not print(): the handler may run inside a print
        signal.signal(signum, signal.SIG_DFL)

    def check(self, plan: Plan) -> None:
        """Interrupted if a stop signal came."""
        if self.signum is None:
            return
        done = sum(plan.shard_file(s).is_file() for s in range(plan.num_shards))
        raise Interrupted(self.signum, f"stopped by {signal.Signals(self.signum).name}: {done} of {plan.num_shards} "
                                       f"shards are finished in '{plan.parts}'; rerun the same command to resume")


@contextlib.contextmanager
def stop_at_shards() -> Iterator[ShardStop]:
    """SIGINT and SIGTERM recorded in a ShardStop for the block (only the main thread can install handlers;
    elsewhere the signals keep theirs and the ShardStop stays empty)."""
    stop = ShardStop()
    with handling(STOP_SIGNALS, stop.handle):
        yield stop


# ----------------------------------------------------------------------------- one writer per --out

def lock_out(out: Path) -> RunDirLock:
    """Lock --out against a second precompute (the file <out>.parts/.lock, tread/runtime/lock.py: a lock whose
    process is gone is taken over), then remove what an interrupted run left (remove_stale). A live holder, or an
    --out another run finished meanwhile, is one PrecomputeError."""
    lock = RunDirLock(parts_dir_of(out))
    try:
        lock.acquire()
    except RunDirLocked:
        raise PrecomputeError(f"--out '{out}' is being written by another precompute: {_holder(lock.path)}; wait for "
                              f"it to finish or choose another --out (if that process is gone, delete "
                              f"'{lock.path}')") from None
    try:
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise PrecomputeError(f"--out '{out}' was written by another precompute meanwhile; refusing to overwrite "
                                  f"it. Delete it or choose another path.")
        remove_stale(out)
    except BaseException:
        release_out(lock)
        raise
    return lock


def _holder(path: Path) -> str:
    """Who holds the lock file `path`, for an error."""
    try:
        record = read_lock(path)
    except ValueError as err:
        return f"its lock '{path}' cannot be read ({err})"
    if record is None:
        return f"it held the lock '{path}' a moment ago"
    since = f" (since {record['started']})" if record.get("started") else ""
    return f"pid {record['pid']} on host {record['host']} holds the lock '{path}'{since}"


def remove_stale(out: Path) -> None:
    """Remove the staging folders of `out` (.<name>.tmp-*: LatentDatasetWriter, BucketedWriter) and the half-written
    files of its parts folder that a killed run left; the caller holds the lock, so no live run owns them. One note
    line names them."""
    parts = parts_dir_of(out)
    stale = sorted(out.parent.glob(f".{glob.escape(out.name)}.tmp-*")) + \
        [p for p in sorted(parts.glob(".*.tmp")) if not p.name.startswith(".lock")]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        print(f"note: removed what an interrupted precompute into '{out}' left: {short_list([str(p) for p in stale])}",
              flush=True)


def release_out(lock: Optional[RunDirLock]) -> None:
    """Release lock_out's lock (None: this process holds none) and its parts folder if nothing else is in it."""
    if lock is None:
        return
    lock.release()
    with contextlib.suppress(OSError):
        lock.run_dir.rmdir()


# ----------------------------------------------------------------------------- the work

def process_device(state: PartialState, name: str) -> torch.device:
    """This process's device: its own GPU under accelerate (auto, cuda), else the CPU."""
    if why_unavailable(name):
        raise bad_value("--device", name, "no CUDA device is available here; use auto or cpu")
    if name == "cpu" or why_unavailable("cuda"):
        return torch.device("cpu")
    return state.device if state.device.type == "cuda" else torch.device("cuda", state.local_process_index)


def check_images(plan: Plan, state) -> None:
    """Decode every image still to encode (tread.data.images.unreadable_images), each process every P-th one, before
    any encoding; all processes then hold the full list, and any unreadable image fails every one of them."""
    todo = unfinished_images(plan)
    mine = todo[state.process_index::state.num_processes]

    def work() -> list[tuple[int, str]]:
        with tqdm(total=len(mine), unit="img", desc="checking images", disable=not state.is_main_process,
                  dynamic_ncols=True) as bar, \
                (ThreadPoolExecutor(plan.request.workers) if plan.request.workers else nullcontext()) as pool:
            bad = unreadable_images([plan.paths[i] for i in mine], pool, bar.update)
        return [(int(mine[j]), why) for j, why in bad]

    bad = sorted(gather_object(collective(work)))
    if bad:
        raise unreadable_images_error(plan, bad, len(todo))


def load_encoder(plan: Plan, device) -> Encoder:
    """The VAE (checked against --resolution; clips: load_video_encoder) and, with captions, the text encoders."""
    req = plan.request
    if plan.video:
        encoder = load_video_encoder(plan, device)
        encoder.text = _text_encoder(plan, device)
        return encoder
    cls = plan.settings.get("vae_class", "AutoencoderKL")
    vae = load_vae(req.vae, subfolder=req.vae_subfolder, device=device, dtype=req.vae_dtype, cls=cls)
    info = None if cls == "AutoencoderKL" else image_vae_info(vae)
    factor = spatial_factor(vae)
    multiple = factor * int((info or {}).get("patch_size") or 1)   # FLUX.2's VAE: latents the pipelines patchify
    why = f"the VAE '{req.vae}' downsamples by {factor}" + (f" and its latents patchify {multiple // factor} x "
                                                            f"{multiple // factor}" if multiple > factor else "")
    if plan.buckets is not None and req.bucket_stride % multiple:
        raise bad_value("--bucket-stride", req.bucket_stride, f"a multiple of {multiple} ({why}), so every bucket "
                                                              f"is whole latents")
    if plan.buckets is None and req.resolution % multiple:
        raise bad_value("--resolution", req.resolution, f"a multiple of {multiple} ({why})")
    shift = float(vae.config.get("shift_factor", None) or 0.0)
    encoder = Encoder(vae, plan.settings["kind"], req.seed, shift, _text_encoder(plan, device), info=info)
    if req.repa_encoder is not None:
        encoder.repa, weights = load_repa_encoder(req.repa_encoder, req.repa_encoder_weights, cache_dir=req.cache_dir,
                                                  resolution=req.resolution, device=device)
        encoder.repa_meta = encoder_meta(req.repa_encoder, encoder.repa, weights, req.resolution)
    return encoder


def _text_encoder(plan: Plan, device) -> Optional[TextEncoder]:
    """With captions, the family's text encoders, loaded; else None."""
    req = plan.request
    if plan.captions is None:
        return None
    dtype = getattr(torch, req.text_encoder_dtype)
    encoders = load_text_encoders(req.text_family, req.text_encoder_paths(), device=device, dtype=dtype,
                                  t5=not req.no_t5)
    return TextEncoder(req.text_family, encoders, req.max_text_length, device, dtype)


def run_encoding(plan: Plan, state, device, encoder: Optional[Encoder] = None,
                 stop: Optional[ShardStop] = None) -> tuple[Any, int]:
    """Encode this process's unfinished shards with `encoder` (default: load_encoder(plan, device)), checking `stop`
    before each shard and after the last (Interrupted); returns (vae, shards encoded here)."""
    stop = stop or ShardStop()
    req = plan.request
    encoder = load_encoder(plan, device) if encoder is None else encoder
    if state.is_main_process:  # only once the VAE and resolution are known to work
        write_parts_settings(plan)
    else:
        plan.parts.mkdir(parents=True, exist_ok=True)
    todo = [s for s in plan.shards_of(state.process_index, state.num_processes) if read_shard(plan, s, False) is None]
    per_image = 2 if plan.settings["flip"] else 1
    total = sum(stop - start for start, stop in map(plan.shard_range, todo))
    done = 0
    with tqdm(total=int(total), unit="img", desc=f"encoding (process {state.process_index})",
              disable=not state.is_main_process, dynamic_ncols=True) as bar, \
            (ThreadPoolExecutor(req.workers) if req.workers else nullcontext()) as pool:
        bar.set_postfix(shards=f"{len(todo)} to do", copies=per_image)
        for shard in todo:
            stop.check(plan)
            encode_shard(plan, shard, encoder, pool, bar)
            done += 1
    stop.check(plan)
    return encoder.vae, done


@dataclass
class Run:
    """A precompute under way in this process: the plan every process agreed on, accelerate's process state, this
    process's device and (main process) the lock on --out, released by close() (or the `with` block's end)."""

    plan: Plan
    state: PartialState
    device: torch.device
    lock: Optional[RunDirLock] = None

    @property
    def request(self) -> PrecomputeRequest:
        return self.plan.request

    def close(self) -> None:
        release_out(self.lock)
        self.lock = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prepare(request: PrecomputeRequest) -> Run:
    """Check the request, lock --out (the main process; lock_out), list the images and fix the plan; refuse a parts
    folder of other settings; note the files that are not images. Nothing is loaded or encoded yet; close the run
    (`with prepare(request) as run:`) to release the lock."""
    check_request(request)
    if request.videos is None:    # the VAE class's --kind, from its config.json: before --out is locked
        image_kind(request, image_vae_class(request))
    state = PartialState()
    device = process_device(state, request.device)
    out = Path(request.out).expanduser().absolute()
    lock = collective(lambda: lock_out(out) if state.is_main_process else None)
    try:
        plan = make_plan(request)
        check_parts_settings(plan)                                # every process, before any collective
    except BaseException:
        release_out(lock)
        raise
    note = skipped_note(plan)
    if note and state.is_main_process:
        print(note, flush=True)
    return Run(plan, state, device, lock)


def encode_dataset(run: Run) -> dict:
    """Load the encoders, check every image, encode this process's shards, merge (main process) and delete the
    parts folder; {"out", "num_images", "shards", "encoded_here"}. SIGINT / SIGTERM stop it before the next shard
    (Interrupted; a rerun resumes)."""
    with stop_at_shards() as stop:
        vae, encoded, encoder = _encode(run, stop)
    plan, state = run.plan, run.state
    factor = encoder.info["spatial_factor"] if encoder.info else downsample_factor(vae)
    out = collective(lambda: merge_shards(plan, dataset_meta(plan, vae), factor, vae)
                     if state.is_main_process else None)
    if state.is_main_process:
        shutil.rmtree(plan.parts, ignore_errors=True)
        _report(plan, out)
    return {"out": plan.out, "num_images": plan.num_images, "shards": plan.num_shards, "encoded_here": encoded}


def _encode(run: Run, stop: ShardStop) -> tuple[Any, int, Encoder]:
    """encode_dataset's shards: (vae, shards encoded here, encoder)."""
    plan, state = run.plan, run.state
    encoder = collective(lambda: load_encoder(plan, run.device))  # a bad VAE fails before the long image check
    if not plan.video:                                            # clips were probed by the plan
        check_images(plan, state)                                 # nothing is written before this
    vae, encoded = collective(lambda: run_encoding(plan, state, run.device, encoder, stop))
    return vae, encoded, encoder


def _report(plan: Plan, out: Path) -> None:
    """The lines a finished run prints: what it wrote, and with buckets how the images spread over them."""
    what = "clips" if plan.video else "images"
    print(f"Wrote {plan.num_images * (2 if plan.settings['flip'] else 1)} latents "
          f"({plan.num_images} {what}{' + flips' if plan.settings['flip'] else ''}) to {out}", flush=True)
    if plan.buckets is not None:
        counts = np.bincount(plan.image_bucket, minlength=len(plan.buckets)).tolist()
        used = [(n, b) for n, b in zip(counts, plan.buckets) if n]
        print(f"{what} per bucket ({'width x height x frames' if plan.video else 'width x height'}; {len(used)} "
              f"of {len(plan.buckets)} buckets used):\n"
              + histogram([n for n, _ in used], [b for _, b in used]), flush=True)
