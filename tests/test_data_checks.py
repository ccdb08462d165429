"""Input checks of the data path: precompute_latents.py decodes every image before encoding (corrupt files fail
the run with one error line, nothing written), skips non-image files with a note and refuses non-finite VAE
output; the dataset readers (latents.npy, WebDataset shards) warn once per non-finite sample.

Tiny images, a tiny random AutoencoderKL at 16 px (as tests/test_precompute.py); nothing touches the network."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute as pl
import tread.data.precompute.encode as encode_mod
import tread.data.precompute.run as run_mod
import test_precompute
from conftest import REPO
from tread.data import LatentDataset, WebDatasetLatents, write_latent_dataset
from tread.data.images import ImageFolderError, unreadable_images

RES = 16


# The tiny offline VAE and the no-network guard (autouse) of the precompute tests, as fixtures of this module too.
vae_dir, offline = test_precompute.vae_dir, test_precompute.offline


def image_bytes(fmt: str, seed: int = 0, size=(24, 20)) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def make_images(root, files: dict[str, bytes]):
    for name, payload in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(payload)
    return root


def argv(images, out, vae_dir, *extra):
    return ["--images", str(images), "--out", str(out), "--vae", str(vae_dir), "--resolution", str(RES),
            "--device", "cpu", "--batch-size", "2", "--shard-size", "2", "--workers", "0", *map(str, extra)]


@pytest.fixture
def corrupt_folder(tmp_path):
    """Two classes: good images, a JPEG cut at 60%, and garbage saved as .png."""
    jpeg = image_bytes("JPEG", 1)
    return make_images(tmp_path / "imgs", {"a/ok.png": image_bytes("PNG", 0), "a/cut.jpg": jpeg[:len(jpeg) * 3 // 5],
                                           "b/garbage.png": b"this is not an image",
                                           "b/ok.jpg": image_bytes("JPEG", 2)})


# ----------------------------------------------------------------------------- precompute: image checks

def test_corrupt_images_fail_the_cli_with_one_error_line_and_nothing_written(tmp_path, corrupt_folder, vae_dir):
    out = tmp_path / "ds"
    out.mkdir()  # an existing empty output folder is allowed; it must stay untouched
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/precompute_latents.py", *argv(corrupt_folder, out, vae_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "error:" not in proc.stdout and errors[0] == proc.stderr.splitlines()[-1]
    assert "2 of 4 image(s)" in errors[0] and "a/cut.jpg (" in errors[0]
    assert "b/garbage.png (not an image PIL can identify)" in errors[0]
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ds", "imgs"]


def test_corrupt_images_found_before_encoding_with_threads(tmp_path, corrupt_folder, vae_dir, monkeypatch):
    png = image_bytes("PNG", 3)
    make_images(corrupt_folder, {"c/cut.png": png[:len(png) // 2], "c/empty.jpg": b"", "c/ok.png": png})
    monkeypatch.setattr(run_mod, "run_encoding", lambda *a: pytest.fail("encoding started despite corrupt images"))
    with pytest.raises(ImageFolderError, match=r"^4 of 7 image\(s\) under '.*imgs' cannot be read \(corrupt, "
                                               r"truncated or not an image\): a/cut\.jpg \(.*\), "
                                               r"b/garbage\.png \(.*\), c/cut\.png \(.*\), \.\.\. \(4 in all\)\. "
                                               r"Fix or remove them; nothing was encoded\.$"):
        pl.main(argv(corrupt_folder, tmp_path / "ds", vae_dir, "--workers", "2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]


def test_a_resumed_run_checks_only_the_images_of_unfinished_shards(tmp_path, corrupt_folder, vae_dir, monkeypatch):
    for name in ("a/cut.jpg", "b/garbage.png"):
        (corrupt_folder / name).write_bytes(image_bytes("PNG", 5))
    monkeypatch.setattr(run_mod, "merge_shards", lambda *a: (_ for _ in ()).throw(RuntimeError("stop before merging")))
    with pytest.raises(RuntimeError, match="stop before merging"):
        pl.main(argv(corrupt_folder, tmp_path / "ds", vae_dir))
    (tmp_path / "ds.parts" / "shard_00001.npz").unlink()  # shard 0 (a/*) stays finished
    checked = []
    monkeypatch.setattr(run_mod, "unreadable_images", lambda paths, *a: checked.extend(paths) or [])
    with pytest.raises(RuntimeError, match="stop before merging"):
        pl.main(argv(corrupt_folder, tmp_path / "ds", vae_dir))
    assert [p.relative_to(corrupt_folder).as_posix() for p in checked] == ["b/garbage.png", "b/ok.jpg"]


def test_image_verify_alone_misses_a_truncated_jpeg(tmp_path):
    """Why the check decodes fully: Image.verify() reads no JPEG data."""
    jpeg = image_bytes("JPEG", 4, size=(64, 48))
    paths = [tmp_path / "cut.jpg", tmp_path / "ok.jpg"]
    paths[0].write_bytes(jpeg[:-2])
    paths[1].write_bytes(jpeg)
    with Image.open(paths[0]) as im:
        im.verify()  # passes
    assert [i for i, _ in unreadable_images(paths)] == [0]


def test_non_image_files_are_skipped_with_one_note(tmp_path, vae_dir, capsys):
    root = make_images(tmp_path / "imgs", {"a/x.png": image_bytes("PNG", 0), "b/y.jpg": image_bytes("JPEG", 1),
                                           "a/notes.txt": b"notes", "b/.DS_Store": b"\0\0\0\1Bud1",
                                           "README.md": b"about"})
    summary = pl.main(argv(root, tmp_path / "ds", vae_dir))
    assert summary["num_images"] == 2 and len(LatentDataset(tmp_path / "ds")) == 2
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "skipped 3 file(s) under" in notes[0]
    assert notes[0].endswith(": README.md, a/notes.txt, b/.DS_Store")


def test_non_finite_vae_output_names_the_image(tmp_path, corrupt_folder, vae_dir, monkeypatch):
    for name in ("a/cut.jpg", "b/garbage.png"):
        (corrupt_folder / name).unlink()
    real = encode_mod.encode

    def nan_for_the_second_image(vae, images, **kw):  # images in order: a/ok.png, b/ok.jpg (one batch)
        out = real(vae, images, **kw)
        out[1, 0, 0, 0] = float("nan")
        return out

    monkeypatch.setattr(encode_mod, "encode", nan_for_the_second_image)
    with pytest.raises(pl.PrecomputeError, match=r"the VAE '.*tiny-vae' gave non-finite latents \(NaN/inf\) for 1 "
                                                 r"image\(s\): .*imgs/b/ok\.jpg \(check the VAE weights"):
        pl.main(argv(corrupt_folder, tmp_path / "ds", vae_dir))
    assert not (tmp_path / "ds").exists()


# ----------------------------------------------------------------------------- readers: non-finite latents

def caught(fetch):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fetch()
    return result, [str(w.message) for w in seen]


def test_latents_npy_warns_once_per_non_finite_sample(tmp_path):
    x = np.random.default_rng(0).standard_normal((12, 2, 3, 3)).astype(np.float32)
    path = write_latent_dataset(tmp_path / "ds", x, np.arange(12) % 3, num_classes=3, dtype="float32")
    stored = np.load(path / "latents.npy", mmap_mode="r+")
    stored[7, 1, 2, 0] = np.nan
    stored.flush()
    del stored
    ds = LatentDataset(path)
    (batch, _), messages = caught(lambda: ds.__getitems__([0, 1, 2, 11]))
    assert messages == [] and torch.isfinite(batch).all()
    (batch, _), messages = caught(lambda: ds.__getitems__([9, 7, 3]))
    assert len(messages) == 1 and f"'{path / 'latents.npy'}' index 7" in messages[0]
    assert torch.isnan(batch[1, 1, 2, 0]) and torch.equal(batch[[0, 2]], torch.from_numpy(x[[9, 3]]))
    assert caught(lambda: ds.__getitems__([7]))[1] == [] and caught(lambda: ds[7])[1] == []  # once per sample
    assert "index 7" in caught(lambda: LatentDataset(path)[-5])[1][0]  # a fresh reader, one item


def write_shard(path, latents):
    with tarfile.open(path, "w") as tar:
        for i, arr in enumerate(latents):
            for name, payload in ((f"{i:07d}.latent.npy", npy_bytes(arr)), (f"{i:07d}.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def npy_bytes(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def test_wds_shard_warns_once_per_non_finite_sample(tmp_path):
    x = np.random.default_rng(1).standard_normal((10, 4, 2, 2)).astype(np.float32)
    x[7, 3, 1, 1] = np.inf
    root = tmp_path / "wds"
    root.mkdir()
    write_shard(root / "part-0000.tar", x[:5])
    write_shard(root / "part-0001.tar", x[5:])
    ds = WebDatasetLatents(root, num_classes=2, index_dir=tmp_path / "index")
    (_, _), messages = caught(lambda: ds.__getitems__([0, 4, 5, 9]))
    assert messages == []
    (batch, _), messages = caught(lambda: ds.__getitems__([8, 7]))
    assert len(messages) == 1 and "sample 7 (latent member '0000002.latent.npy' in shard " in messages[0]
    assert str(root / "part-0001.tar") in messages[0]
    assert torch.isinf(batch[1, 3, 1, 1]) and torch.equal(batch[0], torch.from_numpy(x[8]))
    assert caught(lambda: ds[7])[1] == []
