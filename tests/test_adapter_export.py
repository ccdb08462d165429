"""The adapter export (tread/models/lora_export.py, tread/checkpoint/save.py::export_adapter): every adapter type
comes out as an exact plain LoRA that diffusers pipelines load with `pipe.load_lora_weights`, and the loaded pipeline
transformer computes what our model with the adapter computes.

Tiny FLUX and SD3 pipelines are built offline from configs with random weights (text encoders from
tread/encoders/tiny_text.py::save_tiny_text_encoders, a one-level VAE, the flow-matching scheduler)."""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors import safe_open

from tread.encoders.text import load_text_encoders
from tread.encoders.tiny_text import save_tiny_text_encoders
from family_checks import inputs, make
from tread.models.lora import apply_lora
from tread.models.lora_export import METADATA_KEY, diffusers_lora, lora_factors
from tread.checkpoint.save import DIFFUSERS_LORA_FILE, PEFT_ADAPTER_FILE, export_adapter

TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out"],
           "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "ff.net.2", "proj_out"]}
ADAPTERS = {   # tiny widths (64, 256) make peft pick full and decomposed Kronecker factors alike
    "lora": {"type": "lora", "rank": 4, "alpha": 2},
    "lokr": {"type": "lokr", "rank": 3, "alpha": 6},
    "lokr_both": {"type": "lokr", "rank": 2, "alpha": 1, "decompose_both": True, "decompose_factor": 4},
    "loha": {"type": "loha", "rank": 2, "alpha": 3},
}


def adapted(family: str, adapter: str, seed: int = 0, targets=None):
    """A tiny family model with the adapter (on `targets`, default TARGETS[family]), its weights randomly perturbed
    so the update is far from 0."""
    model = make(family, lora={**ADAPTERS[adapter], "target_modules": targets or TARGETS[family]}).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.transformer.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {f: load_text_encoders(f, save_tiny_text_encoders(f, root / f)) for f in TARGETS}


def pipeline(family: str, transformer, encoders):
    """A diffusers pipeline of the family around `transformer` (tiny VAE, scheduler and text encoders)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, layers_per_block=1, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
    cls = {"flux": FluxPipeline, "sd3": StableDiffusion3Pipeline}[family]
    enc = encoders[family]
    return cls(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, **enc.models,
               **enc.tokenizers)


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_pipeline_loads_the_exact_adapter(family, adapter, encoders, tmp_path):
    model = adapted(family, adapter)
    export_adapter(model, tmp_path)
    base = make(family)                     # the same seeded base, no adapter
    pipe = pipeline(family, base.pristine_transformer(), encoders)
    x, noise, labels = inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
        pipe.load_lora_weights(tmp_path)    # the step dir, as users pass it: diffusers picks DIFFUSERS_LORA_FILE
        ours = model(x, noise, labels)
        theirs = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
    assert (ours - plain).abs().max() > 0.05            # the adapter matters ...
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)   # ... and the pipeline applies it exactly


# The newer families' pipelines, built with the transformer and a scheduler only (every other component None):
# load_lora_weights touches the transformer alone. Targets: each family's attention and feed-forward projections.
NEW_PIPELINES = {
    "chroma": ("ChromaPipeline", ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp",
                                  "proj_out"]),
    "sana": ("SanaPipeline", ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                              "attn2.to_out.0", "proj_out"]),
    "flux2": ("Flux2Pipeline", ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "to_qkv_mlp_proj",
                                "ff.linear_in"]),
    "hidream": ("HiDreamImagePipeline", ["to_q", "to_k", "to_v", "to_out", "to_q_t", "to_out_t"]),
    "qwen_image": ("QwenImagePipeline", ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out",
                                         "img_mlp.net.2"]),
    "lumina2": ("Lumina2Pipeline", ["to_q", "to_k", "to_v", "to_out.0", "linear_1"]),
    "z_image": ("ZImagePipeline", ["to_q", "to_k", "to_v", "to_out.0", "feed_forward.w2"]),
    "ltx_video": ("LTXPipeline", ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]),
    "ernie_image": ("ErnieImagePipeline", ["to_q", "to_k", "to_v", "to_out.0", "mlp.gate_proj", "linear_fc2"]),
    "ltx2": ("LTX2Pipeline", ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]),
    "kandinsky5": ("Kandinsky5T2VPipeline", ["to_query", "to_key", "to_value", "self_attention.out_layer",  # + the
                                             "cross_attention.out_layer", "visual_modulation.out_layer"]),  # zero gates
    "wan_vace": ("WanVACEPipeline", ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out"]),
    # -- new families above this line --
}


@pytest.mark.parametrize("family", list(NEW_PIPELINES))
@pytest.mark.parametrize("adapter", ["lora", "lokr"])
@pytest.mark.usefixtures("no_bf16_rounding")   # Kandinsky 5's q, k rounding: float32 for the exact comparison
def test_family_pipeline_loads_the_exact_adapter(family, adapter, tmp_path):
    """The exported LoRA / LoKr (as an exact plain LoRA) loads with the family pipeline's load_lora_weights and
    gives what our adapted model gives."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipeline_name, targets = NEW_PIPELINES[family]
    model = adapted(family, adapter, targets=targets)
    export_adapter(model, tmp_path)
    base = make(family)
    cls = getattr(diffusers, pipeline_name)
    kw = {k: None for k in inspect.signature(cls.__init__).parameters if k != "self"}
    pipe = cls(**{**kw, "transformer": base.pristine_transformer(), "scheduler": FlowMatchEulerDiscreteScheduler()})
    pipeline_applies_the_adapter(model, base, pipe, tmp_path)


