"""Checkpoint benchmarking (fid.py mode=bench): sample N images per checkpoint, decode, score, tabulate.

Seeds are sharded across processes, each with its own noise generator, so images and metrics do not depend on
the process count or batch size; writes the ADM-format samples.npz and appends a row to metrics.jsonl / csv.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import time
import zipfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from tread.data import decode_to_uint8, model_shape
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.sampling import Guidance, generate, load_for_inference, sampling_cost, text_conditioning
from tread.checkpoint.files import find_checkpoint, step_of
from tread.utils.distributed import all_reduce_max, barrier, rank, world_size
from tread.utils.errors import UserError
from tread.utils.io import atomic_write
from tread.utils.readers import parse_json, read_npy
from tread.utils.renamed_keys import rename_keys

TABLE_JSONL, TABLE_CSV = "metrics.jsonl", "metrics.csv"


class BenchError(UserError):
    """A benchmarking input that cannot work (reported before any sampling)."""


# ----------------------------------------------------------------------------- checkpoints

def expand_checkpoints(spec: Any) -> list[Path]:
    """Checkpoint dirs from `spec` (a path, comma-separated paths, a list or globs of run dirs, step dirs or files in
    them; a run dir means its latest), deduplicated in order. Missing -> FileNotFoundError."""
    if spec is None:
        raise BenchError("mode=bench needs checkpoints=<run dir | checkpoint dir | a file in it | glob | list>")
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s) for s in spec]
    out: list[Path] = []
    for item in filter(None, items):
        if glob.has_magic(item):
            matches = sorted(glob.glob(os.path.expanduser(item)))
            if not matches:
                raise FileNotFoundError(f"checkpoints={item!r}: the pattern matches nothing")
        else:
            matches = [os.path.expanduser(item)]
        for m in matches:
            path = find_checkpoint(m, "checkpoints")
            if path.resolve() not in [p.resolve() for p in out]:
                out.append(path)
    if not out:
        raise BenchError(f"checkpoints={spec!r} names no checkpoint")
    return out


def checkpoint_label(path: Path) -> str:
    """'<run name>_step_0001200' for …/<run>/checkpoints/step_0001200, else the directory name."""
    path = Path(path)
    return f"{path.parent.parent.name}_{path.name}" if path.parent.name == "checkpoints" else path.name


# ----------------------------------------------------------------------------- npz writing

def write_npz_streaming(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """np.savez without holding a copy in RAM: memmaps are streamed into the zip in chunks
    (numpy's write_array buffers non-file targets). Written atomically."""
    def write(f) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(arr), allow_pickle=False)

    return atomic_write(path, write)


# ----------------------------------------------------------------------------- table

