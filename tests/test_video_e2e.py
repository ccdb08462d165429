"""Every video family end to end on clip files: decode (mp4, GIF, frame folders) -> precompute with the family's
video VAE (a tiny random one of the released class) -> train with routing -> sample.py writes videos. Wan also on
single-frame clips (T = 1: an image through the video path)."""
from __future__ import annotations

import numpy as np
import pytest

from tread.cli.precompute import main as precompute
from tread.cli.sample import run as sample_run
from tread.data import Bucket, LatentDataset
from tread.data.builtin.toy_clips import write_clip_files
from tread.training.loop import train
from conftest import TINY, compose_cfg
from test_video_vae import tiny_hunyuan, tiny_hunyuan10, tiny_ltx, tiny_ltx2, tiny_wan

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# family -> its pipeline's VAE class (Cosmos-Predict2 and WanVACE use the Wan 2.1 VAE, Kandinsky 5 HunyuanVideo
# 1.0's AutoencoderKLHunyuanVideo), tiny: spatial 4, temporal 4. A stand-in where precompute has no loader for the
# pipeline's own VAE class (the transformer takes any latent channels): MiniMax-H3 (AutoencoderKLMiniMaxH3, whose
# pipeline feeds it pixels normalised by its own pixel mean and std) a Wan VAE.
VAES = {"wan": tiny_wan, "ltx_video": tiny_ltx, "hunyuan_video": tiny_hunyuan, "cosmos": tiny_wan,
        "kandinsky5": tiny_hunyuan10, "ltx2": tiny_ltx2, "minimax_h3": tiny_wan, "wan_vace": tiny_wan}
ROUTE = "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 5}]"


def clips_to_latents(root, family: str, frames: int) -> LatentDataset:
    write_clip_files(root / "clips", [Bucket(32, 32, frames)], num_per_class=1, captions=False)
    VAES[family]().save_pretrained(root / "vae")
    precompute(["--videos", str(root / "clips"), "--out", str(root / "data"), "--vae", str(root / "vae"),
                "--frames", str(frames), "--resolution", "32", "--device", "cpu", "--workers", "0"])
    return LatentDataset(root / "data")


@pytest.mark.parametrize("family, frames", [*((f, 9) for f in VAES), ("wan", 1)],
                         ids=[*VAES, "wan-single-frame"])
def test_clips_train_and_sample_videos(family, frames, tmp_path):
    data = clips_to_latents(tmp_path, family, frames)
    c, t, h, w = data.shape
    assert (t, h, w) == (1 + (frames - 1) // 4, 8, 8) and len(data) == 10
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={tmp_path / 'cache'}", f"model={family}", "data=latents", f"data.path={data.root}",
        f"data.channels={c}", "data.resolution=8", f"data.frames={t}", "data.num_classes=10", ROUTE,
        "train.max_steps=2", "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, tmp_path / "run")
    out = tmp_path / "out"
    sample_run(compose_cfg("sample", [f"checkpoint={tmp_path / 'run'}", "device=cpu", "num_steps=2", "seeds=0-1",
                                      f"out_dir={out}"]))
    samples = np.load(out / "samples.npz")["arr_0"]
    if frames == 1:                 # a one-frame clip is an image: sample.py writes images
        assert samples.shape == (2, 32, 32, 3)
    else:
        assert samples.shape == (2, frames, 32, 32, 3)
        assert len(list((out / "videos").iterdir())) == 2
