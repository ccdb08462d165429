"""A bucketed dataset checked whole, keys accepted and ignored or wrongly refused, tracker folders, FDD's weights and
resolution phases (issue 43), as bad-input cases: a bucketed meta.json that disagrees with its buckets (a bucket
listed twice, a wrong image_size or vae_factor, a folder whose own meta.json says another shape, a crops file
missing or of other rows); a key only another key reads, set without it (train.i2v_probability, diffusion.mode_scale,
P_mean, P_std); data.frames named as set (not as model.frames, which takes it); data.latent_draw's values; a
TensorBoard or wandb folder of the run dir that is a file; truncated DINOv2 weights for FDD; a resolution phase (or
a run) whose data holds no full batch. Each is refused with one `error:` line before any work (the rules:
tests/bad_input_table.py); a read-only tracker folder is refused by the same check (test_read_only_tracker_folder)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from transformers import Dinov2Config, Dinov2Model

from bad_input_table import refused, train
from tread.cli.writable_dirs import tracker_dir_problem
from tread.data import Bucket, write_bucketed_dataset
from tread.data.builtin.toy import TOY_CLASS_NAMES, generate_toy_shapes

pytestmark = pytest.mark.slow   # ~30 program runs in the harness beside the other tables

Setup = Callable[[Path, dict], Any]
SIZES = {"16x16": 1, "24x16": 1, "32x32": 3}        # bucket -> images per class (10 classes)


# ----------------------------------------------------------------------------- a bucketed dataset, edited

def write_buckets(root: Path) -> None:
    """The toy shapes in three buckets (10, 10 and 30 samples), identity latents (vae_factor 1)."""
    parts = []
    for k, (name, n) in enumerate(SIZES.items()):
        width, height = map(int, name.split("x"))
        images, labels = generate_toy_shapes(n, (height, width), k)[:2]
        parts.append({"bucket": Bucket(height, width), "latents": images.numpy(), "labels": labels.numpy()})
    write_bucketed_dataset(root, parts, num_classes=len(TOY_CLASS_NAMES), class_names=TOY_CLASS_NAMES,
                           dtype="float16")


def top_meta(change: Callable[[dict], Any], file: str = "meta.json") -> Callable[[Path], Any]:
    def edit(root: Path) -> None:
        meta = json.loads((root / file).read_text())
        change(meta)
        (root / file).write_text(json.dumps(meta))
    return edit


def buckets_copy(edit: Callable[[Path], Any]) -> Setup:
    """A setup: the bucketed dataset written as {out}/ds, then edited."""
    def setup(out: Path, places: dict) -> None:
        write_buckets(out / "ds")
        edit(out / "ds")
    return setup


def bucketed(id: str, edit: Callable[[Path], Any], *needles: str, args: tuple[str, ...] = ()) -> Any:
    return train(f"buckets_{id}", "data=toy_buckets", "data.builtin=null", "data.path={out}/ds", *args,
                 setup=buckets_copy(edit), needles=needles)


def rename_bucket(root: Path) -> None:
    """Bucket 24x16's folder renamed 640x480, the top meta.json saying 640x480 throughout: its own meta.json says
    [3, 16, 24] latents."""
    (root / "24x16").rename(root / "640x480")
    top_meta(lambda m: m["buckets"][1].update(name="640x480", path="640x480", image_size=[480, 640],
                                              crops="640x480/crops.npy"))(root)


def crops_rows(rows: int) -> Callable[[Path], Any]:
    return lambda root: np.save(root / "24x16" / "crops.npy", np.zeros((rows, 6), np.int32))


OWN = "'{out}/ds/24x16/meta.json' says latents of shape [3, 16, 24]"
BUCKET_CASES = [
    bucketed("listed_twice", top_meta(lambda m: m["buckets"].append(dict(m["buckets"][0]))),
             "{out}/ds/meta.json: buckets[0] and buckets[3] both have name '16x16'", "each bucket is listed once"),
    bucketed("folder_listed_twice", top_meta(lambda m: m["buckets"][2].update(path="16x16")),
             "{out}/ds/meta.json: buckets[0] and buckets[2] both have path '16x16'"),
    bucketed("image_size_not_its_name", top_meta(lambda m: m["buckets"][1].update(image_size=[48, 64])),
             "{out}/ds/meta.json: buckets[1] has name '24x16' but image_size [48, 64]", "which is bucket '64x48'"),
    bucketed("image_size_not_its_latents", top_meta(lambda m: m["buckets"][1].update(image_size=[48, 64],
                                                                                      name="64x48")),
             OWN, "at vae_factor 1 is image_size [16, 24]",
             "buckets[1] '64x48' of '{out}/ds/meta.json' says image_size [48, 64]"),
    bucketed("folder_says_640x480", rename_bucket,
             "'{out}/ds/640x480/meta.json' says latents of shape [3, 16, 24]", "says image_size [480, 640]"),
    bucketed("vae_factor_wrong", top_meta(lambda m: m.update(vae_factor=8)),
             "'{out}/ds/16x16/meta.json' says latents of shape [3, 16, 16], which at vae_factor 8 is image_size "
             "[128, 128]"),
    bucketed("vae_factor_missing", top_meta(lambda m: m.pop("vae_factor")),
             "{out}/ds/meta.json: key 'vae_factor' is None but must be a positive integer"),
    bucketed("frames_on_an_image_bucket", top_meta(lambda m: m["buckets"][0].update(frames=5)),
             "buckets[0] has name '16x16' but image_size [16, 16] and frames 5", "which is bucket '16x16x5'"),
    bucketed("num_samples_differ", top_meta(lambda m: m["buckets"][1].update(num_samples=99)),
             "bucket '24x16' at '{out}/ds/24x16' holds 10 samples but '{out}/ds/meta.json' says 99"),
    bucketed("crops_deleted", lambda root: (root / "24x16" / "crops.npy").unlink(),
             "missing crops file '{out}/ds/24x16/crops.npy' of buckets[1] '24x16'"),
    bucketed("crops_rows", crops_rows(3), "'{out}/ds/24x16/crops.npy' holds a int32 array of shape [3, 6] but must be "
             "integer of shape [10, 6]"),
    bucketed("crops_outside", top_meta(lambda m: m["buckets"][1].update(crops="../crops.npy")),
             "{out}/ds/meta.json: buckets[1] is", "'crops' is a file path inside the dataset folder"),
    bucketed("bucket_latent_scale_differs", top_meta(lambda m: m.update(latent_scale=2.0), "24x16/meta.json"),
             "buckets '16x16' and '24x16' of '{out}/ds' differ in latent_scale"),
]


# ----------------------------------------------------------------------------- resolution phases, batches

SCHEDULE = "data.resolution_schedule=[{{until_step:2,max_pixels:256}},{{until_step:null}}]"
PHASE_CASES = [
    bucketed("phase_without_a_full_batch", lambda root: None,
             "data.resolution_schedule[0] ({{'until_step': 2, 'max_pixels': 256}}) draws from bucket(s) 16x16 "
             "(10 samples) of '{out}/ds'", "so a bucket needs at least 16 samples", "lower train.batch_size",
             args=(SCHEDULE, "train.batch_size=16")),
    bucketed("no_bucket_with_a_full_batch", lambda root: None, "no bucket has a batch",
             "the per-process batch size (from train.batch_size) is 64", args=("train.batch_size=64",)),
    bucketed("phase_without_buckets", lambda root: None, "data.resolution_schedule[0]", "selects no bucket of "
             "'{out}/ds'", args=("data.resolution_schedule=[{{until_step:null,min_pixels:100000}}]",)),
    train("batch_beyond_the_data", "train.batch_size=1000",
          needles=("the per-process batch size (from train.batch_size) is 1000", "only 400 of the dataset's 400")),
]


# ----------------------------------------------------------------------------- keys read only with another

KEY_CASES = [
    train("i2v_probability_without_i2v", "train.i2v_probability=0.5",
          needles=("train.i2v_probability=0.5 is read with model.i2v=true only", "model._target_=tread.models."
                   "build_dit (no model.i2v)", "or train.i2v_probability left at 1.0")),
    train("i2v_probability_with_i2v_false", "model=wan", "train.i2v_probability=0.25",
          needles=("train.i2v_probability=0.25 is read with model.i2v=true only", "model.i2v=false trains none")),
    train("mode_scale_with_logit_normal", "diffusion=rf", "diffusion.mode_scale=1.5",
          needles=("diffusion.mode_scale=1.5 is read with diffusion.weighting_scheme=mode only",
                   "diffusion.weighting_scheme=logit_normal ignores it", "diffusion.mode_scale left at 1.29")),
    train("mode_scale_with_cosmap", "diffusion=rf", "diffusion.weighting_scheme=cosmap", "diffusion.mode_scale=0.5",
          needles=("diffusion.mode_scale=0.5 is read with diffusion.weighting_scheme=mode only",
                   "diffusion.weighting_scheme=cosmap ignores it")),
    train("p_mean_with_mode", "diffusion=rf", "diffusion.weighting_scheme=mode", "diffusion.P_mean=-0.5",
          needles=("diffusion.P_mean=-0.5 is read with diffusion.weighting_scheme=logit_normal only",
                   "diffusion.weighting_scheme=mode ignores it")),
    train("p_std_with_uniform", "diffusion=rf", "diffusion.weighting_scheme=uniform", "diffusion.P_std=2.0",
          needles=("diffusion.P_std=2.0 is read with diffusion.weighting_scheme=logit_normal only",)),
    train("data_frames_zero_as_set", "model=wan", "data.frames=0", needles=("data.frames=0 is not allowed",)),
    train("latent_draw_mean_on_latents", "data.latent_draw=mean",
          needles=("data.latent_draw=mean is not allowed with data.format=latents", "allowed: sample")),
    train("latent_draw_unknown", "data.latent_draw=posterior",
          needles=("data.latent_draw='posterior' is not allowed", "sample")),
]


# ----------------------------------------------------------------------------- tracker folders, FDD's weights

def in_run_dir(name: str) -> Setup:
    """A setup: {out}/run (the case's run dir) holding a file where a tracker writes its folder."""
    def setup(out: Path, places: dict) -> None:
        (out / "run").mkdir(parents=True)
        (out / "run" / name).write_text("not a folder")
    return setup


def dino(cut: Callable[[int], int]) -> Setup:
    """A setup: a tiny DINOv2 folder {out}/dino whose model.safetensors is cut to cut(size) bytes."""
    def setup(out: Path, places: dict) -> None:
        torch.manual_seed(0)
        config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                              patch_size=14, image_size=224)
        Dinov2Model(config).save_pretrained(out / "dino")
        weights = out / "dino" / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(cut(weights.stat().st_size))
    return setup