def append_row(out_dir: Path, row: dict[str, Any]) -> None:
    """Append to metrics.jsonl and rewrite metrics.csv from all rows (columns: union of keys, in order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / TABLE_JSONL, "a") as f:
        f.write(json.dumps(row) + "\n")
    rows = read_rows(out_dir)
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out_dir / TABLE_CSV, lambda fh: fh.write(buf.getvalue().encode()))


def read_rows(out_dir: Path) -> list[dict[str, Any]]:
    """The table's rows, in today's key names (rows written before a sampling key was renamed say the old name)."""
    path = Path(out_dir) / TABLE_JSONL
    if not path.is_file():
        return []
    return [rename_keys(parse_json(line, f"{path} line {number}", "a JSON object (one table row)", BenchError))
            for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


SETTINGS = ("checkpoint", "use_ema", "num_samples", "seeds", "cfg_scale", "num_steps", "features", "reference",
            "metrics", "selection_ratio", "tread_scale", "tread_weak_selection_ratio", "guidance_interval",
            "route_spans", "path_drop", "cfg_rule", "tread_uncond", "class_labels")  # the same measurement (skip_existing)
# Rows written before a setting existed were measured with its default.
SETTING_DEFAULTS = {"selection_ratio": None, "tread_scale": 1.0, "tread_weak_selection_ratio": None,
                    "guidance_interval": None, "route_spans": None, "path_drop": False, "cfg_rule": "any",
                    "tread_uncond": False, "class_labels": "cycle"}


def seed_text(seeds: Sequence[int]) -> str:
    """'a..b' for a consecutive run of seeds, else the comma-separated list."""
    seeds = [int(s) for s in seeds]
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ",".join(map(str, seeds))


def bench_settings(ckpt: Path, *, use_ema: bool, seeds: Sequence[int], num_steps: Optional[int], features: str,
                   reference: Any, metrics: Sequence[str], guidance: Guidance,
                   class_labels: str = "cycle") -> dict[str, Any]:
    """The SETTINGS columns of a row (num_steps as given: null means the checkpoint's own), with the guidance
    settings (CFG, inference routing, TREAD guidance) and how class labels were drawn."""
    return {"checkpoint": str(ckpt), "use_ema": use_ema, "num_samples": len(seeds), "seeds": seed_text(seeds),
            "num_steps": num_steps, "features": features, "reference": str(reference),
            "metrics": ",".join(metrics), **guidance.describe(), "class_labels": class_labels}


def settings_key(row: dict[str, Any]) -> tuple:
    return tuple(str(row.get(k, SETTING_DEFAULTS.get(k))) for k in SETTINGS)


# ----------------------------------------------------------------------------- benchmarking

def min_samples(metrics: Sequence[str], pr_k: int) -> int:
    """The fewest images the metrics can be computed from."""
    need = 2 if {"fid", "sfid", "kid"} & set(metrics) else 1
    if {"precision", "recall"} & set(metrics):
        need = max(need, pr_k + 1)
    return need


def load_checked(ckpt: Path, use_ema: bool, guidance: Guidance, reference, decode_kwargs: dict,
                 device: torch.device):
    """(net, diffusion, meta, config, image shape) of a checkpoint, after the checks that need it: the guidance's
    route spans against its depth, and its image size against the reference's."""
    net, diffusion, meta, config = load_for_inference(ckpt, use_ema, device)
    try:
        guidance.check(net.model)
    except ValueError as err:
        raise BenchError(f"checkpoint '{ckpt}': {err}") from None
    zeros = torch.zeros(1, *model_shape(meta), device=device)
    image_shape = tuple(decode_to_uint8(zeros, meta, **decode_kwargs).shape[1:])
    ref_res = getattr(reference, "resolution", None)
    if ref_res is not None and image_shape[:2] != tuple(ref_res):
        raise BenchError(f"checkpoint '{ckpt}' generates {image_shape[0]}x{image_shape[1]} images but the reference "
                         f"is for {ref_res[0]}x{ref_res[1]} images: use a reference built from this model's data "
                         f"(python fid.py mode=ref source=<its dataset> out=...)")
    return net, diffusion, meta, config, image_shape


@torch.no_grad()
def sample_and_score(net, diffusion, meta: dict, positions: list[int], seeds: Sequence[int], *,
                     acc: FeatureAccumulator, batch_size: int, num_steps: Optional[int], guidance: Guidance,
                     decode_kwargs: dict, buf: Optional[np.ndarray], label: str, cond_fn: Any,
                     device: torch.device, class_labels: str = "cycle") -> tuple[torch.Tensor, dict]:
    """Sample this process's seeds, decode them, add their features to `acc` and images to `buf`; returns (labels by
    position, -1 where another rank has them; the forward passes per branch)."""
    labels = torch.full((len(seeds),), -1, dtype=torch.long)
    my_seeds = [int(seeds[p]) for p in positions]
    bar = tqdm(total=len(seeds), disable=rank() != 0, desc=f"bench {label}", dynamic_ncols=True)
    done, stats = 0, {}
    for batch_seeds, y, x in generate(net, diffusion, my_seeds, model_shape(meta), int(meta["num_classes"]),
                                      device, batch_size=batch_size, num_steps=num_steps, cond_fn=cond_fn,
                                      guidance=guidance, stats=stats, class_labels=class_labels):
        images = decode_to_uint8(x, meta, **decode_kwargs)                       # (B, H, W, 3) uint8
        pos = positions[done:done + len(batch_seeds)]
        acc.add(images.permute(0, 3, 1, 2), pos)
        labels[pos] = y.cpu()
        if buf is not None:
            buf[pos] = images.cpu().numpy()
        done += len(batch_seeds)
        bar.update(len(batch_seeds) * world_size())
    bar.close()
    return all_reduce_max(labels), stats   # every label is set by exactly one rank; the others hold -1


def benchmark_checkpoint(ckpt: Path, *, extractor, reference, metrics: Sequence[str], seeds: Sequence[int],
                         out_dir: Path, device: torch.device, batch_size: int, num_steps: Optional[int],
                         use_ema: bool, decode_kwargs: dict, keep_npz: bool, metric_kwargs: dict,
                         guidance: Guidance, class_labels: str = "cycle") -> dict[str, Any]:
    """Sample `seeds` from one checkpoint (this process's share), score against `reference` and return the table row,
    with the guidance, forward passes and GFLOPs per image. Call it on every rank."""
    start = time.time()
    net, diffusion, meta, config, image_shape = load_checked(ckpt, use_ema, guidance, reference, decode_kwargs,
                                                             device)
    label = checkpoint_label(ckpt)
    npz_path, buf_path = out_dir / label / "samples.npz", out_dir / label / ".arr_0.npy"
    if rank() == 0:
        npz_path.parent.mkdir(parents=True, exist_ok=True)
        if keep_npz:
            np.lib.format.open_memmap(buf_path, mode="w+", dtype=np.uint8, shape=(len(seeds), *image_shape)).flush()
    barrier()
    buf = np.lib.format.open_memmap(buf_path, mode="r+") if keep_npz else None
    positions = list(range(rank(), len(seeds), world_size()))
    acc = FeatureAccumulator(extractor, metrics, device=device)
    cond_fn = text_conditioning(net, meta, config)  # text-conditioned checkpoints: the training data's text
    labels, stats = sample_and_score(net, diffusion, meta, positions, seeds, acc=acc, batch_size=batch_size,
                                     num_steps=num_steps, guidance=guidance, decode_kwargs=decode_kwargs, buf=buf,
                                     label=label, cond_fn=cond_fn, device=device, class_labels=class_labels)
    sample_sec = time.time() - start
    if buf is not None:
        buf.flush()
        del buf
    scores = compute_metrics(acc, reference, metrics, **metric_kwargs)
    barrier()
    if rank() == 0 and keep_npz:
        arr = read_npy(buf_path, "sample buffer", mmap=True)
        write_npz_streaming(npz_path, {"arr_0": arr, "arr_1": labels.numpy()})
        del arr
        os.remove(buf_path)
    settings = bench_settings(ckpt, use_ema=use_ema, seeds=seeds, num_steps=num_steps, features=extractor.name,
                              reference=getattr(reference, "path", None), metrics=metrics, guidance=guidance,
                              class_labels=class_labels)
    # Every rank samples with the same settings: this rank's counts per image stand for all.
    cost = sampling_cost(net, guidance, stats, len(positions), cond_fn, int(seeds[0])) if positions else {}
    return {**settings, "label": label, "step": step_of(ckpt), "model": config.model.arch,
            "sampler_steps": num_steps or config.diffusion.num_steps,
            "forward_passes_per_image": cost.get("forward_passes_per_image"),
            "sample_gflops_per_image": cost.get("sample_gflops_per_image"),
            **{k: v for k, v in scores.items() if k != "num_samples"},
            "npz": str(npz_path) if keep_npz else None, "world_size": world_size(),
            "sample_sec": round(sample_sec, 3), "images_per_sec": round(len(seeds) / max(sample_sec, 1e-9), 3),
            "total_sec": round(time.time() - start, 3), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
