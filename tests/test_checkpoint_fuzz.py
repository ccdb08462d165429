"""A fuzz test of the resume path: a real tiny run's newest checkpoint, mutated hundreds of ways (values, types,
nesting depth, deleted keys, NaNs, shapes, truncated and garbage files), is read as train.py reads it
(read_resume with check_resume against the run built from its config). Each mutation must end one of three
ways: refused with one line naming a file or key (a UserError), the previous checkpoint used instead (a
warning naming the newest), or accepted; an accepted one loads into the run without an exception. Nothing of
the run but the mutated copy changes. The outcome counts are recorded as a figure (record_property). The same for a
sharded run's shards and index (truncated, garbage, deleted, bytes flipped, a file of another checkpoint)."""
from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from bad_input_harness import digest
from tread.schema import check_train
from tread.training.loop import train
from tread.checkpoint.resume import check_resume, read_resume
from tread.training.setup import build_parts, make_accelerator, make_loader, open_dataset
from tread.checkpoint.state import TrainingState
from tread.checkpoint.files import list_checkpoints
from tread.checkpoint.sharded import SHARDED_DIR, save_sharded
from tread.utils.errors import UserError
from tread.checkpoint.tensorfile import load_state, load_tensors, save_state, save_tensors

QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.keep_last=null", "train.compile=false"]
MUTATIONS = int(os.environ.get("TREAD_FUZZ_MUTATIONS", 150))
VALUES: list[Any] = [-1, 0, 10**15, 2**70, "abc", "", None, 1.5, math.nan, math.inf, True, [], {}, [1, [2]],
                     {"x": 1}, -0.0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4, and the config it was trained with."""
    from conftest import TINY, compose_cfg, shared_cache

    cfg = compose_cfg("train", TINY + [f"paths.cache_dir={shared_cache(tmp_path_factory)}", *QUIET])
    path = tmp_path_factory.mktemp("fuzz") / "run"
    train(cfg, path)
    return path, cfg


def leaves(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths to every leaf of a nested dict/list/tuple tree (tensors and arrays are leaves)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in leaves(v, (*prefix, k))] or [prefix]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in leaves(v, (*prefix, i))] or [prefix]
    return [prefix]


def set_leaf(tree: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """`tree` with the leaf at `path` replaced (or deleted); tuples are rebuilt."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        items = list(tree)
        items[head] = set_leaf(items[head], rest, value, delete)
        return tuple(items)
    if delete and not rest:
        del tree[head]
        return tree
    tree[head] = set_leaf(tree[head], rest, value, delete)
    return tree


def mutate_tree(rng: random.Random, tree: Any) -> tuple[Any, str]:
    path = rng.choice(leaves(tree))
    if path and rng.random() < 0.15:
        return set_leaf(tree, path, None, delete=True), f"delete {path}"
    value = DEEP if rng.random() < 0.05 else rng.choice(VALUES)   # DEEP: written as JSON nested 100,000 deep
    return set_leaf(tree, path, value), f"{path} = {str(value)[:40]}"


DEEP = "__deep__"
NESTED = "[" * 100_000 + "]" * 100_000


def deepen(path: Path) -> None:
    """Replace the DEEP marker in a JSON file, or in a safetensors file's JSON tree metadata, by NESTED."""
    if path.suffix == ".json":
        path.write_text(path.read_text().replace(json.dumps(DEEP), NESTED))
        return
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["__metadata__"]["tree"] = header["__metadata__"]["tree"].replace(json.dumps(DEEP), NESTED)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + size:])


def mutate_common(rng: random.Random, folder: Path, broken: float) -> tuple[Path, str]:
    """A random file of `folder`; with probability `broken` cut short or replaced by garbage, and a JSON file
    mutated as a tree. Returns (the file, what was done: "" when the caller is to mutate it its own way)."""
    path = rng.choice(sorted(p for p in folder.iterdir() if p.is_file()))
    kind = rng.random()
    if kind < broken * 2 / 3:
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(len(data))])
        return path, f"truncate {path.name}"
    if kind < broken:
        path.write_bytes(rng.randbytes(rng.randrange(1, 300)))
        return path, f"garbage {path.name}"
    if path.suffix == ".json":
        tree, what = mutate_tree(rng, json.loads(path.read_text()))
        path.write_text(json.dumps(tree))
        deepen(path)
        return path, f"{path.name} {what}"
    return path, ""


def mutate_file(rng: random.Random, step: Path) -> str:
    """One mutation of one file of the checkpoint dir `step`; returns what was done."""
    path, what = mutate_common(rng, step, 0.15)
    if what:
        return what
    if path.name in ("model.safetensors", "ema.safetensors"):
        return mutate_weights(rng, path)
    tree, what = mutate_tree(rng, load_state(path))
    save_state(tree, path)
    deepen(path)
    return f"{path.name} {what}"


