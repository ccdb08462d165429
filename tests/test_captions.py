"""Captions from files (tread/data/precompute/captions.py; precompute's --captions manifests, --caption-sidecars, --trigger-word,
--empty-prompt), the caption table of the latent format (tread/data/meta.py), the per-epoch caption draw
(tread/data/reader.py caption_choice, fed by the loader's EpochBatch) and caption dropout
(tread/training/caption_dropout.py, swapped in by the training step).

Precompute runs use the tiny VAE and tiny PixArt text encoders of test_precompute.py (a run takes about a second);
stored rows are decoded back to their captions by comparing them with encode_prompts of every expected caption.
The draw and dropout tests use small synthetic datasets whose text rows hold their own row number."""
from __future__ import annotations

from types import SimpleNamespace

import json

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute as pl
import tread.data.precompute.run as work
import tread.training.caption_dropout as caption_dropout_module
from tread.data import BucketedDataset, LatentDataset, LatentDatasetError, LatentLoader, write_latent_dataset
from tread.data.bucketed import BucketedWriter, make_sampler
from tread.data.buckets import Bucket
from tread.data.precompute.captions import read_caption_manifest, with_trigger
from tread.data.images import ImageFolderError
from tread.data.loader import EpochBatch
from tread.data.precompute.request import PrecomputeError
from tread.data.reader import caption_choice
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.models.families.base import null_text
from tread.schema import ConfigError, check_train
from tread.training.caption_dropout import caption_dropout_settings, drop_captions
from tread.training.loop import train

from test_precompute import offline, text_dirs, vae_dir  # noqa: F401  (fixtures: tiny VAE, tiny text encoders)

pytestmark = pytest.mark.usefixtures("one_thread")

