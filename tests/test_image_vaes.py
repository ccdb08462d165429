"""The image VAEs whose pipelines feed normalised latents (tread/encoders/image_vaes.py): FLUX.2's AutoencoderKLFlux2
(FLUX.2, ERNIE-Image, FLUX.3), AutoencoderKLQwenImage (Qwen-Image, Krea 2), AutoencoderKLQwenImage21 (Qwen-Image
2.1) and Sana's AutoencoderDC. Tiny random VAEs of the real classes with non-trivial statistics (FLUX.2's batch-norm
running mean and variance, Qwen's per-channel mean and std): our model-space latents equal what each pipeline's own
encoding gives, decoding inverts it as the pipelines decode, and scripts/precompute_latents.py stores them, with one
error line for a --kind the class cannot store."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import tread.cli.precompute as pl
from tread.cli.sample import run as sample_run
from tread.data import LatentDataset, LatentDatasetError, check_decodable, decode_to_uint8
from tread.data.buckets import assign_bucket, fit_crop, parse_buckets
from tread.data.meta import validate_meta
from tread.data.precompute.request import PrecomputeError
from tread.encoders.image_vaes import (decode_model_space, encode_model_space, image_posterior, image_vae_info,
                                       spatial_factor)
from tread.encoders.vae import MODEL_SPACE_IMAGE_VAES, load_vae, to_model_space
from tread.training.loop import train

from conftest import TINY, blob_images, compose_cfg
from test_precompute import crops, offline, random_image  # noqa: F401 - offline: autouse, no network

RES = 16


def tiny_vae(name: str):
    """A tiny random VAE of class `name`, downsampling 2 (Qwen-Image 2.1's: 4, with its 2 x 2 pixel patch), 4
    latent channels, with non-trivial normalisation statistics."""
    import diffusers

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    stats = {"latents_mean": (torch.randn(4, generator=g) * 0.5).tolist(),
             "latents_std": (torch.rand(4, generator=g) + 0.5).tolist()}
    if name == "AutoencoderKLFlux2":
        vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                           up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                           latent_channels=4, norm_num_groups=4)
        vae.bn.running_mean.copy_(torch.randn(16, generator=g) * 0.5)
        vae.bn.running_var.copy_(torch.rand(16, generator=g) + 0.5)
    elif name == "AutoencoderKLQwenImage":
        vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                               temperal_downsample=[False], **stats)
    elif name == "AutoencoderKLQwenImage21":
        vae = diffusers.AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[2, 2],
                                                 num_res_blocks=1, temperal_downsample=[False], in_channels=12,
                                                 out_channels=12, patch_size=2, scale_factor_spatial=4,
                                                 scale_factor_temporal=1, **stats)
    else:
        vae = diffusers.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=4,
                                      encoder_block_types=("ResBlock",) * 2, decoder_block_types=("ResBlock",) * 2,
                                      encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
                                      encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                                      encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()),
                                      upsample_block_type="interpolate", downsample_block_type="Conv",
                                      decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41)
    return vae.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def vaes():
    return {name: tiny_vae(name) for name in MODEL_SPACE_IMAGE_VAES}


@pytest.fixture(scope="module")
def vae_dirs(vaes, tmp_path_factory):
    root = tmp_path_factory.mktemp("image_vaes")
    for name, vae in vaes.items():
        vae.save_pretrained(root / name)
    return {name: root / name for name in vaes}


def pixels(n=2, seed=0):
    return torch.rand(n, 3, RES, RES, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def pipeline_encoding(name, vae, x):
    """The pipeline's own encoding of images x (B, 3, H, W) in [-1, 1], in the layout its transformer path takes."""
    from diffusers import Flux2Pipeline, QwenImage21Pipeline, QwenImageEditPipeline

    if name == "AutoencoderKLFlux2":        # patchified (B, 4C, h / 2, w / 2)
        me = SimpleNamespace(vae=vae, _patchify_latents=Flux2Pipeline._patchify_latents)
        return Flux2Pipeline._encode_vae_image(me, x, generator=None)
    if name == "AutoencoderKLQwenImage":    # (B, C, 1, h, w)
        me = SimpleNamespace(vae=vae, latent_channels=vae.config.z_dim)   # the pipeline's own latent_channels
        return QwenImageEditPipeline._encode_vae_image(me, x[:, :, None], generator=None)
    if name == "AutoencoderKLQwenImage21":
        me = SimpleNamespace(vae=vae, latent_channels=vae.config.z_dim)
        return QwenImage21Pipeline._encode_vae_image(me, x[:, :, None], generator=None)
    # SanaSprintImg2ImgPipeline.prepare_latents: vae.encode(image).latent * scaling_factor (then TrigFlow's sigma_data,
    # Sprint's own scaling); SanaPipeline decodes latents / scaling_factor
    return vae.encode(x).latent * vae.config.scaling_factor


def pipeline_layout(name, ours):
    from diffusers import Flux2Pipeline

    if name == "AutoencoderKLFlux2":
        return Flux2Pipeline._patchify_latents(ours)
    return ours[:, :, None] if name in ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21") else ours


@pytest.mark.parametrize("name", MODEL_SPACE_IMAGE_VAES)
def test_model_space_equals_the_pipelines_encoding(name, vaes):
    vae, x = vaes[name], pixels()
    info = image_vae_info(vae)
    ours = encode_model_space(vae, x, info)
    torch.testing.assert_close(pipeline_layout(name, ours), pipeline_encoding(name, vae, x))
    raw = image_posterior(vae, x)[0]
    assert (ours - raw).abs().max() > 0.05            # the statistics matter: model space is not raw
    assert ours.shape == (2, 4, RES // spatial_factor(vae), RES // spatial_factor(vae))


@pytest.mark.parametrize("name", MODEL_SPACE_IMAGE_VAES)
def test_decoding_inverts_it_as_the_pipeline_decodes(name, vaes):
    """decode_model_space = the pipeline's decode lines: FLUX.2 latents * bn std + bn mean, unpatchified; Qwen
    latents * latents_std + latents_mean, decoded as one frame; Sana latents / scaling_factor."""
    from diffusers import Flux2Pipeline

    vae = vaes[name]
    info = image_vae_info(vae)
    latents = encode_model_space(vae, pixels(seed=1), info)
    if name == "AutoencoderKLFlux2":
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        raw = Flux2Pipeline._unpatchify_latents(Flux2Pipeline._patchify_latents(latents) * std + mean)
        want = vae.decode(raw).sample
    elif name in ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21"):
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        want = vae.decode(latents[:, :, None] * std + mean).sample[:, :, 0]
    else:
        want = vae.decode(latents / vae.config.scaling_factor).sample
    want = ((want.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    got = decode_model_space(vae, latents, info)
    assert got.shape == (2, RES, RES, 3)
    assert (got.int() - want.int()).abs().max() <= 1 and (got != want).float().mean() <= 0.01


def precompute(images, out, vae_dir, *extra):
    return pl.main(["--images", str(images), "--out", str(out), "--vae", str(vae_dir), "--resolution", str(RES),
                    "--device", "cpu", "--batch-size", "2", "--shard-size", "2", "--workers", "0", *map(str, extra)])


@pytest.fixture(scope="module")
def class_images(tmp_path_factory):
    """One class folder of three images of different sizes."""
    root = tmp_path_factory.mktemp("images") / "imgs"
    (root / "a").mkdir(parents=True)
    rng = np.random.default_rng(3)
    for i, size in enumerate([(20, 16), (16, 30), (40, 33)]):
        random_image(rng, size).save(root / "a" / f"{i}.png")
    return root


@pytest.mark.parametrize("name", ["AutoencoderKLFlux2", "AutoencoderKLQwenImage"])
def test_precompute_stores_model_space_and_the_data_decodes(name, tmp_path, vae_dirs, class_images):
    out = tmp_path / "ds"
    precompute(class_images, out, vae_dirs[name], "--dtype", "float32")   # the class from the folder's config.json
    meta = LatentDataset(out).meta
    vae = load_vae(str(vae_dirs[name]), cls=name)
    info = image_vae_info(vae)
    assert meta["latent_scale"] == 1.0 and meta["latent_kind"] == "sample"
    assert meta["encoding"] == "posterior mean, model space"
    assert meta["decode"] == {**info, "vae": str(vae_dirs[name]), "subfolder": None}
    images = crops(sorted((class_images / "a").iterdir()))
    stored = np.load(out / "latents.npy")
    np.testing.assert_allclose(stored, encode_model_space(vae, images, info).numpy(), rtol=1e-5, atol=1e-5)
    check_decodable(meta)
    decoded = decode_to_uint8(torch.from_numpy(stored), meta)
    assert decoded.shape == (3, RES, RES, 3) and decoded.dtype == torch.uint8
    with pytest.raises(Exception, match="decode_rule='paper' is the paper code's decode of AutoencoderKL"):
        check_decodable(meta, rule="paper")


def test_sample_kind_draws_one_seeded_posterior_sample(tmp_path, vae_dirs, class_images):
    name = "AutoencoderKLFlux2"
    a, b = tmp_path / "a", tmp_path / "b"
    precompute(class_images, a, vae_dirs[name], "--dtype", "float32", "--kind", "sample", "--seed", "5")
    precompute(class_images, b, vae_dirs[name], "--dtype", "float32", "--kind", "sample", "--seed", "5",
               "--batch-size", "3")
    meta = LatentDataset(a).meta
    assert meta["encoding"] == "one posterior draw, model space"
    np.testing.assert_allclose(np.load(a / "latents.npy"), np.load(b / "latents.npy"), rtol=1e-5, atol=1e-5)
    vae = load_vae(str(vae_dirs[name]), cls=name)
    images = crops(sorted((class_images / "a").iterdir()))
    mean, std = image_posterior(vae, images)
    eps = np.stack([np.random.default_rng([5, i]).standard_normal(mean.shape[1:], np.float32) for i in range(3)])
    want = to_model_space(mean + std * torch.from_numpy(eps), image_vae_info(vae))
    np.testing.assert_allclose(np.load(a / "latents.npy"), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, extra, message", [
    ("AutoencoderKLFlux2", ["--kind", "moments"],
     r"--kind='moments' .*mean or sample with an AutoencoderKLFlux2 VAE"),
    ("AutoencoderDC", ["--kind", "sample"], r"--kind='sample' .*mean with an AutoencoderDC VAE.*deterministic"),
    ("AutoencoderKLFlux2", ["--vae-class", "AutoencoderKLWan"], r"--vae-class='AutoencoderKLWan' .*one of AutoencoderKL, AutoencoderKLFlux2"),
    ("AutoencoderKLFlux2", ["--resolution", "18"], r"--resolution=18 .*multiple of 4 .*patchify 2 x 2"),
])
def test_what_a_class_cannot_store_is_one_error_before_work(name, extra, message, tmp_path, vae_dirs, class_images):
    out = tmp_path / "ds"
    with pytest.raises(PrecomputeError, match=message):
        precompute(class_images, out, vae_dirs[name], *extra)
    assert not out.exists()
    argv = ["--images", str(class_images), "--out", str(out), "--vae", str(vae_dirs[name]), "--resolution", str(RES),
            "--device", "cpu", *extra]
    assert pl.cli(argv) == 2 and not out.exists()


def test_a_video_vae_folder_is_refused_for_images(tmp_path, vae_dirs, class_images):
    folder = tmp_path / "wan"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
    with pytest.raises(PrecomputeError, match=r"is a video VAE \(AutoencoderKLWan.*--videos"):
        precompute(class_images, tmp_path / "ds", folder)


# each family whose pipeline uses one of these VAEs: precompute with a tiny VAE of that class -> a routed run ->
# sample.py decodes through it
FAMILY_VAES = {"flux2": "AutoencoderKLFlux2", "ernie_image": "AutoencoderKLFlux2", "flux3": "AutoencoderKLFlux2",
               "qwen_image": "AutoencoderKLQwenImage", "krea2": "AutoencoderKLQwenImage",
               "qwen_image21": "AutoencoderKLQwenImage21", "sana": "AutoencoderDC"}
ROUTE = "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 0, end_layer_idx: 1}]"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_VAES)
def test_family_trains_on_its_vaes_latents_and_samples_images(family, tmp_path, vae_dirs, one_thread):
    root = tmp_path / "images"
    for i, image in enumerate(blob_images(4, size=32)):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(root / f"c{i % 2}" / f"{i}.png")
    precompute(root, tmp_path / "data", vae_dirs[FAMILY_VAES[family]], "--resolution", "32")
    data = LatentDataset(tmp_path / "data")
    c, h, w = data.shape
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={tmp_path / 'cache'}", f"model={family}", "data=latents", f"data.path={data.root}",
        f"data.channels={c}", f"data.resolution={h}", "data.num_classes=2", ROUTE, "train.max_steps=2",
        "train.batch_size=2", "eval.every_steps=0", "eval.at_end=false"])
    train(cfg, tmp_path / "run")
    out = tmp_path / "out"
    sample_run(compose_cfg("sample", [f"checkpoint={tmp_path / 'run'}", "device=cpu", "num_steps=2", "seeds=0-1",
                                      f"out_dir={out}"]))
    samples = np.load(out / "samples.npz")["arr_0"]
    assert samples.shape == (2, 32, 32, 3) and samples.dtype == np.uint8


