"""Latent dataset format, deterministic/resumable loading, and the built-in toy_shapes data."""
from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tread import data
from tread.data import (TOY_CLASS_NAMES, LatentDataset, LatentDatasetError, LatentDatasetExistsError, LatentLoader,
                  ShardedBatchSampler, build_dataset, decode_to_uint8, ensure_toy_dataset, generate_toy_shapes,
                  read_meta, write_latent_dataset)


def make_arrays(n=12, shape=(3, 4, 4), num_classes=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (n, *shape)).astype(np.float32), rng.integers(0, num_classes, n)


@pytest.fixture
def small(tmp_path):
    """A valid float32 dataset (12 x 3x4x4, 5 classes) and its arrays."""
    x, y = make_arrays()
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=5, dtype="float32")
    return path, x, y


def edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    for key, value in changes.items():
        if value is ...:
            del meta[key]
        else:
            meta[key] = value
    (path / "meta.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------------------- format round trip

@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_write_read_round_trip(tmp_path, dtype):
    x, y = make_arrays()
    names = [f"c{i}" for i in range(5)]
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=5, latent_scale=0.5, source="unit test",
                                class_names=names, dtype=dtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left behind
    meta = read_meta(path)
    assert meta["shape"] == [3, 4, 4] and meta["dtype"] == dtype and meta["num_samples"] == 12
    assert meta["num_classes"] == 5 and meta["latent_scale"] == 0.5 and meta["decode"] == {"type": "identity"}
    assert meta["source"] == "unit test" and meta["class_names"] == names

    ds = LatentDataset(path, expected_channels=3, expected_resolution=4, expected_num_classes=5)
    assert (len(ds), ds.channels, ds.resolution, ds.num_classes, ds.latent_scale) == (12, 3, 4, 5, 0.5)
    assert ds.meta == meta
    want = torch.from_numpy(x.astype(dtype).astype(np.float32)) * 0.5  # stored values times latent_scale
    xi, yi = ds[7]
    assert xi.dtype == torch.float32 and yi.dtype == torch.int64 and yi.ndim == 0
    torch.testing.assert_close(xi, want[7], rtol=0, atol=0)
    assert yi.item() == y[7]
    idx = [9, 2, 2, 11, 0]  # unsorted, with a repeat: the batched read must keep the request order
    xb, yb = ds.__getitems__(idx)
    torch.testing.assert_close(xb, want[idx], rtol=0, atol=0)
    assert yb.tolist() == y[idx].tolist() and yb.dtype == torch.int64


def test_dataset_pickles_without_data(small):
    path, x, _ = small
    ds = LatentDataset(path)
    ds[0]  # opens the memmaps
    blob = pickle.dumps(ds)
    assert len(blob) < x.nbytes  # path and meta only; workers re-map the files
    torch.testing.assert_close(pickle.loads(blob)[3][0], torch.from_numpy(x[3]))


def test_write_refuses_to_overwrite_but_fills_empty_dir(small, tmp_path):
    path, x, y = small
    with pytest.raises(LatentDatasetExistsError, match="already exists"):
        write_latent_dataset(path, x, y, num_classes=5)
    (tmp_path / "empty").mkdir()
    assert LatentDataset(write_latent_dataset(tmp_path / "empty", x, y, num_classes=5)).num_classes == 5


@pytest.mark.parametrize("latents, labels, kwargs, message", [
    (np.zeros((4, 4, 4)), np.zeros(4, int), {}, r"\(N, C, H, W\).*\(4, 4, 4\)"),
    (np.zeros((4, 1, 2, 2)), np.zeros(3, int), {}, r"length N=4.*\(3,\)"),
    (np.zeros((4, 1, 2, 2)), np.array([0, 1, 5, 2]), {}, r"\[0, 5\].*num_classes=5"),
    (np.zeros((4, 1, 2, 2)), np.zeros(4, int), {"dtype": "int8"}, r"dtype.*'int8'.*float16"),
    (np.full((4, 1, 2, 2), 1e5), np.zeros(4, int), {}, r"non-finite.*float16"),
])
def test_write_validates_inputs(tmp_path, latents, labels, kwargs, message):
    with pytest.raises(LatentDatasetError, match=message):
        write_latent_dataset(tmp_path / "ds", latents, labels, num_classes=5, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing half-written


# ----------------------------------------------------------------------------- error messages

def break_meta(key, value):
    return lambda path: edit_meta(path, **{key: value})


def truncate_latents(path):
    blob = (path / "latents.npy").read_bytes()
    (path / "latents.npy").write_bytes(blob[:len(blob) // 2])


def resave(name, array):
    return lambda path: np.save(path / name, array)


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p / "meta.json").unlink(), r"no meta\.json.*meta\.json'"),
    (lambda p: (p / "meta.json").write_text("{not json"), r"meta\.json: invalid JSON"),
    (break_meta("format", "npz"), r"meta\.json: key 'format' is 'npz' but must be 'tread-latents'"),
    (break_meta("latent_scale", ...), r"meta\.json: missing key\(s\) \['latent_scale'\]"),
    (break_meta("dtype", "bfloat16"), r"key 'dtype' is 'bfloat16' but must be one of \['float16', 'float32'\]"),
    (break_meta("shape", [3, 4]), r"key 'shape' is \[3, 4\] but must be \[C, H, W\]"),
    (break_meta("num_classes", "5"), r"key 'num_classes' is '5' but must be of JSON type int"),
    (break_meta("decode", {"type": "jpeg"}), r"key 'decode' is \{'type': 'jpeg'\}.*'identity', 'vae'"),
    (lambda p: (p / "latents.npy").unlink(), r"missing latents file '.*latents\.npy'"),
    (truncate_latents, r"cannot read latents file '.*latents\.npy'.*corrupt or truncated"),
    (lambda p: (p / "latents.npy").write_bytes(b"garbage"), r"cannot read latents file '.*latents\.npy'"),
    (resave("latents.npy", np.zeros((12, 3, 4, 5), np.float32)),
     r"latents\.npy' holds a float32 array of shape \[12, 3, 4, 5\] but meta\.json says float32 of shape "
     r"\[12, 3, 4, 4\]"),
    (resave("latents.npy", np.zeros((12, 3, 4, 4), np.float16)), r"holds a float16 array.*meta\.json says float32"),
    (resave("labels.npy", np.arange(12)), r"labels\.npy' has labels in \[0, 11\] but meta\.json num_classes=5"),
    (resave("labels.npy", np.zeros(11, np.int64)), r"labels\.npy' holds a int64 array of shape \[11\]"),
])
def test_corrupt_dataset_errors_name_file_key_and_value(small, corrupt, message):
    path, _, _ = small
    corrupt(path)
    with pytest.raises(LatentDatasetError, match=message) as err:
        LatentDataset(path)
    assert str(path) in str(err.value)  # every message says which dataset


