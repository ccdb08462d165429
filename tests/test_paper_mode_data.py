"""The paper-code mode's data, decode and step numbering: data.latent_draw (sample | mean | stored) on the two
shard layouts (MaskDiT's 8-channel moments, the paper's 4-channel latents), eval.decode_rule=paper (its bf16 VAE
decode truncated to uint8) and train.step_offset (its eval/checkpoint after k * every + 1 updates)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import compose_cfg
from test_vae import make_tiny_vae
from test_wds import SHARD, moments, write_shard
from tread.data import LatentDatasetError, WebDatasetLatents, build_dataset, decode_to_uint8, draw_latents
from tread.encoders.vae import decode_raw_to_uint8, load_vae
from tread.schema.base import ConfigError
from tread.schema.train import check_train
from tread.checkpoint.files import list_checkpoints, step_of

pytestmark = pytest.mark.usefixtures("one_thread")


def shard_dir(tmp_path, x):
    root = tmp_path / f"wds{x.shape[1]}"
    root.mkdir()
    write_shard(root / SHARD.format(0), [(f"{i:07d}", x[i], i % 10) for i in range(len(x))])
    return root


def read(root, tmp_path, draw, **kw):
    ds = WebDatasetLatents(root, num_classes=10, index_dir=tmp_path / "index", latent_draw=draw, **kw)
    return ds, ds.__getitems__(range(len(ds)))[0]


def test_moments_shards_under_each_draw(tmp_path):
    m = moments(5)                                                   # (5, 8, 4, 4): MaskDiT's layout
    root = shard_dir(tmp_path, m)
    ds, x = read(root, tmp_path, "sample", expected_channels=4)     # raw moments; the training step draws
    assert torch.equal(x, torch.from_numpy(m)) and ds.meta["latent_kind"] == "moments" and ds.shape == (4, 4, 4)
    gen = torch.Generator().manual_seed(0)
    drawn = draw_latents(x, ds.meta, generator=gen)
    assert drawn.shape == (5, 4, 4, 4) and not torch.equal(drawn, draw_latents(x, ds.meta, mode="mean"))
    ds, x = read(root, tmp_path, "mean", expected_channels=4)
    assert torch.equal(x, torch.from_numpy(m[:, :4]) * 0.18215) and ds.meta["shape"] == [4, 4, 4]
    assert ds.meta["latent_kind"] == "sample" and torch.equal(draw_latents(x, ds.meta), x)   # no second draw
    ds, x = read(root, tmp_path, "stored", expected_channels=8)     # as stored: the model takes 8 channels
    assert torch.equal(x, torch.from_numpy(m)) and ds.shape == (8, 4, 4) and ds.meta["latent_kind"] == "sample"


def test_paper_four_channel_shards_load_as_stored(tmp_path):
    z = np.random.default_rng(0).standard_normal((5, 4, 4, 4)).astype(np.float32)   # the paper's: already scaled
    root = shard_dir(tmp_path, z)
    ds, x = read(root, tmp_path, "stored", expected_channels=4)
    assert torch.equal(x, torch.from_numpy(z)) and torch.equal(draw_latents(x, ds.meta), x)
    assert ds.meta["decode"]["scaling_factor"] == 0.18215           # decode divides by it, as the paper's does
    with pytest.raises(LatentDatasetError, match=r"has 2 channels \(shards hold \[4, 4, 4\] moments -> model shape "
                                                 r"\[2, 4, 4\]\) but the model expects "
                                                 r"in_channels=4 .* set data\.latent_draw \(stored: "):
        read(root, tmp_path, "sample", expected_channels=4)
    with pytest.raises(LatentDatasetError, match=r"latent_draw='mean' needs moments"):
        read(root, tmp_path, "mean", latent_kind="sample")
    cfg = compose_cfg("train", ["data=imagenet256_wds", f"data.path={root}", "data.channels=4", "data.resolution=4",
                                "data.num_classes=10", f"paths.cache_dir={tmp_path}", "repro=paper"])
    assert torch.equal(build_dataset(cfg.data).__getitems__(range(5))[0], torch.from_numpy(z))


def test_a_channel_count_that_fits_neither_layout_is_one_error(tmp_path):
    root = shard_dir(tmp_path, moments(3)[:, :6])
    for draw in ("sample", "stored"):
        with pytest.raises(LatentDatasetError, match=r"latent member '0000000\.latent\.npy' in shard '.*-0000\.tar' "
                                                     r"has shape \[6, 4, 4\], which fits neither layout .*channels=4; "
                                                     r"allowed: 8 channels .* or 4 "):
            read(root, tmp_path, draw, expected_channels=4)


def test_latent_draw_schema_and_our_directory_format(tiny_cfg, tmp_path):
    bad = compose_cfg("train", ["data=imagenet256_wds", "data.path=/x", "data.latent_kind=sample",
                                "data.latent_draw=mean", "eval.reference=/r"])
    with pytest.raises(ConfigError, match=r"^data\.latent_draw=mean needs moments data .*got sample"):
        check_train(bad)
    assert len(build_dataset(tiny_cfg("data.latent_draw=stored").data)) > 0     # plain latents: as stored
    with pytest.raises(LatentDatasetError, match=r"latent_draw=mean is not allowed .*plain latents.*sample or stored"):
        build_dataset(tiny_cfg("data.latent_draw=mean").data)


def test_paper_decode_is_bf16_and_truncates(tmp_path, monkeypatch):
    vae_dir = make_tiny_vae(tmp_path / "vae")
    meta = {"latent_scale": 0.5, "decode": {"type": "vae", "vae": str(vae_dir), "scaling_factor": 0.5}}
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    ours = decode_to_uint8(z, meta)
    assert torch.equal(ours, decode_raw_to_uint8(load_vae(str(vae_dir)), z / 0.5))          # ours unchanged
    seen = []
    real = torch.autocast.__init__

    def spy(self, device_type, *args, **kwargs):
        seen.append(device_type)
        real(self, device_type, *args, **kwargs)
    monkeypatch.setattr(torch.autocast, "__init__", spy)
    paper = decode_to_uint8(z, meta, rule="paper")
    assert seen == ["cpu"] and paper.dtype == torch.uint8 and paper.shape == ours.shape
    vae = load_vae(str(vae_dir), dtype="bfloat16")
    assert next(vae.parameters()).dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu"):
        x = vae.decode((z / 0.5).bfloat16()).sample.float()
    expect = (((x + 1) / 2).clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(paper, expect)
    rounded = (((x + 1) * 127.5).round().clamp(0, 255)).to(torch.uint8).permute(0, 2, 3, 1)
    assert (paper <= rounded).all() and (paper < rounded).any()      # truncation, never above rounding


def checkpoint_steps(run):
    return [step_of(p) for p in list_checkpoints(run)]


def test_step_offset_moves_eval_and_checkpoint_and_resume_continues(tiny_cfg, tmp_path, monkeypatch):
    from tread.training.loop import train
    from tread.training.trainer import Trainer
    evals = []
    monkeypatch.setattr(Trainer, "evaluate", lambda trainer: evals.append(trainer.state.step))
    keep = ["checkpoint.every_steps=2", "eval.every_steps=2", "eval.at_end=false", "checkpoint.keep_last=null"]
    train(tiny_cfg("train.max_steps=5", *keep), tmp_path / "ours")
    assert checkpoint_steps(tmp_path / "ours") == [2, 4, 5] and evals == [2, 4]
    evals.clear()
    train(tiny_cfg("train.max_steps=4", "train.step_offset=1", *keep), tmp_path / "paper")
    assert checkpoint_steps(tmp_path / "paper") == [3, 4] and evals == [3]
    train(tiny_cfg("train.max_steps=6", "train.step_offset=1", "resume=auto", *keep), tmp_path / "paper")
    assert checkpoint_steps(tmp_path / "paper") == [3, 4, 5, 6] and evals == [3, 5]