RES, LEN = 16, 8
# (class/file, (width, height)): images of three shapes, so that buckets split them
IMAGES = [("a_cat/x.png", (20, 16)), ("a_cat/y.png", (16, 30)), ("b_dog/1.png", (40, 33)), ("b_dog/2.png", (17, 17))]
MANIFESTS = {
    "csv": ("captions.csv", 'file_name,caption\na_cat/y.png,a green ring\nb_dog/1.png,an orange tree\n'
                            'a_cat/y.png,"a white x, on a disc"\na_cat/x.png,a lime bird\n'),
    "json": ("captions.json", json.dumps({"a_cat/y.png": ["a green ring", "a white x, on a disc"],
                                          "b_dog/1.png": "an orange tree", "a_cat/x.png": "a lime bird"})),
    "jsonl": ("captions.jsonl", '{"file_name": "a_cat/y.png", "text": "a green ring"}\n'
                                '{"file": "a_cat/y.png", "captions": ["a white x, on a disc"]}\n\n'
                                '{"image": "b_dog/1.png", "prompt": "an orange tree"}\n'
                                '{"path": "./a_cat/x.png", "caption": "a lime bird"}\n'),
}
# Each image's captions: x's sidecar wins over the manifest; 1's sidecar is empty, so the manifest gives its
# caption; 2 has neither, so the class template does.
EXPECTED = [["a red disc", "a blue square"], ["a green ring", "a white x, on a disc"], ["an orange tree"],
            ["a photo of a b_dog"]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("captioned") / "imgs"
    rng = np.random.default_rng(5)
    for name, (w, h) in IMAGES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
    (root / "a_cat" / "x.txt").write_text("a red disc\n\n  a blue square  \n")
    (root / "b_dog" / "1.txt").write_text("\n  \n")
    return root


def manifest(tmp_path, form="csv"):
    name, text = MANIFESTS[form]
    (tmp_path / name).write_text(text)
    return tmp_path / name


def run(images, out, vae, pixart, *extra):
    size = [] if "--buckets" in extra else ["--resolution", str(RES)]     # buckets give the sizes themselves
    return pl.main(["--images", str(images), "--out", str(out), "--vae", str(vae), *size,
                    "--device", "cpu", "--batch-size", "3", "--shard-size", "3", "--workers", "0",
                    "--text-family", "pixart", "--text-encoders", str(pixart), "--max-text-length", str(LEN),
                    *map(str, extra)])


def encoded(pixart, captions):
    """encode_prompts of `captions` as the data stores them (float16)."""
    out = encode_prompts("pixart", load_text_encoders("pixart", pixart), captions, max_length=LEN)
    return {k: v.astype(np.float16) if k == "text" else v for k, v in out.items()}


def decode(rows, candidates, want):
    """The caption of each stored text row: the candidate whose encoding (want["text"]) it equals."""
    found = []
    for row in np.asarray(rows, np.float32):
        hits = [c for c, w in zip(candidates, want["text"].astype(np.float32)) if np.allclose(row, w, atol=2e-3)]
        assert len(hits) == 1, hits
        found.append(hits[0])
    return found


# ----------------------------------------------------------------------------- manifests

def test_manifest_forms_give_several_captions_per_file(tmp_path):
    for form in MANIFESTS:
        m = read_caption_manifest(manifest(tmp_path, form))
        assert m.captions == {"a_cat/y.png": ["a green ring", "a white x, on a disc"],
                              "b_dog/1.png": ["an orange tree"], "a_cat/x.png": ["a lime bird"]}, form
    assert read_caption_manifest(manifest(tmp_path, "csv")).where["a_cat/y.png"] == "line 2"
    assert read_caption_manifest(manifest(tmp_path, "jsonl")).where["b_dog/1.png"] == "line 4"
    assert with_trigger("a cat", "sks") == "sks, a cat" and with_trigger("", "sks") == "sks"


@pytest.mark.parametrize("name, text, message", [
    ("m.jsonl", '{"file": "a.png", "caption": "x"}\n{"file": "b.png", "caption": \n',
     r"captions file '.*m\.jsonl' line 2: not a JSON object"),
    ("m.jsonl", '{"file": "a.png", "text": "x", "caption": "y"}\n', r"line 1: .* must have one file key"),
    ("m.jsonl", '{"file": "a.png", "captions": "x"}\n', r"line 1: 'captions' is 'x'; allowed: a non-empty list"),
    ("m.jsonl", '["a.png", "x"]\n', r"line 1: .* is not a JSON object"),
    ("m.json", '{"a.png": []}', r"the caption of 'a\.png' is \[\]; allowed: a caption string or a non-empty list"),
    ("m.json", '{"a.png": ["x", 3]}', r"the caption of 'a\.png' is \['x', 3\]"),
    ("m.csv", "a.png,x\njust-a-name\n", r"line 2: 'just-a-name' is not '<file name>,<caption>'"),
    ("m.csv", "# nothing\n", r"has no entries"),
])
def test_bad_manifests_name_the_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ImageFolderError, match=message):
        read_caption_manifest(tmp_path / name)


# ----------------------------------------------------------------------------- precompute round trip

@pytest.mark.parametrize("form", list(MANIFESTS))
def test_manifests_and_sidecars_round_trip_into_the_dataset(tmp_path, folder, vae_dir, text_dirs, form):
    out = tmp_path / "ds"
    run(folder, out, vae_dir, text_dirs["pixart"], "--caption-sidecars", "--captions", manifest(tmp_path, form),
        "--caption-from-class", "a photo of a {class}", "--trigger-word", "sks", "--flip", "--empty-prompt")
    ds = LatentDataset(out)
    flat = [with_trigger(c, "sks") for captions in EXPECTED for c in captions]
    assert len(ds) == 8 and ds.captions == {"rows": 2 * len(flat) + 1, "empty_prompt": True}
    assert ds.caption_counts().tolist() == [2, 2, 1, 1] * 2
    assert ds.meta["trigger_word"] == "sks" and ds.meta["caption_sidecars"] is True
    assert (out / "caption_offsets.npy").is_file() and ds.meta["files"]["caption_offsets"] == "caption_offsets.npy"
    # every caption encoded once, as encode_prompts does; the flipped copies' rows repeat them; "" last
    want = encoded(text_dirs["pixart"], flat + [""])
    stored, mask = np.load(out / "text_embeds.npy"), np.load(out / "text_mask.npy")
    assert decode(stored[:6], flat, want) == flat and decode(stored[6:12], flat, want) == flat
    np.testing.assert_allclose(stored[12], want["text"][-1], atol=2e-3)
    np.testing.assert_array_equal(mask, np.concatenate([want["text_mask"][:6]] * 2 + [want["text_mask"][6:]]))
    empty = ds.empty_prompt()
    assert torch.equal(empty["text"], torch.from_numpy(stored[12]).float()) and set(empty) == {"text", "text_mask"}
    # a loader batch draws one of the sample's own captions; over two epochs (at most 2 captions) all of them
    seen = {i: set() for i in range(8)}
    for epoch in range(2):
        _, _, extras = ds.__getitems__(EpochBatch(list(range(8)), epoch, seed=1))
        for i, caption in enumerate(decode(extras["text"].numpy(), flat, want)):
            seen[i].add(caption)
    assert [sorted(seen[i]) for i in range(4)] == [sorted(with_trigger(c, "sks") for c in e) for e in EXPECTED]
    assert seen == {i: seen[i % 4] for i in range(8)}