def test_missing_dataset_error(tmp_path):
    with pytest.raises(LatentDatasetError, match=r"not found at '.*nope'.*meta\.json, latents\.npy, labels\.npy.*"
                                                 r"data\.path="):
        LatentDataset(tmp_path / "nope")


@pytest.mark.parametrize("kwargs, message", [
    ({"expected_channels": 4}, r"has 3 channels \(meta\.json shape \[3, 4, 4\]\) but the model expects "
                               r"in_channels=4 \(data\.channels\)"),
    ({"expected_resolution": 8}, r"is 4x4 .* expects input_size=8 \(data\.resolution\)"),
    ({"expected_num_classes": 10}, r"has 5 classes .* expects num_classes=10 \(data\.num_classes\)"),
])
def test_expected_mismatch_errors(small, kwargs, message):
    with pytest.raises(LatentDatasetError, match=message):
        LatentDataset(small[0], **kwargs)


# ----------------------------------------------------------------------------- decoding

def test_decode_identity_round_trip_is_exact(tmp_path):
    u = torch.randint(0, 256, (6, 3, 5, 5), dtype=torch.uint8)
    u[0, 0, 0, :2] = torch.tensor([0, 255])  # both extremes
    for dtype, scale in [("float32", 1.0), ("float16", 0.5)]:
        stored = (u.float() / 127.5 - 1).numpy()
        path = write_latent_dataset(tmp_path / dtype, stored, np.zeros(6, int), num_classes=1,
                                    latent_scale=scale, dtype=dtype)
        ds = LatentDataset(path)
        images = decode_to_uint8(ds.__getitems__(list(range(6)))[0], ds.meta)
        assert images.dtype == torch.uint8 and images.shape == (6, 5, 5, 3)
        assert torch.equal(images, u.permute(0, 2, 3, 1))


def test_decode_channels_and_vae():
    meta = {"decode": {"type": "identity"}, "latent_scale": 1.0}
    gray = decode_to_uint8(torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 2, 2), meta)
    assert gray.shape == (1, 2, 2, 3) and gray[0, :, :, 0].flatten().tolist() == [0, 128, 255, 255]
    assert torch.equal(gray[..., 0], gray[..., 2])
    with pytest.raises(LatentDatasetError, match=r"C = 1 or 3.*\[2, 4, 8, 8\]"):
        decode_to_uint8(torch.zeros(2, 4, 8, 8), meta)
    with pytest.raises(LatentDatasetError, match=r"decode\.type='vae', vae='stabilityai/sd-vae'"):
        decode_to_uint8(torch.zeros(1, 4, 8, 8), {"decode": {"type": "vae", "vae": "stabilityai/sd-vae"}})


