"""A fuzz test of opening a dataset as train.py does (issue 43): a small bucketed dataset and a small video dataset,
made once each, mutated a few dozen seeded ways (meta.json values of every type, negative, huge, NaN, deleted keys,
bucket entries listed twice or swapped; .npy headers cut, bodies cut, garbage, another shape or dtype; files deleted;
a crops file with other rows). Each mutated copy is opened in-process with open_dataset (the dataset, checked against
the model and its integrity record: what train.py does before any work) and must end refused with one line naming a
file or key (a UserError), or accepted with a first batch that reads. The pristine datasets never change. The
outcome counts are recorded as a figure (record_property)."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bad_input_harness import digest
from conftest import TINY, compose_cfg
from tread.data import BucketedDataset, make_sampler
from tread.schema import check_train
from tread.schema.builders import build_model
from tread.training.setup import open_dataset
from tread.utils.errors import UserError

MUTATIONS = int(os.environ.get("TREAD_FUZZ_DATASET_MUTATIONS", 60))   # per dataset
VALUES: list[Any] = [-1, 0, 10**15, 2**70, -(10**9), "abc", "", None, 1.5, math.nan, math.inf, True, [], {}, [1, [2]],
                     {"x": 1}, [16, 16], "16x16"]
BUCKETS = ["data=toy_buckets", "data.builtin_args.sizes=[16x16,24x16,32x32]", "data.builtin_args.num_per_class=1"]
CLIPS = ["model=wan", "data=toy_clips", "data.builtin_args.frames=3", "data.builtin_args.num_per_class=1",
         "data.builtin_args.first_frame=true", "model.i2v=true"]


@pytest.fixture(scope="module", params=["buckets", "clips"])
def made(request, tmp_path_factory):
    """(the config, the model built from it, the dataset's folder) of the bucketed or the video dataset."""
    cache = tmp_path_factory.mktemp("fuzz_data_cache")
    extra = BUCKETS if request.param == "buckets" else CLIPS
    cfg = compose_cfg("train", TINY + [f"paths.cache_dir={cache}", "eval.every_steps=0", "eval.at_end=false", *extra])
    checked = check_train(cfg)
    torch.manual_seed(0)
    model = build_model(checked.model.plain())
    root = Path(open_dataset(checked.data, model, checked.model.arch).root)
    return request.param, cfg, model, root


# ----------------------------------------------------------------------------- JSON trees

def leaves(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths to every leaf (and every non-empty container) of a JSON tree."""
    if isinstance(tree, dict):
        return [prefix] + [p for k, v in tree.items() for p in leaves(v, (*prefix, k))]
    if isinstance(tree, list):
        return [prefix] + [p for i, v in enumerate(tree) for p in leaves(v, (*prefix, i))]
    return [prefix]


def set_leaf(tree: Any, path: tuple, value: Any, delete: bool = False) -> None:
    for part in path[:-1]:
        tree = tree[part]
    if delete:
        del tree[path[-1]]
    else:
        tree[path[-1]] = value


def edit_json(path: Path, change: Callable[[Any], str]) -> str:
    tree = json.loads(path.read_text())
    what = change(tree)
    path.write_text(json.dumps(tree))        # NaN and inf are written as JSON's NaN / Infinity extensions
    return f"{path.parent.name}/{path.name} {what}"


def json_value(rng: random.Random, path: Path) -> str:
    """A leaf (or container) of a meta.json replaced by a value of another type or range, or deleted."""
    def change(tree: Any) -> str:
        where = rng.choice([p for p in leaves(tree) if p])
        if rng.random() < 0.25:
            set_leaf(tree, where, None, delete=True)
            return f"delete {where}"
        value = rng.choice(VALUES)
        set_leaf(tree, where, value)
        return f"{where} = {str(value)[:30]}"
    return edit_json(path, change)


def bucket_entries(rng: random.Random, path: Path) -> str:
    """The top meta.json's bucket list: an entry twice, two swapped (whole, or only their names, paths or sizes),
    one dropped."""
    def change(meta: dict) -> str:
        buckets = meta["buckets"]
        i, j = rng.sample(range(len(buckets)), 2)
        kind = rng.choice(["twice", "swap", "swap name", "swap path", "swap image_size", "swap num_samples", "drop"])
        if kind == "twice":
            buckets.append(dict(buckets[i]))
        elif kind == "swap":
            buckets[i], buckets[j] = buckets[j], buckets[i]
        elif kind == "drop":
            del buckets[i]
        else:
            key = kind.split()[1]
            buckets[i][key], buckets[j][key] = buckets[j][key], buckets[i][key]
        return f"buckets {kind} {i} {j}"
    return edit_json(path, change)


# ----------------------------------------------------------------------------- .npy files

def npy_header_end(path: Path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def npy_cut(rng: random.Random, path: Path) -> str:
    """Cut inside the header, or inside the data."""
    data, end = path.read_bytes(), npy_header_end(path)
    at = rng.randrange(end) if rng.random() < 0.5 else rng.randrange(end, len(data))
    path.write_bytes(data[:at])
    return f"{path.parent.name}/{path.name} cut at {at} of {len(data)} (header {end})"


def npy_garbage(rng: random.Random, path: Path) -> str:
    path.write_bytes(rng.randbytes(rng.randrange(1, 400)))
    return f"{path.parent.name}/{path.name} garbage"


def npy_shape(rng: random.Random, path: Path) -> str:
    """Saved again with one axis longer or shorter, or one axis more or less."""
    array = np.load(path)
    kind = rng.choice(["rows -1", "rows +1", "axis -1", "axis +1", "flat", "extra axis"])
    if kind.startswith("rows"):
        n = len(array) + (1 if kind.endswith("+1") else -1)
        array = np.resize(array, (max(n, 0), *array.shape[1:]))
    elif kind.startswith("axis") and array.ndim > 1:
        axis = rng.randrange(1, array.ndim)
        shape = list(array.shape)
        shape[axis] = max(1, shape[axis] + (1 if kind.endswith("+1") else -1))
        array = np.resize(array, shape)
    elif kind == "flat":
        array = array.reshape(-1)
    else:
        array = array[..., None]
    np.save(path, array)
    return f"{path.parent.name}/{path.name} {kind} -> {list(array.shape)}"


def npy_dtype(rng: random.Random, path: Path) -> str:
    dtype = rng.choice(["float64", "float16", "int8", "int64", "bool", "uint8", "complex64"])
    np.save(path, np.load(path).astype(dtype))
    return f"{path.parent.name}/{path.name} as {dtype}"


def delete_file(rng: random.Random, path: Path) -> str:
    path.unlink()
    return f"delete {path.parent.name}/{path.name}"


def crops_rows(rng: random.Random, root: Path) -> str:
    """A bucket's crops file with one row more or less, or float."""
    path = rng.choice(sorted(root.glob("*/crops.npy")))
    crops = np.load(path)
    kind = rng.choice(["-1", "+1", "float"])
    np.save(path, crops.astype(np.float32) if kind == "float" else np.resize(crops, (len(crops) + int(kind), 6)))
    return f"{path.parent.name}/crops.npy rows {kind}"


NPY_EDITS = {"cut": npy_cut, "garbage": npy_garbage, "shape": npy_shape, "dtype": npy_dtype, "delete": delete_file}


def mutate(rng: random.Random, root: Path, bucketed: bool) -> str:
    """One mutation of the dataset copy at `root`; returns what was done."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    metas = [p for p in files if p.name == "meta.json"]
    kind = rng.choice(["json"] * 4 + ["npy"] * 4 + ["delete"] + (["entries", "crops"] if bucketed else []))
    if kind == "json":
        return json_value(rng, rng.choice(metas))
    if kind == "entries":
        return bucket_entries(rng, root / "meta.json")
    if kind == "crops":
        return crops_rows(rng, root)
    if kind == "delete":
        return delete_file(rng, rng.choice(files))
    edit = rng.choice(sorted(NPY_EDITS))
    return NPY_EDITS[edit](rng, rng.choice([p for p in files if p.suffix == ".npy"]))


# ----------------------------------------------------------------------------- opening as training does

def first_batch(dataset: Any) -> tuple:
    """The first batch training would read: one bucket's (the bucket sampler's), or the first samples."""
    if isinstance(dataset, BucketedDataset):
        return dataset.__getitems__(make_sampler(dataset, 2, 0, 0, 1).epoch_batches(0)[0])
    return dataset.__getitems__(list(range(min(len(dataset), 4))))


def outcome(cfg: Any, model: Any, copy: Path) -> tuple[str, str]:
    """(refused | accepted, the error line or ''): the copy opened as train.py opens its data before any work."""
    mutated = OmegaConf.merge(cfg, {"data": {"builtin": None, "path": str(copy)}})
    try:
        checked = check_train(mutated)
        dataset = open_dataset(checked.data, model, checked.model.arch)
        batch = first_batch(dataset)
    except UserError as err:
        line = str(err)
        assert "\n" not in line.strip() and (str(copy) in line or "data." in line), line   # names a file or key
        return "refused", line
    assert torch.isfinite(batch[0]).all(), "non-finite data accepted without data.allow_nonfinite"
    return "accepted", ""


def test_mutated_datasets_are_refused_in_one_line_or_read(made, tmp_path, capsys, record_property):
    name, cfg, model, source = made
    before = digest(source)
    rng, counts, seen = random.Random(f"{name}-43"), {"refused": 0, "accepted": 0}, []
    for i in range(MUTATIONS):
        copy = tmp_path / f"m{i}"
        shutil.copytree(source, copy)
        what = mutate(rng, copy, name == "buckets")
        result, line = outcome(cfg, model, copy)
        counts[result] += 1
        seen.append(f"{result}: {what}" + (f" -> {line[:160]}" if line else ""))
        shutil.rmtree(copy)
    capsys.readouterr()
    record_property(f"dataset_fuzz_{name}", json.dumps(counts))
    print(f"{name} dataset fuzz: {MUTATIONS} mutations: {counts}")
    if os.environ.get("TREAD_FUZZ_LIST"):
        print("\n".join(seen))
    assert digest(source) == before
    assert counts["refused"] > MUTATIONS // 2 and counts["accepted"] > 0, (counts, seen)