FDD = ("eval.metrics=[fid,fdd]", "eval.dinov2_weights={out}/dino")
FILE_CASES = [
    train("tensorboard_folder_is_a_file", "train.log_with=[tensorboard]", setup=in_run_dir("tensorboard"),
          needles=("train.log_with=['tensorboard'] logs tensorboard into '{out}/run/tensorboard'",
                   "it is a file, not a folder")),
    train("wandb_folder_is_a_file", "wandb.mode=offline", setup=in_run_dir("wandb"),
          needles=("wandb.mode=offline logs wandb into '{out}/run/wandb'", "it is a file, not a folder",
                   "wandb.mode=disabled")),
    train("fdd_weights_truncated", *FDD, setup=dino(lambda n: n // 2),
          needles=("eval.dinov2_weights='{out}/dino': '{out}/dino/model.safetensors' is not a whole safetensors file",
                   "Dinov2Model.from_pretrained('facebook/dinov2-large').save_pretrained('DIR')")),
    train("fdd_weights_empty", *FDD, setup=dino(lambda n: 0),
          needles=("'{out}/dino/model.safetensors' is not a whole safetensors file", "header too small")),
    train("fdd_weights_header_cut", *FDD, setup=dino(lambda n: 5),
          needles=("'{out}/dino/model.safetensors' is not a whole safetensors file",)),
    train("fdd_weights_without_config", *FDD, setup=lambda out, places: (out / "dino").mkdir(),
          needles=("eval.dinov2_weights='{out}/dino' is not a saved Dinov2Model folder (no config.json there)",)),
]

CASES = BUCKET_CASES + PHASE_CASES + KEY_CASES + FILE_CASES


def test_the_table_is_big_enough():
    assert len(CASES) >= 20
    assert len(BUCKET_CASES) >= 8 and len(KEY_CASES) >= 5 and len(FILE_CASES) >= 4 and len(PHASE_CASES) >= 2


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)


@pytest.fixture
def read_only_folder(tmp_path):
    """tmp_path/run/tensorboard that no file can be made in: a tmpfs mounted read-only (root writes through
    permissions), else chmod 0o555; skipped where files can still be made in it."""
    folder = tmp_path / "run" / "tensorboard"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:
        folder.chmod(0o555)
    try:
        if _writable(folder):
            pytest.skip("cannot make a read-only folder here (root, and no tmpfs mount)")
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        else:
            folder.chmod(0o755)


def _writable(folder: Path) -> bool:
    try:
        (folder / "probe").write_text("")
    except OSError:
        return False
    (folder / "probe").unlink()
    return True


def test_read_only_tracker_folder(read_only_folder):
    """A read-only <run>/tensorboard is found by the start-up check (train.py's callback says it in one line); a
    tracker folder still to be made is the run dir's own check."""
    found = tracker_dir_problem(read_only_folder.parent, ["tensorboard"])
    assert found is not None and found[0] == "tensorboard" and "no file can be made in it" in found[1], found
    assert tracker_dir_problem(read_only_folder.parent, ["wandb"]) is None
