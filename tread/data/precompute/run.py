"""Precomputing latents, the work (docs/data.md "Precomputing latents"): `prepare(request)` (the checks, the plan
every process agrees on, this process's device), then `encode_dataset(run)` (check the images decode, load the
encoders once, encode this process's shards into the parts folder, merge), returning {"out", "num_images",
"shards", "encoded_here"}. Every failing step is agreed on by all processes, so no one waits at a barrier."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

from tread.encoders.text import load_text_encoders
from tread.encoders.vae import downsample_factor, load_vae
from tread.utils.device import why_unavailable
from tread.utils.distributed import any_rank

from tread.data.buckets import histogram
from tread.data.builtin.toy import load_repa_encoder
from tread.data.images import unreadable_images
from tread.data.repa_features import encoder_meta

from .encode import Encoder, TextEncoder, dataset_meta, encode_shard, merge_shards
from .plan import (Plan, check_parts_settings, make_plan, read_shard, skipped_note, unfinished_images,
                   unreadable_images_error, write_parts_settings)
from .request import PrecomputeError, PrecomputeRequest, bad_value, check_request
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
    vae = load_vae(req.vae, subfolder=req.vae_subfolder, device=device, dtype=req.vae_dtype)
    factor = downsample_factor(vae)
    if plan.buckets is not None and req.bucket_stride % factor:
        raise bad_value("--bucket-stride", req.bucket_stride, f"a multiple of {factor} (the VAE '{req.vae}' "
                                                              f"downsamples by {factor}), so every bucket is whole "
                                                              f"latents")
    if plan.buckets is None and req.resolution % factor:
        raise bad_value("--resolution", req.resolution, f"a multiple of {factor} (the VAE '{req.vae}' downsamples by "
                                                        f"{factor})")
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    encoder = Encoder(vae, plan.settings["kind"], req.seed, shift, _text_encoder(plan, device))
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


def run_encoding(plan: Plan, state, device, encoder: Optional[Encoder] = None) -> tuple[Any, int]:
    """Encode this process's unfinished shards with `encoder` (default: load_encoder(plan, device)); returns
    (vae, shards encoded here)."""
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
            encode_shard(plan, shard, encoder, pool, bar)
            done += 1
    return encoder.vae, done


@dataclass
class Run:
    """A precompute under way in this process: the plan every process agreed on, accelerate's process state and
    this process's device."""

    plan: Plan
    state: PartialState
    device: torch.device

    @property
    def request(self) -> PrecomputeRequest:
        return self.plan.request


def prepare(request: PrecomputeRequest) -> Run:
    """Check the request, list the images and fix the plan; refuse a parts folder of other settings; note the
    files that are not images. Nothing is loaded or written yet."""
    check_request(request)
    plan = make_plan(request)
    state = PartialState()
    device = process_device(state, request.device)
    check_parts_settings(plan)                                    # every process, before any collective
    note = skipped_note(plan)
    if note and state.is_main_process:
        print(note, flush=True)
    return Run(plan, state, device)


def encode_dataset(run: Run) -> dict:
    """Load the encoders, check every image, encode this process's shards, merge (main process) and delete the
    parts folder; {"out", "num_images", "shards", "encoded_here"}."""
    plan, state = run.plan, run.state
    encoder = collective(lambda: load_encoder(plan, run.device))  # a bad VAE fails before the long image check
    if not plan.video:                                            # clips were probed by the plan
        check_images(plan, state)                                 # nothing is written before this
    vae, encoded = collective(lambda: run_encoding(plan, state, run.device, encoder))
    factor = encoder.info["spatial_factor"] if plan.video else downsample_factor(vae)
    out = collective(lambda: merge_shards(plan, dataset_meta(plan, vae), factor, vae)
                     if state.is_main_process else None)
    if state.is_main_process:
        shutil.rmtree(plan.parts, ignore_errors=True)
        what = "clips" if plan.video else "images"
        print(f"Wrote {plan.num_images * (2 if plan.settings['flip'] else 1)} latents "
              f"({plan.num_images} {what}{' + flips' if plan.settings['flip'] else ''}) to {out}", flush=True)
        if plan.buckets is not None:
            counts = np.bincount(plan.image_bucket, minlength=len(plan.buckets)).tolist()
            used = [(n, b) for n, b in zip(counts, plan.buckets) if n]
            print(f"{what} per bucket ({'width x height x frames' if plan.video else 'width x height'}; {len(used)} "
                  f"of {len(plan.buckets)} buckets used):\n"
                  + histogram([n for n, _ in used], [b for _, b in used]), flush=True)
    return {"out": plan.out, "num_images": plan.num_images, "shards": plan.num_shards, "encoded_here": encoded}
