"""scripts/diffusers_pipeline.py (tread/cli/diffusers_pipeline.py): a run's exported adapter in diffusers' FluxPipeline,
as the worked example (`make example`) uses it: a LoKr run over an int8 base on the built-in text data, then the
pipeline's transformer and its own sampling loop against ours."""
from __future__ import annotations

import json

import pytest

from tread.cli.diffusers_pipeline import main, run
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.training.loop import train

LOKR = "model.lora={type: lokr, rank: 4, alpha: 4, target_modules: [to_q, to_k, to_v, to_out.0, proj_mlp, proj_out]}"


@pytest.fixture(scope="module")
def flux_encoders(tmp_path_factory):
    return save_tiny_text_encoders("flux", tmp_path_factory.mktemp("enc") / "flux")


def adapter_run(tiny_cfg, run_dir, encoders, *extra):
    train(tiny_cfg("model=flux", "data=toy_text", f"model.text_encoders={encoders}",
                   "data.builtin_args.num_per_class=4", "eval.every_steps=0", "eval.at_end=false",
                   "optimizer.lr=1e-2", *extra), run_dir)
    return run_dir


def test_the_pipeline_loads_the_adapter_and_samples_what_we_sample(tiny_cfg, tmp_path, flux_encoders):
    run_dir = adapter_run(tiny_cfg, tmp_path / "run", flux_encoders, LOKR, "model.quantize=int8")
    report = run(str(run_dir), ["a red disc", "a lime X"], [0, 1], 3, tmp_path / "out")
    assert report["pipeline"] == "FluxPipeline" and report["quantize"] == "int8"
    # the export is exact: the pipeline's transformer equals our adapter over the full-precision base ...
    assert report["transformer_max_abs_diff_vs_adapter_on_full_precision_base"] < 1e-5
    # ... and differs from the trained (int8) model by the base's quantization error only
    assert 0 < report["transformer_max_abs_diff_vs_run_model"] < 0.05
    # the pipeline's own prompt encoding and Euler loop give our images, up to that error
    assert report["image_max_abs_diff_uint8"] <= 8
    assert json.loads((tmp_path / "out" / "pipeline.json").read_text()) == report
    assert (tmp_path / "out" / "diffusers_pipeline.png").is_file() and (tmp_path / "out" / "ours.png").is_file()


def test_a_run_without_an_adapter_is_refused(tiny_cfg, tmp_path, flux_encoders):
    plain = adapter_run(tiny_cfg, tmp_path / "plain", flux_encoders)
    with pytest.raises(SystemExit, match=r"^error: .* holds no pytorch_lora_weights.safetensors: only adapter runs "
                                         r"\(model.lora\) export one"):
        main([str(plain), "--prompts", "a red disc"])
