"""Precompute inputs that were read wrongly (issue 43): a resumed run re-encodes the shards whose inputs changed in
place (tread/data/precompute/plan.py read_shard: each shard records its samples' input digests, SHA-256 of the
bytes), folders are walked once whatever their symbolic links say (tread/data/images.py walk_folders), and a clip
tree's stray images and empty folders are refused (tread/data/video.py clip_tree). The tiny VAE of
test_precompute.py; a run takes about a second."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tread.data.precompute.run as work
from tread.data.images import ImageFolderError, list_image_folder
from tread.data.precompute.plan import DIGESTS, digest_inputs, make_plan
from tread.data.precompute.request import PrecomputeError, PrecomputeRequest, check_request
from tread.data.video import VideoError, clip_tree, find_clips, is_clip

from test_precompute import offline, run, vae_dir  # noqa: F401  (fixtures: offline, the tiny VAE)

pytestmark = pytest.mark.usefixtures("one_thread")


def bmp_folder(root: Path, n: int = 5) -> Path:
    """n random 20x16 BMPs in class 'a' (uncompressed: new pixels keep the file's size)."""
    rng = np.random.default_rng(3)
    (root / "a").mkdir(parents=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(root / "a" / f"{i}.bmp")
    return root


def repaint_in_place(path: Path) -> None:
    """New pixels, the same name, size in bytes and modification time."""
    stat = path.stat()
    Image.fromarray(np.full((16, 20, 3), 7, np.uint8)).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_resume_re_encodes_an_image_changed_in_place(tmp_path, vae_dir, monkeypatch, capsys):
    images, out = bmp_folder(tmp_path / "imgs"), tmp_path / "ds"
    real, calls = work.encode_shard, []

    def crash_on_third(plan, shard, *args, **kwargs):
        calls.append(shard)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real(plan, shard, *args, **kwargs)

    monkeypatch.setattr(work, "encode_shard", crash_on_third)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(images, out, vae_dir, "--shard-size", "2")
    parts = tmp_path / "ds.parts"
    assert np.load(parts / "shard_00000.npz")[DIGESTS].shape == (2, 32)
    repaint_in_place(images / "a" / "1.bmp")                     # in shard 0
    calls.clear()
    monkeypatch.setattr(work, "encode_shard", lambda plan, shard, *a, **k: calls.append(shard) or
                        real(plan, shard, *a, **k))
    capsys.readouterr()
    run(images, out, vae_dir, "--shard-size", "2")
    assert calls == [0, 2]                                        # shard 1 kept, shard 0 encoded again
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: shard")]
    assert notes == [f"note: shard 0 in '{parts}': 1 of 2 input(s) changed since it was encoded (a/1.bmp); "
                     f"encoding it again"]
    run(images, tmp_path / "fresh", vae_dir, "--shard-size", "2")
    np.testing.assert_array_equal(np.load(out / "latents.npy"), np.load(tmp_path / "fresh" / "latents.npy"))


def test_digests_are_of_the_bytes_of_each_sample(tmp_path):
    images = bmp_folder(tmp_path / "imgs", 4)
    (images / "a" / "3.bmp").write_bytes((images / "a" / "0.bmp").read_bytes())     # a copy: the same digest
    request = PrecomputeRequest(images=str(images), out=str(tmp_path / "ds"), vae="unused", device="cpu")
    check_request(request)
    digests = digest_inputs(make_plan(request), range(4))
    assert digests.shape == (4, 32) and digests.dtype == np.uint8
    assert len({bytes(d) for d in digests}) == 3 and bytes(digests[0]) == bytes(digests[3])


# ----------------------------------------------------------------------------- symbolic links

def test_a_folder_link_loop_is_refused_and_file_links_are_followed(tmp_path):
    root = bmp_folder(tmp_path / "imgs", 3)
    (root / "b").mkdir()
    os.symlink(root / "a" / "0.bmp", root / "b" / "linked.bmp")  # a link to an image: one more sample
    assert len(list_image_folder(root)[0]) == 4
    os.symlink(root / "a", root / "a" / "self")
    with pytest.raises(ImageFolderError, match=r"folder '.*a/self' is '.*imgs/a' again \(a symbolic link loop"):
        list_image_folder(root)
    os.unlink(root / "a" / "self")
    os.symlink(root / "a", root / "b" / "again")                 # a second path to one folder
    with pytest.raises(ImageFolderError, match=r"'.*b/again' is '.*imgs/a' again \(a symbolic link leads to a "
                                               r"folder listed already"):
        list_image_folder(root)
    os.unlink(root / "b" / "again")
    os.symlink(root / "missing.bmp", root / "b" / "gone.bmp")
    with pytest.raises(ImageFolderError, match=r"'.*b/gone\.bmp' is a broken symbolic link"):
        list_image_folder(root)


def frame_folder(folder: Path, n: int = 2) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((16, 16, 3), 20 * i, np.uint8)).save(folder / f"f_{i}.png")
    return folder


def test_clip_folder_loop_cover_image_and_empty_folder(tmp_path):
    root = tmp_path / "clips"
    for name in ("a", "b", "c"):
        frame_folder(root / "cls" / name)
    assert find_clips(root) == [root / "cls" / n for n in "abc"] and not is_clip(root / "cls")
    os.symlink(root / "cls", root / "cls" / "self")
    with pytest.raises(VideoError, match=r"a symbolic link loop"):
        find_clips(root)
    os.unlink(root / "cls" / "self")
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(root / "cls" / "cover.jpg")
    assert not is_clip(root / "cls")
    with pytest.raises(VideoError, match=r"'.*cls/cover\.jpg' lies beside clip folders in '.*cls' \(a, b, c\)"):
        find_clips(root)
    (root / "cls" / "cover.jpg").unlink()
    (root / "cls" / "d").mkdir()
    assert clip_tree(root) == ([root / "cls" / n for n in "abc"], [root / "cls" / "d"])


def test_video_plan_refuses_an_empty_frame_folder(tmp_path):
    root = tmp_path / "clips"
    frame_folder(root / "cls" / "a")
    (root / "cls" / "b").mkdir()
    request = PrecomputeRequest(videos=str(root), out=str(tmp_path / "ds"), vae="unused", device="cpu", frames=1)
    check_request(request)
    with pytest.raises(PrecomputeError, match=r"1 folder\(s\) under --videos '.*clips' hold no clip .*: cls/b "
                                              r"\(an empty frame folder"):
        make_plan(request)