def test_buckets_and_references_are_model_space_too(tmp_path, vae_dirs):
    """FLUX.2-style edit data: bucketed images and their reference images through AutoencoderKLFlux2: every bucket's
    latents and references are the posterior means of the bucket's crops in model space; a bucket stride the
    latents cannot patchify is one error."""
    images, refs = tmp_path / "images", tmp_path / "refs"
    rng = np.random.default_rng(5)
    for root in (images, refs):
        (root / "a").mkdir(parents=True)
        for name, size in (("0.png", (20, 16)), ("1.png", (16, 30)), ("2.png", (18, 18))):
            random_image(rng, size).save(root / "a" / name)
    name, buckets = "AutoencoderKLFlux2", "16x16,20x12,12x20"
    out = tmp_path / "ds"
    argv = ["--images", str(images), "--vae", str(vae_dirs[name]), "--device", "cpu", "--buckets", buckets,
            "--workers", "0"]
    pl.main([*argv, "--out", str(out), "--bucket-stride", "4", "--reference-images", str(refs), "--dtype", "float32"])
    vae = load_vae(str(vae_dirs[name]), cls=name)
    info = image_vae_info(vae)
    sizes = parse_buckets(buckets)
    paths = sorted((images / "a").iterdir())
    for b, bucket in enumerate(sizes):
        mine = [p for p in paths if assign_bucket(*Image.open(p).size, sizes) == b]
        if not mine:
            continue
        meta = LatentDataset(out / bucket.name).meta
        assert meta["decode"]["class"] == name and meta["latent_scale"] == 1.0
        for folder, key in ((images, "latents"), (refs, "reference_latents")):
            pics = np.stack([fit_crop(Image.open(folder / "a" / p.name), bucket)[0] for p in mine])
            np.testing.assert_allclose(np.load(out / bucket.name / f"{key}.npy"),
                                       encode_model_space(vae, pics, info).numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(PrecomputeError, match=r"--bucket-stride=2 .*multiple of 4"):
        pl.main([*argv, "--out", str(tmp_path / "ds2"), "--bucket-stride", "2"])


@pytest.mark.parametrize("change, message", [
    ({"latents_mean": [0.0] * 15}, r"decode.latents_mean has 15 values but the latents have 4 channels \(16 after"),
    ({"patch_size": 3}, r"do not patchify by decode.patch_size 3"),
    ({"patch_size": 0}, r"patch_size"),
])
def test_a_decode_record_that_does_not_fit_is_one_error_at_start_up(change, message, tmp_path, vae_dirs,
                                                                     class_images):
    """A meta.json whose normalisation does not fit its latents is refused by the start-up check (before training),
    not by the first evaluation hours later."""
    out = tmp_path / "ds"
    precompute(class_images, out, vae_dirs["AutoencoderKLFlux2"])
    meta = json.loads((out / "meta.json").read_text())
    meta["decode"].update(change)
    with pytest.raises(LatentDatasetError, match=message):
        check_decodable(validate_meta(meta, str(out / "meta.json")))