# ----------------------------------------------------------------------------- sampling and resuming

def take(iterable, n):
    it = iter(iterable)
    return [next(it) for _ in range(n)]


def test_sampler_is_deterministic_per_seed_and_epoch():
    a, b = ShardedBatchSampler(20, 5, seed=3), ShardedBatchSampler(20, 5, seed=3)
    assert take(a, 8) == take(b, 8)  # two epochs of 4 batches
    first = take(ShardedBatchSampler(20, 5, seed=3), 8)
    assert sorted(sum(first[:4], [])) == list(range(20))  # an epoch is a permutation
    assert first[:4] != first[4:]  # the next epoch is reshuffled
    assert take(ShardedBatchSampler(20, 5, seed=4), 4) != first[:4]


def test_sampler_ranks_partition_each_epoch():
    world, n, bs = 3, 31, 2  # 10 samples per rank, 5 batches, 1 sample dropped per epoch
    per_rank = [take(ShardedBatchSampler(n, bs, seed=0, rank=r, world_size=world), 10) for r in range(world)]
    for epoch in range(2):
        shards = [sum(batches[5 * epoch:5 * (epoch + 1)], []) for batches in per_rank]
        assert all(len(s) == 10 for s in shards)
        flat = sum(shards, [])
        assert len(set(flat)) == len(flat) == 30  # disjoint, equal, 30 of the 31 covered


def test_sampler_state_dict_and_errors():
    s = ShardedBatchSampler(12, 4, seed=0)
    it = iter(s)
    batches = [next(it) for _ in range(5)]  # 3 batches per epoch: into the second epoch
    assert s.state_dict() == {"epoch": 1, "batch": 2}
    t = ShardedBatchSampler(12, 4, seed=0)
    t.load_state_dict({"epoch": 1, "batch": 1})
    assert next(iter(t)) == batches[4]
    with pytest.raises(ValueError, match=r"batch size \(from train\.batch_size\) is 7.*2 process\(es\).*6 of "
                                         r"the dataset's 12 samples"):
        ShardedBatchSampler(12, 7, seed=0, world_size=2)


def tiny_dataset(tmp_path, n=30):
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 1, 2, 2), np.float32)
    return LatentDataset(write_latent_dataset(tmp_path / "tiny", x, np.arange(n) % 3, num_classes=3,
                                              dtype="float32"))


def batch_ids(batches):
    return [x[:, 0, 0, 0].long().tolist() for x, _ in batches]


@pytest.mark.parametrize("num_workers, world_size, stops", [(0, 1, [3, 7, 10]), (0, 2, [3, 5]), (2, 1, [4, 7])])
def test_loader_resume_matches_uninterrupted_run(tmp_path, num_workers, world_size, stops):
    ds = tiny_dataset(tmp_path)  # 30 samples, batch 4: 7 batches/epoch (3 with 2 ranks)
    for rank in range(world_size):
        kw = dict(seed=5, rank=rank, world_size=world_size, num_workers=num_workers)
        reference = take(LatentLoader(ds, 4, **kw), 16)
        for x, y in reference:
            assert x.shape == (4, 1, 2, 2) and x.dtype == torch.float32 and y.dtype == torch.int64
            assert torch.equal(y, x[:, 0, 0, 0].long() % 3)  # labels stay paired with their latents
        for k in stops:  # mid-epoch and exactly at an epoch boundary
            loader = LatentLoader(ds, 4, **kw)
            assert batch_ids(take(loader, k)) == batch_ids(reference[:k])
            state = loader.state_dict()  # consumed batches only, however far workers prefetched
            bpe = loader.sampler.batches_per_epoch
            assert (state["epoch"], state["batch"]) == divmod(k, bpe)
            resumed = LatentLoader(ds, 4, **kw)
            resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
            assert batch_ids(take(resumed, 16 - k)) == batch_ids(reference[k:])


def test_loader_leaves_the_global_rng_alone(tmp_path):
    # A resumed run starts its DataLoader iterator after restoring the RNG: it must not draw from it.
    ds = tiny_dataset(tmp_path)
    state = torch.get_rng_state()
    take(LatentLoader(ds, 4, seed=0), 3)
    assert torch.equal(torch.get_rng_state(), state)