def test_buckets_keep_the_caption_table_per_bucket(tmp_path, folder, vae_dir, text_dirs):
    out = tmp_path / "ds"
    run(folder, out, vae_dir, text_dirs["pixart"], "--caption-sidecars", "--captions", manifest(tmp_path),
        "--caption-from-class", "a photo of a {class}", "--empty-prompt", "--buckets", "16x16,12x24",
        "--bucket-stride", "4")
    ds = BucketedDataset(out)
    flat = [c for captions in EXPECTED for c in captions]
    want = encoded(text_dirs["pixart"], flat + [""])
    by_bucket = {"16x16": [0, 2, 3], "12x24": [1]}                  # the images (IMAGES order) in each bucket
    for b, bucket in enumerate(ds.buckets):
        part, images = ds.parts[b], by_bucket[bucket.name]
        assert part.caption_counts().tolist() == [len(EXPECTED[i]) for i in images]
        np.testing.assert_allclose(part.empty_prompt()["text"].numpy(), want["text"][-1], atol=2e-3)
        rows = np.load(out / bucket.name / "text_embeds.npy")[:-1]
        assert decode(rows, flat, want) == [c for i in images for c in EXPECTED[i]]
        # through BucketedDataset: the bucket's own draw, keyed by the global sample index
        idx = list(range(int(ds.offsets[b]), int(ds.offsets[b + 1])))
        got = ds.__getitems__(EpochBatch(idx, 3, 7))[2]["text"]
        local = EpochBatch(list(range(len(idx))), 3, 7, index_base=int(ds.offsets[b]))
        assert torch.equal(got, part.__getitems__(local)[2]["text"])
        counts = part.caption_counts()
        assert part.caption_rows(local).tolist() == (np.concatenate([[0], np.cumsum(counts)[:-1]]) + caption_choice(
            7, 3, np.array(idx), counts)).tolist()


def one_error_line(capsys, argv):
    """pl.cli(argv)'s exit status and its stderr, which must be one `error:` line."""
    status = pl.cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return status, err[0]