def pipeline_applies_the_adapter(model, base, pipe, folder) -> None:
    """`pipe` (holding base's pristine transformer) loads the export in `folder` with its load_lora_weights: its
    transformer then gives what the adapted `model` gives, and the adapter changes the output."""
    x, noise, labels = inputs(model)
    with torch.no_grad():
        plain = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
        pipe.load_lora_weights(folder)
        ours = model(x, noise, labels)
        theirs = base.reference_forward(x, noise, labels, transformer=pipe.transformer)
    assert (ours - plain).abs().max() > 0.02            # the adapter matters ...
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)   # ... and the pipeline applies it exactly


def test_transformer_load_lora_adapter_reads_the_file(tmp_path):
    """`transformer.load_lora_adapter` with its default prefix="transformer" loads the export too, given the
    file or the directory with weight_name (for a directory alone it looks for a .bin); peft's own file (no
    prefix, LoKr keys) is for peft, not for diffusers."""
    model = adapted("flux", "lokr")
    export_adapter(model, tmp_path)
    x, noise, labels = inputs(model)
    with torch.no_grad():
        ours = model(x, noise, labels)
        for source, kwargs in ((tmp_path / DIFFUSERS_LORA_FILE, {}), (tmp_path, {"weight_name": DIFFUSERS_LORA_FILE})):
            transformer = make("flux").pristine_transformer()
            transformer.load_lora_adapter(source, **kwargs)
            torch.testing.assert_close(model.reference_forward(x, noise, labels, transformer=transformer), ours,
                                       atol=2e-5, rtol=1e-5)
    with safe_open(str(tmp_path / PEFT_ADAPTER_FILE), "pt") as f:
        assert json.loads(f.metadata()["peft_config"])["peft_type"] == "LOKR"
        assert all(".lokr_" in k for k in f.keys())


def test_metadata_describes_the_file_with_the_scale_folded_in():
    model = adapted("flux", "lokr")
    tensors, metadata = diffusers_lora(model.transformer)
    config = {k.removeprefix("transformer."): v for k, v in json.loads(metadata[METADATA_KEY]).items()}
    ranks = {k[len("transformer."):-len(".lora_B.weight")]: v.shape[1] for k, v in tensors.items() if "lora_B" in k}
    assert sorted(config["target_modules"]) == sorted(ranks) and config["lora_alpha"] == config["r"]
    assert all(config["rank_pattern"].get(f"^{n}", config["r"]) == r for n, r in ranks.items())
    assert config["alpha_pattern"] == config["rank_pattern"]          # scale 1 everywhere: it is in lora_B
    assert len(set(ranks.values())) > 1                              # the pattern is exercised


def lokr_layer(out_dim, in_dim, **cfg):
    layer = torch.nn.Sequential(torch.nn.Linear(in_dim, out_dim))
    apply_lora(layer, {"type": "lokr", "target_modules": ["0"], **cfg})
    return layer[0]


@pytest.mark.parametrize("shape,cfg,rank", [
    ((64, 48), {"rank": 2, "alpha": 3}, 2 * 6),                        # w1 full 8x6 (inner 6) x w2 = U V (r 2)
    ((64, 48), {"rank": 2, "decompose_both": True, "decompose_factor": 16}, 2 * 3),   # w1 = P Q, w2 full 4x3
    ((96, 32), {"rank": 8, "alpha": 4}, 32),                           # both full: dense form (min dim)
    ((24, 40), {"rank": 1, "decompose_factor": 4}, 4 * 1),             # fixed factor, w1 4x4
])
def test_lokr_factors_are_exact(shape, cfg, rank):
    layer = lokr_layer(*shape, **cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g))
    b, a = lora_factors(layer)
    assert b.shape == (shape[0], rank) and a.shape == (rank, shape[1])
    delta = layer.get_delta_weight("default")
    torch.testing.assert_close(b @ a, delta, atol=1e-5 * delta.abs().max().item(), rtol=0)


def test_loha_factors_are_exact():
    layer = torch.nn.Sequential(torch.nn.Linear(40, 30))
    apply_lora(layer, {"type": "loha", "rank": 3, "alpha": 5, "target_modules": ["0"]})
    with torch.no_grad():
        for p in layer[0].parameters():
            if p.requires_grad:
                p.normal_()
    b, a = lora_factors(layer[0])
    assert b.shape == (30, 9)
    torch.testing.assert_close(b @ a, layer[0].get_delta_weight("default"), atol=1e-4, rtol=1e-5)
