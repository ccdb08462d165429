"""Validation videos (tread/evaluation/videos.py, validation.py, run_log.py) and sample.py's videos: a tiny Wan
(model.frames=3) samples the validation prompts as videos, one file each (mp4 through PyAV's libx264, or GIF
without it), read back with PyAV and compared with the decoded samples; the still grid; the trackers' copies
(TensorBoard's GIF image summary read with EventAccumulator, wandb's offline video file)."""
from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from PIL import Image

import tread.data.video as video_io
from conftest import TINY, compose_cfg
from test_trackers import board, wandb_history, wandb_records
from tread.cli.sample import run as sample_run
from tread.data import write_latent_dataset
from tread.schema.builders import build_diffusion, build_model
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.evaluation.images import make_captioned_grid, make_grid
from tread.evaluation.validation import ValidationPrompts
from tread.evaluation.videos import (DEFAULT_FPS, gif_bytes, slug, still_captions, still_indices, stills,
                                     video_fps)
from tread.sampling import Guidance
from tread.training.loop import train
from tread.training.trainer import Trainer
from tread.training.run_log import RunLog, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a red disc moving right", "A lime X, spinning!"]
FPS = 6.0
TOLERANCE = {"mp4": 8.0, "gif": 4.0}   # mean absolute error over 4x4-pixel blocks, in uint8 levels


def read_frames(path: Path) -> np.ndarray:
    """Every frame of a video file (or GIF bytes) as uint8 (F, H, W, 3), decoded by PyAV."""
    with av.open(io.BytesIO(path) if isinstance(path, bytes) else str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(float) - b.astype(float)).mean())


