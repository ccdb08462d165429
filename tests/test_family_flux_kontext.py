"""FLUX Kontext (model.kontext, model=flux_kontext): the reference image's latents as never-routed image tokens.

Proofs against diffusers (tiny configs, fp32): the dense forward equals FluxTransformer2DModel run on the inputs
exactly as FluxKontextPipeline builds them; the reference tokens keep their full length in every block while
routes shorten the target tokens; the kept tokens equal diffusers' blocks on [kept subsequence, reference] with
their true ids; ratio 0 equals dense; only the target carries a loss. Then the data path (writer -> reader,
precompute --reference-images) and a 2-step train.py run that samples with the references.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline

import tread.cli.precompute as pl
import family_checks as fc
from tread.data import LatentDataset, read_meta, write_latent_dataset
from tread.data.precompute.plan import PrecomputeError
from tread.encoders.vae import encode, load_vae
from tread.diffusion import RectifiedFlow
from tread.models.families import FamilyConfigError
from tread.sampling.prompts import PromptError, check_text_model
from tread.schema.model import FAMILY_ONLY
from test_families import CROSS
from test_precompute import crops, offline, random_image, run, vae_dir  # noqa: F401 (fixtures)

FAMILY = "flux"

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_for(model, batch: int = 3, seed: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, model.in_channels, model.input_size, model.input_size, generator=g)


def kontext(routes=None):
    return fc.make(FAMILY, routes, kontext=True)


def test_dense_equals_diffusers_on_the_pipelines_inputs():
    """(a) No routes: our forward = FluxTransformer2DModel on FluxKontextPipeline's own packing and ids: hidden
    [target, reference], img_ids [target ids, reference ids with first coordinate 1], output's target part."""
    model = kontext().eval()
    x, t, y = fc.inputs(model)
    ref = reference_for(model)
    B, C, H, W = x.shape
    pipe = FluxKontextPipeline
    latents, image_latents = pipe._pack_latents(x, B, C, H, W), pipe._pack_latents(ref, B, C, H, W)
    latent_ids = pipe._prepare_latent_image_ids(B, H // 2, W // 2, x.device, x.dtype)
    image_ids = pipe._prepare_latent_image_ids(B, H // 2, W // 2, x.device, x.dtype)
    image_ids[..., 0] = 1
    text = model.conditioner(y)
    tr = model.pristine_transformer()
    with torch.no_grad():
        pred = tr(hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t / 1000, guidance=None,
                  pooled_projections=text["pooled"], encoder_hidden_states=text["text"],
                  txt_ids=torch.zeros(text["text"].shape[1], 3), img_ids=torch.cat([latent_ids, image_ids]),
                  return_dict=False)[0][:, :latents.size(1)]
        want = pipe._unpack_latents(pred, H * 8, W * 8, 8)
        ours = model(x, t, y, cond={"reference": ref})
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond={"reference": ref}), rtol=1e-6,
                               atol=1e-6)


def test_reference_tokens_keep_full_length_in_every_block():
    """(b) Every block sees kept target tokens + all N reference tokens (image weights) and the whole text."""
    model = kontext(CROSS).train()
    x, t, y = fc.inputs(model)
    N, seen = model.num_tokens, []
    hooks = [b.register_forward_pre_hook(lambda m, a, kw: seen.append(
        (kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1])), with_kwargs=True)
        for b in model.routable_blocks()]
    try:
        model(x, t, y, cond={"reference": reference_for(model)})
    finally:
        for h in hooks:
            h.remove()
    route = model.routing.routes[0]
    kept = [route.num_keep(N) if route.start_layer_idx <= i <= route.end_layer_idx else N for i in range(8)]
    assert seen == [(k + N, model.text_len) for k in kept]
    assert min(kept) < N


@pytest.mark.parametrize("routes", [CROSS, [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]],
                         ids=["double-to-single", "double-only"])
