"""Optional per-sample conditioning (text / pooled embeddings, attention masks) and loss masks in the latent
dataset format; the token-grid helpers; the toy_masked data; text encoding per model family (tread/encoders/text.py);
caption files (tread/data/precompute/captions.py).

Text encoders are tiny random transformers models with word-level tokenizers that the tests write
themselves (tread.encoders.tiny_text.save_tiny_text_encoders); nothing touches the network.
"""
from __future__ import annotations

import json
import pickle
import re
import socket

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tread import data
from tread import routing
from tread.data import (ImageFolderError, LatentDataset, LatentDatasetError, LatentDatasetWriter, LatentLoader,
                        build_dataset, ensure_toy_dataset, generate_toy_shapes, read_meta, write_latent_dataset)
from tread.data.meta import EXTRA_FILES, EXTRA_KEYS
from tread.data.precompute.captions import read_captions_file
from tread.encoders.errors import EncoderError
from tread.encoders.text import TextEncoderError, encode_prompts, load_text_encoders, resolve_text_encoder_paths
from tread.encoders.text_families import FAMILIES, TEXT_FAMILIES
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.models.families import FAMILIES as MODEL_FAMILIES
from tread.routing import resize_loss_mask, token_keep_mask
from tread.schema import compose

N, L, D, P, HM = 10, 6, 5, 3, 8


def compose_cfg(config_name, overrides):
    return compose(overrides, config_name)


def shapes(**given) -> dict:
    """LatentDataset.conditioning of a dataset holding only the `given` extras (every other entry empty)."""
    return {"text": None, "text_mask": False, "pooled": None, "llama": None, "glyph": None, "image_embeds": None,
            "loss_mask": None, **given}


def make_extras(n=N, seed=0, float_mask=False):
    rng = np.random.default_rng(seed)
    mask = rng.random((n, L)) < 0.6
    mask[:, 0] = True  # every prompt keeps at least one token
    loss = rng.random((n, HM, HM)) if float_mask else rng.integers(0, 256, (n, HM, HM), dtype=np.uint8)
    return {"text": rng.standard_normal((n, L, D)).astype(np.float32), "text_mask": mask,
            "pooled": rng.standard_normal((n, P)).astype(np.float32), "loss_mask": loss}


def make_latents(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 2, 4, 4)).astype(np.float32), rng.integers(0, 3, n)


@pytest.fixture
def cond_ds(tmp_path):
    """A float32 dataset with all four extras, and its arrays."""
    x, y = make_latents()
    extras = make_extras()
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=3, dtype="float32", extras=extras,
                                conditioning_meta={"text": {"family": "flux", "encoders": ["a", "b"],
                                                            "max_length": L}})
    return path, x, y, extras


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("network access in a test")))


# ----------------------------------------------------------------------------- format round trip

@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_with_all_extras(tmp_path, dtype):
    x, y = make_latents()
    extras = make_extras(float_mask=True)
    path = write_latent_dataset(tmp_path / "ds", x, y, num_classes=3, dtype=dtype, extras=extras,
                                conditioning_meta={"text": {"family": "sd3", "max_length": 4}, "note": "unit"})
    meta = read_meta(path)
    assert meta["files"] == {"latents": "latents.npy", "labels": "labels.npy", "text_embeds": "text_embeds.npy",
                             "text_mask": "text_mask.npy", "pooled_embeds": "pooled_embeds.npy",
                             "loss_mask": "loss_mask.npy"}
    assert meta["conditioning"] == {"text": {"seq_len": L, "dim": D, "mask": True, "family": "sd3", "max_length": 4},
                                    "pooled": {"dim": P}, "note": "unit"}
    assert meta["loss_mask"] == {"shape": [HM, HM]}
    stored_mask = np.rint(extras["loss_mask"] * 255).astype(np.uint8)  # float coverage is stored as uint8
    np.testing.assert_array_equal(np.load(path / "loss_mask.npy"), stored_mask)
    assert np.load(path / "text_embeds.npy").dtype == dtype and np.load(path / "text_mask.npy").dtype == bool

    ds = LatentDataset(path)
    assert ds.has_extras
    assert ds.conditioning == shapes(text=(L, D), text_mask=True, pooled=P, loss_mask=(HM, HM))
    text = torch.from_numpy(extras["text"].astype(dtype).astype(np.float32))
    pooled = torch.from_numpy(extras["pooled"].astype(dtype).astype(np.float32))
    loss = torch.from_numpy(stored_mask).float().unsqueeze(1) / 255
    xi, yi, ei = ds[4]
    torch.testing.assert_close(xi, torch.from_numpy(x[4].astype(dtype).astype(np.float32)), rtol=0, atol=0)
    assert yi.item() == y[4] and list(ei) == ["text", "text_mask", "pooled", "loss_mask"]
    torch.testing.assert_close(ei["text"], text[4], rtol=0, atol=0)
    assert ei["text_mask"].dtype == torch.bool and ei["text_mask"].tolist() == extras["text_mask"][4].tolist()
    torch.testing.assert_close(ei["pooled"], pooled[4], rtol=0, atol=0)
    assert ei["loss_mask"].shape == (1, HM, HM)
    torch.testing.assert_close(ei["loss_mask"], loss[4], rtol=0, atol=0)

    idx = [7, 2, 2, 9, 0]  # unsorted with a repeat: request order is kept
    xb, yb, eb = ds.__getitems__(idx)
    assert xb.shape == (5, 2, 4, 4) and yb.tolist() == y[idx].tolist()
    assert eb["text"].dtype == torch.float32 and eb["text"].shape == (5, L, D)
    torch.testing.assert_close(eb["text"], text[idx], rtol=0, atol=0)
    assert eb["text_mask"].dtype == torch.bool
    assert torch.equal(eb["text_mask"], torch.from_numpy(extras["text_mask"][idx]))
    torch.testing.assert_close(eb["pooled"], pooled[idx], rtol=0, atol=0)
    assert eb["loss_mask"].shape == (5, 1, HM, HM) and eb["loss_mask"].dtype == torch.float32
    torch.testing.assert_close(eb["loss_mask"], loss[idx], rtol=0, atol=0)
    assert 0 <= eb["loss_mask"].min() and eb["loss_mask"].max() <= 1


