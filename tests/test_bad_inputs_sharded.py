"""Sharded checkpoints (checkpoint.layout=sharded) whose shards (.distcp), index (.metadata) or folder are broken, and
the converter's flags: sample.py, fid.py mode=bench, an explicit train.py resume=PATH and
scripts/convert_checkpoint.py refuse each with one `error:` line naming the file (and the tensor or flag), before any
work and without changing anything. Each case breaks its own copy of {run} converted to the sharded layout ({out}/run:
one checkpoint, so a resume has nothing to fall back to; resume=auto with an earlier checkpoint falls back:
tests/test_sharded_checkpoints.py, tests/test_checkpoint_fuzz.py). The rules: tests/bad_input_table.py.
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from bad_input_table import _Payload, checkpoint_json, convert, copy_run, fid, refused, sample, train
from tread.checkpoint.dcp_io import SafeReader
from tread.checkpoint.layouts import convert_layout
from tread.checkpoint.sharded import INDEX, SHARDED_DIR, save_sharded

pytestmark = pytest.mark.slow   # ~35 program runs in the harness beside the other tables

SHARD = "__0_0.distcp"
_CONVERTED: dict[str, Path] = {}     # {run} -> its checkpoint in the sharded layout (converted once a session)


def sharded_run(out: Path, places: dict) -> Path:
    """{out}/run: a copy of {run} whose checkpoint is in the sharded layout; returns its step dir."""
    step = copy_run(out, places)
    if places["run"] not in _CONVERTED:       # beside the first case's folder, outside the world's files
        _CONVERTED[places["run"]] = convert_layout(step, out.parent / "sharded_step", "sharded")
    shutil.rmtree(step)
    shutil.copytree(_CONVERTED[places["run"]], step)
    return step


def intact(out: Path, places: dict) -> None:
    sharded_run(out, places)


def shard(edit: Callable[[Path], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with its one .distcp changed by edit(path)."""
    def setup(out: Path, places: dict) -> None:
        edit(sharded_run(out, places) / SHARDED_DIR / SHARD)
    return setup


