"""WebDataset latent shards (the TREAD/MaskDiT ImageNet layout) read with random access: data.wds."""
from __future__ import annotations

import collections
import gzip
import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import tread.data.wds
import tread.data.wds_index
from conftest import TINY, compose_cfg
from tread.data import (LatentDatasetError, LatentLoader, WebDatasetLatents, build_dataset, draw_latents)
from tread.data.meta import validate_meta
from tread.data.wds import expand_braces

SHARD = "latent_imagenet_512_train-{:04d}.tar"  # the name MaskDiT's lmdb2wds.py gives (512 hard-coded)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def write_shard(path, samples, *, ext="latent.npy", extra=()):
    """samples: (key, latent array or None, label text or None); extra: (name, bytes) members added at the end."""
    with tarfile.open(path, "w") as tar:
        for key, arr, label in samples:
            if arr is not None:
                add(tar, f"{key}.{ext}", npy_bytes(arr) if ext == "latent.npy" else pickle.dumps(arr))
            if label is not None:
                add(tar, f"{key}.cls", str(label).encode())
        for name, payload in extra:
            add(tar, name, payload)
    return path


def moments(n, c=4, res=4, seed=0):
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((n, c, res, res)).astype(np.float32)
    logvar = rng.uniform(-3, 0, (n, c, res, res)).astype(np.float32)
    return np.concatenate([mean, logvar], axis=1)  # (n, 2c, res, res), like the VAE's encode_moments


@pytest.fixture
def shards(tmp_path):
    """Two shards (4 + 3 samples) of 8x4x4 float32 moments with labels in [0, 10), plus unrelated members."""
    x, y = moments(7), np.random.default_rng(1).integers(0, 10, 7)
    root = tmp_path / "wds"
    root.mkdir()
    samples = [(f"{i:07d}", x[i], y[i]) for i in range(7)]
    # Written second-shard-first: the order comes from the sorted names, not from the file system.
    write_shard(root / SHARD.format(1), samples[4:])
    write_shard(root / SHARD.format(0), samples[:4], extra=[("0000003.jpg", b"\xff\xd8 not a latent"),
                                                            ("README.txt", b"unrelated member")])
    (root / "notes.md").write_text("not a shard")
    return root, x, y


def open_ds(path, tmp_path, **kw):
    kw.setdefault("num_classes", 10)
    return WebDatasetLatents(path, index_dir=tmp_path / "index", **kw)


# ----------------------------------------------------------------------------- reading

def test_reads_back_raw_moments_in_deterministic_order(shards, tmp_path):
    root, x, y = shards
    ds = open_ds(root, tmp_path, expected_channels=4, expected_resolution=4, expected_num_classes=10)
    assert (len(ds), ds.channels, ds.resolution, ds.num_classes, ds.latent_kind) == (7, 4, 4, 10, "moments")
    assert ds.shape == (4, 4, 4) and ds.latent_scale == 0.18215 and ds.root == root
    assert [s.name for s in ds.shards] == [SHARD.format(0), SHARD.format(1)]
    meta = ds.meta
    validate_meta(meta, "test")
    assert meta["shape"] == [8, 4, 4] and meta["dtype"] == "float32" and meta["num_samples"] == 7
    assert meta["num_classes"] == 10 and meta["latent_kind"] == "moments" and meta["class_names"] is None
    assert meta["decode"] == {"type": "vae", "vae": "stabilityai/sd-vae-ft-ema", "scaling_factor": 0.18215}
    assert meta["source"] == str(root) and meta["files"] == {"latents": "*.latent.npy", "labels": "*.cls"}
    for i in range(7):
        xi, yi = ds[i]
        assert xi.dtype == torch.float32 and yi.dtype == torch.int64 and yi.ndim == 0
        assert torch.equal(xi, torch.from_numpy(x[i])) and yi.item() == y[i]  # raw moments, unscaled
    idx = [6, 0, 3, 3, -1, 4]  # across shards, unsorted, repeated, negative
    xb, yb = ds.__getitems__(idx)
    assert torch.equal(xb, torch.stack([ds[i][0] for i in idx])) and yb.tolist() == [ds[i][1].item() for i in idx]
    assert torch.equal(xb, torch.from_numpy(x[idx]))
    with pytest.raises(IndexError):
        ds[7]


