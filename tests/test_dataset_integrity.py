"""Datasets checked once, cheaply (tread/data/integrity.py): the writer records each file's digest and non-finite
samples in meta.json; a training start trusts a file whose size and mtime are as recorded (no read), reads one that
changed (digest compared, NaN/inf counted), scans a dataset written before records were kept (and says so), and
refuses NaN/inf data naming the file and the first bad sample unless data.allow_nonfinite=true."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import xxhash

import tread.data.integrity as integrity
from tread.data import (LatentDataset, LatentDatasetError, check_dataset, check_integrity, ensure_toy_dataset,
                        record_integrity, write_latent_dataset)
from tread.data.integrity import integrity_verdict, nonfinite_rows, scan_array
from tread.training.loop import train

N = 50


def dataset(root: Path, dtype: str = "float16", extras: bool = False) -> Path:
    """N samples of 2x4x4 latents (and text / pooled embeddings and a loss mask with extras=True)."""
    rng = np.random.default_rng(0)
    more = {"text": rng.standard_normal((N, 3, 5)), "pooled": rng.standard_normal((N, 6)),
            "loss_mask": rng.integers(0, 256, (N, 4, 4)).astype(np.uint8)} if extras else None
    return write_latent_dataset(root, rng.standard_normal((N, 2, 4, 4)), np.arange(N) % 3, num_classes=3,
                                dtype=dtype, extras=more)


def plant(path: Path, index: int, value: float = np.nan) -> None:
    """value into sample `index` of the .npy file at `path`, in place (the file's mtime changes)."""
    array = np.load(path, mmap_mode="r+")
    array.reshape(len(array), -1)[index, -1] = value
    array.flush()
    del array


def drop_record(root: Path) -> None:
    """Make `root` look like a dataset written before integrity records were kept."""
    meta = json.loads((root / "meta.json").read_text())
    del meta["integrity"]
    (root / "meta.json").write_text(json.dumps(meta))


def checks_by_key(root: Path) -> dict:
    return {c.key: c for c in check_integrity(root)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Scan in steps of 3 samples (2x4x4 float16: 64 bytes each), so bad samples fall on chunk edges too."""
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 3 * 64)


def test_the_writer_records_every_file(tmp_path):
    root = dataset(tmp_path / "ds", extras=True)
    record = json.loads((root / "meta.json").read_text())["integrity"]
    assert record["digest"] == "xxh3_128"
    assert set(record["files"]) == {"latents", "labels", "text_embeds", "pooled_embeds", "loss_mask"}
    for key, entry in record["files"].items():
        path = root / json.loads((root / "meta.json").read_text())["files"][key]
        assert entry["bytes"] == path.stat().st_size and entry["mtime_ns"] == path.stat().st_mtime_ns
        assert entry["digest"] == xxhash.xxh3_128(np.ascontiguousarray(np.load(path)).tobytes()).hexdigest()
        assert (entry["nonfinite_samples"], entry["first_nonfinite"]) == (0, None)
    assert all(c.how == "trusted" and not c.read for c in check_integrity(root))   # a stat each, no read


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "old_dataset"])
@pytest.mark.parametrize("file,index,value", [("latents.npy", 0, np.nan), ("latents.npy", 23, np.inf),
                                              ("latents.npy", N - 1, -np.inf), ("text_embeds.npy", 17, np.nan),
                                              ("pooled_embeds.npy", 44, np.inf)])
def test_a_planted_nan_is_found_and_named(tmp_path, small_chunks, recorded, file, index, value):
    root = dataset(tmp_path / "ds", extras=True)
    if not recorded:
        drop_record(root)
    plant(root / file, index)
    plant(root / file, N - 1 if index < N - 1 else 3, value)        # a second bad sample, later or earlier
    bad = {c.path.name: c for c in check_integrity(root) if c.nonfinite}
    first = min(index, N - 1 if index < N - 1 else 3)
    assert list(bad) == [file] and (bad[file].nonfinite, bad[file].first) == (2, first)
    assert bad[file].how == ("changed" if recorded else "scanned")
    with pytest.raises(LatentDatasetError) as err:
        check_dataset(LatentDataset(root), allow_nonfinite=False)
    message = str(err.value)
    assert f"'{root / file}' holds NaN/inf in 2 of {N} samples, the first at index {first}" in message
    assert "data.allow_nonfinite=true" in message and "\n" not in message
    assert ("digest differs" in message) == recorded


def test_allow_nonfinite_turns_the_refusal_into_a_warning(tmp_path):
    root = dataset(tmp_path / "ds")
    plant(root / "latents.npy", 31)
    notes, warned = check_dataset(LatentDataset(root), allow_nonfinite=True)
    assert notes == [] and len(warned) == 1
    assert warned[0].startswith("data.allow_nonfinite=true: ") and "index 31" in warned[0]


def test_a_changed_digest_is_detected_and_a_copied_file_verified(tmp_path):
    root = dataset(tmp_path / "ds")
    latents = root / "latents.npy"
    stat = latents.stat()
    os.utime(latents, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))   # a copy without its times: same bytes
    assert checks_by_key(root)["latents"].how == "verified"
    notes, warned = check_dataset(LatentDataset(root), allow_nonfinite=False)
    assert warned == [] and len(notes) == 1 and "latents.npy read to verify their digests" in notes[0]
    plant(root / "latents.npy", 7, 0.5)                                      # finite, but not what was written
    assert checks_by_key(root)["latents"].how == "changed"
    notes, warned = check_dataset(LatentDataset(root), allow_nonfinite=False)
    assert len(warned) == 1 and f"'{latents}' changed since the dataset was written" in warned[0]
    assert "record_integrity" in warned[0]
    record_integrity(root)                                                    # the change was intended
    assert all(c.how == "trusted" for c in check_integrity(root))
    assert check_dataset(LatentDataset(root), allow_nonfinite=False) == ([], [])


def test_an_old_dataset_is_scanned_once_and_says_so(tmp_path):
    root = dataset(tmp_path / "ds")
    drop_record(root)
    assert {c.how for c in check_integrity(root)} == {"scanned"}
    notes, warned = check_dataset(LatentDataset(root), allow_nonfinite=False)
    assert warned == [] and len(notes) == 1
    assert "has no integrity record" in notes[0] and "all finite" in notes[0] and "record_integrity" in notes[0]
    record_integrity(root)                                # recorded: later starts only stat the files
    assert {c.how for c in check_integrity(root)} == {"trusted"}
    plant(root / "labels.npy", 0, 1)                      # an integer file: digest only, never "non-finite"
    assert checks_by_key(root)["labels"].how == "changed" and checks_by_key(root)["labels"].nonfinite == 0


def test_a_recorded_bad_sample_is_refused_without_reading(tmp_path):
    """record_integrity on data that holds NaN records it, and the record alone refuses it afterwards."""
    root = dataset(tmp_path / "ds", dtype="float32")
    plant(root / "latents.npy", 12)
    record_integrity(root)
    check = checks_by_key(root)["latents"]
    assert (check.how, check.nonfinite, check.first) == ("trusted", 1, 12)
    with pytest.raises(LatentDatasetError, match=r"latents.npy' holds NaN/inf in 1 of 50 samples, the first at "
                                                 r"index 12: refusing"):
        check_dataset(LatentDataset(root), allow_nonfinite=False)


@pytest.mark.parametrize("record", [[], {"digest": "md4", "files": {}}, {"digest": "xxh3_128", "files": {
    "latents": {"bytes": "12"}}}], ids=["a_list", "unknown_digest", "bad_entry"])
def test_a_malformed_record_is_refused_naming_the_key(tmp_path, record):
    root = dataset(tmp_path / "ds")
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps({**meta, "integrity": record}))
    with pytest.raises(LatentDatasetError, match=r"meta.json: key 'integrity' is .* Delete the key"):
        check_integrity(root)


def test_the_writer_refuses_to_be_told_the_record(tmp_path):
    with pytest.raises(LatentDatasetError, match="sets \\['integrity'\\]"):
        write_latent_dataset(tmp_path / "ds", np.zeros((2, 1, 2, 2)), np.zeros(2, np.int64), num_classes=1,
                             extra_meta={"integrity": {}})


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_bit_test_agrees_with_isfinite(dtype):
    info = np.finfo(dtype)
    specials = np.array([0.0, -0.0, info.tiny, info.tiny / 4, info.max, -info.max, 1.0, np.nan, np.inf, -np.inf],
                        dtype=dtype)
    for value in specials:
        rows = np.zeros((4, 3), dtype)
        rows[2, 1] = value
        found = nonfinite_rows(rows)
        expected = ~np.isfinite(rows).all(axis=1)
        assert (found is None and not expected.any()) or np.array_equal(found, expected), value
    assert nonfinite_rows(np.zeros((3, 2), np.int64)) is None


def test_the_digest_does_not_depend_on_chunking_or_memory_order(monkeypatch):
    array = np.random.default_rng(1).standard_normal((37, 3, 5)).astype(np.float32)
    whole = scan_array(array)["digest"]
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 100)
    assert scan_array(array)["digest"] == whole == scan_array(np.asfortranarray(array))["digest"]
    assert scan_array(array, "sha256")["digest"] != whole


def test_the_toy_data_is_recorded_and_trusted(tmp_path):
    root = ensure_toy_dataset(tmp_path / "toy", num_per_class=4, resolution=8, loss_masks=True)
    checks = check_integrity(root)
    assert {c.key for c in checks} == {"latents", "labels", "loss_mask"} and {c.how for c in checks} == {"trusted"}
    copy = Path(shutil.copytree(root, tmp_path / "copy"))              # copytree keeps the times: still trusted
    assert {c.how for c in check_integrity(copy)} == {"trusted"}


def test_notes_and_verdict_for_several_bad_files(tmp_path):
    root = dataset(tmp_path / "ds", extras=True)
    plant(root / "latents.npy", 5)
    plant(root / "pooled_embeds.npy", 9)
    with pytest.raises(LatentDatasetError, match=r"latents.npy' holds NaN/inf in 1 of 50 samples, the first at "
                                                 r"index 5 .*; also 'pooled_embeds.npy'"):
        integrity_verdict(root, check_integrity(root), N, allow_nonfinite=False)


def test_training_refuses_nan_data_before_the_run_dir_and_trains_with_the_allow_key(tiny_cfg, cache_dir, tmp_path):
    """The refusal comes before any step and before anything is written in the run dir; data.allow_nonfinite=true
    starts the run with a warning naming the file and sample."""
    ensure_toy_dataset(cache_dir / "toy_shapes_r16_n40_s0", num_per_class=40, resolution=16)
    data = Path(shutil.copytree(cache_dir / "toy_shapes_r16_n40_s0", tmp_path / "nan_data"))
    plant(data / "latents.npy", 123)
    at = [f"data.path={data}", "data.builtin=null", "data.resolution=16", "~data.builtin_args", "eval.every_steps=0",
          "eval.at_end=false", "train.max_steps=1", "checkpoint.every_steps=0"]
    run = tmp_path / "run"
    with pytest.raises(LatentDatasetError, match=r"nan_data/latents.npy' holds NaN/inf in 1 of 400 samples, the first "
                                                 r"at index 123"):
        train(tiny_cfg(*at), run)
    assert not run.exists() or [p.name for p in run.iterdir()] == []    # no config.yaml, metrics, checkpoints
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary = train(tiny_cfg(*at, "data.allow_nonfinite=true"), run)
    assert summary["status"] == "completed"
    assert any(str(w.message).startswith("data.allow_nonfinite=true: ") and "index 123" in str(w.message)
               for w in seen)