def test_loader_warns_on_changed_settings(tmp_path):
    ds = tiny_dataset(tmp_path)
    state = LatentLoader(ds, 4, seed=0).state_dict()
    with pytest.warns(UserWarning, match="batch_size"):
        LatentLoader(ds, 5, seed=0).load_state_dict(state)


# ----------------------------------------------------------------------------- toy_shapes

def test_toy_generator():
    x, y = generate_toy_shapes(num_per_class=20, resolution=32, seed=1)
    assert x.shape == (200, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y[:10].tolist() == list(range(10)) and torch.bincount(y).tolist() == [20] * 10
    assert x.min() >= -1 and x.max() <= 1 and x.max() > 0.8  # bright shapes on a dark background
    x2, y2 = generate_toy_shapes(num_per_class=20, resolution=32, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # bit-identical for a seed
    assert not torch.equal(x, generate_toy_shapes(num_per_class=20, resolution=32, seed=2)[0])
    means = torch.stack([x[y == c].mean(0) for c in range(10)]).flatten(1)  # per-class mean image
    dist = torch.cdist(means, means) / means.shape[1] ** 0.5  # RMS difference
    assert dist[~torch.eye(10, dtype=torch.bool)].min() > 0.1  # every pair of classes clearly differs
    assert (x[y == 0] - x[y == 0].mean(0)).abs().mean() > 0.02  # a distribution, not one image per class
    assert len(TOY_CLASS_NAMES) == 10
    assert generate_toy_shapes(num_per_class=2, resolution=16)[0].shape == (20, 3, 16, 16)


def test_ensure_toy_dataset_caches_and_checks_parameters(tmp_path, monkeypatch):
    path = ensure_toy_dataset(tmp_path / "toy", num_per_class=5, resolution=16, seed=0)
    ds = LatentDataset(path, expected_channels=3, expected_resolution=16, expected_num_classes=10)
    assert len(ds) == 50 and ds.meta["dtype"] == "float16" and ds.meta["class_names"] == TOY_CLASS_NAMES
    assert ds.meta["builtin"] == {"name": "toy_shapes", "num_per_class": 5, "resolution": 16, "seed": 0}
    x, _ = generate_toy_shapes(5, 16, 0)
    torch.testing.assert_close(ds.__getitems__(list(range(50)))[0], x, rtol=0, atol=1e-3)  # float16 storage
    mtime = (path / "latents.npy").stat().st_mtime_ns

    monkeypatch.setattr(data.builtin.toy, "generate_toy_shapes", lambda *a: pytest.fail("regenerated a cached dataset"))
    assert ensure_toy_dataset(tmp_path / "toy", num_per_class=5, resolution=16, seed=0) == path
    assert (path / "latents.npy").stat().st_mtime_ns == mtime
    with pytest.raises(LatentDatasetError, match=r"'seed': 0.*'seed': 1.*Delete the directory"):
        ensure_toy_dataset(path, num_per_class=5, resolution=16, seed=1)


def test_ensure_toy_dataset_accepts_a_concurrent_writer(tmp_path, monkeypatch):
    target = tmp_path / "toy"
    real_write = data.builtin.toy.write_latent_dataset

    def lose_the_race(path, *args, **kwargs):  # another process publishes the dataset just before us
        real_write(path, *args, **kwargs)
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(data.builtin.toy, "write_latent_dataset", lose_the_race)
    assert ensure_toy_dataset(target, num_per_class=2, resolution=8) == target
    assert len(LatentDataset(target)) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]  # the loser's temporary directory is gone


def test_build_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = OmegaConf.create({"path": "~/toy", "builtin": "toy_shapes", "channels": 3, "resolution": 8,
                            "num_classes": 10, "builtin_args": {"num_per_class": 2, "resolution": 8, "seed": 0}})
    ds = build_dataset(cfg)
    assert ds.root == tmp_path / "toy" and len(ds) == 20
    with pytest.raises(LatentDatasetError, match=r"in_channels=4 \(data\.channels\)"):
        build_dataset({**OmegaConf.to_container(cfg), "channels": 4})
    with pytest.raises(LatentDatasetError, match=r"data\.builtin='mnist'.*\['toy_shapes', 'toy_shapes_buckets', "
                                                   r"'toy_shapes_clips', 'toy_shapes_text'\]"):
        build_dataset({"path": str(tmp_path / "x"), "builtin": "mnist"})
    with pytest.raises(LatentDatasetError, match=r"data\.path is not set"):
        build_dataset(OmegaConf.create({"path": "???", "builtin": None}))
    with pytest.raises(LatentDatasetError, match=r"not found at"):  # real data: nothing is generated
        build_dataset({"path": str(tmp_path / "real"), "builtin": None, "channels": 4})
    assert not os.path.exists(tmp_path / "real")