def mutate_weights(rng: random.Random, path: Path) -> str:
    tensors = load_tensors(path)
    name = rng.choice(sorted(tensors))
    edits: dict[str, Callable[[torch.Tensor], Any]] = {
        "nan": lambda t: t.clone().view(-1).index_fill_(0, torch.tensor([0]), math.nan).view(t.shape),
        "shape": lambda t: t.reshape(-1)[: max(1, t.numel() // 2)].clone(),
        "dtype": lambda t: t.to(torch.int32), "delete": lambda t: None}
    kind = rng.choice(sorted(edits))
    value = edits[kind](tensors[name])
    tensors = {k: v for k, v in tensors.items() if k != name} if value is None else {**tensors, name: value}
    save_tensors(tensors, path)
    return f"{path.name} {kind} {name}"


def outcome(state: TrainingState, candidates: list[Path], config: dict, capsys) -> str:
    """What reading the mutated newest checkpoint came to: refused, fell back or accepted (and loaded)."""
    try:
        chosen, read = read_resume(candidates, 0, lambda r, c: check_resume(state, r, c, config))
    except UserError as err:
        assert "\n" not in str(err) and ("'" in str(err) or "=" in str(err)), str(err)
        return "refused"
    if chosen == candidates[0]:
        state.load_state_dict(read, adapter_only=read["adapter_only"], where=str(chosen))
        return "accepted"
    warned = capsys.readouterr().out
    assert str(candidates[0]) in warned and warned.count("\n") == 1, warned
    return "fell back"


def fuzz(count: int, mutated: Callable[[int], Path], mutate: Callable[[Path, Path], str], state, config,
         capsys) -> tuple[dict[str, int], list[str]]:
    """`count` times: a fresh copy of the run (`mutated(i)` makes it, returns its dir), its newest checkpoint
    mutated (`mutate(newest, older)` says how), what reading it came to; the outcome counts and one line per
    mutation (printed with TREAD_FUZZ_LIST=1). Each copy is removed after its reading."""
    counts, seen = {"refused": 0, "fell back": 0, "accepted": 0}, []
    for i in range(count):
        copy = mutated(i)
        older, newest = list_checkpoints(copy)[-2:]
        what = mutate(newest, older)
        result = outcome(state, [newest, older], config, capsys)
        counts[result] += 1
        seen.append(f"{result}: {what}")
        shutil.rmtree(copy)
    if os.environ.get("TREAD_FUZZ_LIST"):
        print("\n".join(seen))
    return counts, seen


def test_mutated_checkpoints_are_refused_fall_back_or_load(run, tmp_path, capsys, record_property):
    path, cfg = run
    state, config = training_state(cfg)
    before = digest(path)
    rng = random.Random(0)

    def mutated(i: int) -> Path:
        shutil.copytree(path, tmp_path / f"m{i}")
        return tmp_path / f"m{i}"
    counts, seen = fuzz(MUTATIONS, mutated, lambda newest, older: mutate_file(rng, newest), state, config, capsys)
    record_property("fuzz_outcomes", json.dumps(counts))
    print(f"checkpoint fuzz: {MUTATIONS} mutations: {counts}")
    assert digest(path) == before
    assert counts["fell back"] > MUTATIONS // 3 and counts["accepted"] > 0, (counts, seen[:20])


def training_state(cfg) -> tuple[TrainingState, dict]:
    """The state a launch of `cfg` builds (what a resume loads into), and the config it compares with."""
    from omegaconf import OmegaConf

    checked = check_train(cfg)
    accelerator = make_accelerator(checked.train)
    parts = build_parts(checked, accelerator)
    dataset = open_dataset(checked.data, parts.model, checked.model.arch)
    state = TrainingState(parts.model, parts.ema.model, parts.optimizer, make_loader(checked, dataset, accelerator))
    return state, OmegaConf.to_container(cfg, resolve=True)


# ----------------------------------------------------------------------------- sharded checkpoints

SHARDED_MUTATIONS = int(os.environ.get("TREAD_FUZZ_SHARDED_MUTATIONS", 40))
ZIP_HEADERS = re.compile(rb"PK[\x01-\x06]")      # where a shard's archives keep their structure (the rest is data)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """The tiny run with sharded checkpoints at steps 2 and 4, its config, and a sharded folder of another model."""
    from conftest import TINY, compose_cfg, shared_cache

    cfg = compose_cfg("train", TINY + [f"paths.cache_dir={shared_cache(tmp_path_factory)}", *QUIET,
                                       "checkpoint.layout=sharded"])
    root = tmp_path_factory.mktemp("fuzz_sharded")
    train(cfg, root / "run")
    save_sharded({"model": {"w": torch.ones(3, 5)}, "optimizer": {"0": {"step": torch.zeros(())}}}, root / "other")
    return root / "run", cfg, root / "other"


def flip(rng: random.Random, data: bytes, name: str) -> tuple[bytes, str]:
    """1 to 3 bytes changed: anywhere, or (half the time in a shard) next to a zip header of one of its archives."""
    out, where = bytearray(data), []
    heads = [m.start() for m in ZIP_HEADERS.finditer(data)] if name.endswith(".distcp") and rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        pos = (rng.choice(heads) + rng.randrange(-8, 64)) % len(data) if heads else rng.randrange(len(data))
        out[pos] = rng.randrange(256)
        where.append(pos)
    return bytes(out), f"at {where}"


def mutate_sharded(rng: random.Random, step: Path, older: Path, other: Path) -> str:
    """One mutation of one file of the sharded folder of `step` (its files are links into the original run: each is
    unlinked before it is written). Returns what was done."""
    path = rng.choice(sorted((step / SHARDED_DIR).iterdir()))
    data = path.read_bytes()
    path.unlink()
    kind = rng.choice(["truncate", "garbage", "delete", "flip", "flip", "flip", "foreign"])
    if kind == "truncate":
        path.write_bytes(data[:rng.randrange(len(data))])
    elif kind == "garbage":
        path.write_bytes(rng.randbytes(rng.randrange(1, 300)))
    elif kind == "flip":
        data, where = flip(rng, data, path.name)
        path.write_bytes(data)
        kind = f"flip {where}"
    elif kind == "foreign":
        source = rng.choice([older / SHARDED_DIR / path.name, other / path.name])
        shutil.copyfile(source, path)
        kind = f"foreign ({source.parent.parent.name if source.parent.name == SHARDED_DIR else 'another model'})"
    return f"{kind} {path.name}"


def test_mutated_sharded_checkpoints_are_refused_fall_back_or_load(sharded_run, tmp_path, capsys, record_property):
    """Every accepted mutation loads (each process's slices: here one process, all of them) without an exception: what
    the index and the archives' headers claim was checked before the checkpoint was chosen (dcp_check.py)."""
    path, cfg, other = sharded_run
    state, config = training_state(cfg)
    before = digest(path)
    rng = random.Random(2)

    def mutated(i: int) -> Path:
        shutil.copytree(path / "checkpoints", tmp_path / f"s{i}" / "checkpoints", copy_function=os.link)
        return tmp_path / f"s{i}"
    counts, seen = fuzz(SHARDED_MUTATIONS, mutated, lambda newest, older: mutate_sharded(rng, newest, older, other),
                        state, config, capsys)
    record_property("sharded_fuzz_outcomes", json.dumps(counts))
    print(f"sharded checkpoint fuzz: {SHARDED_MUTATIONS} mutations: {counts}")
    assert digest(path) == before
    assert counts["fell back"] > SHARDED_MUTATIONS // 3 and counts["accepted"] > 0, (counts, seen[:20])


# ----------------------------------------------------------------------------- the dataset

DATA_MUTATIONS = int(os.environ.get("TREAD_FUZZ_DATA_MUTATIONS", 120))


def mutate_dataset(rng: random.Random, root: Path) -> str:
    """One mutation of one file of a latent dataset directory; returns what was done."""
    path, what = mutate_common(rng, root, 0.2)
    if what:
        return what
    array = np.load(path, mmap_mode="r+")
    index = rng.randrange(array.shape[0])
    value = rng.choice([math.nan, math.inf, -1, 10**6]) if array.dtype.kind == "f" else rng.choice([-1, 10**6, 10])
    array[index] = value
    array.flush()
    del array
    return f"{path.name}[{index}] = {value}"


def data_outcome(cfg, model) -> str:
    """Opening the mutated dataset as training does: refused in one line, or accepted with batches that read."""
    try:
        dataset = open_dataset(check_train(cfg).data, model, "DiT-T/4")
        batch = dataset.__getitems__(list(range(min(len(dataset), 16))))
    except UserError as err:
        assert "\n" not in str(err) and "'" in str(err), str(err)
        return "refused"
    assert torch.isfinite(batch[0]).all(), "non-finite data accepted without data.allow_nonfinite"
    return "accepted"


def test_mutated_datasets_are_refused_or_read(run, tmp_path, capsys, record_property):
    from omegaconf import OmegaConf

    path, cfg = run
    checked = check_train(cfg)
    model = build_parts(checked, make_accelerator(checked.train)).model
    source = Path(str(open_dataset(checked.data, model, checked.model.arch).root))
    before = digest(source)
    rng, counts, seen = random.Random(1), {"refused": 0, "accepted": 0}, []
    for i in range(DATA_MUTATIONS):
        copy = tmp_path / f"d{i}"
        shutil.copytree(source, copy)
        what = mutate_dataset(rng, copy)
        mutated = OmegaConf.merge(cfg, {"data": {"builtin": None, "path": str(copy)}})
        result = data_outcome(mutated, model)
        counts[result] += 1
        seen.append(f"{result}: {what}")
        shutil.rmtree(copy)
    capsys.readouterr()
    record_property("data_fuzz_outcomes", json.dumps(counts))
    print(f"dataset fuzz: {DATA_MUTATIONS} mutations: {counts}")
    if os.environ.get("TREAD_FUZZ_LIST"):
        print("\n".join(seen))
    assert digest(source) == before
    assert counts["refused"] > DATA_MUTATIONS // 3, (counts, seen[:20])