def test_kept_tokens_equal_blocks_on_subsequence_plus_reference(routes):
    """(c) Kept tokens after the route = diffusers' blocks (default processors) run per sample on [kept target
    tokens, all reference tokens] with their true ids (kept target ids, reference ids (1, row, col))."""
    ref = None

    def cond(model):
        nonlocal ref
        ref = reference_for(model)
        return {"reference": ref}

    r = fc.routed_run(FAMILY, routes, cond=cond, kontext=True)
    model, route = r.model, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()
    text = model.conditioning(r.y, r.cond)
    blocks = [*ref_tr.transformer_blocks, *ref_tr.single_transformer_blocks]
    grid = model.token_grid
    img_ids, ref_ids = model.image_ids(x_kept.device, grid), model.reference_ids(x_kept.device, grid)
    assert torch.equal(ref_ids[:, 0], torch.ones(len(ref_ids))) and torch.equal(ref_ids[:, 1:], img_ids[:, 1:])
    with torch.no_grad():
        temb = ref_tr.time_text_embed(r.t / 1000 * 1000, text["pooled"])
        for b in range(x_kept.shape[0]):
            h = r.dense[route.start_layer_idx][0][b:b + 1, ids[b]]           # dense route-start tokens, kept
            c, z = (v[b:b + 1] for v in r.dense[route.start_layer_idx][1])   # text and reference streams
            K, L = h.shape[1], c.shape[1]
            rope = ref_tr.pos_embed(torch.cat([torch.zeros(L, 3), img_ids[ids[b]], ref_ids]))
            for blk in blocks[route.start_layer_idx:route.end_layer_idx + 1]:
                c, hz = blk(hidden_states=torch.cat([h, z], dim=1), encoder_hidden_states=c, temb=temb[b:b + 1],
                            image_rotary_emb=rope)
                h, z = hz[:, :K], hz[:, K:]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route.end_layer_idx + 1 < len(blocks):                         # both streams after the route
                after = r.routed[route.end_layer_idx + 1][1]
                torch.testing.assert_close(after[0][b:b + 1], c, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(after[1][b:b + 1], z, rtol=1e-5, atol=1e-5)


def test_ratio_zero_permuted_equals_dense():
    """(d) selection_ratio 0 with a random permutation of the target tokens equals dense (1e-5)."""
    model = kontext(fc.RATIO_ZERO)
    fc.check_ratio_zero_model(model, fc.inputs(model), {"reference": reference_for(model)})


def test_reference_gets_no_loss_and_gradients_reach_the_parameters():
    """(e) The flow-matching loss covers the target only (its shape; the reference reaches the model clean, not
    noised), the reference changes the prediction, and every parameter the dense model trains gets a gradient
    under routing."""
    def grads(routes):
        model = kontext(routes).train()
        x, t, y = fc.inputs(model)
        ref, got = reference_for(model), []
        real = model.conditioning
        model.conditioning = lambda labels, cond: got.append(cond["reference"]) or real(labels, cond)
        torch.manual_seed(0)
        loss = RectifiedFlow().loss(RectifiedFlow().precondition(model), x, y, cond={"reference": ref})
        assert loss.shape == x.shape and all(g is ref for g in got)
        loss.mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    dense, routed = grads(None), grads(CROSS)
    trained = [n for n, g in dense.items() if g is not None and g.abs().sum() > 0]
    assert trained and all(routed[n] is not None and routed[n].abs().sum() > 0 for n in trained)
    model = kontext().eval()
    x, t, y = fc.inputs(model)
    with torch.no_grad():
        a = model(x, t, y, cond={"reference": reference_for(model, seed=1)})
        b = model(x, t, y, cond={"reference": reference_for(model, seed=2)})
    assert not torch.allclose(a, b)


def test_kontext_errors_name_what_is_missing():
    model = kontext().eval()
    x, t, y = fc.inputs(model)
    with pytest.raises(FamilyConfigError, match=r"model.kontext=true needs .*cond\['reference'\].*got none"):
        model(x, t, y)
    with pytest.raises(FamilyConfigError, match=r"got shape \[3, 4, 4, 4\]"):
        model(x, t, y, cond={"reference": torch.zeros(3, 4, 4, 4)})
    with pytest.raises(FamilyConfigError, match=r"data.path='/d' has no reference latents .*reference_latents.npy"):
        model.check_text_data({"text": None, "reference": None}, "'/d'")
    with pytest.raises(FamilyConfigError, match=r"model.kontext=false would ignore them: use model=flux_kontext"):
        fc.make(FAMILY).check_text_data({"text": None, "reference": (4, 8, 8)}, "'/d'")
    for family in ("sd3", "wan", "sana", "z_image"):    # families that take no references refuse such data too
        with pytest.raises(FamilyConfigError, match=rf"model.family={family} takes none; use model=flux_kontext"):
            fc.make(family).check_text_data({"text": None, "reference": (4, 8, 8)}, "'/d'")
    with pytest.raises(FamilyConfigError, match=r"model.kontext='yes' is not allowed"):
        fc.make(FAMILY, kontext="yes")
    with pytest.raises(PromptError, match=r"prompts are not supported for a FLUX Kontext model .*reference image"):
        check_text_model(model, {"conditioning": {"text": {"seq_len": 8, "dim": 32}}})


def test_kontext_key_is_checked_by_the_schema():
    """model=flux_kontext sets model.kontext=true; the key is FLUX-only and a boolean."""
    from conftest import compose_cfg
    from tread.schema import ConfigError, check_train
    assert compose_cfg("train", ["model=flux_kontext"]).model.kontext is True
    assert compose_cfg("train", ["model=flux"]).model.kontext is False
    check_train(compose_cfg("train", ["model=flux_kontext"]))
    needle = f"model.kontext is a key of model.family={' | '.join(FAMILY_ONLY['kontext'])}; model.family=sd3 does not"
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_train(compose_cfg("train", ["model=sd3", "+model.kontext=true"]))
    with pytest.raises(ConfigError, match="model.kontext='maybe' is not allowed; allowed: true or false"):
        check_train(compose_cfg("train", ["model=flux_kontext", "model.kontext=maybe"]))


# ----------------------------------------------------------------------------- data

def test_writer_reader_round_trip_of_references(tmp_path):
    """(f) reference_latents.npy: written with the dataset dtype and model-space shape (C halved for moments),
    read * latent_scale whatever the latent kind; a wrong shape is refused naming the key."""
    rng = np.random.default_rng(0)
    lat, ref = rng.standard_normal((5, 8, 8, 8)).astype(np.float32), rng.standard_normal((5, 4, 8, 8))
    path = write_latent_dataset(tmp_path / "ds", lat, np.arange(5) % 2, num_classes=2, latent_scale=0.5,
                                dtype="float32", extras={"reference": ref}, extra_meta={"latent_kind": "moments"})
    meta = read_meta(path)
    assert meta["files"]["reference_latents"] == "reference_latents.npy"
    ds = LatentDataset(path)
    assert ds.conditioning["reference"] == (4, 8, 8) and ds.has_extras
    _, _, extras = ds.__getitems__([3, 1])
    torch.testing.assert_close(extras["reference"], torch.from_numpy(ref[[3, 1]] * 0.5).float())
    torch.testing.assert_close(ds[2][2]["reference"], torch.from_numpy(ref[2] * 0.5).float())
    from tread.data import LatentDatasetError
    with pytest.raises(LatentDatasetError, match=r"extras\['reference'\].*shape \(5, 4, 8, 8\)"):
        write_latent_dataset(tmp_path / "bad", lat, np.zeros(5, np.int64), num_classes=1,
                             extras={"reference": ref[:, :, :4]}, extra_meta={"latent_kind": "moments"})


def _pairs(root, names, seed):
    rng = np.random.default_rng(seed)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        random_image(rng, (20, 17)).save(root / name)


def test_precompute_reference_images(tmp_path, vae_dir):  # noqa: F811 (fixture)
    """(f) --reference-images: references paired by relative path and stem (any extension), center-cropped and
    encoded by the same VAE as its posterior mean (flipped copies get flipped references); unmatched names on
    either side are one error naming them."""
    images, refs = tmp_path / "images", tmp_path / "refs"
    _pairs(images, ["a/x.png", "a/y.png", "b/z.png"], 0)
    _pairs(refs, ["a/x.jpg", "a/y.png", "b/z.png"], 1)
    out = tmp_path / "ds"
    run(images, out, vae_dir, "--reference-images", refs, "--flip", "--dtype", "float32")
    ds = LatentDataset(out)
    assert len(ds) == 6 and ds.conditioning["reference"] == ds.shape
    ref_paths = [refs / n for n in ("a/x.jpg", "a/y.png", "b/z.png")]
    pics = crops(ref_paths)
    vae = load_vae(str(vae_dir))
    scale = read_meta(out)["latent_scale"]
    want = encode(vae, pics, kind="mean").numpy() * scale
    want_flip = encode(vae, np.ascontiguousarray(pics[:, :, ::-1]), kind="mean").numpy() * scale
    got = ds.__getitems__(list(range(6)))[2]["reference"].numpy()
    np.testing.assert_allclose(got, np.concatenate([want, want_flip]), rtol=1e-5, atol=1e-5)
    assert read_meta(out)["reference_images_dir"] == str(refs)
    (refs / "a" / "y.png").rename(refs / "a" / "w.png")
    with pytest.raises(PrecomputeError, match=r"no reference for 1 of 3 image\(s\): a/y; 1 reference\(s\) with no "
                                              r"image .*: a/w"):
        run(images, tmp_path / "ds2", vae_dir, "--reference-images", refs)
    with pytest.raises(PrecomputeError, match=r"--reference-images="):
        pl.main(["--images", str(images), "--out", str(tmp_path / "ds3"), "--vae", str(vae_dir),
                 "--reference-images", str(tmp_path / "nope")])


# ----------------------------------------------------------------------------- training and sampling

def _edit_dataset(path, n=24, seed=0):
    """A tiny class-conditional edit dataset: 3x8x8 targets = their reference's colour flipped in sign."""
    rng = np.random.default_rng(seed)
    ref = np.broadcast_to(rng.standard_normal((n, 3, 1, 1)), (n, 3, 8, 8)) + 0.05 * rng.standard_normal((n, 3, 8, 8))
    target = -ref + 0.05 * rng.standard_normal((n, 3, 8, 8))
    return write_latent_dataset(path, target.astype(np.float32), np.arange(n) % 2, num_classes=2, dtype="float32",
                                extras={"reference": ref.astype(np.float32)})


def test_kontext_trains_evaluates_and_samples_with_the_references(tiny_cfg, tmp_path, monkeypatch):
    """(g) train.py model=flux_kontext: the data's references reach the model in every training step, in the
    in-training evaluation (both CFG branches: label dropout never drops the reference) and in sample.py
    (seed i conditions on item i mod N's reference); data without references is one clear error."""
    from tread.cli.sample import run as sample_run
    from conftest import compose_cfg
    from tread.models.families.flux import FluxFamily
    from tread.training.loop import train

    data = _edit_dataset(tmp_path / "edit")
    seen = []
    real = FluxFamily.conditioning
    monkeypatch.setattr(FluxFamily, "conditioning", lambda self, labels, cond: seen.append(
        (labels.clone(), (cond or {}).get("reference"))) or real(self, labels, cond))
    common = ["model=flux_kontext", f"data.path={data}", "data.builtin=null", "data.resolution=8",
              "data.channels=3", "data.num_classes=2", "train.batch_size=8", "optimizer.lr=1e-3"]
    cfg = tiny_cfg(*common, "train.max_steps=2", "eval.every_steps=2", "eval.num_samples=6",
                   "eval.batch_size=6", "eval.grid_size=6", "eval.cfg_scale=2.0", "train.label_dropout=0.5")
    train(cfg, tmp_path / "run")
    assert seen and all(r is not None and r.shape[1:] == (3, 8, 8) for _, r in seen)
    assert any((y == 2).any() for y, _ in seen)                    # null labels (dropout, CFG) kept the reference
    assert [json.loads(x)["type"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()].count(
        "train") == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())   # the reference doubles the image tokens
    assert summary["tokens_fraction"] < 1
    assert summary["tokens_fraction_with_reference"] == pytest.approx((summary["tokens_fraction"] + 1) / 2)
    seen.clear()
    sample_run(compose_cfg("sample", [f"checkpoint={tmp_path / 'run'}", "num_samples=3", "num_steps=2",
                                      "batch_size=3", "seeds=25-27", f"out_dir={tmp_path / 'samples'}"]))
    ref = LatentDataset(data).__getitems__([1, 2, 3])[2]["reference"]
    assert seen and torch.equal(seen[0][1][:3].cpu(), ref)
    with pytest.raises(FamilyConfigError, match=r"model.kontext=true but the data at data.path=.*no reference"):
        train(tiny_cfg("model=flux_kontext", "train.max_steps=1", "eval.every_steps=0"), tmp_path / "nope")
