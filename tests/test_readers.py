"""tread/utils/readers.py: every accepted file format read one guarded way. A broken file (deep nesting, truncated,
another format, empty, 16-bit) raises ONE error of the caller's class whose message names the file, says what is
wrong and what is expected; and the readers that use them (datasets, checkpoints, locks, state files, references,
the checkpoint converter) refuse such files the same way."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tread.utils.errors import UserError
from tread.utils.readers import (MAX_JSON_DEPTH, FileFormatError, image_problem, image_size, iter_npz_batches,
                                 json_depth, npz_array_info, npz_names, parse_json, parse_npy, read_image, read_json,
                                 read_npy, read_npz, read_yaml)

DEEP = 200_000


def deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def empty_png() -> bytes:
    """A PNG whose header says 0x0 pixels (PIL cannot write one)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def refused(call, error: type[Exception], *needles: str) -> str:
    """call() raises `error` (and only it); its one-line message holds every needle."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ----------------------------------------------------------------------------- JSON, YAML

def test_json_depth_skips_strings_and_counts_without_recursing():
    assert json_depth('{"a": "[[[[", "b": [[1]], "c": "\\"[["}') == 3
    assert json_depth(deep_json()) == DEEP
    assert json_depth("") == 0


@pytest.mark.parametrize("content, problem", [
    (deep_json(), f"nested {DEEP} levels deep (the limit is {MAX_JSON_DEPTH})"),
    ('{"a": [' * 100 + "1" + "]}" * 100, "nested 200 levels deep"),
    ("{not json", "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    ('{"n": ' + "9" * 5000 + "}", "invalid JSON"),        # int longer than Python parses: a ValueError, not JSON's
])
def test_read_json_refuses_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "meta.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    message = refused(lambda: read_json(path, "meta.json"), FileFormatError, f"meta.json '{path}'", problem,
                      "expected a JSON document")
    assert message.startswith(f"meta.json '{path}': ")


def test_read_json_takes_the_callers_error_class_and_hint(tmp_path):
    class MyError(UserError):
        pass
    path = tmp_path / "x.json"
    path.write_text(deep_json(100))
    refused(lambda: read_json(path, "", "a JSON object", MyError, "Rebuild it."), MyError,
            f"{path}: nested 100 levels deep", "expected a JSON object. Rebuild it.")
    path.write_text('{"a": [1, {"b": "[[[["}]}')
    assert read_json(path) == {"a": [1, {"b": "[[[["}]}
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")
    refused(lambda: read_json(tmp_path, "folder"), FileFormatError, f"folder '{tmp_path}': unreadable")


def test_parse_json_of_text_and_bytes():
    assert parse_json(b'{"pid": 1}', "lock") == {"pid": 1}
    refused(lambda: parse_json(deep_json(), "lock file '/r/.lock'"), FileFormatError,
            "lock file '/r/.lock': nested")


@pytest.mark.parametrize("content, problem", [
    ("a: " + "[" * 5000 + "]" * 5000, "nested 5000 levels deep"),
    ("a: [1, 2\nb: }", "invalid YAML"),
    ("".join(f"{' ' * i}k{i}:\n" for i in range(1500)) + " " * 1500 + "v: 1\n", "nested too deep"),
    ("!!python/object/apply:os.system ['true']", "invalid YAML"),           # safe_load: no object tags
])
def test_read_yaml_refuses_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "config.yaml"
    path.write_text(content)
    refused(lambda: read_yaml(path, "config"), FileFormatError, f"config '{path}'", problem)


def test_read_yaml_reads_plain_data(tmp_path):
    (tmp_path / "c.yaml").write_text("a: [1, 2]\nb: {c: x}\n")
    assert read_yaml(tmp_path / "c.yaml") == {"a": [1, 2], "b": {"c": "x"}}


# ----------------------------------------------------------------------------- .npy / .npz

@pytest.fixture
def arrays(tmp_path) -> Path:
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    np.savez(tmp_path / "b.npz", arr_0=np.zeros((5, 4, 4, 3), np.uint8), mu=np.ones(3))
    np.savez_compressed(tmp_path / "c.npz", arr_0=np.full((5, 4, 4, 3), 7, np.uint8))
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    return tmp_path


@pytest.mark.parametrize("make, problem", [
    (lambda d: (d / "b.npz").read_bytes(), "an .npz archive (a zip of arrays), not a single .npy array"),
    (lambda d: (d / "a.npy").read_bytes()[:100], "corrupt or truncated"),
    (lambda d: b"not numpy" * 10, "not an .npy array"),
    (lambda d: b"", "empty"),
    (lambda d: (d / "obj.npy").read_bytes(), "an array of Python objects (a pickle: never loaded)"),
])
@pytest.mark.parametrize("mmap", [False, True])
def test_read_npy_refuses_naming_the_file(arrays, make, problem, mmap):
    path = arrays / "latents.npy"
    path.write_bytes(make(arrays))
    refused(lambda: read_npy(path, "latents file", mmap=mmap), FileFormatError, f"latents file '{path}': {problem}",
            "expected one array written by numpy.save")


def test_read_npy_and_parse_npy_read_arrays(arrays):
    assert read_npy(arrays / "a.npy").shape == (3, 4)
    assert isinstance(read_npy(arrays / "a.npy", mmap=True), np.memmap)
    np.testing.assert_array_equal(parse_npy((arrays / "a.npy").read_bytes(), "member"), read_npy(arrays / "a.npy"))
    refused(lambda: parse_npy(b"PK\x03\x04rest", "member x"), FileFormatError, "member x: an .npz archive")


@pytest.mark.parametrize("make, problem", [
    (lambda d: (d / "a.npy").read_bytes(), "a single .npy array, not an .npz archive"),
    (lambda d: (d / "b.npz").read_bytes()[:300], "truncated or corrupt"),
    (lambda d: (d / "b.npz").read_bytes()[:-30], "truncated or corrupt"),
    (lambda d: b"garbage" * 20, "not an .npz archive"),
    (lambda d: b"", "empty"),
])
@pytest.mark.parametrize("reader", [
    lambda p: read_npz(p, "reference"), lambda p: npz_names(p, "reference"),
    lambda p: npz_array_info(p, "arr_0", "reference"), lambda p: next(iter_npz_batches(p, "arr_0", 2, "reference")),
], ids=["read_npz", "npz_names", "npz_array_info", "iter_npz_batches"])
def test_npz_readers_refuse_naming_the_file(arrays, make, problem, reader):
    path = arrays / "ref.npz"
    path.write_bytes(make(arrays))
    refused(lambda: reader(path), FileFormatError, f"reference '{path}': {problem}", "expected an .npz archive")


def test_npz_readers_read_and_stream(arrays):
    assert set(read_npz(arrays / "b.npz")) == {"arr_0", "mu"}
    assert set(read_npz(arrays / "b.npz", keys=("mu", "nope"))) == {"mu"}
    assert npz_names(arrays / "b.npz") == ["arr_0", "mu"]
    assert npz_array_info(arrays / "c.npz") == ((5, 4, 4, 3), np.dtype(np.uint8))
    batches = list(iter_npz_batches(arrays / "c.npz", batch_size=2))
    assert [len(b) for b in batches] == [2, 2, 1] and int(batches[-1].max()) == 7
    refused(lambda: npz_array_info(arrays / "b.npz", "arr_9", "images"), FileFormatError, "no 'arr_9' array",
            "['arr_0', 'mu']")


def test_npz_refuses_pickled_members(tmp_path):
    np.savez(tmp_path / "p.npz", x=np.array([{"a": 1}], dtype=object))
    refused(lambda: read_npz(tmp_path / "p.npz", "archive"), FileFormatError, "Object arrays cannot be loaded")


def test_a_damaged_member_is_refused_while_streaming(arrays):
    blob = bytearray((arrays / "c.npz").read_bytes())
    blob[60:80] = b"\x00" * 20                           # inside the compressed arr_0 data
    (arrays / "d.npz").write_bytes(bytes(blob))
    with pytest.raises(FileFormatError, match=r"archive '.*d\.npz': "):
        list(iter_npz_batches(arrays / "d.npz", batch_size=2))


# ----------------------------------------------------------------------------- images

@pytest.mark.parametrize("content, problem", [
    (b"garbage" * 10, "not an image PIL can identify"),
    (empty_png(), "not an image PIL can identify"),
    (b"", "not an image PIL can identify"),
])
def test_image_readers_refuse_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "x.png"
    path.write_bytes(content)
    for call in (lambda: read_image(path, "image"), lambda: image_size(path, "image")):
        refused(call, FileFormatError, f"image '{path}': {problem}", "expected an image file PIL decodes")
    assert image_problem(path) == problem


def test_a_truncated_png_is_refused_by_size_check_and_decode(tmp_path):
    arr = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "full.png")
    blob = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(blob[:len(blob) * 3 // 4])
    refused(lambda: image_size(tmp_path / "cut.png"), FileFormatError, "cut.png': corrupt or truncated")
    refused(lambda: read_image(tmp_path / "cut.png"), FileFormatError, "cut.png': corrupt or truncated")
    assert image_size(tmp_path / "full.png") == (64, 64)


def test_16_bit_images_are_refused_8_bit_ones_read(tmp_path):
    Image.fromarray(np.full((4, 4), 60000, np.uint16)).save(tmp_path / "deep.png")
    refused(lambda: read_image(tmp_path / "deep.png"), FileFormatError, "pixel mode 'I;16'")
    Image.new("L", (5, 3), 9).save(tmp_path / "gray.png")
    image = read_image(tmp_path / "gray.png")
    assert image.mode == "RGB" and image.size == (5, 3) and np.asarray(image).max() == 9
    assert read_image(tmp_path / "gray.png", mode="L").mode == "L"
    assert image_problem(tmp_path / "gray.png") is None
    with pytest.raises(FileNotFoundError):
        read_image(tmp_path / "missing.png")


# ----------------------------------------------------------------------------- the readers that use them

def test_dataset_meta_and_latents_are_refused_naming_the_file(tmp_path):
    from tread.data import LatentDataset, LatentDatasetError, read_meta, write_latent_dataset

    root = tmp_path / "ds"
    write_latent_dataset(root, np.zeros((4, 2, 2, 2), np.float32), np.zeros(4, np.int64), num_classes=1)
    with open(root / "latents.npy", "wb") as f:              # an npz under the .npy name
        np.savez(f, x=np.zeros(3))
    refused(lambda: LatentDataset(root), LatentDatasetError,
            f"cannot read latents file '{root / 'latents.npy'}': an .npz archive", "Rebuild the dataset")
    (root / "meta.json").write_text(deep_json())
    refused(lambda: read_meta(root), LatentDatasetError, f"{root / 'meta.json'}: nested {DEEP} levels deep")


def test_checkpoint_json_state_file_and_lock_are_refused_naming_the_file(tmp_path):
    from tread.runtime.lock import RunDirLock, RunDirLocked
    from tread.checkpoint.files import CheckpointError, read_meta
    from tread.checkpoint.tensorfile import StateFileError, load_state, save_tensors

    (tmp_path / "checkpoint.json").write_text(deep_json())
    refused(lambda: read_meta(tmp_path), CheckpointError, f"{tmp_path / 'checkpoint.json'}: nested")
    save_tensors({"t0": torch.zeros(1)}, tmp_path / "s.safetensors", {"tree": deep_json()})
    refused(lambda: load_state(tmp_path / "s.safetensors"), StateFileError, "s.safetensors' state layout: nested")
    (tmp_path / ".lock").write_text(deep_json())
    message = refused(lambda: RunDirLock(tmp_path).acquire(), RunDirLocked, "lock file that cannot be read",
                      "nested")
    assert str(tmp_path / ".lock") in message


def test_reference_with_an_empty_resolution_is_refused(tmp_path):
    from tread.evaluation.reference import read_reference_file

    np.savez(tmp_path / "r.npz", mu=np.zeros(2), sigma=np.eye(2), resolution=np.array([]))
    refused(lambda: read_reference_file(tmp_path / "r.npz"), ValueError, "r.npz: key 'resolution' is []")
    np.savez(tmp_path / "z.npz", arr_0=np.zeros((3, 0, 0, 3), np.uint8))
    refused(lambda: read_reference_file(tmp_path / "z.npz"), ValueError, "arr_0 must be uint8 (N, H, W, 3) images "
                                                                          "of at least 1x1 pixels")
    np.savez(tmp_path / "ok.npz", mu=np.zeros(2), sigma=np.eye(2), resolution=np.array(16), num_images=np.array(5))
    data, names, shape = read_reference_file(tmp_path / "ok.npz")
    assert names == {"mu", "sigma", "resolution", "num_images"} and shape is None


def test_image_folder_check_refuses_corrupt_empty_and_mixed_images(tmp_path):
    from tread.evaluation.images import check_image_folder

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(folder / f"{i}.png")
    assert check_image_folder(folder) == (3, (8, 8))
    (folder / "3.png").write_bytes(empty_png())
    refused(lambda: check_image_folder(folder, "images"), FileFormatError, f"image '{folder / '3.png'}'",
            f"Fix or remove it from images={folder}")
    Image.new("RGB", (4, 8)).save(folder / "3.png")
    refused(lambda: check_image_folder(folder, "images"), ValueError, "image sizes differ", "3.png is 4x8")


def test_seed_ranges_over_the_limit_are_refused():
    from tread.schema.base import ConfigError
    from tread.schema.programs import MAX_SEEDS, check_seeds

    refused(lambda: check_seeds("0-99999999999"), ConfigError, "seeds='0-99999999999' names 100000000000 seeds",
            f"at most {MAX_SEEDS}")
    refused(lambda: check_seeds(None, num_samples=MAX_SEEDS + 1), ConfigError, f"num_samples={MAX_SEEDS + 1}")
    check_seeds(f"0-{MAX_SEEDS - 1}")
    check_seeds("5,99999999990-99999999999")


def test_directories_below_a_file_are_refused_naming_the_key(tmp_path):
    from tread.schema.base import ConfigError, check_dirs

    (tmp_path / "f").write_text("x")
    refused(lambda: check_dirs({"paths.cache_dir": tmp_path / "f" / "x"}), ConfigError,
            f"paths.cache_dir='{tmp_path / 'f' / 'x'}' lies below '{tmp_path / 'f'}', which is a file")
    refused(lambda: check_dirs({"out_dir": tmp_path / "f"}), ConfigError, "out_dir=", "is a file, not a directory")
    refused(lambda: check_dirs({}, files={"out": tmp_path / "f" / "r.npz"}), ConfigError, "out=", "lies below")
    check_dirs({"a": tmp_path / "new" / "deeper", "b": None, "c": ""}, files={"out": tmp_path / "r.npz"})


# ----------------------------------------------------------------------------- the checkpoint converter

def legacy_step(root: Path, model: object = "default", rng_names: tuple[str, ...] = ("rng_rank0.pt",)) -> Path:
    step = root / "run" / "checkpoints" / "step_0000001"
    step.mkdir(parents=True)
    weights = {"w": torch.ones(2)}
    torch.save({"step": 1, "config": {}, "model": weights, "ema": weights} if model == "default" else model,
               step / "model.pt")
    torch.save({"step": 1}, step / "train_state.pt")
    for name in rng_names:
        torch.save({"torch": torch.get_rng_state()}, step / name)
    return step


def converter_refuses(run: Path, *needles: str) -> None:
    from tread.cli.convert_checkpoint import main

    with pytest.raises(SystemExit) as info:
        main([str(run), "--trust"])
    assert str(info.value.code).startswith("error: ") and "\n" not in str(info.value.code)
    for needle in needles:
        assert needle in str(info.value.code), (needle, info.value.code)


@pytest.mark.parametrize("model, needles", [
    ({"step": 1, "config": {}}, ("has no ['model', 'ema']", "Nothing was written")),
    ({"step": 1, "config": {}, "model": {}, "ema": {}}, ("key 'model' is dict (empty)",)),
    ({"step": 1, "config": {}, "model": [1], "ema": {"w": torch.ones(1)}}, ("key 'model' is list",)),
    ({"step": "x", "config": {}, "model": {"w": torch.ones(1)}, "ema": {"w": torch.ones(1)}}, ("step='x'",)),
])
def test_converter_refuses_a_model_without_weights_writing_nothing(tmp_path, model, needles):
    step = legacy_step(tmp_path, model)
    before = sorted(p.name for p in step.iterdir())
    converter_refuses(tmp_path / "run", "model.pt", *needles)
    assert sorted(p.name for p in step.iterdir()) == before


def test_converter_refuses_a_bad_rng_file_name_before_writing(tmp_path):
    step = legacy_step(tmp_path, rng_names=("rng_rank0.pt", "rng_rankX.pt"))
    before = sorted(p.name for p in step.iterdir())
    converter_refuses(tmp_path / "run", "rng_rankX.pt", "rng_rank<N>.pt", "nothing was written")
    assert sorted(p.name for p in step.iterdir()) == before


def test_converter_writes_nothing_when_a_state_cannot_be_stored(tmp_path, monkeypatch):
    import tread.checkpoint.legacy as legacy

    step = legacy_step(tmp_path)
    before = sorted(p.name for p in step.iterdir())
    real = legacy.save_state

    def failing(obj, path):
        if "rng" in Path(path).name:
            raise TypeError("cannot store a Generator in a state file (tensors, arrays and plain data only)")
        return real(obj, path)
    monkeypatch.setattr(legacy, "save_state", failing)
    converter_refuses(tmp_path / "run", "cannot store a Generator", "Nothing was written")
    assert sorted(p.name for p in step.iterdir()) == before


def test_converter_converts_a_good_checkpoint(tmp_path):
    from tread.cli.convert_checkpoint import main

    step = legacy_step(tmp_path)
    assert main([str(tmp_path / "run"), "--trust"]) == [step]
    assert json.loads((step / "checkpoint.json").read_text())["step"] == 1
    assert {"model.safetensors", "ema.safetensors", "train_state.safetensors", "rng_rank0.safetensors"} <= \
        {p.name for p in step.iterdir()}
    assert not (step / ".convert.tmp").exists()
