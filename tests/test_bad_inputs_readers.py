"""Files in a format the programs accept but broken (issue 25, "one guarded way to read every file format we
accept"): JSON nested 200,000 deep, truncated or non-zip .npz files, an .npy given as .npz (and an .npz given as
.npy), 0x0 / truncated / 16-bit images, an empty reference `resolution`, state files whose tree is nested too deep;
and paths that cannot work (a cache or output directory below a regular file, a seed range of 10**11 seeds).
train.py, sample.py, fid.py and the precompute script refuse each with one `error:` line naming the file or key,
before any work (tread/utils/readers.py reads them all). The checkpoint converter's cases (not a harness program)
are in tests/test_readers.py. The rules: tests/bad_input_table.py.
"""
from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image

from bad_input_table import copy_run, fid, precompute, refused, sample, train
from tread.utils.readers import MAX_JSON_DEPTH
from tread.checkpoint.tensorfile import save_tensors

pytestmark = pytest.mark.slow   # ~40 program runs in the harness beside the other tables

DEEP = 200_000
DEEP_JSON = "[" * DEEP + "]" * DEEP
NESTED = f"nested {DEEP} levels deep (the limit is {MAX_JSON_DEPTH})"
Setup = Callable[[Path, dict], Any]


# ----------------------------------------------------------------------------- broken files, made in {out}

def empty_png() -> bytes:
    """A PNG whose header says 0x0 pixels (PIL cannot write one)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def good_npz(path: Path, **extra: np.ndarray) -> None:
    np.savez(path, arr_0=np.random.default_rng(0).integers(0, 255, (8, 16, 16, 3), dtype=np.uint8), **extra)


def file_at(name: str, make: Callable[[Path], Any]) -> Setup:
    """A setup: make({out}/name)."""
    return lambda out, places: make(out / name)


def truncated_npz(path: Path) -> None:
    good_npz(path)
    path.write_bytes(path.read_bytes()[:2000])


def npy_as_npz(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.zeros((8, 16, 16, 3), np.uint8))


def images_with(name: str, write: Callable[[Path], Any]) -> Setup:
    """A setup: {out}/imgs with three good 16x16 PNGs, and `name` written by write(path)."""
    def setup(out: Path, places: dict) -> None:
        (out / "imgs").mkdir()
        for i in range(3):
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(out / "imgs" / f"{i}.png")
        write(out / "imgs" / name)
    return setup


def truncated_png(path: Path) -> None:
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:400])


def sixteen_bit_png(path: Path) -> None:
    Image.fromarray(np.full((16, 16), 60000, np.uint16)).save(path)


def dataset_with(edit: Callable[[Path], Any]) -> Setup:
    """A setup: a copy of the pristine dataset {data} as {out}/ds, broken by edit(its folder)."""
    def setup(out: Path, places: dict) -> None:
        shutil.copytree(places["data"], out / "ds")
        edit(out / "ds")
    return setup


def npz_as_npy(path: Path) -> None:
    with open(path, "wb") as f:
        np.savez(f, latents=np.zeros((4, 4), np.float16))


def run_with(edit: Callable[[Path], Any]) -> Setup:
    """A setup: a copy of the finished run {run} as {out}/run, its checkpoint's step dir broken by edit(step)."""
    return lambda out, places: edit(copy_run(out, places))


def deep_tree(name: str) -> Callable[[Path], Any]:
    """A state file (train_state, rng_rank0) whose JSON tree is nested 200,000 deep."""
    return lambda step: save_tensors({"t0": torch.zeros(1)}, step / name, {"tree": DEEP_JSON})


def deep_lock(out: Path, places: dict) -> None:
    (out / "run").mkdir()
    (out / "run" / ".lock").write_text(DEEP_JSON)


def flat_folder_with_labels(text: str) -> Setup:
    def setup(out: Path, places: dict) -> None:
        (out / "flat").mkdir()
        for i in range(2):
            Image.fromarray(np.full((16, 16, 3), 50 * i, np.uint8)).save(out / "flat" / f"{i}.png")
        (out / "labels.json").write_text(text)
    return setup


# ----------------------------------------------------------------------------- the cases

def calc(id: str, *args: str, needles: tuple[str, ...], setup: Setup | None = None) -> Any:
    return fid(f"calc_{id}", "mode=calc", *args, setup=setup, needles=needles)