def blocks(frames: np.ndarray, side: int = 4) -> np.ndarray:
    """(F, H, W, 3) frames averaged over side x side pixel blocks."""
    f, h, w, c = frames.shape
    return frames.reshape(f, h // side, side, w // side, side, c).mean(axis=(2, 4))


def same_rate(path: Path, fps: float) -> bool:
    """Whether a file's frame rate is `fps`: to 1% (mp4), or its frame delay to a centisecond (GIF: 1/100 s units)."""
    with av.open(str(path)) as container:
        got = float(container.streams.video[0].average_rate)
    return abs(1 / got - 1 / fps) <= 0.0101 if str(path).endswith(".gif") else abs(got / fps - 1) < 0.01


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> Path:
    return save_tiny_text_encoders("wan", tmp_path_factory.mktemp("encoders"))


@pytest.fixture(scope="module")
def wan():
    """A tiny Wan (model.frames=3) and its diffusion, untrained (its samples are still deterministic videos)."""
    cfg = compose_cfg("train", TINY + ["model=wan", "data.frames=3"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    diffusion = build_diffusion(cfg.diffusion)
    return cfg, diffusion.precondition(model).eval(), diffusion


def wandb_offline(monkeypatch, root: Path) -> None:
    """wandb offline, quiet, its folders under `root`."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": root,
                        "WANDB_CONFIG_DIR": root / "wandb_config", "WANDB_CACHE_DIR": root / "wandb_cache",
                        "WANDB_DATA_DIR": root / "wandb_data"}.items():
        monkeypatch.setenv(name, str(value))


def video_dataset(frames: int = 3, fps=FPS) -> SimpleNamespace:
    """What ValidationPrompts reads of a dataset: identity-decoded (3, T, 16, 16) clips with text embeddings."""
    meta = {"shape": [3, frames, 16, 16], "decode": {"type": "identity"}, "latent_scale": 1.0, "num_classes": 1,
            "conditioning": {"text": {"family": "wan", "max_length": 16}}}
    if fps is not None:
        meta["video"] = {"frames": frames, "frame_stride": 1, "fps": fps, "temporal_factor": 1}
    return SimpleNamespace(meta=meta, shape=list(meta["shape"]), num_classes=1, buckets=None)


def validation(wan, encoders, dataset, per_prompt: int = 1) -> ValidationPrompts:
    net = wan[1]
    eval_cfg = compose_cfg("train", TINY + ["model=wan", f"eval.validation_prompts={PROMPTS}",
                                           f"eval.validation_per_prompt={per_prompt}", "eval.num_steps=2"]).eval
    return ValidationPrompts(eval_cfg, str(encoders), net.model, dataset, torch.device("cpu"))


@pytest.mark.parametrize("encoder", ["mp4", "gif"])
def test_validation_writes_a_video_per_prompt(wan, encoders, tmp_path, monkeypatch, encoder):
    """Each prompt's video holds the decoded sample's frames: exactly what write_video makes of them (decoded
    again), close to the samples themselves (codec tolerance), at the data's fps; the grid is their stills."""
    if encoder == "gif":
        monkeypatch.setattr(video_io, "video_encoder_available", lambda: False)
    elif not video_io.video_encoder_available():
        pytest.skip("PyAV has no libx264 here")
    _, net, diffusion = wan
    val = validation(wan, encoders, video_dataset())
    samples, captions = val.sample(net, diffusion, Guidance(), {})
    assert captions == PROMPTS and [tuple(s.shape) for s in samples] == [(3, 16, 16, 3)] * 2
    assert not torch.equal(samples[0][0], samples[0][2])        # frames differ: a video, not a repeated image
    record = val.save(samples, captions, 7, tmp_path / "samples")
    folder = tmp_path / "validation" / "step_0000007"
    names = [f"00_a_red_disc_moving_right.{encoder}", f"01_a_lime_x_spinning.{encoder}"]
    assert record["validation_videos"] == [str(folder / n) for n in names]
    assert sorted(p.name for p in folder.iterdir()) == names
    for path, sample in zip(record["validation_videos"], samples):
        got, want = read_frames(path), sample.numpy()
        assert got.shape == want.shape and same_rate(path, FPS)
        again = video_io.write_video(tmp_path / f"again.{encoder}", want, FPS)
        np.testing.assert_array_equal(got, read_frames(again))      # the writer's own encoding of these frames
        # lossy (yuv420p / one 256-colour palette, on noise-like samples of an untrained model): in 4x4 blocks
        # near these frames, and nearer them in this order than reversed
        error = [mean_error(blocks(got), blocks(x)) for x in (want, want[::-1])]
        assert error[0] < TOLERANCE[encoder] and error[0] < error[1] / 2
    grid = np.asarray(Image.open(record["validation_grid"]).convert("RGB"))
    cells = torch.cat([s[[0, 1, 2]] for s in samples])                  # first, middle, last of 3 frames
    labels = [t for c in captions for t in still_captions(c, 3)]
    assert record["validation_grid"] == str(tmp_path / "samples" / "validation_step_0000007.png")
    np.testing.assert_array_equal(grid, make_captioned_grid(cells, labels, nrow=3))


def test_fps_default_seeds_and_single_frames(wan, encoders, tmp_path):
    """Data without a video fps: DEFAULT_FPS; several seeds: one file per seed; one-frame data: images (no
    videos, the image grid)."""
    _, net, diffusion = wan
    val = validation(wan, encoders, video_dataset(fps=None), per_prompt=2)
    record = val.save(*val.sample(net, diffusion, Guidance(), {}), 1, tmp_path / "samples")
    assert [Path(p).stem for p in record["validation_videos"]] == [
        "00_a_red_disc_moving_right_seed0", "01_a_red_disc_moving_right_seed1", "02_a_lime_x_spinning_seed0",
        "03_a_lime_x_spinning_seed1"]
    assert same_rate(record["validation_videos"][0], DEFAULT_FPS)
    assert not np.array_equal(read_frames(record["validation_videos"][0]), read_frames(record["validation_videos"][1]))
    single = validation(wan, encoders, video_dataset(frames=1))
    samples, captions = single.sample(net, diffusion, Guidance(), {})
    assert [tuple(s.shape) for s in samples] == [(16, 16, 3)] * 2
    assert set(single.save(samples, captions, 2, tmp_path / "images")) == {"validation_grid"}


def test_slug_fps_and_stills():
    assert slug("A lime X, spinning!") == "a_lime_x_spinning" and slug("...") == "video"
    assert slug("word " * 20) == "word_word_word_word_word_word_word_word"
    assert video_fps({"video": {"fps": 12.5}}) == 12.5 and video_fps({}) == DEFAULT_FPS
    assert video_fps({"video": {"fps": None}}) == DEFAULT_FPS
    assert still_indices(17) == (0, 8, 16) and still_indices(2) == (0, 0, 1)
    video = torch.arange(17, dtype=torch.uint8)[:, None, None, None].expand(17, 2, 2, 3)
    assert stills(video)[:, 0, 0, 0].tolist() == [0, 8, 16]
    assert still_captions("a disc", 17) == ["a disc [first frame 1/17]", "a disc [middle frame 9/17]",
                                            "a disc [last frame 17/17]"]


def test_trackers_get_the_videos(tmp_path, monkeypatch):
    """RunLog.log_videos: TensorBoard holds each video as an animated-GIF image summary (the GIF's own bytes,
    or an mp4's frames as a GIF), wandb offline a video entry with the file itself."""
    wandb_offline(monkeypatch, tmp_path)
    frames = np.random.default_rng(0).integers(0, 256, (4, 10, 12, 3), dtype=np.uint8)
    frames[:, :5] = 40                                               # some flat area: not all noise
    paths = [video_io.write_video(tmp_path / "videos" / "00_disc.gif", frames, FPS),
             video_io.write_video(tmp_path / "videos" / "01_square.mp4", frames[::-1].copy(), FPS)]
    log = RunLog(tmp_path / "run", True, ["tensorboard"], {"mode": "offline"})
    log.log_videos("eval/validation_video", [str(p) for p in paths], 3)
    log.close()
    acc = board(tmp_path / "run")
    for path in paths:
        (event,) = acc.Images(f"eval/validation_video/{path.stem}")
        assert event.step == 3 and (event.width, event.height) == (12, 10)
        assert event.encoded_image_string == gif_bytes(path)
        shown = read_frames(event.encoded_image_string)
        assert shown.shape == (4, 10, 12, 3)
        if path.suffix == ".gif":
            assert event.encoded_image_string == path.read_bytes()
        else:   # the mp4's frames, palette-quantised
            assert np.abs(shown.astype(int) - read_frames(path).astype(int)).mean() < 16
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    row = wandb_history(wandb_records(run_file))[3]
    for path in paths:
        entry = row[f"eval/validation_video/{path.stem}"]
        assert entry["_type"] == "video-file"
        assert (run_file.parent / "files" / entry["path"]).read_bytes() == path.read_bytes()


def test_evaluation_logs_the_videos(wan, encoders, tmp_path, monkeypatch):
    """The loop's evaluate(): an evaluation record with validation videos puts them in metrics.jsonl and on
    TensorBoard (the grid as before), at the evaluation's step."""
    wandb_offline(monkeypatch, tmp_path)
    _, net, diffusion = wan
    val = validation(wan, encoders, video_dataset())
    record = {"type": "eval", "step": 4, "features": "toy", "num_samples": 0,
              **val.save(*val.sample(net, diffusion, Guidance(), {}), 4, tmp_path / "run" / "samples")}
    log = RunLog(tmp_path / "run", True, ["tensorboard"], {"mode": "offline"})
    run = SimpleNamespace(state=SimpleNamespace(step=4, train_sec=1.0), log=log, run_dir=tmp_path / "run",
                          parts=SimpleNamespace(ema=None, diffusion=None,
                                                accelerator=SimpleNamespace(is_main_process=True)),
                          evaluator=lambda *args: dict(record))
    Trainer.evaluate(run)
    log.close()
    (logged,) = read_metrics(tmp_path / "run")
    assert logged["validation_videos"] == record["validation_videos"] and len(logged["validation_videos"]) == 2
    acc = board(tmp_path / "run")
    assert [e.step for e in acc.Images("eval/validation")] == [4]
    for path in map(Path, record["validation_videos"]):
        (event,) = acc.Images(f"eval/validation_video/{path.stem}")
        assert event.step == 4 and read_frames(event.encoded_image_string).shape == (3, 16, 16, 3)


CAPTIONS = ["a red square moving right", "a blue square moving down"]


@pytest.fixture(scope="module")
def video_run(encoders, tmp_path_factory) -> Path:
    """A tiny Wan trained one step on 4 identity-decoded 3-frame clips (moving squares, 5 fps) with text."""
    root = tmp_path_factory.mktemp("video_run")
    labels = np.arange(4) % 2
    clips = np.full((4, 3, 3, 16, 16), -1.0, np.float32)
    for clip, label in zip(clips, labels):
        for t in range(3):
            y, x = (4, 2 + 4 * t) if label == 0 else (2 + 4 * t, 4)
            clip[2 * label, t, y:y + 6, x:x + 6] = 1.0                     # red or blue
    text = encode_prompts("wan", load_text_encoders("wan", str(encoders)), CAPTIONS, max_length=16)
    data = write_latent_dataset(root / "data", clips, labels, num_classes=2, dtype="float32",
                                extras={k: np.ascontiguousarray(v[labels]) for k, v in text.items()},
                                conditioning_meta={"text": {"family": "wan", "encoders": str(encoders),
                                                            "max_length": 16}},
                                video={"frames": 3, "frame_stride": 1, "fps": 5.0, "temporal_factor": 1})
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={root / 'cache'}", "model=wan", "data=latents", f"data.path={data}", "data.channels=3",
        "data.resolution=16", "data.frames=3", "data.num_classes=2", f"model.text_encoders={encoders}",
        "train.max_steps=1", "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, root / "run")
    return root / "run"


@pytest.mark.parametrize("prompts", [None, CAPTIONS[:1]], ids=["by-seed", "prompts"])
def test_sample_py_writes_videos(video_run, tmp_path, prompts):
    """sample.py on a video checkpoint: one video per sample (the frames of samples.npz, as write_video encodes
    them, at the data's 5 fps), the grid of their first, middle and last frames."""
    out = tmp_path / "out"
    overrides = [f"checkpoint={video_run}", "device=cpu", "num_steps=2", "seeds=0-1", f"out_dir={out}"]
    info = sample_run(compose_cfg("sample", overrides + ([f"prompts={prompts}"] if prompts else [])))
    frames = np.load(out / "samples.npz")["arr_0"]
    assert frames.shape == (2, 3, 16, 16, 3) and info["videos"] == str(out / "videos")
    names = ["000000", "000001"] if prompts is None else [f"00000{i}_a_red_square_moving_right" for i in (0, 1)]
    files = sorted((out / "videos").iterdir())
    assert [f.stem for f in files] == names and not (out / "images").exists()
    for path, want in zip(files, frames):
        again = video_io.write_video(tmp_path / f"again{path.suffix}", want, 5.0)
        np.testing.assert_array_equal(read_frames(path), read_frames(again))
        assert same_rate(path, 5.0)
    cells = torch.from_numpy(frames).flatten(0, 1)                      # 3 frames: all of them are stills
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    if prompts is None:
        np.testing.assert_array_equal(grid, make_grid(cells, nrow=3, upscale=4))
    else:
        labels = [t for _ in range(2) for t in still_captions(CAPTIONS[0], 3)]
        np.testing.assert_array_equal(grid, make_captioned_grid(cells, labels, nrow=3))
