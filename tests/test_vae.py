"""VAE loading (cached, offline-aware), encoding to moments, and decoding VAE latent data to pixels.

Every test uses a tiny randomly initialised AutoencoderKL saved to a temp dir; HF_HUB_OFFLINE=1 and a
blocked socket make sure nothing ever touches the network.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import tread.encoders.vae as vae_mod
from pixel_checks import assert_pixels_close
from tread.data import LatentDataset, LatentDatasetError, check_decodable, decode_to_uint8, draw_latents, \
    write_latent_dataset
from tread.encoders.errors import EncoderError
from tread.encoders.vae import clear_vae_cache, decode_raw_to_uint8, encode, load_vae


def make_tiny_vae(path, **overrides):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    config = dict(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                  norm_num_groups=4, sample_size=16, **overrides)
    AutoencoderKL(**config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    """A tiny VAE (4 latent channels, downsampling 2) on disk."""
    return make_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network: HF offline mode, and any socket connection fails loudly; a fresh VAE cache per test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError(f"a test tried to open a network connection: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)
    clear_vae_cache()
    yield
    clear_vae_cache()


def images(n=3, side=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def vae_meta(vae, shape=(4, 8, 8), kind="sample", scale=0.18215, **decode):
    meta = {"decode": {"type": "vae", "vae": str(vae), **decode}, "latent_scale": scale, "shape": list(shape)}
    if kind == "moments":
        meta.update(latent_kind="moments", shape=[2 * shape[0], *shape[1:]])
    return meta


def test_encode_kinds_match_the_posterior(vae_dir):
    vae = load_vae(str(vae_dir))
    x = images()
    dist = vae.encode(torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist
    moments = encode(vae, x)
    assert moments.shape == (3, 8, 8, 8) and moments.dtype == torch.float32
    torch.testing.assert_close(moments, torch.cat([dist.mean, dist.logvar], 1).detach())
    torch.testing.assert_close(encode(vae, x, kind="mean"), dist.mean.detach())
    floats = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1  # float NCHW in [-1, 1] works too
    torch.testing.assert_close(encode(vae, floats, kind="mean"), dist.mean.detach())
    s1 = encode(vae, x, kind="sample", generator=torch.Generator().manual_seed(1))
    s2 = encode(vae, x, kind="sample", generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(s1, s2)
    assert s1.shape == (3, 4, 8, 8) and not torch.allclose(s1, dist.mean)
    decoded = decode_raw_to_uint8(vae, dist.mean.detach())
    assert decoded.shape == (3, 16, 16, 3) and decoded.dtype == torch.uint8
    with pytest.raises(ValueError, match="allowed"):
        encode(vae, x, kind="mode")
    with pytest.raises(ValueError, match=r"\(B, H, W, 3\)"):
        encode(vae, x[..., :2])


def test_draw_mean_then_decode_equals_decoding_the_mean(vae_dir):
    vae = load_vae(str(vae_dir))
    moments = encode(vae, images())
    meta = vae_meta(vae_dir, kind="moments")
    z = draw_latents(moments, meta, mode="mean")
    torch.testing.assert_close(z, moments[:, :4] * 0.18215)
    expected = decode_raw_to_uint8(vae, moments[:, :4]).int()
    got = decode_to_uint8(z, meta).int()
    assert got.shape == (3, 16, 16, 3)
    assert (got - expected).abs().max() <= 1  # z / scale may differ from the mean in the last bit


def test_decode_batched_equals_unbatched_and_rounds_like_identity(vae_dir):
    meta = vae_meta(vae_dir)
    z = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    one_batch = decode_to_uint8(z, meta)
    assert one_batch.shape == (5, 16, 16, 3) and one_batch.dtype == torch.uint8
    # 2, 2, 1 latents per decode call against all 5 in one: other convolution shapes, which may round differently
    assert_pixels_close(decode_to_uint8(z, meta, batch_size=2), one_batch, what="decoded 2 per call vs 5")
    vae = load_vae(str(vae_dir))
    with torch.no_grad():                                         # the same decode call as one_batch's: exact
        pixels = vae.decode(z / 0.18215).sample
    torch.testing.assert_close(one_batch, ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                               .permute(0, 2, 3, 1), rtol=0, atol=0)


def test_shift_factor_is_undone_before_decoding(vae_dir):
    vae = load_vae(str(vae_dir))
    moments = encode(vae, images(2))
    meta = vae_meta(vae_dir, kind="moments", shift_factor=0.5)
    z = draw_latents(moments, meta, mode="mean")
    torch.testing.assert_close(z, (moments[:, :4] - 0.5) * 0.18215)
    want = decode_raw_to_uint8(vae, z / 0.18215 + 0.5)
    torch.testing.assert_close(decode_to_uint8(z, meta), want, rtol=0, atol=0)


def test_override_path_subfolder_and_bf16(vae_dir, tmp_path):
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    want = decode_to_uint8(z, vae_meta(vae_dir))
    offline_meta = vae_meta("stabilityai/sd-vae-ft-ema")  # not available here: the override supplies it
    torch.testing.assert_close(decode_to_uint8(z, offline_meta, vae=str(vae_dir)), want, rtol=0, atol=0)
    check_decodable(offline_meta, vae=str(vae_dir))
    # A whole "pipeline repo" with the VAE in vae/: meta's subfolder applies to a copy of the repo, and is
    # ignored when the override points at the VAE folder itself.
    repo = tmp_path / "pipeline"
    make_tiny_vae(repo / "vae")
    sub_meta = vae_meta("org/pipeline", subfolder="vae")
    torch.testing.assert_close(decode_to_uint8(z, sub_meta, vae=str(repo)), want, rtol=0, atol=0)
    torch.testing.assert_close(decode_to_uint8(z, sub_meta, vae=str(repo / "vae")), want, rtol=0, atol=0)
    bf16 = decode_to_uint8(z, vae_meta(vae_dir), vae_dtype="bfloat16")
    assert bf16.shape == want.shape and bf16.dtype == torch.uint8
    assert (bf16.int() - want.int()).abs().float().mean() < 8
    assert next(load_vae(str(vae_dir), dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(EncoderError, match=r"VAE dtype 'float64'.*'float32', 'bfloat16', 'float16'"):
        check_decodable(vae_meta(vae_dir), vae_dtype="float64")


def test_vae_is_loaded_once_per_process(vae_dir, monkeypatch):
    from diffusers import AutoencoderKL

    calls = []
    real = AutoencoderKL.from_pretrained
    monkeypatch.setattr(AutoencoderKL, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    meta = vae_meta(vae_dir)
    check_decodable(meta)  # start-up check loads it
    z = torch.zeros(1, 4, 8, 8)
    for _ in range(3):
        decode_to_uint8(z, meta)
    decode_to_uint8(z, meta, vae_dtype="bfloat16")  # another dtype: a copy, not another read
    assert len(calls) == 1
    assert load_vae(str(vae_dir)) is load_vae(str(vae_dir) + "/")  # same directory, same cached model
    assert not any(p.requires_grad for p in load_vae(str(vae_dir)).parameters())
    assert not load_vae(str(vae_dir)).training


def test_missing_vae_fails_fast_with_instructions(tmp_path, monkeypatch):
    how_to = r"hf download .*--local-dir.*save_pretrained.*vae=.*eval\.vae=.*HF_HOME"
    with pytest.raises(EncoderError, match=rf"VAE directory '{tmp_path}/nope' does not exist.*{how_to}"):
        load_vae(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EncoderError, match=rf"'{tmp_path}/empty'.*not a loadable AutoencoderKL.*{how_to}"):
        load_vae(str(tmp_path / "empty"))
    with pytest.raises(EncoderError, match=rf"'tread-test/no-such-vae'.*HF_HUB_OFFLINE.*hf download "
                                                 rf"tread-test/no-such-vae --local-dir.*HF_HOME"):
        load_vae("tread-test/no-such-vae")
    # Start-up checks fail before any sampling, naming the data's VAE (a data error: the data's decoder is missing).
    with pytest.raises(LatentDatasetError, match=r"decode\.type='vae', vae='tread-test/no-such-vae'.*HF_HUB_OFFLINE"):
        check_decodable(vae_meta("tread-test/no-such-vae"))
    # Network allowed but unreachable: a quick probe, not huggingface_hub's retries.
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import (conftest sets it for all tests)
    monkeypatch.setattr(vae_mod, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(EncoderError, match=r"cannot be reached \(no network\)"):
        load_vae("tread-test/no-such-vae")


def test_check_decodable_catches_channel_mismatch(vae_dir):
    with pytest.raises(LatentDatasetError, match=r"3-channel latents.*takes 4 channels"):
        check_decodable(vae_meta(vae_dir, shape=(3, 8, 8)))
    check_decodable(vae_meta(vae_dir, kind="moments"))  # 8 stored channels = 4-channel latents
    with pytest.raises(EncoderError, match=r"takes \(B, 4, h, w\) latents"):
        decode_to_uint8(torch.zeros(1, 3, 8, 8), vae_meta(vae_dir))


@pytest.mark.parametrize("decode, message", [
    ({"type": "vae", "vae": ""}, r"the VAE name is missing"),
    ({"type": "vae", "vae": "a/b", "subfolder": 3}, r"'decode\.subfolder' is 3 but must be null or a non-empty"),
    ({"type": "vae", "vae": "a/b", "scaling_factor": -1}, r"'decode\.scaling_factor' is -1 .* > 0"),
    ({"type": "vae", "vae": "a/b", "shift_factor": "x"}, r"'decode\.shift_factor' is 'x' .* finite number"),
])
def test_vae_decode_meta_is_validated(tmp_path, decode, message):
    with pytest.raises(LatentDatasetError, match=message):
        write_latent_dataset(tmp_path / "ds", np.zeros((2, 4, 2, 2)), np.zeros(2, int), num_classes=1,
                             decode=decode)


def test_vae_dataset_round_trip(tmp_path, vae_dir):
    decode = {"type": "vae", "vae": str(vae_dir), "subfolder": None, "scaling_factor": 0.18215,
              "shift_factor": None}
    path = write_latent_dataset(tmp_path / "ds", np.zeros((2, 8, 8, 8)), np.zeros(2, int), num_classes=1,
                                latent_scale=0.18215, decode=decode, extra_meta={"latent_kind": "moments"})
    ds = LatentDataset(path)
    check_decodable(ds.meta)
    assert decode_to_uint8(draw_latents(ds.__getitems__([0, 1])[0], ds.meta), ds.meta).shape == (2, 16, 16, 3)