def images_npz(id: str, make: Callable[[Path], Any], *needles: str) -> Any:
    """fid.py mode=calc with images={out}/s.npz made by make(path)."""
    return calc(f"images_{id}", "images={out}/s.npz", "ref={ref}", setup=file_at("s.npz", make), needles=needles)


def images_folder(id: str, write: Callable[[Path], Any], *needles: str) -> Any:
    """fid.py mode=calc with images={out}/imgs: three good PNGs and 3.png written by write(path)."""
    return calc(f"images_{id}", "images={out}/imgs", "ref={ref}", setup=images_with("3.png", write), needles=needles)


def ref_npz(id: str, make: Callable[[Path], Any], *needles: str) -> Any:
    """fid.py mode=calc with ref={out}/r.npz made by make(path)."""
    return calc(f"ref_{id}", "images={imgs}/cls0", "ref={out}/r.npz", setup=file_at("r.npz", make), needles=needles)


def raw(data: bytes) -> Callable[[Path], Any]:
    return lambda path: path.write_bytes(data)


def zero_size_images(path: Path) -> None:
    np.savez(path, arr_0=np.zeros((8, 0, 0, 3), np.uint8))


FID_CASES = [
    # images=: an .npz that is no .npz, or holds 0x0 images; a folder with a broken image
    images_npz("not_zip", raw(b"not a zip file" * 20), "images '{out}/s.npz'", "not an .npz archive"),
    images_npz("truncated_npz", truncated_npz, "images '{out}/s.npz'", "truncated or corrupt"),
    images_npz("npy_as_npz", npy_as_npz, "images '{out}/s.npz'", "a single .npy array, not an .npz archive"),
    images_npz("empty_file", raw(b""), "images '{out}/s.npz'", "empty"),
    images_npz("0x0_npz", zero_size_images, "images={out}/s.npz", "at least 1x1 pixels"),
    images_folder("0x0_png", raw(empty_png()), "{out}/imgs/3.png", "not an image PIL can identify"),
    images_folder("corrupt_png", truncated_png, "{out}/imgs/3.png", "corrupt or truncated"),
    images_folder("16_bit_png", sixteen_bit_png, "{out}/imgs/3.png", "pixel mode 'I;16'"),
    images_folder("sizes_differ", lambda p: Image.new("RGB", (8, 16)).save(p), "images={out}/imgs",
                  "image sizes differ", "3.png is 8x16"),
    # ref=: the reference .npz
    ref_npz("not_zip", raw(b"garbage" * 30), "reference '{out}/r.npz'", "not an .npz archive"),
    ref_npz("truncated", truncated_npz, "reference '{out}/r.npz'", "truncated or corrupt"),
    ref_npz("npy_as_npz", npy_as_npz, "reference '{out}/r.npz'", "a single .npy array"),
    ref_npz("empty_resolution", lambda p: good_npz(p, resolution=np.array([], np.int64)), "{out}/r.npz",
            "key 'resolution' is []"),
    ref_npz("0x0_images", zero_size_images, "reference={out}/r.npz", "at least 1x1 pixels"),
    fid("bench_ref_truncated", "mode=bench", "checkpoints={run}", "ref={out}/r.npz",
        setup=file_at("r.npz", truncated_npz), needles=("reference '{out}/r.npz'", "truncated or corrupt")),
    fid("ref_source_npy_as_npz", "mode=ref", "source={out}/s.npz", "out={out}/new.npz",
        setup=file_at("s.npz", npy_as_npz), needles=("source '{out}/s.npz'", "a single .npy array")),
    fid("ref_source_corrupt_png", "mode=ref", "source={out}/imgs", "out={out}/new.npz",
        setup=images_with("3.png", truncated_png), needles=("{out}/imgs/3.png", "corrupt or truncated")),
    fid("ref_source_latents_npz", "mode=ref", "source={out}/ds", "out={out}/new.npz",
        setup=dataset_with(lambda d: npz_as_npy(d / "latents.npy")),
        needles=("{out}/ds/latents.npy", "an .npz archive (a zip of arrays), not a single .npy array")),
    # directories and amounts that cannot work
    calc("cache_dir_below_a_file", "images={imgs}/cls0", "ref={ref}", "cache_dir={ref}/cache",
         needles=("cache_dir='{ref}/cache' lies below '{ref}', which is a file",)),
    calc("out_json_below_a_file", "images={imgs}/cls0", "ref={ref}", "out_json={ref}/m.json",
         needles=("out_json='{ref}/m.json' lies below '{ref}'",)),
    fid("bench_out_dir_below_a_file", "mode=bench", "checkpoints={run}", "ref={ref}", "out_dir={ref}/bench",
        needles=("out_dir='{ref}/bench' lies below '{ref}'",)),
    fid("bench_seeds_too_many", "mode=bench", "checkpoints={run}", "ref={ref}", "seeds='0-99999999999'",
        needles=("seeds='0-99999999999' names 100000000000 seeds", "at most 1000000")),
]