def test_subsets_of_extras(tmp_path):
    x, y = make_latents()
    e = make_extras()
    for name, extras, cond in [
        ("text", {"text": e["text"]}, shapes(text=(L, D))),
        ("pooled", {"pooled": e["pooled"]}, shapes(pooled=P)),
        ("mask", {"loss_mask": e["loss_mask"][:, :4]}, shapes(loss_mask=(4, HM))),
    ]:
        ds = LatentDataset(write_latent_dataset(tmp_path / name, x, y, num_classes=3, extras=extras))
        assert ds.has_extras and ds.conditioning == cond
        keys = {"text": "text", "pooled": "pooled", "mask": "loss_mask"}
        assert list(ds[0][2]) == list(ds.__getitems__([1, 0])[2]) == [keys[name]]
        assert ("conditioning" in ds.meta) == (name != "mask") and ("loss_mask" in ds.meta) == (name == "mask")


def test_plain_data_is_unchanged(tmp_path):
    x, y = make_latents()
    a = write_latent_dataset(tmp_path / "a", x, y, num_classes=3)
    b = write_latent_dataset(tmp_path / "b", x, y, num_classes=3, extras=None, conditioning_meta=None)
    for name in ("latents.npy", "labels.npy"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert sorted(p.name for p in a.iterdir()) == ["labels.npy", "latents.npy", "meta.json"]
    meta = read_meta(a)
    for one in (meta, other := read_meta(b)):     # the integrity record's file times differ between two writes
        for record in one["integrity"]["files"].values():
            record.pop("mtime_ns")
    assert meta == other
    assert "conditioning" not in meta and "loss_mask" not in meta
    assert meta["files"] == {"latents": "latents.npy", "labels": "labels.npy"}
    ds = LatentDataset(a)
    assert not ds.has_extras
    assert ds.conditioning == shapes()
    item, batch = ds[3], ds.__getitems__([3, 1])
    assert isinstance(item, tuple) and len(item) == 2 and isinstance(batch, tuple) and len(batch) == 2


def test_streaming_writer_with_extras_any_order(tmp_path):
    x, y = make_latents()
    e = make_extras()
    part = lambda s: {k: v[s] for k, v in e.items()}  # noqa: E731
    kw = dict(shape=(2, 4, 4), num_samples=N, num_classes=3, dtype="float32", text_shape=(L, D), text_mask=True,
              pooled_dim=P, loss_mask_shape=(HM, HM))
    with LatentDatasetWriter(tmp_path / "ds", **kw) as w:
        w.write(6, x[6:], y[6:], part(slice(6, None)))
        w.write(0, x[:6], y[:6], part(slice(0, 6)))
    ds = LatentDataset(tmp_path / "ds")
    _, _, eb = ds.__getitems__(list(range(N)))
    np.testing.assert_array_equal(eb["text"].numpy(), e["text"])
    np.testing.assert_array_equal(eb["text_mask"].numpy(), e["text_mask"])
    with pytest.raises(LatentDatasetError, match=r"incomplete: 4 of 10 samples were never written"):
        with LatentDatasetWriter(tmp_path / "part", **kw) as w:
            w.write(0, x[:6], y[:6], part(slice(0, 6)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # failed writers leave nothing behind


def bad_extras(**changes):
    e = make_extras(n=4)
    for k, v in changes.items():
        if v is ...:
            del e[k]
        else:
            e[k] = v
    return e


@pytest.mark.parametrize("extras, message", [
    (bad_extras(text=np.zeros((4, L))), r"extras\['text'\] .* must be a \(N, L, D\) float array .*N=4.*got shape "
                                        r"\(4, 6\)"),
    (bad_extras(pooled=np.zeros((3, P))), r"extras\['pooled'\] .*N=4 .*got shape \(3, 3\)"),
    (bad_extras(text=...), r"text_mask=True .* needs text_shape"),
    (bad_extras(text_mask=np.zeros((4, L + 1), bool)), r"extras\['text_mask'\] .* must be a \(n, L\) bool attention "
                                                       r"mask of shape \(4, 6\)"),
    (bad_extras(text_mask=np.zeros((4, L), bool)), r"sample\(s\) \[0, 1, 2, 3\] have no real token"),
    (bad_extras(text_mask=np.full((4, L), 2)), r"extras\['text_mask'\] .* must be bool .* or 0/1 integers, got int64"),
    (bad_extras(loss_mask=np.full((4, HM, HM), 1.5)), r"extras\['loss_mask'\] .* float mask, so it must lie in "
                                                      r"\[0, 1\] .*got values in \[1\.5, 1\.5\]"),
    (bad_extras(loss_mask=np.full((4, HM, HM), 300)), r"integer mask, so it must lie in \[0, 255\]"),
    (bad_extras(text=np.full((4, L, D), 1e6)), r"extras\['text'\] .*non-finite .*float16 overflows"),
    (bad_extras(caption=np.zeros(4)), r"unknown key\(s\) \['caption'\]; allowed: " + re.escape(str(list(EXTRA_KEYS)))),
])
def test_write_validates_extras(tmp_path, extras, message):
    x, y = make_latents(4)
    with pytest.raises(LatentDatasetError, match=message):
        write_latent_dataset(tmp_path / "ds", x, y, num_classes=3, extras=extras)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_writer_requires_exactly_the_declared_extras(tmp_path):
    x, y = make_latents(4)
    e = make_extras(4)
    w = LatentDatasetWriter(tmp_path / "ds", shape=(2, 4, 4), num_samples=4, num_classes=3, text_shape=(L, D))
    with pytest.raises(LatentDatasetError, match=r"lack \['text'\]: the dataset stores \['text'\]"):
        w.write(0, x, y)
    with pytest.raises(LatentDatasetError, match=r"include \['pooled'\], which the dataset does not store.*"
                                                 r"pooled_dim=P"):
        w.write(0, x, y, {"text": e["text"], "pooled": e["pooled"]})
    w.abort()
    for kwargs, message in [
        ({"text_shape": (L,)}, r"text_shape .* is \(6,\) but must be \(L, D\)"),
        ({"pooled_dim": 0}, r"pooled_dim .* is 0 but must be a positive integer"),
        ({"loss_mask_shape": (4, 4.5)}, r"loss_mask_shape .* must be \(Hm, Wm\)"),
        ({"conditioning_meta": {"text": {"family": "flux"}}}, r"conditioning_meta\['text'\] .* no text_shape"),
        ({"text_shape": (L, D), "conditioning_meta": {"text": {"seq_len": 7}}}, r"contradicts the arrays: "
                                                                                r"\{'seq_len': \(7, 6\)\}"),
        ({"extra_meta": {"conditioning": {}}}, r"extra_meta .* sets \['conditioning'\]"),
        ({"conditioning_meta": {"note": object()}}, r"not JSON-serialisable"),
    ]:
        with pytest.raises(LatentDatasetError, match=message):
            LatentDatasetWriter(tmp_path / "ds", shape=(2, 4, 4), num_samples=4, num_classes=3, **kwargs)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- validation on open

def edit_meta(path, fn):
    meta = json.loads((path / "meta.json").read_text())
    fn(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def resave(name, array):
    return lambda path: np.save(path / name, array)


@pytest.mark.parametrize("corrupt, message", [
    (resave("text_embeds.npy", np.zeros((N, L, D + 1), np.float32)),
     r"text_embeds\.npy' \(files\.text_embeds\) holds a float32 array of shape \[10, 6, 6\] but must be float16 or "
     r"float32 of shape \[10, 6, 5\] \(meta\.json num_samples, conditioning\.text seq_len and dim\)"),
    (resave("text_embeds.npy", np.zeros((N, L, D))), r"text_embeds\.npy' .* holds a float64 array"),
    (resave("text_mask.npy", np.ones((N, L), np.uint8)), r"text_mask\.npy' .* holds a uint8 array .* must be bool"),
    (resave("pooled_embeds.npy", np.zeros((N - 1, P), np.float32)), r"pooled_embeds\.npy' .* shape \[9, 3\] .*"
                                                                    r"\[10, 3\] .*conditioning\.pooled dim"),
    (resave("loss_mask.npy", np.zeros((N, HM, HM), np.float32)), r"loss_mask\.npy' .* float32 .* must be uint8 of "
                                                                 r"shape \[10, 8, 8\] .*loss_mask\.shape"),
    (lambda p: (p / "pooled_embeds.npy").unlink(), r"missing pooled_embeds file '.*pooled_embeds\.npy'"),
    (lambda p: edit_meta(p, lambda m: m["conditioning"].pop("text")),
     r"meta has files\.text_embeds but no conditioning\.text"),
    (lambda p: edit_meta(p, lambda m: m["files"].pop("loss_mask")), r"meta has loss_mask but no files\.loss_mask"),
    (lambda p: edit_meta(p, lambda m: m["conditioning"]["text"].update(mask=False)),
     r"meta has files\.text_mask but no conditioning\.text\.mask=true"),
    (lambda p: edit_meta(p, lambda m: m["conditioning"]["text"].update(seq_len="6")),
     r"key 'conditioning\.text' is .*'seq_len': '6'.* but must be an object with positive integers 'seq_len'"),
    (lambda p: edit_meta(p, lambda m: m["conditioning"]["text"].update(mask="yes")),
     r"key 'conditioning\.text\.mask' is 'yes' but must be true or false"),
    (lambda p: edit_meta(p, lambda m: m["conditioning"].update(pooled={"dim": -1})),
     r"key 'conditioning\.pooled' is \{'dim': -1\}"),
    (lambda p: edit_meta(p, lambda m: m.update(loss_mask={"shape": [0, 8]})),
     r"key 'loss_mask' is \{'shape': \[0, 8\]\} but must be an object \{'shape': \[Hm, Wm\]\}"),
    (lambda p: edit_meta(p, lambda m: m.update(conditioning=[1])), r"key 'conditioning' is \[1\]"),
    (lambda p: edit_meta(p, lambda m: m["files"].update(captions="c.npy")),
     r"key 'files' is .* optionally any of " + re.escape(str(sorted(EXTRA_FILES)))),
])
def test_corrupt_extras_errors_name_file_key_and_value(cond_ds, corrupt, message):
    path = cond_ds[0]
    corrupt(path)
    with pytest.raises(LatentDatasetError, match=message) as err:
        LatentDataset(path)
    assert str(path) in str(err.value)


# ----------------------------------------------------------------------------- loading

def test_dataset_with_extras_pickles_without_data(cond_ds):
    path, _, _, extras = cond_ds
    ds = LatentDataset(path)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < extras["text"].nbytes
    torch.testing.assert_close(pickle.loads(blob)[3][2]["text"], torch.from_numpy(extras["text"][3]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_passes_extras_through_deterministically(cond_ds, num_workers):
    path, x, y, extras = cond_ds
    ds = LatentDataset(path)
    kw = dict(seed=3, num_workers=num_workers)
    reference = [next(iter_) for iter_ in [LatentLoader(ds, 3, **kw)] for _ in range(7)]
    sampler_order = LatentLoader(ds, 3, seed=3).sampler
    it = iter(sampler_order)
    for batch in reference:
        assert isinstance(batch, tuple) and len(batch) == 3
        xb, yb, eb = batch
        idx = next(it)
        torch.testing.assert_close(xb, torch.from_numpy(x[idx]))  # extras stay paired with their latents
        assert torch.equal(eb["text_mask"], torch.from_numpy(extras["text_mask"][idx]))
        torch.testing.assert_close(eb["text"], torch.from_numpy(extras["text"][idx]))
        assert eb["loss_mask"].shape == (3, 1, HM, HM)
    loader = LatentLoader(ds, 3, **kw)
    [next(loader) for _ in range(4)]
    resumed = LatentLoader(ds, 3, **kw)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    for want in reference[4:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and all(torch.equal(got[2][k], want[2][k]) for k in want[2])


# ----------------------------------------------------------------------------- token grids

def test_token_keep_mask_divisible_hand_computed():
    m = torch.tensor([[1, 1, 1, 0],
                      [1, 1, 0, 0],
                      [1, 1, 0, 0],
                      [0, 1, 0, 0]], dtype=torch.float32)[None, None]
    # 2x2 cells: top-left 4/4, top-right 1/4, bottom-left 3/4, bottom-right 0/4
    assert token_keep_mask(m, (2, 2)).tolist() == [[True, False, True, False]]
    torch.testing.assert_close(resize_loss_mask(m, (2, 2)), torch.tensor([[[[1.0, 0.25], [0.75, 0.0]]]]))
    half = torch.tensor([[1, 1], [0, 0]], dtype=torch.float32)[None, None]
    assert token_keep_mask(half, (1, 1)).tolist() == [[False]]  # exactly half covered: not kept
    assert token_keep_mask(half * 0.5 + 0.5 * (1 / 255 + 0.5), (1, 1)).tolist() == [[True]]  # a bit more: kept
    soft = torch.full((1, 1, 4, 4), 0.5)
    assert not token_keep_mask(soft, (2, 2)).any()  # half coverage everywhere
    assert token_keep_mask(torch.full((1, 1, 4, 4), 128 / 255), (2, 2)).all()


def test_token_keep_mask_non_divisible_and_row_major():
    m = torch.zeros(1, 1, 3, 3)
    m[0, 0, 0, 0] = 1
    # a 1.5 x 1.5-pixel cell holds one whole covered pixel: 1 / 2.25 = 0.44 -> not kept
    assert token_keep_mask(m, (2, 2)).tolist() == [[False] * 4]
    m[0, 0, 0, 1] = m[0, 0, 1, 0] = 1  # top-left cell: 1 + 0.5 + 0.5 of 2.25 = 0.89; top-right: 0.5 / 2.25
    torch.testing.assert_close(resize_loss_mask(m, (2, 2))[0, 0],
                               torch.tensor([[2 / 2.25, 0.5 / 2.25], [0.5 / 2.25, 0.0]]))
    assert token_keep_mask(m, (2, 2)).tolist() == [[True, False, False, False]]
    # row-major (h, then w) on a non-square grid; upsampling (mask smaller than the grid) copies pixels
    small = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])[None, None]
    keep = token_keep_mask(small, (2, 3))
    assert keep.shape == (1, 6) and keep.tolist() == [[True, False, True, False, False, True]]
    assert token_keep_mask(small, (4, 6)).view(4, 6)[:, ::2].tolist() == [[True, False, True]] * 2 + \
        [[False, False, True]] * 2


def test_area_resize_matches_area_interpolation_and_keeps_the_mean():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(3, 1, 16, 12, generator=g)
    torch.testing.assert_close(resize_loss_mask(m, (4, 3)), F.interpolate(m, size=(4, 3), mode="area"))
    assert torch.equal(token_keep_mask(m, (8, 6)), (F.interpolate(m, size=(8, 6), mode="area") > 0.5).flatten(1))
    odd = resize_loss_mask(m, (5, 7))  # non-divisible: exact area weights preserve the mean
    assert odd.shape == (3, 1, 5, 7) and odd.dtype == torch.float32 and 0 <= odd.min() and odd.max() <= 1
    torch.testing.assert_close(odd.mean((1, 2, 3)), m.mean((1, 2, 3)))
    assert resize_loss_mask(m.double(), (5, 7)).dtype == torch.float64
    assert token_keep_mask(m[:, 0], (2, 2)).shape == (3, 4)  # (B, Hm, Wm) works too
    with pytest.raises(ValueError, match=r"\(B, 1, Hm, Wm\).*got shape \[3, 2, 16, 12\]"):
        token_keep_mask(m.expand(3, 2, 16, 12), (2, 2))
    with pytest.raises(ValueError, match=r"target size is \(2, 0\)"):
        resize_loss_mask(m, (2, 0))
    with pytest.raises(ValueError, match=r"uint8; pass coverage in \[0, 1\]"):
        token_keep_mask((m * 255).to(torch.uint8), (2, 2))


# ----------------------------------------------------------------------------- toy_masked

def test_toy_masked_masks_cover_the_shapes(tmp_path):
    images, labels = generate_toy_shapes(3, 16, 0)
    images_m, labels_m, masks = generate_toy_shapes(3, 16, 0, loss_masks=True)
    assert torch.equal(images, images_m) and torch.equal(labels, labels_m)  # masks change nothing else
    assert masks.shape == (30, 16, 16) and masks.dtype == torch.uint8 and masks.max() == 255 and masks.min() == 0

    path = ensure_toy_dataset(tmp_path / "toy_masked", num_per_class=3, resolution=16, loss_masks=True)
    ds = LatentDataset(path)
    assert ds.conditioning["loss_mask"] == (16, 16) and ds.meta["builtin"]["loss_masks"] is True
    x, y, extras = ds.__getitems__(list(range(30)))
    mask = extras["loss_mask"][:, 0]
    torch.testing.assert_close(mask, masks.float() / 255, rtol=0, atol=0)
    for i in range(30):  # the image is its background where the mask is 0, the shape colour where it is 1
        bg = x[i, :, 0, 0]  # corners lie outside every shape
        assert mask[i, 0, 0] == 0
        diff = (x[i] - bg[:, None, None]).abs().amax(0)
        assert diff[mask[i] == 0].max() < 2e-3 and diff[mask[i] > 0.5].min() > 0.1
        top = mask[i].flatten().argmax()  # the most covered pixel gives the shape colour
        assert mask[i].flatten()[top] > 0.5
        fg = bg + (x[i].flatten(1)[:, top] - bg) / mask[i].flatten()[top]
        # and in between it is the coverage-weighted blend: the mask is exactly the shape's coverage
        blend = bg[:, None, None] + (fg - bg)[:, None, None] * mask[i]
        torch.testing.assert_close(x[i], blend, rtol=0, atol=1e-2)

    plain = ensure_toy_dataset(tmp_path / "toy", num_per_class=3, resolution=16)
    meta = read_meta(plain)
    assert meta["builtin"] == {"name": "toy_shapes", "num_per_class": 3, "resolution": 16, "seed": 0}
    assert "loss_mask" not in meta and "conditioning" not in meta and not LatentDataset(plain).has_extras
    assert (plain / "latents.npy").read_bytes() == (path / "latents.npy").read_bytes()
    with pytest.raises(LatentDatasetError, match=r"'loss_masks': True.*was requested"):
        ensure_toy_dataset(plain, num_per_class=3, resolution=16, loss_masks=True)


def test_toy_masked_config(tmp_path):
    cfg = compose_cfg("train", ["data=toy_masked", f"paths.cache_dir={tmp_path}", "data.builtin_args.num_per_class=2"])
    assert "_masked" in cfg.data.path and cfg.data.builtin_args.loss_masks is True
    assert cfg.data.path != compose_cfg("train", [f"paths.cache_dir={tmp_path}",
                                                  "data.builtin_args.num_per_class=2"]).data.path
    ds = build_dataset(OmegaConf.to_container(cfg.data, resolve=True))
    assert ds.has_extras and len(ds) == 20 and ds.conditioning["loss_mask"] == (16, 16)


# ----------------------------------------------------------------------------- text encoders

# The families encoded here (text.py); those delegated to their pipeline's encode_prompt: tests/test_text_pipelines.py
OWN_FAMILIES = ("flux", "sd3", "wan", "auraflow", "pixart")


@pytest.fixture(scope="module")
def tiny_encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_encoders")
    return {family: save_tiny_text_encoders(family, root / family) for family in OWN_FAMILIES}


PROMPTS = ["a photo of a red disc", "", "dog &amp; cat  with   zebra stripes"]
# (text (L, D), mask?, pooled P) with max_length=12: sd3 prepends the 77 CLIP tokens.
SHAPES = {"flux": ((12, 32), False, 32), "sd3": ((77 + 12, 32), False, 16 + 16), "wan": ((12, 32), True, None),
          "auraflow": ((12, 32), True, None), "pixart": ((12, 32), True, None)}


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_encode_prompts_shapes(tiny_encoders, family):
    enc = load_text_encoders(family, tiny_encoders[family])
    out = encode_prompts(family, enc, PROMPTS, max_length=12)
    (seq, mask, pooled) = SHAPES[family]
    assert list(out) == ["text"] + (["text_mask"] if mask else []) + (["pooled"] if pooled else [])
    assert out["text"].shape == (3, *seq) and out["text"].dtype == np.float32 and np.isfinite(out["text"]).all()
    if mask:
        assert out["text_mask"].dtype == bool and out["text_mask"].shape == (3, 12)
        assert out["text_mask"][1].sum() == 1  # the empty prompt: just the end-of-sequence token
        if family != "pixart":  # wan / auraflow zero the padding positions
            assert not out["text"][~out["text_mask"]].any()
    if pooled:
        assert out["pooled"].shape == (3, pooled) and out["pooled"].dtype == np.float32
    again = encode_prompts(family, enc, PROMPTS[:1], max_length=12)  # independent of the batch
    np.testing.assert_allclose(again["text"][0], out["text"][0], rtol=1e-5, atol=1e-5)
    default = encode_prompts(family, enc, "a cat")
    assert default["text"].shape[1] == FAMILIES[family].max_length + (77 if family == "sd3" else 0)


def _pipeline(family, enc):
    import diffusers

    m, t = enc.models, enc.tokenizers
    common = dict(vae=None, scheduler=None, transformer=None)
    if family == "flux":
        return diffusers.FluxPipeline(text_encoder=m["text_encoder"], tokenizer=t["tokenizer"],
                                      text_encoder_2=m["text_encoder_2"], tokenizer_2=t["tokenizer_2"], **common)
    if family == "sd3":
        return diffusers.StableDiffusion3Pipeline(
            text_encoder=m["text_encoder"], tokenizer=t["tokenizer"], text_encoder_2=m["text_encoder_2"],
            tokenizer_2=t["tokenizer_2"], text_encoder_3=m["text_encoder_3"], tokenizer_3=t["tokenizer_3"], **common)
    cls = {"wan": diffusers.WanPipeline, "auraflow": diffusers.AuraFlowPipeline,
           "pixart": diffusers.PixArtAlphaPipeline}[family]
    return cls(text_encoder=m["text_encoder"], tokenizer=t["tokenizer"], **common)


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_encode_prompts_matches_the_diffusers_pipeline(tiny_encoders, family):
    """The published recipe, checked against diffusers' own encode_prompt on the same tiny encoders."""
    enc = load_text_encoders(family, tiny_encoders[family])
    pipe = _pipeline(family, enc)
    ours = encode_prompts(family, enc, PROMPTS, max_length=12)
    if family == "flux":
        text, pooled, _ = pipe.encode_prompt(PROMPTS, prompt_2=None, device="cpu", max_sequence_length=12)
        want = {"text": text, "pooled": pooled}
    elif family == "sd3":
        r = pipe.encode_prompt(PROMPTS, None, None, device="cpu", do_classifier_free_guidance=False,
                               max_sequence_length=12)
        want = {"text": r[0], "pooled": r[2]}
    elif family == "pixart":
        r = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device="cpu", max_sequence_length=12,
                               clean_caption=False)
        want = {"text": r[0], "text_mask": r[1].bool()}
    else:
        r = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device="cpu", max_sequence_length=12)
        want = {"text": r[0]}
    for key, value in want.items():
        np.testing.assert_allclose(ours[key], value.float().numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def test_load_text_encoders_paths_and_errors(tiny_encoders, tmp_path):
    flux = tiny_encoders["flux"]
    # per-encoder folders override the pipeline folder; a model folder's own tokenizer is used if present
    split = load_text_encoders("flux", {"text_encoder": flux / "text_encoder", "tokenizer": flux / "tokenizer",
                                        "text_encoder_2": flux, "tokenizer_2": flux / "tokenizer_2"})
    assert split.paths["text_encoder_2"] == str(flux / "text_encoder_2")
    np.testing.assert_array_equal(encode_prompts("flux", split, ["a cat"], max_length=4)["pooled"],
                                  encode_prompts("flux", load_text_encoders("flux", str(flux)), ["a cat"],
                                                 max_length=4)["pooled"])
    # PixArt-Sigma weights default to 300 tokens (model_index.json), Alpha to 120
    sigma = tmp_path / "sigma"
    save_tiny_text_encoders("pixart", sigma)
    (sigma / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
    assert load_text_encoders("pixart", sigma).max_length == 300
    assert encode_prompts("pixart", load_text_encoders("pixart", sigma), "a")["text"].shape[1] == 300

    with pytest.raises(TextEncoderError, match=r"flux text encoder 'text_encoder_2' \(T5 \(T5EncoderModel\)\): no "
                                               r"model at '.*nowhere/text_encoder_2' \(no such folder\).*nothing is "
                                               r"downloaded.*hf download black-forest-labs/FLUX\.1-dev --include "
                                               r"'text_encoder\*/\*' 'tokenizer\*/\*' --local-dir DIR"):
        load_text_encoders("flux", {"text_encoder": flux / "text_encoder", "tokenizer": flux / "tokenizer",
                                    "text_encoder_2": tmp_path / "nowhere/text_encoder_2"})
    with pytest.raises(TextEncoderError, match=r"sd3 text encoders: the pipeline folder '.*missing' does not exist"
                                               r".*hf download stabilityai/stable-diffusion-3-medium-diffusers"):
        load_text_encoders("sd3", tmp_path / "missing")
    with pytest.raises(TextEncoderError, match=r"sd3 text encoder 'text_encoder_3'.*no model at"):
        load_text_encoders("sd3", flux)  # a FLUX folder has no text_encoder_3
    with pytest.raises(TextEncoderError, match=r"wan tokenizer 'tokenizer' of text encoder 'text_encoder'.*no "
                                               r"tokenizer files"):
        resolve_text_encoder_paths("wan", {"text_encoder": tiny_encoders["wan"] / "text_encoder"})
    with pytest.raises(TextEncoderError, match=r"unknown key\(s\) \['text_encoder_3'\]; allowed: \['pipeline', "
                                               r"'text_encoder', 'tokenizer'\]"):
        load_text_encoders("pixart", {"text_encoder_3": flux})
    with pytest.raises(TextEncoderError, match=r"text family 'sdxl' is unknown; allowed: flux, sd3, wan, auraflow, "
                                               r"pixart"):
        load_text_encoders("sdxl", flux)
    with pytest.raises(TextEncoderError, match=r"wan text encoder 'text_encoder' at .* is a 'clip_text_model' model"):
        load_text_encoders("wan", {"text_encoder": flux / "text_encoder", "tokenizer": flux / "tokenizer"})
    enc = load_text_encoders("pixart", tiny_encoders["pixart"])
    with pytest.raises(TextEncoderError, match=r"encoders were loaded for family 'pixart', not 'wan'"):
        encode_prompts("wan", enc, ["a"])
    with pytest.raises(TextEncoderError, match=r"max_length=0 must be a positive integer"):
        encode_prompts("pixart", enc, ["a"], max_length=0)
    with pytest.raises(TextEncoderError, match=r"non-empty list of strings, got int 3"):
        encode_prompts("pixart", enc, ["a", 3])
    with pytest.raises(TextEncoderError, match=r"needs \['text_encoder_2', 'tokenizer_2'\]"):
        encode_prompts("flux", {"text_encoder": enc.models["text_encoder"], "tokenizer": enc.tokenizers["tokenizer"]},
                       ["a"])


def test_save_tiny_text_encoders_leaves_the_global_rng_alone(tmp_path):
    state = torch.get_rng_state()
    a = save_tiny_text_encoders("pixart", tmp_path / "a", seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    b = save_tiny_text_encoders("pixart", tmp_path / "b", seed=1)
    ea, eb = (encode_prompts("pixart", load_text_encoders("pixart", p), ["a red disc"], max_length=5) for p in (a, b))
    np.testing.assert_array_equal(ea["text"], eb["text"])  # deterministic per seed


def test_read_captions_file(tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_text('file_name,caption\na.png,a red disc, on black\n# comment\n\n./sub/b.png,"quoted, with comma"\n'
                   'c.png,\n')
    assert read_captions_file(csv) == {"a.png": "a red disc, on black", "sub/b.png": "quoted, with comma", "c.png": ""}
    tsv = tmp_path / "c.tsv"
    tsv.write_text("a.png\ta caption, with comma\n")
    assert read_captions_file(tsv) == {"a.png": "a caption, with comma"}
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"a.png": "one", "b.png": "two"}))
    assert read_captions_file(js) == {"a.png": "one", "b.png": "two"}
    for text, suffix, message in [("a.png,x\na.png,y\n", ".csv", r"lists 'a\.png' twice \(line 2\)"),
                                  ("just-a-name\n", ".csv", r"line 1: 'just-a-name' is not '<file name>,<caption>'"),
                                  ('{"a.png": 3}', ".json", r"caption of 'a\.png' is 3; captions must be strings"),
                                  ("[1]", ".json", r"expected a JSON object"), ("# nothing\n", ".csv", r"no entries")]:
        f = tmp_path / f"bad{suffix}"
        f.write_text(text)
        with pytest.raises(ImageFolderError, match=message):
            read_captions_file(f)
    with pytest.raises(ImageFolderError, match="not found"):
        read_captions_file(tmp_path / "none.csv")


def test_package_exports():
    for name in ("encode_prompts", "load_text_encoders", "TEXT_FAMILIES", "TextEncoderError",
                 "save_tiny_text_encoders"):  # text encoders are frozen networks: tread.encoders, not data
        assert name not in data.__all__ and not hasattr(data, name)
    for name in ("token_keep_mask", "resize_loss_mask"):  # loss-mask geometry lives next to routing
        assert name in routing.__all__ and hasattr(routing, name)
    # every model family has its text encoders, the first five in the order precompute lists them
    assert TEXT_FAMILIES[:5] == OWN_FAMILIES and set(TEXT_FAMILIES) == set(MODEL_FAMILIES)
    assert issubclass(TextEncoderError, EncoderError) and issubclass(TextEncoderError, ValueError)