def test_shard_specs_pattern_glob_file_and_list(shards, tmp_path):
    root, x, _ = shards
    first, second = str(root / SHARD.format(0)), str(root / SHARD.format(1))
    everything = torch.from_numpy(x)
    for spec in [str(root / "latent_imagenet_512_train-{0000..0001}.tar"), str(root / "*.tar"), [second, first],
                 str(root / "latent_imagenet_512_train-{0001,0000}.tar")]:
        ds = open_ds(spec, tmp_path)
        assert torch.equal(ds.__getitems__(range(7))[0], everything), spec
        assert ds.root == root
    single = open_ds(second, tmp_path)
    assert len(single) == 3 and torch.equal(single[0][0], everything[4]) and single.root == root / SHARD.format(1)
    assert json.loads(open_ds([second, first], tmp_path).meta["source"]) == [second, first]


def test_expand_braces():
    assert expand_braces("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert expand_braces("a-{1..3}-{x,y}") == ["a-1-x", "a-1-y", "a-2-x", "a-2-y", "a-3-x", "a-3-y"]
    assert expand_braces("{000000..000002}") == ["000000", "000001", "000002"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_pickled_latent_members_like_maskdit_lmdb2wds(tmp_path):
    x = moments(5)
    write_shard(tmp_path / "a.tar", [(f"{i:07d}", x[i], i) for i in range(3)], ext="latent")
    with tarfile.open(tmp_path / "b.tar", "w") as tar:  # protocol 5 (numpy's _frombuffer path)
        for i in (3, 4):
            add(tar, f"{i:07d}.latent", pickle.dumps(x[i], protocol=5))
            add(tar, f"{i:07d}.cls", str(i).encode())
    ds = open_ds(tmp_path, tmp_path)
    assert ds.meta["files"]["latents"] == "*.latent" and ds.meta["shape"] == [8, 4, 4]
    assert torch.equal(ds.__getitems__(range(5))[0], torch.from_numpy(x))
    assert ds.__getitems__(range(5))[1].tolist() == [0, 1, 2, 3, 4]


def test_a_pickle_that_is_not_an_array_is_refused(tmp_path):
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        add(tar, "0.latent", pickle.dumps(collections.OrderedDict(a=1)))
        add(tar, "0.cls", b"1")
    with pytest.raises(LatentDatasetError, match=r"'0\.latent' in shard .*evil\.tar.*refusing to unpickle "
                                                 r"'collections\.OrderedDict'"):
        open_ds(tmp_path, tmp_path)


def test_draw_latents_samples_and_scales_the_moments(shards, tmp_path):
    root, x, _ = shards
    ds = open_ds(root, tmp_path)
    batch, _ = ds.__getitems__(range(7))
    z = draw_latents(batch, ds.meta, generator=torch.Generator().manual_seed(3))
    eps = torch.randn((7, 4, 4, 4), generator=torch.Generator().manual_seed(3))
    mean, logvar = torch.from_numpy(x[:, :4]), torch.from_numpy(x[:, 4:])
    torch.testing.assert_close(z, 0.18215 * (mean + torch.exp(logvar / 2) * eps))
    torch.testing.assert_close(draw_latents(batch, ds.meta, mode="mean"), 0.18215 * mean, rtol=0, atol=0)


def test_sample_kind_shards_are_scaled_like_latent_dataset(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 4, 4, 4)).astype(np.float16)
    write_shard(tmp_path / "s.tar", [(f"k{i}", x[i], 0) for i in range(3)])
    ds = open_ds(tmp_path, tmp_path, latent_kind="sample", latent_scale=0.5, expected_channels=4)
    assert ds.channels == 4 and ds.meta["dtype"] == "float16" and ds.meta["latent_kind"] == "sample"
    batch, _ = ds.__getitems__([0, 1, 2])
    assert torch.equal(batch, torch.from_numpy(x.astype(np.float32)) * 0.5)
    assert torch.equal(draw_latents(batch, ds.meta), batch)


# ----------------------------------------------------------------------------- index cache

def count_scans(monkeypatch):
    calls = []
    real = tread.data.wds_index.scan_shard

    def spy(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(tread.data.wds_index, "scan_shard", spy)
    return calls


def test_index_is_cached_and_rebuilt_when_a_shard_changes(shards, tmp_path, monkeypatch):
    root, x, y = shards
    calls = count_scans(monkeypatch)
    first = open_ds(root, tmp_path)
    assert sorted(calls) == [SHARD.format(0), SHARD.format(1)]
    assert first.index_file.parent == tmp_path / "index" and first.index_file.is_file()
    calls.clear()
    again = open_ds(root, tmp_path)
    assert calls == [] and again.index_file == first.index_file  # no rescan
    assert torch.equal(again.__getitems__(range(7))[0], first.__getitems__(range(7))[0])

    # Rewrite the second shard with one more sample: a new fingerprint, so a new index.
    extra = moments(1, seed=9)[0]
    write_shard(root / SHARD.format(1), [(f"{i:07d}", x[i], y[i]) for i in range(4, 7)] + [("0000007", extra, 9)])
    changed = open_ds(root, tmp_path)
    assert calls and changed.index_file != first.index_file and len(changed) == 8
    assert torch.equal(changed[7][0], torch.from_numpy(extra)) and changed[7][1].item() == 9

    # Same content, new mtime: rescanned too (the fingerprint is path + size + mtime).
    calls.clear()
    st = os.stat(root / SHARD.format(0))
    os.utime(root / SHARD.format(0), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    open_ds(root, tmp_path)
    assert calls


def test_a_corrupt_index_file_is_rebuilt(shards, tmp_path, monkeypatch):
    root, x, _ = shards
    index_file = open_ds(root, tmp_path).index_file
    index_file.write_bytes(b"garbage")
    calls = count_scans(monkeypatch)
    ds = open_ds(root, tmp_path)
    assert calls and torch.equal(ds.__getitems__(range(7))[0], torch.from_numpy(x))


def test_unwritable_index_dir_warns_and_still_works(shards, tmp_path):
    root, _, _ = shards
    (tmp_path / "file").write_text("")
    with pytest.warns(UserWarning, match="could not cache the WebDataset index"):
        ds = WebDatasetLatents(root, num_classes=10, index_dir=tmp_path / "file" / "index")
    assert ds.index_file is None and len(ds) == 7


# ----------------------------------------------------------------------------- workers and resuming

def test_pickles_without_open_files(shards, tmp_path):
    root, x, _ = shards
    ds = open_ds(root, tmp_path)
    ds[0]  # opens a shard
    assert ds._fds
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._fds and torch.equal(clone[5][0], torch.from_numpy(x[5]))
    assert clone.meta == ds.meta


def test_open_files_are_capped(shards, tmp_path, monkeypatch):
    root, x, _ = shards
    monkeypatch.setattr(tread.data.wds, "MAX_OPEN_SHARDS", 1)
    ds = open_ds(root, tmp_path)
    assert torch.equal(ds.__getitems__([0, 6, 1, 5])[0], torch.from_numpy(x[[0, 6, 1, 5]]))
    assert len(ds._fds) == 1
    ds.close()
    assert not ds._fds and torch.equal(ds[2][0], torch.from_numpy(x[2]))


def counting_shards(root, n=30, per_shard=8):
    """n samples whose latent values are their index; label = index % 3."""
    root.mkdir()
    for s in range(0, n, per_shard):
        write_shard(root / SHARD.format(s // per_shard),
                    [(f"{i:07d}", np.full((2, 2, 2), i, np.float32), i % 3) for i in range(s, min(n, s + per_shard))])
    return root


def take(iterable, n):
    it = iter(iterable)
    return [next(it) for _ in range(n)]


def batch_ids(batches):
    return [x[:, 0, 0, 0].long().tolist() for x, _ in batches]


@pytest.mark.parametrize("num_workers, world_size, stops", [(0, 1, [3, 7, 10]), (0, 2, [3]), (1, 1, [5])])
def test_loader_resume_matches_uninterrupted_run(tmp_path, num_workers, world_size, stops):
    ds = open_ds(counting_shards(tmp_path / "wds"), tmp_path, num_classes=3)
    ds[0]  # the parent has a shard open before workers fork: they must open their own
    for rank in range(world_size):
        kw = dict(seed=5, rank=rank, world_size=world_size, num_workers=num_workers)
        reference = take(LatentLoader(ds, 4, **kw), 12)
        for x, y in reference:
            assert x.shape == (4, 2, 2, 2) and torch.equal(y, x[:, 0, 0, 0].long() % 3)
        assert batch_ids(reference) == batch_ids(take(LatentLoader(ds, 4, **kw), 12))  # deterministic
        for k in stops:
            loader = LatentLoader(ds, 4, **kw)
            assert batch_ids(take(loader, k)) == batch_ids(reference[:k])
            resumed = LatentLoader(ds, 4, **kw)
            resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
            assert batch_ids(take(resumed, 12 - k)) == batch_ids(reference[k:])


# ----------------------------------------------------------------------------- errors

def _shard_with(tmp_path, samples, name="x.tar", **kw):
    write_shard(tmp_path / name, samples, **kw)
    return tmp_path


M = moments(2)


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda p: p, {}, r"no WebDataset shards \(\*\.tar\) in directory '.*'"),
    (lambda p: p / "missing", {}, r"'.*missing' does not exist.*data\.path"),
    (lambda p: str(p / "x-{000..}.tar"), {}, r"bad brace pattern .*neither a range"),
    (lambda p: str(p / "x-{3..1}.tar"), {}, r"bad brace pattern .*descending"),
    (lambda p: str(p / "x-{1,{2,3}}.tar"), {}, r"bad brace pattern .*nested"),
    (lambda p: str(p / "x-{0..9}.tar"), {}, r"10 of its 10 shard\(s\) do not exist: '.*x-0\.tar'"),
    (lambda p: _shard_with(p, [("a", M[0], 1), ("b", M[1], None)]),
     {}, r"sample 'b' in shard '.*x\.tar' has no class label member \(has \['latent\.npy'\]"),
    (lambda p: _shard_with(p, [("a", None, 1)]), {}, r"sample 'a' in shard '.*x\.tar' has no latent member"),
    (lambda p: _shard_with(p, [("a", M[0], "cat")]), {}, r"label member 'a\.cls' in shard .* holds b'cat', not an "
                                                         r"integer"),
    (lambda p: _shard_with(p, [("a", M[0], 3), ("b", M[1], 12)]),
     {}, r"label member 'b\.cls' in shard '.*x\.tar' is 12 but data\.num_classes=10 allows only \[0, 9\]"),
    (lambda p: _shard_with(p, [("a", M[0], -1)]), {}, r"'a\.cls' .* is -1 but data\.num_classes=10"),
    (lambda p: _shard_with(p, [("a", M[0], 1), ("b", moments(1, res=8)[0], 1)]),
     {}, r"'b\.latent\.npy' in shard '.*x\.tar' is float32 of shape \[8, 8, 8\] but 'a\.latent\.npy' .* \[8, 4, 4\]"),
    (lambda p: _shard_with(p, [("a", M[0], 1), ("b", M[1].astype(np.float16), 1)]),
     {}, r"'b\.latent\.npy' .* is float16 .* float32"),
    (lambda p: _shard_with(_shard_with(p, [("a", M[0], 1)], "x0.tar"), [("b", moments(1, c=2)[0], 1)], "x1.tar"),
     {}, r"shard '.*x1\.tar' holds '\.latent\.npy' latents, float32 of shape \[4, 4, 4\].*all shards must hold one"),
    (lambda p: _shard_with(p, [("a", M[0, :7], 1)]), {}, r"shape \[7, 4, 4\]: 7 channels, but latent_kind 'moments' "
                                                         r"needs an even count"),
    (lambda p: _shard_with(p, [("a", M[0].astype(np.float64), 1)]), {}, r"'a\.latent\.npy' .* is float64; allowed "
                                                                       r"dtypes: \['float16', 'float32'\]"),
    (lambda p: _shard_with(p, [("a", M[0], 1)]), {"expected_channels": 8},
     r"has 4 channels \(shards hold \[8, 4, 4\] moments -> model shape \[4, 4, 4\]\) but the model expects "
     r"in_channels=8 \(data\.channels\)"),
    (lambda p: _shard_with(p, [("a", M[0], 1)]), {"expected_resolution": 32},
     r"is 4x4 .* expects input_size=32 \(data\.resolution\)"),
    (lambda p: _shard_with(p, [("a", M[0], 1)]), {"expected_num_classes": 1000},
     r"has 10 classes .* expects num_classes=1000 \(data\.num_classes\)"),
    (lambda p: _shard_with(p, [("a", M[0], 1)]), {"latent_kind": "mean"}, r"data\.latent_kind='mean'; allowed"),
    (lambda p: _shard_with(p, [("a", M[0], 1)]), {"num_classes": 0}, r"data\.num_classes=0 must be a positive"),
])
def test_errors_name_the_shard_member_and_value(tmp_path, make, kwargs, message):
    root = tmp_path / "wds"
    root.mkdir()
    with pytest.raises(LatentDatasetError, match=message):
        open_ds(make(root), tmp_path, **{"num_classes": 10, **kwargs})


def test_truncated_compressed_and_changed_shards(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    blob = (write_shard(root / "x.tar", [("a", M[0], 1), ("b", M[1], 1)])).read_bytes()
    (root / "x.tar").write_bytes(blob[:1200])  # cut inside the first latent
    with pytest.raises(LatentDatasetError, match=r"shard '.*x\.tar' is truncated or corrupt \(ReadError"):
        open_ds(root, tmp_path)
    (root / "x.tar").write_bytes(blob[:2560])  # cut between the two samples: tarfile alone would not notice
    with pytest.raises(LatentDatasetError, match=r"shard '.*x\.tar' is truncated or corrupt: no readable tar header "
                                                 r"or end-of-archive marker at byte 2560"):
        open_ds(root, tmp_path)
    (root / "x.tar").write_bytes(gzip.compress(blob))
    with pytest.raises(LatentDatasetError, match=r"not an uncompressed tar file.*decompress"):
        open_ds(root, tmp_path)

    # Pickled members are only spot-checked at indexing time; every read checks shape and dtype.
    write_shard(root / "x.tar", [("a", M[0], 1), ("b", moments(1, res=2)[0], 1)], ext="latent")
    ds = open_ds(root, tmp_path)
    assert torch.equal(ds[0][0], torch.from_numpy(M[0]))
    with pytest.raises(LatentDatasetError, match=r"'b\.latent' in shard '.*x\.tar' is float32 of shape \[8, 2, 2\] "
                                                 r"but the dataset is float32 of shape \[8, 4, 4\]"):
        ds[1]


# ----------------------------------------------------------------------------- config

def wds_cfg(tmp_path, *extra):
    return compose_cfg("train", ["data=imagenet256_wds", "data.channels=4", "data.resolution=4",
                                 "data.num_classes=10", f"paths.cache_dir={tmp_path / 'cache'}", *extra])


def test_build_dataset_from_the_composed_config(shards, tmp_path):
    root, x, _ = shards
    cfg = wds_cfg(tmp_path, f"data.path={root}")
    assert cfg.data.format == "wds" and cfg.model.in_channels == 4
    ds = build_dataset(cfg.data)
    assert isinstance(ds, WebDatasetLatents) and len(ds) == 7
    assert ds.index_file.parent == tmp_path / "cache" / "wds_index"
    pattern = wds_cfg(tmp_path, f"data.path='{root}/latent_imagenet_512_train-{{0000..0001}}.tar'")
    assert torch.equal(build_dataset(pattern.data).__getitems__(range(7))[0], torch.from_numpy(x))
    listed = wds_cfg(tmp_path, f"data.path=[{root / SHARD.format(0)},{root / SHARD.format(1)}]")
    assert len(build_dataset(listed.data)) == 7


def test_build_dataset_format_errors(shards, tmp_path):
    root, _, _ = shards
    with pytest.raises(LatentDatasetError, match=r"data\.format='zip'; allowed: \['latents', 'wds'\]"):
        build_dataset({"format": "zip", "path": str(root)})
    with pytest.raises(LatentDatasetError, match=r"data\.path is not set.*\.tar"):
        build_dataset(wds_cfg(tmp_path).data)
    with pytest.raises(LatentDatasetError, match=r"data\.builtin='toy_shapes' cannot be used with data\.format=wds"):
        build_dataset({"format": "wds", "path": str(root), "builtin": "toy_shapes"})
    with pytest.raises(LatentDatasetError, match=r"in_channels=8 \(data\.channels\)"):
        build_dataset(wds_cfg(tmp_path, f"data.path={root}", "data.channels=8").data)
    # The data config is the one source of the wds keys: a key left out is an error, not a default.
    full = OmegaConf.to_container(wds_cfg(tmp_path, f"data.path={root}").data, resolve=True)
    partial = {k: v for k, v in full.items() if k not in ("latent_scale", "vae")}
    with pytest.raises(LatentDatasetError, match=r"needs data\.latent_scale, data\.vae .*imagenet256_wds\.yaml"):
        build_dataset(partial)


def test_train_fails_fast_on_missing_shards(tmp_path):
    from tread.training.loop import train

    cfg = wds_cfg(tmp_path, f"data.path={tmp_path / 'nonexistent'}", f"paths.output_dir={tmp_path}")
    with pytest.raises(LatentDatasetError, match=r"'.*nonexistent' does not exist"):
        train(cfg, tmp_path / "run")


def test_tiny_training_run_on_shards(tmp_path):
    from tread.training.loop import train
    from tread.training.run_log import read_metrics

    root = tmp_path / "wds"
    root.mkdir()
    x, y = moments(32, res=8), np.arange(32) % 10
    for s in range(2):
        write_shard(root / SHARD.format(s), [(f"{i:07d}", x[i], y[i]) for i in range(16 * s, 16 * (s + 1))])
    cfg = compose_cfg("train", TINY + ["~data.builtin_args", "data=imagenet256_wds", f"data.path={root}", "data.channels=4",
                                            "data.resolution=8", "data.num_classes=10", "model.arch=DiT-T/4",
                                            "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2",
                                            f"paths.cache_dir={tmp_path / 'cache'}"])
    summary = train(cfg, tmp_path / "run")
    assert summary["final_step"] == 2
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert len(losses) == 2 and all(np.isfinite(losses))
