"""The built-in text-conditioned data (data=toy_text, tread/data/builtin/toy_text.py) and the text-width check of families."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tread.data import LatentDataset, LatentDatasetError
from tread.data.builtin.toy import TOY_CLASS_NAMES, generate_toy_shapes
from tread.data.builtin.toy_text import class_captions, ensure_toy_text_dataset
from tread.encoders.text import encode_prompts, load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.models.families import FamilyConfigError
from tread.training.loop import train


@pytest.fixture(scope="module")
def flux_encoders(tmp_path_factory):
    return save_tiny_text_encoders("flux", tmp_path_factory.mktemp("enc") / "flux")


def test_captions_are_encoded_per_class_with_the_family_encoders(tmp_path, flux_encoders):
    root = ensure_toy_text_dataset(tmp_path / "ds", num_per_class=3, resolution=8, family="flux",
                                   text_encoders=flux_encoders, caption="a photo of a {class}", max_text_length=6)
    ds = LatentDataset(root)
    assert ds.conditioning["text"] == (6, 32) and ds.conditioning["pooled"] == 32
    x, y, extras = ds.__getitems__(list(range(len(ds))))
    images, labels = generate_toy_shapes(3, 8, 0)
    torch.testing.assert_close(x, images.half().float())               # the toy_shapes images, unchanged
    assert torch.equal(y, labels)
    want = encode_prompts("flux", load_text_encoders("flux", flux_encoders),
                          [f"a photo of a {name}" for name in TOY_CLASS_NAMES], max_length=6)
    np.testing.assert_allclose(extras["text"].numpy(), want["text"][labels.numpy()].astype(np.float16), rtol=0,
                               atol=0)
    np.testing.assert_allclose(extras["pooled"].numpy(), want["pooled"][labels.numpy()].astype(np.float16))
    assert ds.meta["captions"][0] == "a photo of a red disc"
    # the same parameters reuse the data; others (captions, encoders, ...) get their own directory beside it
    again = dict(num_per_class=3, resolution=8, family="flux", text_encoders=flux_encoders, max_text_length=6)
    assert ensure_toy_text_dataset(tmp_path / "ds", caption="a photo of a {class}", **again) == root
    other = ensure_toy_text_dataset(tmp_path / "ds", caption="a {class}", **again)
    assert other.parent == root.parent and other != root
    assert LatentDataset(other).meta["captions"][0] == "a red disc" and LatentDataset(root).meta["builtin"]["caption"] \
        == "a photo of a {class}"


@pytest.mark.parametrize("kwargs, match", [
    (dict(text_encoders=None), r"text_encoders is not set.*scripts/tiny_text_encoders.py flux DIR"),
    (dict(caption="a shape"), r"caption='a shape' must be a string containing '\{class\}'"),
    (dict(family="dit"), r"family='dit' is not a text-to-image family"),
    (dict(max_text_length=0), r"max_text_length=0 must be a positive integer"),
])
def test_bad_builtin_args(tmp_path, flux_encoders, kwargs, match):
    args = {**dict(num_per_class=1, resolution=8, family="flux", text_encoders=flux_encoders), **kwargs}
    with pytest.raises(LatentDatasetError, match=match):
        ensure_toy_text_dataset(tmp_path / "ds", **args)
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())
    assert class_captions("a {class}")[9] == "a lime X"


def test_flux_trains_on_toy_text_and_text_widths_are_checked(tiny_cfg, tmp_path, flux_encoders):
    data = ["data=toy_text", f"data.builtin_args.text_encoders={flux_encoders}", "data.builtin_args.num_per_class=4"]
    summary = train(tiny_cfg("model=flux", *data, "eval.every_steps=0", "eval.at_end=false",
                             "checkpoint.every_steps=0"), tmp_path / "run")
    assert summary["final_step"] == 4
    with pytest.raises(FamilyConfigError, match=r"pooled text embeddings of the data at .* are 32 wide, but "
                                                r"model.config.pooled_projection_dim=16 \(flux\)"):
        train(tiny_cfg("model=flux", *data, "model.config={pooled_projection_dim: 16}"), tmp_path / "run2")
    with pytest.raises(FamilyConfigError, match=r"text embeddings of the data at .* are 32 wide, but "
                                                r"model.config.joint_attention_dim=64"):
        train(tiny_cfg("model=flux", *data, "model.config={joint_attention_dim: 64}"), tmp_path / "run3")