SAMPLE_CASES = [
    sample("seeds_too_many", "seeds='0-99999999999'",
           needles=("seeds='0-99999999999' names 100000000000 seeds", "at most 1000000")),
    sample("num_samples_too_many", "num_samples=99999999999", needles=("num_samples=99999999999", "1000000")),
    sample("out_dir_below_a_file", "out_dir={ref}/samples", needles=("out_dir='{ref}/samples' lies below '{ref}'",)),
    sample("checkpoint_json_deep", "checkpoint={out}/run", ckpt=False,
           setup=run_with(lambda step: (step / "checkpoint.json").write_text(DEEP_JSON)),
           needles=("checkpoint.json", NESTED)),
]


def data(id: str, edit: Callable[[Path], Any], *needles: str) -> Any:
    return train(f"data_{id}", "data.builtin=null", "data.path={out}/ds", setup=dataset_with(edit), needles=needles)


TRAIN_CASES = [
    data("meta_deep", lambda d: (d / "meta.json").write_text(DEEP_JSON), "{out}/ds/meta.json", NESTED),
    data("meta_not_utf8", lambda d: (d / "meta.json").write_bytes(b"\xff\xfe{}"), "{out}/ds/meta.json",
         "not UTF-8 text"),
    data("latents_npz", lambda d: npz_as_npy(d / "latents.npy"), "{out}/ds/latents.npy",
         "an .npz archive (a zip of arrays), not a single .npy array"),
    data("latents_empty", lambda d: (d / "latents.npy").write_bytes(b""), "{out}/ds/latents.npy", "empty"),
    data("labels_pickled", lambda d: np.save(d / "labels.npy", np.array([{"x": 1}] * 400, dtype=object),
                                             allow_pickle=True),
         "{out}/ds/labels.npy", "an array of Python objects"),
    train("resume_checkpoint_json_deep", "resume={out}/run",
          setup=run_with(lambda step: (step / "checkpoint.json").write_text(DEEP_JSON)),
          needles=("checkpoint.json", NESTED)),
    train("resume_train_state_tree_deep", "resume={out}/run", setup=run_with(deep_tree("train_state.safetensors")),
          needles=("train_state.safetensors", "state layout: " + NESTED)),
    train("resume_rng_tree_deep", "resume={out}/run", setup=run_with(deep_tree("rng_rank0.safetensors")),
          needles=("rng_rank0.safetensors", "state layout: " + NESTED)),
    train("run_dir_lock_deep", "hydra.run.dir={out}/run", setup=deep_lock,
          needles=("{out}/run/.lock", "lock file that cannot be read", NESTED)),
    train("cache_dir_below_a_file", "paths.cache_dir={ref}/cache",
          needles=("paths.cache_dir='{ref}/cache' lies below '{ref}', which is a file",)),
    train("output_dir_below_a_file", "paths.output_dir={ref}/outputs",
          needles=("paths.output_dir='{ref}/outputs' lies below '{ref}'",)),
    train("run_dir_below_a_file", "hydra.run.dir={ref}/run",       # Hydra makes it before train.py's code runs
          needles=("hydra.run.dir='{ref}/run' cannot be made: '{ref}' is a file", "paths.output_dir")),
]

PRECOMPUTE_CASES = [
    precompute("labels_json_deep", "--images", "{out}/flat", "--out", "{out}/ds", "--labels", "{out}/labels.json",
               "--device", "cpu", setup=flat_folder_with_labels('{"0.png": ' + DEEP_JSON + "}"),
               needles=("labels file '{out}/labels.json'", "nested 200001 levels deep")),
]

CASES = FID_CASES + SAMPLE_CASES + TRAIN_CASES + PRECOMPUTE_CASES


def test_the_table_is_big_enough():
    assert len(CASES) >= 25
    assert {c.program for c in CASES} == {"train.py", "sample.py", "fid.py", "scripts/precompute_latents.py"}


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