@pytest.mark.parametrize("extra, text, message", [
    (["--captions", "{m}"], "a_cat/x.png,a red disc\nb_dog/gone.png,a blue square\n",
     r"--captions '.*m\.csv' names file\(s\) that are not images in '.*imgs': b_dog/gone\.png \(line 2\)"),
    (["--caption-sidecars"], None,
     r"3 of 4 image\(s\) have no caption: their caption sidecars .* are missing or empty: a_cat/y\.txt \(missing\), "
     r"b_dog/1\.txt \(empty\), b_dog/2\.txt \(missing\)\. .*--caption-from-class"),
    (["--caption-sidecars", "--captions", "{m}"], "a_cat/y.png,a green ring\n",
     r"2 of 4 image\(s\) have no caption: .* missing or empty and --captions '.*m\.csv' does not list them: "
     r"b_dog/1\.txt \(empty\), b_dog/2\.txt \(missing\)"),
    (["--captions", "{m}"], "a_cat/x.png,a red disc\n",
     r"3 of 4 image\(s\) have no caption in --captions '.*m\.csv': a_cat/y\.png, b_dog/1\.png, b_dog/2\.png"),
    (["--captions", "{m}", "--trigger-word", " sks"], "a_cat/x.png,a\n", r"--trigger-word=' sks' is not valid"),
    (["--caption-sidecars", "--trigger-word", "a\nb"], None, r"--trigger-word='a\\nb' is not valid"),
])
def test_bad_caption_inputs_are_one_error_line_before_any_work(tmp_path, folder, vae_dir, text_dirs, capsys,
                                                               monkeypatch, extra, text, message):
    monkeypatch.setattr(work, "load_encoder", lambda *a: pytest.fail("work started despite bad captions"))
    m = tmp_path / "m.csv"
    if text is not None:
        m.write_text(text)
    argv = ["--images", str(folder), "--out", str(tmp_path / "ds"), "--vae", str(vae_dir), "--device", "cpu",
            "--text-family", "pixart", "--text-encoders", str(text_dirs["pixart"])] + \
        [str(m) if a == "{m}" else a for a in extra]
    with pytest.raises(PrecomputeError, match=message):
        pl.main(argv)
    status, line = one_error_line(capsys, argv)
    assert status == 2 and not (tmp_path / "ds").exists() and not (tmp_path / "ds.parts").exists()


def test_caption_flags_without_a_text_family(tmp_path, folder, capsys):
    base = ["--images", str(folder), "--out", str(tmp_path / "ds")]
    for flags, message in ((["--caption-sidecars"], "--captions/--caption-from-class/--caption-sidecars need "
                                                    "--text-family"),
                           (["--empty-prompt"], "--empty-prompt only apply with --text-family"),
                           (["--trigger-word", "sks"], "--trigger-word only apply with --text-family")):
        assert one_error_line(capsys, base + flags)[1].startswith(f"error: {message}")


def test_malformed_jsonl_line_fails_before_encoding(tmp_path, folder, vae_dir, text_dirs, monkeypatch, capsys):
    monkeypatch.setattr(work, "load_encoder", lambda *a: pytest.fail("work started despite a bad manifest"))
    (tmp_path / "m.jsonl").write_text('{"file": "a_cat/x.png", "caption": "x"}\n{oops}\n')
    argv = ["--images", str(folder), "--out", str(tmp_path / "ds"), "--vae", str(vae_dir), "--text-family", "pixart",
            "--text-encoders", str(text_dirs["pixart"]), "--captions", str(tmp_path / "m.jsonl"),
            "--caption-from-class", "{class}"]
    status, line = one_error_line(capsys, argv)
    assert status == 2 and "m.jsonl' line 2: not a JSON object" in line


# ----------------------------------------------------------------------------- the draw

def table_dataset(path, counts, empty=True, text_dim=2, seed=0, size=(4, 4)):
    """A caption table whose text rows hold their row number (text[r] = r) and the empty prompt -1; latents of
    `size` (h, w)."""
    counts = np.asarray(counts)
    rows, n = int(counts.sum()), len(counts)
    text = np.broadcast_to(np.arange(rows, dtype=np.float32)[:, None, None], (rows, 3, text_dim)).copy()
    mask = np.ones((rows, 3), bool)
    extra = {"empty_prompt": {"text": np.full((1, 3, text_dim), -1, np.float32), "text_mask": np.ones((1, 3), bool)}} \
        if empty else {}
    x = np.random.default_rng(seed).standard_normal((n, 2, *size)).astype(np.float32)
    return write_latent_dataset(path, x, np.arange(n) % 2, num_classes=2, dtype="float32",
                                extras={"text": text, "text_mask": mask}, caption_counts=counts, **extra)


def rows_of(batch):
    return batch[2]["text"][:, 0, 0].long().tolist()