def index(edit: Callable[[Any], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with its index's records changed by edit(metadata), pickled again."""
    def setup(out: Path, places: dict) -> None:
        folder = sharded_run(out, places) / SHARDED_DIR
        metadata = SafeReader(folder).read_metadata()
        edit(metadata)
        (folder / INDEX).write_bytes(pickle.dumps(metadata))
    return setup


def folder(edit: Callable[[Path, dict], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with edit(its sharded folder, places) done."""
    def setup(out: Path, places: dict) -> None:
        edit(sharded_run(out, places) / SHARDED_DIR, places)
    return setup


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def pickled(path: Path) -> None:
    path.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}))


def pickled_full_size(path: Path) -> None:
    """A pickle padded to the shard's size: the sizes the index claims fit; the bytes are no archive."""
    size = path.stat().st_size
    path.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}).ljust(size, b"\0"))


def garbage_head(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(os.urandom(64))


def first(metadata: Any) -> tuple[str, Any, Any, Any]:
    """(name, entry, storage key, storage record) of the index's first tensor."""
    fqn, entry = next(iter(metadata.state_dict_metadata.items()))
    key = next(k for k in metadata.storage_data if k.fqn == fqn)
    return fqn, entry, key, metadata.storage_data[key]


def huge(metadata: Any) -> None:
    """The first tensor claims 10^13 elements, in one chunk stored where its real bytes are."""
    fqn, entry, key, info = first(metadata)
    entry.size = torch.Size([10**13])
    entry.chunks = [type(entry.chunks[0])(offsets=torch.Size([0]), sizes=torch.Size([10**13]))]
    del metadata.storage_data[key]
    metadata.storage_data[type(key)(fqn, torch.Size([0]))] = info


def huge_shape_only(metadata: Any) -> None:
    first(metadata)[1].size = torch.Size([10**13])


def past_the_end(metadata: Any) -> None:
    first(metadata)[3].offset = 10**12


def shared(metadata: Any) -> None:
    """The smallest chunk stored in the largest one's bytes."""
    by_length = sorted(metadata.storage_data.items(), key=lambda item: item[1].length)
    metadata.storage_data[by_length[0][0]] = by_length[-1][1]


def outside(metadata: Any) -> None:
    first(metadata)[3].relative_path = "../../model.safetensors"


def transformed(metadata: Any) -> None:
    first(metadata)[3].transform_descriptors = ["zstd"]


def not_a_tensor(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    metadata.planner_data["model.extra"] = ("model", "extra")


def planted_index(folder: Path, places: dict) -> None:
    """An index whose unpickling would run `touch <base>/payload_ran` (every case checks no file is new there)."""
    (folder / INDEX).write_bytes(pickle.dumps(_Payload(f"touch {Path(places['run']).parent / 'payload_ran'}")))


def foreign_shard(path: Path) -> None:
    """The shard of another model's folder in place of this one's."""
    save_sharded({"model": {"w": torch.ones(3)}}, path.parent / "other")
    shutil.move(path.parent / "other" / SHARD, path)
    shutil.rmtree(path.parent / "other")


def meta(edit: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    """A setup: {out}/run with its checkpoint.json edited."""
    return checkpoint_json(sharded_run, edit)


DISTCP = "sharded/__0_0.distcp"


def ckpt(id: str, setup: Callable[[Path, dict], None], *needles: str) -> Any:
    return sample(f"sharded_{id}", "checkpoint={out}/run", ckpt=False, setup=setup, needles=needles)


SAMPLE_CASES = [
    ckpt("shard_truncated", shard(cut), DISTCP, "holds", "the file is truncated"),
    ckpt("shard_missing", shard(Path.unlink), DISTCP, "is missing", ".metadata"),
    ckpt("shard_is_a_pickle", shard(pickled), DISTCP, "the file is truncated"),
    ckpt("shard_is_a_padded_pickle", shard(pickled_full_size), DISTCP, "not a torch.save archive"),
    ckpt("shard_garbage_head", shard(garbage_head), DISTCP, "cannot be read"),
    ckpt("shard_of_another_model", shard(foreign_shard), DISTCP, "the file is truncated"),
    ckpt("index_missing", folder(lambda f, p: (f / INDEX).unlink()), "sharded/.metadata", "is missing"),
    ckpt("index_garbage", folder(lambda f, p: (f / INDEX).write_bytes(b"\x80\x04garbage")), "sharded/.metadata",
         "cannot be read"),
    ckpt("index_planted_pickle", folder(planted_index), "sharded/.metadata",
         "system, which a checkpoint index may not"),
    ckpt("index_huge_tensor", index(huge), "sharded/.metadata", "claims a [10000000000000] torch.float32 chunk",
         "the index is corrupt"),
    ckpt("index_huge_shape", index(huge_shape_only), "sharded/.metadata", "its shape [10000000000000] needs"),
    ckpt("index_past_the_end", index(past_the_end), DISTCP, "at bytes 1000000000000..", "truncated"),
    ckpt("index_shared_bytes", index(shared), "sharded/.metadata", "are stored in the same bytes of"),
    ckpt("index_outside_the_folder", index(outside), "sharded/.metadata", "'../../model.safetensors'",
         "not a byte range of a file in its folder"),
    ckpt("index_transforms", index(transformed), "sharded/.metadata", "transforms ['zstd']"),
    ckpt("index_not_a_tensor", index(not_a_tensor), "sharded/.metadata", "entry 'model.extra' is not a tensor"),
    ckpt("folder_missing", folder(lambda f, p: shutil.rmtree(f)), "/sharded' is missing",
         "checkpoint.json says layout='sharded'"),
    ckpt("layout_bogus", meta(lambda m: m.update(layout="bogus")), "checkpoint.json", "layout='bogus'"),
]

FID_CASES = [
    fid(f"bench_sharded_{id}", "mode=bench", "checkpoints={out}/run", "ref={ref}", setup=setup, needles=needles)
    for id, setup, needles in (
        ("shard_truncated", shard(cut), (DISTCP, "truncated")),
        ("shard_is_a_padded_pickle", shard(pickled_full_size), (DISTCP, "not a torch.save archive")),
        ("index_huge_tensor", index(huge), ("sharded/.metadata", "claims a [10000000000000]")),
        ("folder_missing", folder(lambda f, p: shutil.rmtree(f)), ("/sharded' is missing",)),
    )]

RESUME_CASES = [
    train(f"resume_sharded_{id}", "resume={out}/run", setup=setup, needles=("no checkpoint of the run can be read",
                                                                            *needles))
    for id, setup, needles in (
        ("shard_truncated", shard(cut), (DISTCP, "truncated")),
        ("shard_missing", shard(Path.unlink), (DISTCP, "is missing")),
        ("shard_garbage_head", shard(garbage_head), (DISTCP, "cannot be read")),
        ("index_huge_tensor", index(huge), ("sharded/.metadata", "claims a [10000000000000]")),
        ("index_planted_pickle", folder(planted_index), ("system, which a checkpoint index may not",)),
    )]

STEP = "{out}/run/checkpoints/step_0000001"


def conv(id: str, *args: str, needles: tuple[str, ...], setup: Callable[[Path, dict], None] = intact) -> Any:
    return convert(id, STEP, *args, needles=needles, setup=setup)


CONVERT_CASES = [
    conv("layout_bogus", "--layout", "bogus", "--out", "{out}/new", needles=("--layout", "'bogus'")),
    conv("unknown_flag", "--layot", "single", needles=("unrecognized arguments: --layot",)),
    conv("out_missing", "--layout", "single", needles=("--layout needs --out",)),
    conv("out_without_layout", "--out", "{out}/new", needles=("--out '{out}/new'", "--layout")),
    conv("same_layout", "--layout", "sharded", "--out", "{out}/new", needles=("is sharded; allowed: single",)),
    conv("out_exists", "--layout", "single", "--out", "{out}/run", needles=("--out '{out}/run' exists",)),
    conv("out_below_a_file", "--layout", "single", "--out", f"{STEP}/checkpoint.json/new",
         needles=("checkpoint.json' is a file, not a directory",)),
    conv("out_inside_the_source", "--layout", "single", "--out", f"{STEP}/new",
         needles=(f"--out '{STEP}/new' lies inside the checkpoint",)),
    conv("shard_truncated", "--layout", "single", "--out", "{out}/new", setup=shard(cut),
         needles=(DISTCP, "truncated")),
    conv("index_huge_tensor", "--layout", "single", "--out", "{out}/new", setup=index(huge),
         needles=("sharded/.metadata", "claims a [10000000000000]")),
    conv("folder_missing", "--layout", "single", "--out", "{out}/new", setup=folder(lambda f, p: shutil.rmtree(f)),
         needles=("/sharded' is missing",)),
]

CASES = SAMPLE_CASES + FID_CASES + RESUME_CASES + CONVERT_CASES


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
