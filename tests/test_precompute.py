"""scripts/precompute_latents.py (tread/cli/precompute.py parses the flags into a PrecomputeRequest,
tread/data/precompute/run.py does the work), tread/data/images.py (image folders, ADM center crop) and the streaming
writer.

A tiny random AutoencoderKL (downsampling 2) and a few generated images of different sizes and aspect
ratios; resolution 16, so a whole run takes about a second. Nothing touches the network.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from test_conditioning import shapes
import tread.cli.precompute as pl
import tread.data.precompute.run as work
from tread.data import LatentDataset, LatentDatasetError, LatentDatasetExistsError, read_meta
from tread.data.images import ImageFolderError, center_crop_arr, list_image_folder
from tread.data.precompute.request import PrecomputeError, PrecomputeRequest, check_request
from tread.encoders.errors import EncoderError
from tread.encoders.text_families import TEXT_FAMILIES
from tread.encoders.vae import clear_vae_cache, encode, load_vae
from tread.data.writer import LatentDatasetWriter

REPO = Path(__file__).resolve().parents[1]
RES = 16
SIZES = [(20, 16), (16, 30), (40, 33), (17, 17), (64, 20)]  # (width, height): landscape, portrait, big, odd


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vae") / "tiny-vae"
    AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                  norm_num_groups=4, sample_size=16).save_pretrained(path)
    return path


def random_image(rng, size):
    w, h = size
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory):
    """3 classes ('b_dog' sorts after 'a_cat') with 2-3 images each; one grayscale, one nested, one JPEG."""
    root = tmp_path_factory.mktemp("imgs") / "classes"
    rng = np.random.default_rng(0)
    layout = {"a_cat": ["x.png", "y.jpg", "sub/z.png"], "b_dog": ["1.png", "2.PNG"], "c_eel": ["e.png"]}
    k = 0
    for cls, names in layout.items():
        for name in names:
            (root / cls / name).parent.mkdir(parents=True, exist_ok=True)
            img = random_image(rng, SIZES[k % len(SIZES)])
            (img.convert("L") if k == 3 else img).save(root / cls / name)
            k += 1
    (root / "a_cat" / ".hidden.png").write_bytes(b"not an image")  # hidden files are ignored
    (root / "notes.txt").write_text("not an image, ignored")
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("network access in a test")))
    clear_vae_cache()
    yield
    clear_vae_cache()


def run(images, out, vae_dir, *extra):
    return pl.main(["--images", str(images), "--out", str(out), "--vae", str(vae_dir), "--resolution", str(RES),
                    "--device", "cpu", "--batch-size", "2", "--shard-size", "3", "--workers", "0", *map(str, extra)])


def crops(paths):
    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(center_crop_arr(im, RES))
    return np.stack(out)


# ----------------------------------------------------------------------------- end to end

def test_class_folders_to_dataset_with_flips(tmp_path, class_folder, vae_dir):
    out = tmp_path / "ds"
    summary = run(class_folder, out, vae_dir, "--flip")
    assert summary["num_images"] == 6 and summary["shards"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # parts folder removed, no temp dirs left
    ds = LatentDataset(out)
    meta = ds.meta
    assert len(ds) == 12 and meta["shape"] == [8, 8, 8] and ds.shape == (4, 8, 8) and meta["dtype"] == "float16"
    assert meta["latent_kind"] == "moments" and meta["flip"] is True and meta["num_source_images"] == 6
    assert meta["image_resolution"] == RES and meta["class_names"] == ["a_cat", "b_dog", "c_eel"]
    assert meta["num_classes"] == 3 and meta["latent_scale"] == pytest.approx(0.18215)
    assert meta["decode"] == {"type": "vae", "vae": str(vae_dir), "subfolder": None, "scaling_factor": 0.18215,
                              "shift_factor": None}
    assert str(class_folder) in meta["source"]
    labels = np.load(out / "labels.npy")
    assert labels.tolist() == [0, 0, 0, 1, 1, 2] * 2  # [N, 2N) are the flips, labels kept

    paths, _, _ = list_image_folder(class_folder)
    assert [p.relative_to(class_folder).as_posix() for p in paths] == [
        "a_cat/sub/z.png", "a_cat/x.png", "a_cat/y.jpg", "b_dog/1.png", "b_dog/2.PNG", "c_eel/e.png"]
    images = crops(paths)
    vae = load_vae(str(vae_dir))
    stored = np.load(out / "latents.npy").astype(np.float32)
    want = encode(vae, images).numpy()
    want_flip = encode(vae, np.ascontiguousarray(images[:, :, ::-1])).numpy()
    np.testing.assert_allclose(stored[:6], want.astype(np.float16), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(stored[6:], want_flip.astype(np.float16), rtol=1e-3, atol=1e-3)
    assert np.abs(stored[:6] - stored[6:]).max() > 1e-2  # flipped images give other latents
    # The dataset decodes (start-up check of training / sampling) through the VAE named in meta.json.
    from tread.data import check_decodable, decode_to_uint8, draw_latents

    check_decodable(meta)
    assert decode_to_uint8(draw_latents(ds.__getitems__([0, 7])[0], meta), meta).shape == (2, RES, RES, 3)


def test_sample_kind_is_deterministic_and_independent_of_batching(tmp_path, class_folder, vae_dir):
    a = tmp_path / "a"
    run(class_folder, a, vae_dir, "--kind", "sample", "--dtype", "float32", "--seed", "3")
    b = tmp_path / "b"
    pl.main(["--images", str(class_folder), "--out", str(b), "--vae", str(vae_dir), "--resolution", str(RES),
             "--device", "cpu", "--kind", "sample", "--dtype", "float32", "--seed", "3", "--batch-size", "5",
             "--shard-size", "4", "--workers", "2"])
    la, lb = np.load(a / "latents.npy"), np.load(b / "latents.npy")
    assert la.shape == (6, 4, 8, 8) and read_meta(a)["latent_kind"] == "sample"
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    c = tmp_path / "c"
    run(class_folder, c, vae_dir, "--kind", "sample", "--dtype", "float32", "--seed", "4")
    assert np.abs(np.load(c / "latents.npy") - la).max() > 1e-2  # another seed, other draws
    mean = encode(load_vae(str(vae_dir)), crops(list_image_folder(class_folder)[0]), kind="mean").numpy()
    assert 0 < np.abs(la - mean).max()


def test_flat_folder_with_labels_file(tmp_path, vae_dir):
    root = tmp_path / "flat"
    root.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        random_image(rng, SIZES[i]).save(root / f"img{i}.png")
    csv = tmp_path / "labels.csv"
    csv.write_text("filename,label\nimg0.png,zebra\nimg1.png,ant\n# a comment\n\nimg2.png,zebra\n./img3.png,ant\n")
    run(root, tmp_path / "ds", vae_dir, "--labels", csv)
    meta = read_meta(tmp_path / "ds")
    assert meta["class_names"] == ["ant", "zebra"] and meta["num_classes"] == 2
    assert np.load(tmp_path / "ds" / "labels.npy").tolist() == [1, 0, 1, 0]
    assert meta["labels_file"] == str(csv)
    js = tmp_path / "labels.json"
    js.write_text(json.dumps({"img0.png": 7, "img1.png": 0, "img2.png": 3, "img3.png": 7}))
    paths, labels, names = list_image_folder(root, js)
    assert [p.name for p in paths] == ["img0.png", "img1.png", "img2.png", "img3.png"]
    assert labels.tolist() == [7, 0, 3, 7] and names is None
    run(root, tmp_path / "ds2", vae_dir, "--labels", js, "--max-images", "3")
    meta = read_meta(tmp_path / "ds2")
    assert meta["num_classes"] == 8 and meta["class_names"] is None and meta["num_samples"] == 3


def test_resume_skips_finished_shards(tmp_path, class_folder, vae_dir, monkeypatch):
    full = tmp_path / "full"
    run(class_folder, full, vae_dir, "--shard-size", "2", "--flip")  # 3 shards in one go
    calls = []
    real = work.encode_shard

    def crash_on_second(plan, shard, *args, **kwargs):
        calls.append(shard)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(plan, shard, *args, **kwargs)

    monkeypatch.setattr(work, "encode_shard", crash_on_second)
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(class_folder, out, vae_dir, "--shard-size", "2", "--flip")
    parts = tmp_path / "ds.parts"
    assert sorted(p.name for p in parts.iterdir()) == ["settings.json", "shard_00000.npz"] and not out.exists()
    calls.clear()
    monkeypatch.setattr(work, "encode_shard",
                        lambda plan, shard, *a, **k: calls.append(shard) or real(plan, shard, *a, **k))
    summary = run(class_folder, out, vae_dir, "--shard-size", "2", "--flip")
    assert calls == [1, 2] and summary["encoded_here"] == 2  # shard 0 was kept
    assert not parts.exists()
    for name in ("latents.npy", "labels.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(full / name))


def test_parts_from_other_settings_are_refused(tmp_path, class_folder, vae_dir, monkeypatch):
    monkeypatch.setattr(work, "merge_shards", lambda *a: (_ for _ in ()).throw(RuntimeError("stop before merging")))
    with pytest.raises(RuntimeError, match="stop before merging"):
        run(class_folder, tmp_path / "ds", vae_dir)
    with pytest.raises(PrecomputeError, match=r"other settings \(flip: False -> True\).*Delete '.*ds\.parts'"):
        run(class_folder, tmp_path / "ds", vae_dir, "--flip")
    # A shard file alone (e.g. settings.json lost) is checked too.
    (tmp_path / "ds.parts" / "settings.json").unlink()
    with pytest.raises(PrecomputeError, match=r"shard file '.*shard_00000\.npz' was written with other settings "
                                                 r"\(resolution: 16 -> 32\)"):
        pl.main(["--images", str(class_folder), "--out", str(tmp_path / "ds"), "--vae", str(vae_dir),
                 "--resolution", "32", "--device", "cpu", "--shard-size", "3", "--workers", "0"])


def test_shards_done_out_of_order_by_two_processes_merge_in_image_order(tmp_path, class_folder, vae_dir):
    """World size 2 simulated in one process: rank 1's shards first, then rank 0's, then the merge."""
    single = tmp_path / "single"
    run(class_folder, single, vae_dir, "--shard-size", "2", "--flip")
    request = PrecomputeRequest(images=str(class_folder), out=str(tmp_path / "two"), vae=str(vae_dir), resolution=RES,
                                shard_size=2, batch_size=2, flip=True, workers=0)   # the library, no CLI
    check_request(request)
    plan = work.make_plan(request)
    encoded = []
    for rank in (1, 0):
        state = SimpleNamespace(process_index=rank, num_processes=2, is_main_process=rank == 0)
        vae, n = work.run_encoding(plan, state, torch.device("cpu"))
        encoded.append(sorted(int(p.stem.split("_")[1]) for p in plan.parts.glob("shard_*.npz")))
    assert encoded == [[1], [0, 1, 2]]  # rank 1 did shard 1; rank 0 shards 0 and 2
    work.merge_shards(plan, work.dataset_meta(plan, vae))
    for name in ("latents.npy", "labels.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "two" / name), np.load(single / name))


def test_reference_statistics(tmp_path, class_folder, vae_dir):
    from tread.encoders.toy_classifier import ToyClassifier, cache_path, save_toy_classifier

    cache = tmp_path / "cache"
    torch.manual_seed(0)  # an untrained toy classifier at 16 px: the feature network is not what is tested here
    save_toy_classifier(ToyClassifier(resolution=RES).eval(), cache_path(cache, RES), {"accuracy": 0.0})
    ref = tmp_path / "ref.npz"
    summary = run(class_folder, tmp_path / "ds", vae_dir, "--ref-out", ref, "--ref-features", "toy_classifier",
                  "--cache-dir", cache, "--ref-store-images", "4", "--flip")
    assert summary["ref_out"] == ref
    with np.load(ref) as z:
        assert int(z["num_images"]) == 6 and str(z["feature"]) == "toy_classifier"  # unflipped images only
        assert z["arr_0"].shape == (4, RES, RES, 3) and z["mu"].shape == z["sigma"].shape[:1]
        assert str(class_folder) in str(z["source"])
        stored = z["arr_0"]
    images = crops(list_image_folder(class_folder)[0])
    assert all(any(np.array_equal(s, im) for im in images) for s in stored)


# ----------------------------------------------------------------------------- argument and input errors

@pytest.mark.parametrize("argv, message", [
    ([], r"--images DIR is required"),
    (["--images", "{missing}"], r"--images='.*missing'.*no such folder"),
    (["--images", "{images}"], r"--out DIR is required"),
    (["--images", "{images}", "--out", "{existing}"], r"--out '.*existing' already exists; refusing to overwrite"),
    (["--images", "{images}", "--out", "{new}", "--resolution", "4"], r"--resolution=4 .*integer in \[8, 16384\]"),
    (["--images", "{images}", "--out", "{new}", "--kind", "mode"], r"--kind='mode' .*moments, sample"),
    (["--images", "{images}", "--out", "{new}", "--dtype", "bfloat16"], r"--dtype='bfloat16' .*float16, float32"),
    (["--images", "{images}", "--out", "{new}", "--vae-dtype", "int8"], r"--vae-dtype='int8' .*float32, bfloat16"),
    (["--images", "{images}", "--out", "{new}", "--device", "tpu"], r"--device='tpu' .*auto, cpu, cuda"),
    (["--images", "{images}", "--out", "{new}", "--shard-size", "0"],
     r"--shard-size=0 .*an integer in \[1, 16777216\]"),
    (["--images", "{images}", "--out", "{new}", "--labels", "{missing}"], r"--labels='.*missing'.*no such file"),
    (["--images", "{images}", "--out", "{new}", "--ref-out", "{new}.npz", "--ref-features", "clip"],
     r"--ref-features='clip' .*inception, toy_classifier"),
    (["--images", "{images}", "--out", "{new}", "--ref-out", "{existing}"], r"--ref-out '.*existing' already exists"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, class_folder, argv, message, monkeypatch):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "meta.json").write_text("{}")
    monkeypatch.setattr(work, "make_plan", lambda args: pytest.fail("work started despite a bad argument"))
    fill = {"{images}": str(class_folder), "{missing}": str(tmp_path / "missing"), "{existing}": str(existing),
            "{new}": str(tmp_path / "new")}
    argv = [fill.get(a, a.replace("{new}", str(tmp_path / "new"))) for a in argv]
    with pytest.raises(PrecomputeError, match=message):
        pl.main(argv)
    assert pl.cli(argv) == 2  # the command line prints "error: ..." and exits 2


def test_resolution_must_fit_the_vae_and_missing_vae_is_explained(tmp_path, class_folder, vae_dir):
    with pytest.raises(PrecomputeError, match=r"--resolution=17 .*multiple of 2"):
        pl.main(["--images", str(class_folder), "--out", str(tmp_path / "ds"), "--vae", str(vae_dir),
                 "--resolution", "17", "--device", "cpu"])
    with pytest.raises(EncoderError, match=r"VAE 'tread-test/no-vae'.*HF_HUB_OFFLINE.*--vae /path/no-vae"):
        pl.main(["--images", str(class_folder), "--out", str(tmp_path / "ds"), "--vae", "tread-test/no-vae",
                 "--device", "cpu"])


def test_help_is_useful():
    help_text = pl.build_parser().format_help()
    for flag in ("--images", "--labels", "--out", "--resolution", "--vae", "--kind", "--flip", "--shard-size",
                 "--dtype", "--vae-dtype", "--device", "--max-images", "--ref-out", "--ref-features",
                 "--inception-weights", "accelerate launch"):
        assert flag in help_text


def make_folder(root, layout):
    rng = np.random.default_rng(0)
    for name in layout:
        if name.endswith("/"):  # an empty folder
            (root / name).mkdir(parents=True, exist_ok=True)
            continue
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        random_image(rng, (8, 8)).save(root / name)
    return root


@pytest.mark.parametrize("layout, labels, message", [
    (None, None, r"image folder '.*imgs' not found"),
    (["a/"], None, r"no images .* found in"),
    (["x.png", "cls/y.png"], None, r"mixes layouts.*x\.png.*cls"),
    (["x.png"], None, r"is flat .*--labels"),
    (["a/x.png", "b/"], None, r"class folder\(s\) without images.*: b"),
    (["x.png", "y.png"], "x.png,1\ny.png,2\nz.png,1\n", r"names file\(s\) that are not images.*z\.png"),
    (["x.png", "y.png"], "x.png,1\n", r"have no label in.*y\.png"),
    (["x.png", "c/y.png"], "x.png,1\n", r"mixes layouts: a labels file was given.*\(c\)"),
    (["x.png"], "x.png\n", r"line 1: 'x\.png' is not '<file name>,<label>'"),
    (["x.png"], "x.png,1\nx.png,2\n", r"lists 'x\.png' twice"),
    (["x.png"], "x.png,-1\n", r"negative labels"),
])
def test_image_folder_errors(tmp_path, layout, labels, message):
    root = tmp_path / "imgs"
    if layout is not None:
        root.mkdir()
        make_folder(root, layout)
    labels_file = None
    if labels is not None:
        labels_file = tmp_path / "labels.tsv"
        labels_file.write_text(labels)
    with pytest.raises(ImageFolderError, match=message):
        list_image_folder(root, labels_file)


# ----------------------------------------------------------------------------- center crop

@pytest.mark.parametrize("size", [(16, 16), (20, 16), (16, 45), (33, 70), (200, 64), (5, 9)])
def test_center_crop_size(size):
    out = center_crop_arr(Image.new("L", size, 128), RES)  # grayscale in, RGB out; upscales small images too
    assert out.shape == (RES, RES, 3) and out.dtype == np.uint8 and (out == 128).all()


def test_center_crop_follows_the_adm_recipe_step_by_step():
    y, x = np.mgrid[0:150, 0:70]
    image = Image.fromarray(np.stack([x * 3, y, (x + y) % 256], -1).astype(np.uint8))  # 70 wide, 150 high
    # ADM: BOX-halve while the short side >= 2 * 16 (70 -> 35 -> 17; 150 -> 75 -> 37), then BICUBIC so the
    # short side is 16 (17 x 37 -> 16 x round(37 * 16 / 17) = 16 x 35), then the central 16 x 16.
    step = image.resize((35, 75), Image.BOX).resize((17, 37), Image.BOX).resize((16, 35), Image.BICUBIC)
    want = np.asarray(step)[(35 - 16) // 2:(35 - 16) // 2 + 16, :]
    np.testing.assert_array_equal(center_crop_arr(image, 16), want)


# ----------------------------------------------------------------------------- streaming writer

def test_streaming_writer_any_order_atomic_and_complete(tmp_path):
    x = np.random.default_rng(0).standard_normal((7, 2, 3, 3)).astype(np.float32)
    y = np.arange(7) % 3
    with LatentDatasetWriter(tmp_path / "ds", shape=(2, 3, 3), num_samples=7, num_classes=3, dtype="float32",
                             extra_meta={"note": "streamed"}) as w:
        w.write(4, x[4:], y[4:])
        assert not (tmp_path / "ds").exists()  # published only at the end
        w.write(0, x[:4], y[:4])
    ds = LatentDataset(tmp_path / "ds")
    np.testing.assert_array_equal(np.load(tmp_path / "ds" / "latents.npy"), x)
    assert ds.meta["note"] == "streamed" and np.load(tmp_path / "ds" / "labels.npy").tolist() == y.tolist()
    with pytest.raises(LatentDatasetError, match=r"incomplete: 2 of 7 samples were never written \(first: \[5, 6\]\)"):
        with LatentDatasetWriter(tmp_path / "part", shape=(2, 3, 3), num_samples=7, num_classes=3) as w:
            w.write(0, x[:5], y[:5])
    with pytest.raises(LatentDatasetError, match=r"samples \[5, 9\) lie outside \[0, num_samples=7\)"):
        with LatentDatasetWriter(tmp_path / "part", shape=(2, 3, 3), num_samples=7, num_classes=3) as w:
            w.write(5, x[:4], y[:4])
    with pytest.raises(LatentDatasetExistsError, match="already exists"):
        LatentDatasetWriter(tmp_path / "ds", shape=(2, 3, 3), num_samples=7, num_classes=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # failed writers leave nothing behind


# ----------------------------------------------------------------------------- captions, text encoders, loss masks

CAPTIONS = "file_name,caption\na_cat/x.png,a cat, sitting on a mat\nc_eel/e.png,an eel\n"


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    """Tiny random text encoders (tread.encoders.tiny_text.save_tiny_text_encoders) as pipeline folders, per family."""
    from tread.encoders.tiny_text import save_tiny_text_encoders

    root = tmp_path_factory.mktemp("text")
    return {f: save_tiny_text_encoders(f, root / f) for f in ("pixart", "flux")}


def write_masks(images_root, masks_root, skip=()):
    """One grayscale mask per image (same relative path and stem, .png, the image's size): a gradient."""
    for path in list_image_folder(images_root)[0]:
        rel = path.relative_to(images_root).with_suffix(".png")
        if rel.as_posix() in skip:
            continue
        with Image.open(path) as im:
            w, h = im.size
        (masks_root / rel).parent.mkdir(parents=True, exist_ok=True)
        gradient = (np.add.outer(np.arange(h) * 7, np.arange(w) * 3) % 256).astype(np.uint8)
        Image.fromarray(gradient, mode="L").save(masks_root / rel)
    return masks_root


def test_captions_text_embeddings_and_loss_masks_end_to_end(tmp_path, class_folder, vae_dir, text_dirs):
    from tread.encoders.text import encode_prompts, load_text_encoders

    captions = tmp_path / "captions.csv"
    captions.write_text(CAPTIONS)
    masks = write_masks(class_folder, tmp_path / "masks")
    out = tmp_path / "ds"
    run(class_folder, out, vae_dir, "--flip", "--captions", captions, "--caption-from-class", "a photo of a {class}",
        "--text-family", "pixart", "--text-encoders", text_dirs["pixart"], "--max-text-length", "8",
        "--loss-masks", masks)
    ds = LatentDataset(out)
    assert len(ds) == 12 and ds.has_extras
    assert ds.conditioning == shapes(text=(8, 32), text_mask=True, loss_mask=(RES, RES))
    meta = ds.meta
    assert meta["conditioning"]["text"] == {"seq_len": 8, "dim": 32, "mask": True, "family": "pixart",
                                            "encoders": [str(text_dirs["pixart"] / "text_encoder")],
                                            "max_length": 8, "encoder_dtype": "float32"}
    assert meta["captions_file"] == str(captions) and meta["caption_from_class"] == "a photo of a {class}"
    assert meta["loss_masks_dir"] == str(masks)

    # text: each image's caption encoded once, as encode_prompts does; the flipped copies reuse it
    want_captions = ["a photo of a a_cat", "a cat, sitting on a mat", "a photo of a a_cat", "a photo of a b_dog",
                     "a photo of a b_dog", "an eel"]  # images in order: a_cat/sub/z, a_cat/x, a_cat/y, b_dog/1, ...
    want = encode_prompts("pixart", load_text_encoders("pixart", text_dirs["pixart"]), want_captions, max_length=8)
    _, _, extras = ds.__getitems__(list(range(12)))
    np.testing.assert_allclose(extras["text"][:6].numpy(), want["text"].astype(np.float16), rtol=1e-3, atol=1e-3)
    assert torch.equal(extras["text"][6:], extras["text"][:6])
    assert torch.equal(extras["text_mask"], torch.from_numpy(np.concatenate([want["text_mask"]] * 2)))
    # loss masks: cropped exactly as the images (ADM center crop), mirrored for the flipped copies
    paths = list_image_folder(class_folder)[0]
    crops_m = []
    for p in paths:
        with Image.open(masks / p.relative_to(class_folder).with_suffix(".png")) as m:
            crops_m.append(center_crop_arr(m, RES)[..., 0])
    stored = np.load(out / "loss_mask.npy")
    assert stored.dtype == np.uint8 and stored.shape == (12, RES, RES)
    np.testing.assert_array_equal(stored[:6], np.stack(crops_m))
    np.testing.assert_array_equal(stored[6:], np.stack(crops_m)[:, :, ::-1])
    torch.testing.assert_close(extras["loss_mask"][:, 0], torch.from_numpy(stored).float() / 255, rtol=0, atol=0)
    # the latents are those of a run without conditioning
    plain = tmp_path / "plain"
    run(class_folder, plain, vae_dir, "--flip")
    np.testing.assert_array_equal(np.load(out / "latents.npy"), np.load(plain / "latents.npy"))
    assert sorted(p.name for p in plain.iterdir()) == ["labels.npy", "latents.npy", "meta.json"]


def test_flux_pooled_with_per_encoder_paths_and_flat_folder(tmp_path, vae_dir, text_dirs):
    root = tmp_path / "flat"
    root.mkdir()
    rng = np.random.default_rng(2)
    for i in range(3):
        random_image(rng, SIZES[i]).save(root / f"img{i}.png")
    (tmp_path / "labels.csv").write_text("img0.png,3\nimg1.png,0\nimg2.png,1\n")
    (tmp_path / "captions.json").write_text(json.dumps({"img0.png": "red disc", "img1.png": "a square",
                                                        "img2.png": ""}))
    flux = text_dirs["flux"]
    out = tmp_path / "ds"
    run(root, out, vae_dir, "--labels", tmp_path / "labels.csv", "--captions", tmp_path / "captions.json",
        "--text-family", "flux", "--text-encoder-path", f"text_encoder={flux / 'text_encoder'}",
        "--text-encoder-path", f"tokenizer={flux / 'tokenizer'}", "--text-encoder-path", f"text_encoder_2={flux}",
        "--max-text-length", "5")
    ds = LatentDataset(out)
    assert ds.conditioning == shapes(text=(5, 32), pooled=32)
    assert sorted(p.name for p in out.iterdir()) == ["labels.npy", "latents.npy", "meta.json", "pooled_embeds.npy",
                                                     "text_embeds.npy"]
    assert ds.meta["conditioning"]["text"]["encoders"] == [str(flux / "text_encoder"), str(flux / "text_encoder_2")]
    x, y, extras = ds.__getitems__([2, 0])
    assert list(extras) == ["text", "pooled"] and extras["pooled"].shape == (2, 32)


def test_changed_captions_refuse_the_parts_folder(tmp_path, class_folder, vae_dir, text_dirs, monkeypatch):
    captions = tmp_path / "captions.csv"
    captions.write_text(CAPTIONS)
    args = ["--captions", captions, "--caption-from-class", "{class}", "--text-family", "pixart", "--text-encoders",
            text_dirs["pixart"], "--max-text-length", "4"]
    monkeypatch.setattr(work, "merge_shards", lambda *a: (_ for _ in ()).throw(RuntimeError("stop before merging")))
    with pytest.raises(RuntimeError, match="stop before merging"):
        run(class_folder, tmp_path / "ds", vae_dir, *args)
    captions.write_text(CAPTIONS.replace("an eel", "a long eel"))
    with pytest.raises(PrecomputeError, match=r"other settings \(text: .*'captions_sha256'"):
        run(class_folder, tmp_path / "ds", vae_dir, *args)
    with pytest.raises(PrecomputeError, match=r"other settings \(text: .* -> None\)"):
        run(class_folder, tmp_path / "ds", vae_dir)  # dropping the captions is a change too


@pytest.mark.parametrize("argv, message", [
    (["--captions", "{captions}"], r"--captions/--caption-from-class need --text-family \(one of "
                                   + ", ".join(TEXT_FAMILIES) + r"\)"),
    (["--captions", "{missing}"], r"--captions='.*missing' is not valid: no such file"),
    (["--text-family", "pixart"], r"--text-family pixart needs captions: --captions FILE and/or --caption-from-class"),
    (["--text-family", "sdxl", "--captions", "{captions}"],
     r"--text-family='sdxl' .*flux, sd3, wan, auraflow, pixart, flux2, qwen_image, chroma, sana, z_image, lumina2, "
     r"hidream"),
    (["--text-family", "pixart", "--captions", "{captions}"],
     r"--text-family pixart needs its text encoders: --text-encoders DIR.*hf download PixArt-alpha/PixArt-XL-2-512x512 "
     r"--include 'text_encoder\*/\*' 'tokenizer\*/\*' --local-dir DIR"),
    (["--text-family", "pixart", "--captions", "{captions}", "--text-encoders", "{missing}"],
     r"pixart text encoders: the pipeline folder '.*missing' does not exist.*hf download"),
    (["--text-family", "flux", "--captions", "{captions}", "--text-encoders", "{pixart}"],
     r"flux text encoder 'text_encoder_2' \(T5 \(T5EncoderModel\)\): no model at '.*pixart/text_encoder_2'"),
    (["--text-family", "pixart", "--captions", "{captions}", "--text-encoders", "{pixart}", "--text-encoder-path",
      "text_encoder_2=/x"], r"--text-encoder-path='text_encoder_2=/x' .*KEY one of text_encoder, tokenizer \(pixart\)"),
    (["--text-family", "pixart", "--captions", "{captions}", "--text-encoders", "{pixart}", "--max-text-length", "0"],
     r"--max-text-length=0 .*an integer in \[1, 65536\]"),
    (["--text-family", "pixart", "--captions", "{captions}", "--text-encoders", "{pixart}", "--text-encoder-dtype",
      "int8"], r"--text-encoder-dtype='int8' .*float32, bfloat16, float16"),
    (["--text-encoders", "{pixart}"], r"--text-encoders only apply with --text-family and captions"),
    (["--caption-from-class", "a photo", "--text-family", "pixart"], r"--caption-from-class='a photo' .*\{class\}"),
    (["--caption-from-class", "{class} {x}", "--text-family", "pixart"], r"--caption-from-class='\{class\} \{x\}'"),
    (["--loss-masks", "{missing}"], r"--loss-masks='.*missing' is not valid: no such folder"),
])
def test_bad_conditioning_arguments_fail_before_any_work(tmp_path, class_folder, text_dirs, argv, message,
                                                         monkeypatch):
    monkeypatch.setattr(work, "make_plan", lambda args: pytest.fail("work started despite a bad argument"))
    captions = tmp_path / "captions.csv"
    captions.write_text(CAPTIONS)
    fill = {"{captions}": str(captions), "{missing}": str(tmp_path / "missing"), "{pixart}": str(text_dirs["pixart"])}
    argv = ["--images", str(class_folder), "--out", str(tmp_path / "new")] + [fill.get(a, a) for a in argv]
    with pytest.raises(PrecomputeError, match=message):
        pl.main(argv)
    assert pl.cli(argv) == 2


def test_missing_captions_and_masks_fail_before_encoding(tmp_path, class_folder, vae_dir, text_dirs, monkeypatch):
    monkeypatch.setattr(work, "run_encoding", lambda *a: pytest.fail("encoding started despite bad inputs"))
    captions = tmp_path / "captions.csv"
    captions.write_text(CAPTIONS)
    text = ["--text-family", "pixart", "--text-encoders", text_dirs["pixart"]]
    with pytest.raises(PrecomputeError, match=r"4 of 6 image\(s\) have no caption in --captions '.*captions\.csv': "
                                                 r"a_cat/sub/z\.png, a_cat/y\.jpg, b_dog/1\.png, b_dog/2\.PNG\. .*"
                                                 r"--caption-from-class"):
        run(class_folder, tmp_path / "ds", vae_dir, "--captions", captions, *text)
    captions.write_text(CAPTIONS + "a_cat/missing.png,gone\n")
    with pytest.raises(PrecomputeError, match=r"names file\(s\) that are not images in '.*': a_cat/missing\.png"):
        run(class_folder, tmp_path / "ds", vae_dir, "--captions", captions, "--caption-from-class", "{class}", *text)
    masks = write_masks(class_folder, tmp_path / "masks", skip=("c_eel/e.png",))
    with pytest.raises(PrecomputeError, match=r"--loss-masks '.*masks' has no mask for 1 of 6 image\(s\): c_eel/e "
                                                 r"\(expected e\.g\. '.*masks/c_eel/e\.png'"):
        run(class_folder, tmp_path / "ds", vae_dir, "--loss-masks", masks)
    flat = tmp_path / "flat"
    flat.mkdir()
    random_image(np.random.default_rng(0), (8, 8)).save(flat / "a.png")
    (tmp_path / "labels.csv").write_text("a.png,4\n")
    with pytest.raises(PrecomputeError, match=r"--caption-from-class needs class names.*integer labels"):
        run(flat, tmp_path / "ds", vae_dir, "--labels", tmp_path / "labels.csv", "--caption-from-class", "{class}",
            *text)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.parts").exists()


def test_loss_mask_of_another_size_is_an_error(tmp_path, class_folder, vae_dir):
    masks = write_masks(class_folder, tmp_path / "masks")
    Image.new("L", (5, 5), 255).save(masks / "b_dog" / "1.png")
    with pytest.raises(PrecomputeError, match=r"loss mask '.*b_dog/1\.png' is 5x5 but its image '.*b_dog/1\.png' "
                                                 r"is \d+x\d+; a mask must have its image's size"):
        run(class_folder, tmp_path / "ds", vae_dir, "--loss-masks", masks)
    assert pl.cli(["--images", str(class_folder), "--out", str(tmp_path / "ds2"), "--vae", str(vae_dir),
                   "--resolution", str(RES), "--device", "cpu", "--loss-masks", str(masks)]) == 2


def test_help_lists_the_conditioning_flags():
    help_text = pl.build_parser().format_help()
    for flag in ("--captions", "--caption-from-class", "--text-family", "--text-encoders", "--text-encoder-path",
                 "--max-text-length", "--text-encoder-dtype", "--loss-masks", "hf download"):
        assert flag in help_text