def _splitmix64(x):
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_caption_choice_is_the_documented_hash_and_covers_every_caption_once_per_cycle():
    counts = np.array([1, 2, 3, 5, 4, 3])
    samples = np.array([0, 7, 11, 3, 40, 2])
    for seed, epoch in ((0, 0), (5, 4), (2 ** 31, 11)):
        got = caption_choice(seed, epoch, samples, counts)
        for j, (i, k) in enumerate(zip(samples, counts)):   # the module doc's formula, in Python integers
            key = lambda c: _splitmix64(_splitmix64(_splitmix64(_splitmix64(seed) ^ int(i)) ^ epoch // int(k)) ^ c)  # noqa: E731
            assert got[j] == sorted(range(k), key=key)[epoch % k]
    # every cycle of K epochs uses each of a sample's K captions once, in an order that changes between cycles
    cycles = np.stack([caption_choice(3, e, samples, counts) for e in range(60)])
    for j, k in enumerate(counts):
        per_cycle = cycles[:, j][: 60 // k * k].reshape(-1, k)
        assert (np.sort(per_cycle, axis=1) == np.arange(k)).all()
        assert k < 3 or len({tuple(c) for c in per_cycle}) > 1
    assert not np.array_equal(cycles, np.stack([caption_choice(4, e, samples, counts) for e in range(60)]))


def test_loader_draws_per_epoch_seeded_and_resumes_exactly(tmp_path):
    counts = [1, 3, 2, 4, 1, 2, 3, 2]
    ds = LatentDataset(table_dataset(tmp_path / "ds", counts))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    loader = LatentLoader(ds, batch_size=4, seed=3)
    batches = [next(loader) for _ in range(2 * 12)]                   # 12 epochs of 2 batches
    drawn = {i: [] for i in range(8)}
    for k, batch in enumerate(batches):
        epoch, order = k // 2, loader.sampler.epoch_batches(k // 2)[k % 2]
        want = offsets[order] + caption_choice(3, epoch, np.array(order), np.array(counts)[order])
        assert rows_of(batch) == want.tolist()
        for i, row in zip(order, rows_of(batch)):
            drawn[i].append(row - offsets[i])
    assert all(sorted(set(drawn[i])) == list(range(counts[i])) for i in range(8))    # every caption drawn
    assert any(len(set(d[:2])) > 1 for d in drawn.values())                           # epochs differ
    other = LatentLoader(ds, batch_size=4, seed=4)
    assert [rows_of(next(other)) for _ in range(24)] != [rows_of(b) for b in batches]
    # resumed mid-epoch (after 5 batches): the same batches and captions, with DataLoader workers too
    resumed = LatentLoader(ds, batch_size=4, seed=3, num_workers=1)
    first = LatentLoader(ds, batch_size=4, seed=3)
    for _ in range(5):
        next(first)
    resumed.load_state_dict(first.state_dict())
    for k in range(5, 24):
        got = next(resumed)
        assert rows_of(got) == rows_of(batches[k]) and torch.equal(got[0], batches[k][0])


def test_single_caption_data_reads_as_before(tmp_path):
    rng = np.random.default_rng(0)
    text, mask = rng.standard_normal((6, 3, 2)).astype(np.float32), rng.random((6, 3)) < 0.7
    mask[:, 0] = True
    root = write_latent_dataset(tmp_path / "one", rng.standard_normal((6, 2, 4, 4)).astype(np.float32),
                                np.zeros(6, np.int64), num_classes=1, extras={"text": text, "text_mask": mask})
    ds = LatentDataset(root)
    assert sorted(p.name for p in root.iterdir()) == ["labels.npy", "latents.npy", "meta.json", "text_embeds.npy",
                                                      "text_mask.npy"]
    assert ds.captions is None and "captions" not in ds.meta["conditioning"] and ds.empty_prompt() is None
    idx = [4, 1, 5, 0]
    plain, drawn = ds.__getitems__(idx), ds.__getitems__(EpochBatch(idx, 9, 123))
    assert all(torch.equal(a, b) for a, b in zip(plain[:2], drawn[:2]))
    assert all(torch.equal(plain[2][k], drawn[2][k]) for k in plain[2])
    assert torch.equal(plain[2]["text"], torch.from_numpy(text[idx].astype(np.float16)).float())
    assert torch.equal(ds[4][2]["text_mask"], torch.from_numpy(mask[4]))
    # a caption table read outside the loader (a plain list, one item) gives every sample its first caption
    table = LatentDataset(table_dataset(tmp_path / "table", [2, 1, 3]))
    assert rows_of(table.__getitems__([2, 0, 1])) == [3, 0, 2] and int(table[2][2]["text"][0, 0]) == 3


def test_bucketed_loader_batches_carry_epoch_and_seed(tmp_path):
    counts = {Bucket(8, 8): [2, 1, 3, 2], Bucket(8, 16): [3, 3, 1, 2]}
    with BucketedWriter(tmp_path / "b", 2, 8) as writer:
        for bucket, c in counts.items():
            table_dataset(writer.bucket_dir(bucket), c, size=(bucket.height // 2, bucket.width // 2))
            writer.add(bucket, np.zeros((len(c), 6), np.int32))
    ds = BucketedDataset(tmp_path / "b")
    sampler = make_sampler(ds, batch_size=2, seed=5, rank=0, world_size=1)
    loader = LatentLoader(ds, batch_size=2, seed=5, sampler=sampler)
    for k in range(8):
        batch, epoch = next(loader), k // sampler.batches_per_epoch
        order = sampler.epoch_batches(epoch)[k % sampler.batches_per_epoch]
        b = ds.bucket_of(order[0])
        c = np.array(counts[ds.buckets[b]])
        local = np.array(order) - ds.offsets[b]
        want = np.concatenate([[0], np.cumsum(c)])[local] + caption_choice(5, epoch, np.array(order), c[local])
        assert rows_of(batch) == want.tolist()


def test_caption_table_files_are_checked(tmp_path):
    root = table_dataset(tmp_path / "ds", [2, 1, 3])
    np.save(root / "caption_offsets.npy", np.array([0, 2, 2, 6]))
    with pytest.raises(LatentDatasetError, match=r"caption_offsets\.npy' \(files\.caption_offsets\) holds a int64 "
                                                 r"array of shape \[4\] but must be int64 of shape \[4\] .* strictly "
                                                 r"increasing from 0 to 6 .*rows 7, less the empty prompt"):
        LatentDataset(root)
    meta = json.loads((root / "meta.json").read_text())
    meta["conditioning"]["captions"]["rows"] = 9
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LatentDatasetError, match=r"text_embeds\.npy' .* must be float16 or float32 of shape "
                                                 r"\[9, 3, 2\] \(meta\.json conditioning\.captions rows"):
        LatentDataset(root)
    del meta["files"]["caption_offsets"]
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LatentDatasetError, match=r"meta has conditioning\.captions but no files\.caption_offsets"):
        LatentDataset(root)
    with pytest.raises(LatentDatasetError, match=r"caption_counts for .* must be 3 integers >= 1"):
        table_dataset(tmp_path / "bad", [2, 0, 3])
    with pytest.raises(LatentDatasetError, match=r"extras\['text'\] .* with N=5 \(one per caption row\)"):
        write_latent_dataset(tmp_path / "bad2", np.zeros((3, 1, 2, 2)), np.zeros(3, np.int64), num_classes=1,
                             extras={"text": np.zeros((3, 2, 2))}, caption_counts=[2, 2, 1])


# ----------------------------------------------------------------------------- caption dropout

def test_dropout_rate_and_the_dropped_rows(tmp_path):
    ds = LatentDataset(table_dataset(tmp_path / "ds", [1] * 4000))
    empty = ds.empty_prompt()
    cond = dict(ds.__getitems__(EpochBatch(list(range(4000)), 0, 0))[2])
    cond["pooled"] = torch.randn(4000, 5)
    empty = {**empty, "pooled": torch.full((5,), 7.0)}
    torch.manual_seed(11)
    out = drop_captions(cond, 0.3, "empty", empty)
    torch.manual_seed(11)
    drop = torch.rand(4000) < 0.3                                   # one draw of B on the training stream
    assert abs(drop.float().mean().item() - 0.3) < 0.02
    for key in ("text", "text_mask", "pooled"):
        assert torch.equal(out[key][drop], empty[key].expand_as(out[key][drop]))
        assert torch.equal(out[key][~drop], cond[key][~drop])
    assert (out["text"][drop] == -1).all() and (out["text"][~drop] >= 0).all()
    torch.manual_seed(11)
    zeros = drop_captions(cond, 0.3, "zeros", None)
    assert all(torch.equal(zeros[k], v) for k, v in null_text(cond, drop).items())


def cfg_of(path, p=0.2, mode="auto", family="pixart"):
    """caption_dropout_settings' train section, model.family and data section."""
    data = SimpleNamespace(path=str(path), plain=lambda: {"path": str(path), "builtin": None})
    return SimpleNamespace(caption_dropout=p, caption_dropout_mode=mode), family, data


def test_caption_dropout_settings_resolve_the_mode_and_check_the_data(tmp_path):
    root = table_dataset(tmp_path / "ds", [2, 1])
    meta = LatentDataset(root).meta
    p, mode, empty = caption_dropout_settings(*cfg_of(root), meta)
    assert (p, mode) == (0.2, "empty") and torch.equal(empty["text"], torch.full((3, 2), -1.0))
    assert caption_dropout_settings(*cfg_of(root, family="flux2"), meta) == (0.2, "zeros", None)
    assert caption_dropout_settings(*cfg_of(root, p=0.0, family=None), {}) == (0.0, "auto", None)
    plain = table_dataset(tmp_path / "plain", [2, 1], empty=False)
    with pytest.raises(ConfigError, match=r"caption_dropout_mode=auto \(empty for this family\) needs the encoded "
                                          r"empty prompt.*--empty-prompt, or train.caption_dropout_mode=zeros"):
        caption_dropout_settings(*cfg_of(plain), LatentDataset(plain).meta)
    with pytest.raises(ConfigError, match=r"train.caption_dropout=0.2 needs text data"):
        caption_dropout_settings(*cfg_of(root, mode="zeros"), {"conditioning": None})
    with pytest.raises(ConfigError, match=r"caption_dropout_mode=auto needs a text-conditioned model.family"):
        caption_dropout_settings(*cfg_of(root, family=None), meta)


@pytest.mark.parametrize("override, message", [
    ("train.caption_dropout=0.1", r"train.caption_dropout=0.1 needs a text-conditioned model"),
    ("train.caption_dropout=1", r"train.caption_dropout=1 is not allowed; allowed: a probability in \[0, 1\)"),
    ("train.caption_dropout_mode=sometimes", r"train.caption_dropout_mode='sometimes' is not allowed"),
])
def test_caption_dropout_keys_are_checked(tiny_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        check_train(tiny_cfg(override))


def test_training_swaps_dropped_captions_for_the_empty_prompt(tiny_cfg, tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 4, 16)
    rows = int(counts.sum())
    text = rng.standard_normal((rows, 4, 32)).astype(np.float32)
    empty = {"text": np.zeros((1, 4, 32), np.float32) + 0.5, "pooled": np.zeros((1, 32), np.float32) - 0.5}
    root = write_latent_dataset(tmp_path / "ds", rng.standard_normal((16, 4, 8, 8)).astype(np.float32),
                                np.arange(16) % 2, num_classes=2, extras={"text": text, "pooled": text[:, 0]},
                                caption_counts=counts, empty_prompt=empty)
    seen = []

    def spy(cond, p, mode, empty_prompt):
        out = drop_captions(cond, p, mode, empty_prompt)
        seen.append((cond, out, mode))
        return out

    monkeypatch.setattr(caption_dropout_module, "drop_captions", spy)
    cfg = tiny_cfg("model=flux", f"data.path={root}", "data.builtin=null", "data.resolution=8", "data.channels=4",
                   "data.num_classes=2", "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0",
                   "train.caption_dropout=0.5", "train.label_dropout=0")
    assert train(cfg, tmp_path / "run")["final_step"] == 4
    assert len(seen) == 4 and all(mode == "empty" for *_, mode in seen)
    dropped = 0
    for cond, out, _ in seen:
        swapped = (out["text"] != cond["text"]).flatten(1).any(1)
        dropped += int(swapped.sum())
        assert (out["text"][swapped] == 0.5).all() and (out["pooled"][swapped] == -0.5).all()
        assert torch.equal(out["text"][~swapped], cond["text"][~swapped])
    assert 0 < dropped < 32
