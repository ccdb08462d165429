"""Video VAEs (tread/encoders/vae.py, video part) on tiny randomly initialised diffusers models: latent frame
counts, the model-space normalisation against each family's pipeline code, decoding, loading by class, and the
frame-count rule; and video VAE data decoded through meta (tread/data/decode.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15, AutoencoderKLLTX2Video,
                       AutoencoderKLLTXVideo, AutoencoderKLWan, HunyuanVideo15ImageToVideoPipeline, LTX2Pipeline,
                       LTXPipeline, WanImageToVideoPipeline)
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from PIL import Image

from pixel_checks import assert_pixels_close

from tread.data.decode import check_decodable, decode_to_uint8
from tread.data.meta import LatentDatasetError, validate_meta
from tread.encoders.errors import EncoderError
from tread.encoders.vae import (VIDEO_VAE_CLASSES, check_frame_count, clear_vae_cache, decode_video, encode_video,
                                from_model_space, load_vae, to_model_space, video_vae_info)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_wan(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                            scale_factor_temporal=4, scale_factor_spatial=4).eval()


def tiny_ltx(seed: int = 0, timestep_conditioning: bool = False) -> AutoencoderKLLTXVideo:
    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=1,
        patch_size_t=1, scaling_factor=0.9, timestep_conditioning=timestep_conditioning).eval()
    vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))   # the real VAE's statistics are buffers, not config
    vae.latents_std.copy_(torch.linspace(0.5, 2.0, 8))
    return vae


def tiny_hunyuan(seed: int = 0) -> AutoencoderKLHunyuanVideo15:
    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 16), layers_per_block=1,
                                       spatial_compression_ratio=4, temporal_compression_ratio=4,
                                       scaling_factor=1.03682).eval()


def tiny_hunyuan10(seed: int = 0) -> AutoencoderKLHunyuanVideo:
    """Kandinsky 5's video VAE class (HunyuanVideo 1.0's)."""
    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 16), layers_per_block=1,
                                     down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                                     up_block_types=("HunyuanVideoUpBlock3D",) * 3, norm_num_groups=4,
                                     spatial_compression_ratio=4, temporal_compression_ratio=4,
                                     scaling_factor=0.476986).eval()


def tiny_ltx2(seed: int = 0) -> AutoencoderKLLTX2Video:
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8), down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 8), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False,) * 3, downsample_type=("spatiotemporal",) * 2,
        upsample_type=("spatiotemporal",) * 2, upsample_residual=(False, False), upsample_factor=(1, 1), patch_size=1,
        patch_size_t=1, scaling_factor=0.8).eval()
    vae.latents_mean.copy_(torch.linspace(-0.4, 0.6, 8))
    vae.latents_std.copy_(torch.linspace(0.6, 1.8, 8))
    return vae


TINY = {"AutoencoderKLWan": tiny_wan, "AutoencoderKLLTXVideo": tiny_ltx, "AutoencoderKLHunyuanVideo15": tiny_hunyuan,
        "AutoencoderKLHunyuanVideo": tiny_hunyuan10, "AutoencoderKLLTX2Video": tiny_ltx2}


def clips(batch: int = 2, frames: int = 9, side: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, frames, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("cls", VIDEO_VAE_CLASSES)
def test_encode_gives_one_latent_frame_per_temporal_factor(cls):
    vae = TINY[cls]()
    info = video_vae_info(vae)
    assert (info["class"], info["temporal_factor"], info["spatial_factor"]) == (cls, 4, 4)
    for frames in (1, 5, 9):
        raw = encode_video(vae, clips(2, frames), kind="mean")
        assert raw.shape == (2, vae.config.get("z_dim") or vae.config.latent_channels, 1 + (frames - 1) // 4, 4, 4)
        assert raw.dtype == torch.float32
    mean = encode_video(vae, clips(), "mean")
    draw = encode_video(vae, clips(), "sample", generator=torch.Generator().manual_seed(1))
    again = encode_video(vae, clips(), "sample", generator=torch.Generator().manual_seed(1))
    assert torch.equal(draw, again) and not torch.allclose(draw, mean)
    one = clips()[:1]                                 # (HunyuanVideo 1.5's VAE encodes one clip per call)
    assert torch.allclose(mean[:1], vae.encode(one).latent_dist.mode(), atol=1e-5)   # the pipelines' argmax


def test_ltx_normalisation_is_the_pipelines():
    vae = tiny_ltx()
    info = video_vae_info(vae)
    assert info["scaling_factor"] == pytest.approx(0.9) and info["latents_mean"] == pytest.approx(
        torch.linspace(-0.5, 0.5, 8).tolist())
    raw = encode_video(vae, clips())
    model = to_model_space(raw, info)
    expected = LTXPipeline._normalize_latents(raw, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    assert torch.allclose(model, expected, rtol=1e-6, atol=1e-6) and model.std() > 0
    back = LTXPipeline._denormalize_latents(model, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    assert torch.allclose(from_model_space(model, info), back, rtol=1e-6, atol=1e-6)
    assert torch.allclose(back, raw, atol=1e-5)


def test_ltx2_normalisation_is_the_pipelines():
    vae = tiny_ltx2()
    info = video_vae_info(vae)
    raw = encode_video(vae, clips())
    model = to_model_space(raw, info)
    expected = LTX2Pipeline._normalize_latents(raw, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(model, expected)
    assert (model - raw).abs().max() > 0.05
    back = LTX2Pipeline._denormalize_latents(model, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(from_model_space(model, info), back)


def test_kandinsky5_normalisation_is_the_pipelines():
    """Kandinsky5I2VPipeline encodes its image as latent_dist.sample(generator) * scaling_factor and the video
    pipelines decode latents / scaling_factor: model space is raw * scaling_factor, as for HunyuanVideo 1.5."""
    vae = tiny_hunyuan10()
    info = video_vae_info(vae)
    assert info["scaling_factor"] == pytest.approx(0.476986) and info["latents_mean"] is None
    raw = encode_video(vae, clips())
    torch.testing.assert_close(to_model_space(raw, info), raw * vae.config.scaling_factor)
    torch.testing.assert_close(from_model_space(raw * vae.config.scaling_factor, info), raw)


def test_wan_normalisation_is_the_pipelines():
    """WanImageToVideoPipeline.prepare_latents (expand_timesteps: the image alone) normalises the encoded image as
    model space: the same numbers as to_model_space(encode_video(...))."""
    vae = tiny_wan()
    image = clips(1, 1)[:, :, 0]                                            # (1, 3, H, W) in [-1, 1]
    pipe = SimpleNamespace(vae=vae, config=SimpleNamespace(expand_timesteps=True), vae_scale_factor_temporal=4,
                           vae_scale_factor_spatial=4)
    _, condition, _ = WanImageToVideoPipeline.prepare_latents(
        pipe, image, 1, 4, 16, 16, 9, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    ours = to_model_space(encode_video(vae, image[:, :, None]), video_vae_info(vae))
    assert ours.shape == condition.shape == (1, 4, 1, 4, 4)
    assert torch.allclose(ours, condition, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, encode_video(vae, image[:, :, None]))  # the normalisation does something


def test_hunyuan_normalisation_is_the_pipelines():
    vae = tiny_hunyuan()
    pixels = ((clips(1, 1)[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=4, do_resize=False)
    expected = HunyuanVideo15ImageToVideoPipeline._get_image_latents(vae, processor, Image.fromarray(pixels), 16, 16,
                                                                     torch.device("cpu"))
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    ours = to_model_space(encode_video(vae, x), video_vae_info(vae))
    assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-5)
    assert video_vae_info(vae)["latents_mean"] is None and video_vae_info(vae)["scaling_factor"] == pytest.approx(
        1.03682)


@pytest.mark.parametrize("cls", VIDEO_VAE_CLASSES)
def test_decode_round_trip_shape_and_values(cls):
    vae = TINY[cls]()
    info = video_vae_info(vae)
    model = to_model_space(encode_video(vae, clips(3, 5)), info)
    video = decode_video(vae, model, info, batch_size=2)
    assert video.shape == (3, 5, 16, 16, 3) and video.dtype == torch.uint8
    with torch.no_grad():                                                       # the pipelines' decode, clip by clip
        direct = torch.cat([vae.decode(z[None]).sample for z in from_model_space(model, info)])
    expected = ((direct + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert torch.equal(decode_video(vae, model, info), expected)     # batch_size=1: the same decode calls, bit for bit
    # batch_size=2 decodes clips 0-1 in one call: other convolution shapes, so float32 rounding may differ
    assert_pixels_close(video, expected, what=f"{cls} decoded 2 clips per call vs 1")
    with pytest.raises(EncoderError, match=r"takes \(B, \d+, T, h, w\) latents, got shape \[3, 2, 2, 4, 4\]"):
        decode_video(vae, model[:, :2], info)


def test_ltx_timestep_conditioning_decodes_at_timestep_zero():
    vae = tiny_ltx(timestep_conditioning=True)
    info = video_vae_info(vae)
    model = to_model_space(encode_video(vae, clips(1, 5)), info)
    with torch.no_grad():                                                     # as decode_video: the same decode call
        direct = vae.decode(from_model_space(model, info), temb=torch.zeros(1)).sample
    expected = ((direct + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert torch.equal(decode_video(vae, model, info), expected)


def test_frame_count_rule():
    for ok in (1, 5, 9, 17):
        check_frame_count(ok, 4)
    check_frame_count(8, 1)
    with pytest.raises(EncoderError, match=r"a clip of 8 frames does not suit a VAE of temporal factor 4: allowed "
                                           r"1 \+ k \* 4 frames \(1, 5, 9, \.\.\.\), e\.g\. 5 or 9"):
        check_frame_count(8, 4)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(EncoderError, match="does not suit"):
            check_frame_count(bad, 4)
    vae = tiny_wan()
    with pytest.raises(EncoderError, match="a clip of 8 frames"):
        encode_video(vae, clips(1, 8))
    with pytest.raises(EncoderError, match=r"18x18 \(WxH\) do not suit AutoencoderKLWan: .* multiples of its spatial "
                                           r"factor 4"):
        encode_video(vae, clips(1, 5, 18))
    with pytest.raises(EncoderError, match=r"clips must be float \(B, 3, F, H, W\)"):
        encode_video(vae, clips(1, 5)[:, :2])


@pytest.mark.parametrize("cls", ["AutoencoderKLWan", "AutoencoderKLLTXVideo"])
def test_load_by_class_keeps_the_normalisation(cls, tmp_path):
    vae = TINY[cls]()
    vae.save_pretrained(tmp_path / "vae")
    clear_vae_cache()
    loaded = load_vae(str(tmp_path / "vae"), cls=cls)
    assert type(loaded).__name__ == cls and not loaded.training
    assert video_vae_info(loaded) == video_vae_info(vae)
    assert load_vae(str(tmp_path / "vae"), cls=cls) is loaded
    with pytest.raises(EncoderError, match=r"VAE class 'AutoencoderKLMochi' is not supported; allowed: "):
        load_vae(str(tmp_path / "vae"), cls="AutoencoderKLMochi")
    with pytest.raises(EncoderError, match="AutoencoderKL is not a video VAE"):
        from diffusers import AutoencoderKL
        video_vae_info(AutoencoderKL(block_out_channels=(8,), norm_num_groups=8))
    clear_vae_cache()


def video_meta(decode: dict, shape=(4, 3, 4, 4), frames: int = 9, temporal_factor: int = 4) -> dict:
    return {"format": "tread-latents", "version": 1, "shape": list(shape), "dtype": "float32", "num_samples": 2,
            "num_classes": 1, "latent_scale": 1.0, "decode": decode, "source": "test", "class_names": None,
            "files": {"latents": "latents.npy", "labels": "labels.npy"},
            "video": {"frames": frames, "frame_stride": 1, "fps": 24.0, "temporal_factor": temporal_factor}}


def test_video_vae_data_decodes_through_meta(tmp_path):
    vae = tiny_wan()
    vae.save_pretrained(tmp_path / "vae")
    decode = {**video_vae_info(vae), "vae": str(tmp_path / "vae"), "subfolder": None}
    meta = validate_meta(video_meta(decode), "meta.json")
    clear_vae_cache()
    check_decodable(meta)
    model = to_model_space(encode_video(vae, clips(2, 9)), decode)
    # the same computation both ways (2 clips per decode call): bit for bit; decode_to_uint8's default of 32 clips
    # per call against decode_video's 1 would be other convolution shapes, whose float32 rounding may differ
    assert torch.equal(decode_to_uint8(model, meta, batch_size=2), decode_video(vae, model, decode, batch_size=2))
    assert_pixels_close(decode_to_uint8(model, meta), decode_video(vae, model, decode),
                        what="decode_to_uint8 (32 clips per call) vs decode_video (1)")
    with pytest.raises(LatentDatasetError, match=r"has 8-channel latents .* takes 4 channels"):
        check_decodable(validate_meta(video_meta(decode, shape=(8, 3, 4, 4)), "meta.json"))
    clear_vae_cache()


def test_identity_clips_decode_to_pixels():
    meta = validate_meta(video_meta({"type": "identity"}, shape=(3, 9, 4, 4), temporal_factor=1), "meta.json")
    latents = torch.linspace(-1, 1, 2 * 3 * 9 * 16).reshape(2, 3, 9, 4, 4)
    pixels = decode_to_uint8(latents, meta)
    assert pixels.shape == (2, 9, 4, 4, 3) and pixels.dtype == torch.uint8
    assert torch.equal(pixels, ((latents + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1))
    check_decodable(meta)


@pytest.mark.parametrize("key, value, allowed", [
    ("class", "AutoencoderKLMochi", "null or one of"),
    ("latents_mean", [0.0, "x"], "null or a list of finite numbers"),
    ("latents_std", [1.0, 0.0], "null or a list of finite numbers > 0"),
    ("temporal_factor", 0, "a positive integer"),
    ("spatial_factor", 2.5, "a positive integer"),
])
def test_meta_checks_the_video_decode_keys(key, value, allowed):
    decode = {**video_vae_info(tiny_wan()), "vae": "some/vae", key: value}
    with pytest.raises(LatentDatasetError, match=rf"key 'decode.{key}' is .* but must be {allowed}"):
        validate_meta(video_meta(decode), "meta.json")


def test_tiny_video_vae_unclamped_decode_is_diffusers_decode():
    from tread.encoders.tiny_video_vae import decode_unclamped, tiny_video_vae

    vae = tiny_video_vae(0).eval()
    z = torch.randn(2, 4, 3, 2, 3, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        raw, library = decode_unclamped(vae, z), vae.decode(z).sample
    assert raw.shape == library.shape == (2, 3, 5, 4, 6)     # temporal and spatial factor 2
    assert torch.equal(raw.clamp(-1, 1), library) and (raw.abs() > 1).any()      # only the clamp differs


def test_tiny_video_vae_fits_saves_and_loads(tmp_path):
    from tread.data.builtin.toy_clips import generate_toy_clips
    from tread.encoders.tiny_video_vae import save_tiny_video_vae

    data = [torch.from_numpy(generate_toy_clips(1, 5, size, seed=0)[0]) for size in ((8, 8), (8, 12))]  # 10 each
    out, losses = save_tiny_video_vae(tmp_path / "tiny", data, steps=12, seed=0)
    assert len(losses) == 12 and np.mean(losses[-4:]) < np.mean(losses[:4])
    clear_vae_cache()
    vae = load_vae(str(out), cls="AutoencoderKLWan")
    info = video_vae_info(vae)
    assert (info["temporal_factor"], info["spatial_factor"], len(info["latents_mean"])) == (2, 2, 4)
    assert (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial) == (2, 2)   # what WanPipeline reads
    assert 100_000 < sum(p.numel() for p in vae.parameters()) < 1_000_000
    model = torch.cat([to_model_space(encode_video(vae, d), info).transpose(0, 1).flatten(1) for d in data], 1)
    assert torch.allclose(model.mean(1), torch.zeros(4), atol=1e-4)            # pooled over both sizes
    assert torch.allclose(model.std(1), torch.ones(4), atol=1e-4)
    latents = to_model_space(encode_video(vae, data[1]), info)                 # (10, 4, 3, 4, 6)
    assert decode_video(vae, latents, info).shape == (10, 5, 8, 12, 3)
    clear_vae_cache()
