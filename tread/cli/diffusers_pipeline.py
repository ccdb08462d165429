"""diffusers_pipeline.py: a run's exported adapter in the family's diffusers pipeline, as a user would load it.

Builds the family's pipeline (FluxPipeline, StableDiffusion3Pipeline, WanPipeline for video) around the run's base transformer (the
seeded initialisation or model.pretrained, in full precision), the text encoders of model.text_encoders and a
flow-matching scheduler with the run's shift, loads the checkpoint's exported adapter with
`pipe.load_lora_weights(step_dir)`, and then
  1. compares the pipeline transformer's output with our model's (EMA adapter applied) on the same inputs: with
     the adapter over the full-precision base (the export must match it exactly) and with the run's own model
     (under model.quantize these differ by the base's quantization error), and
  2. generates the prompts with the pipeline itself (its own prompt encoding and sampling loop, our per-seed
     noise) and with our sampler (sample.py's path), writing both captioned grids and their difference.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf

from tread.cli.errors import user_errors
from tread.data import decode_to_uint8, model_shape
from tread.encoders.text import load_text_encoders
from tread.encoders.vae import load_vae
from tread.diffusion import StackedRandomGenerator
from tread.evaluation.images import save_captioned_grid
from tread.models import build_model
from tread.models.lora import load_weights
from tread.sampling import load_for_inference
from tread.sampling.prompts import PromptError, encode_for_model, generate_for_prompts
from tread.training.checkpoint import DIFFUSERS_LORA_FILE
from tread.utils.checkpoints import find_checkpoint, load_model_file
from tread.utils.errors import UserError

PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline"}
VIDEO_PIPELINES = ("wan",)   # latents (B, C, T, H, W); the pipeline's VAE is the data's video VAE when it has one


class PipelineError(UserError):
    """A run whose adapter cannot be tried in a diffusers pipeline; the message says why."""


def base_transformer(config: Any) -> torch.nn.Module:
    """The run's base transformer in full precision, without adapters, with diffusers' own attention processors:
    what a user loads into a pipeline (diffusers' FLUX LoRA loader reads the base Linear weights by name, so a
    quanto-quantized transformer cannot take the LoRA; the pipeline's base is the unquantized one)."""
    model_cfg = OmegaConf.to_container(config.model, resolve=True)
    model_cfg.update(lora=None, quantize=None, base_dtype="fp32")
    torch.manual_seed(int(config.train.seed))
    return build_model(OmegaConf.create(model_cfg)).pristine_transformer().eval()


def full_precision_twin(config: Any, checkpoint: Path) -> Any:
    """Our model with the run's EMA adapter over the full-precision base (equal to the run's model when it was
    not quantized): what the pipeline with the exported LoRA must compute exactly."""
    model_cfg = OmegaConf.to_container(config.model, resolve=True)
    model_cfg.update(quantize=None, base_dtype="fp32")
    torch.manual_seed(int(config.train.seed))
    twin = build_model(OmegaConf.create(model_cfg))
    state = load_model_file(checkpoint)
    load_weights(twin, state["ema"], bool(state.get("adapter_only")), str(checkpoint))
    return twin.eval()


def build_pipeline(config: Any, meta: dict, transformer: torch.nn.Module):
    """The family pipeline around `transformer`: the run's text encoders, its shift, a placeholder VAE of the
    data's scale factor (images are decoded with the data's own decoding, not by the pipeline)."""
    import diffusers  # deferred: only this program builds pipelines

    family = config.model.family
    if family not in PIPELINES:
        raise PipelineError(f"model.family={family}: trying adapters in a diffusers pipeline is supported for "
                            f"{sorted(PIPELINES)}.")
    if not config.model.get("text_encoders"):
        raise PipelineError("the run has no model.text_encoders: the pipeline needs the family's text encoders "
                            "(a local pipeline folder).")
    no_t5 = family == "sd3" and config.model.get("use_t5") is False
    enc = load_text_encoders(family, str(config.model.text_encoders), t5=not no_t5)
    extra = {"text_encoder_3": None, "tokenizer_3": None} if no_t5 else {}
    if family in VIDEO_PIPELINES:
        vae, factor = video_vae(meta), None
    else:
        factor = int(decode_to_uint8(torch.zeros(1, *model_shape(meta)), meta).shape[1]) // int(model_shape(meta)[1])
        levels = max(1, factor.bit_length())       # vae_scale_factor = 2 ** (levels - 1)
        vae = diffusers.AutoencoderKL(block_out_channels=(8,) * levels, norm_num_groups=8, layers_per_block=1,
                                      down_block_types=("DownEncoderBlock2D",) * levels,
                                      up_block_types=("UpDecoderBlock2D",) * levels,
                                      latent_channels=model_shape(meta)[0])
    return getattr(diffusers, PIPELINES[family])(transformer=transformer, scheduler=scheduler(config), vae=vae,
                                                 **enc.models, **enc.tokenizers, **extra), factor


def video_vae(meta: dict) -> Optional[torch.nn.Module]:
    """The data's video VAE (meta decode.class, e.g. AutoencoderKLWan), or None for identity-decoded clips: then the
    pipeline takes its default scale factors (Wan: 4 in time, 8 in space), which only size its arguments, since
    the latents are passed in and come back as latents."""
    decode = meta.get("decode") or {}
    if decode.get("type") != "vae":
        return None
    return load_vae(decode["vae"], subfolder=decode.get("subfolder"), cls=decode.get("class") or "AutoencoderKLWan")


def video_size(pipe: Any, shape: Sequence[int]) -> dict[str, int]:
    """The pipeline's num_frames / height / width arguments for latents of `shape` (C, T, H, W)."""
    t, h, w = (int(v) for v in shape[1:])
    temporal, spatial = int(pipe.vae_scale_factor_temporal), int(pipe.vae_scale_factor_spatial)
    return {"num_frames": (t - 1) * temporal + 1, "height": h * spatial, "width": w * spatial}


def scheduler(config: Any):
    """FlowMatchEulerDiscreteScheduler with the run's shift: static diffusion.shift or FLUX's dynamic one."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    dyn = config.diffusion.get("dynamic_shift")
    if dyn:
        return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=dyn.base_shift,
                                               max_shift=dyn.max_shift, base_image_seq_len=dyn.base_seq_len,
                                               max_image_seq_len=dyn.max_seq_len)
    return FlowMatchEulerDiscreteScheduler(shift=float(config.diffusion.shift))


def pipeline_latents(family: str, model: Any, noise: torch.Tensor) -> torch.Tensor:
    """Our per-seed noise (B, C, H, W) in the layout the pipeline's `latents=` argument takes."""
    return model.pack(noise) if family == "flux" else noise


def pipeline_images(pipe: Any, family: str, model: Any, prompts: list[str], seeds: list[int], shape: Sequence[int],
                    meta: dict, factor: int, num_steps: int, max_length: Optional[int]) -> torch.Tensor:
    """Every prompt with every seed through the pipeline's own __call__ (no CFG), decoded as the data is."""
    images = []
    size = video_size(pipe, shape) if family in VIDEO_PIPELINES else \
        {"height": int(shape[-1]) * factor, "width": int(shape[-1]) * factor}
    for prompt in prompts:
        noise = StackedRandomGenerator(torch.device("cpu"), seeds).randn([len(seeds), *shape])
        kwargs = {"max_sequence_length": max_length} if max_length else {}
        out = pipe(prompt=[prompt] * len(seeds), latents=pipeline_latents(family, model, noise),
                   num_inference_steps=num_steps, guidance_scale=1.0, output_type="latent", **size, **kwargs)
        out = out.frames if family in VIDEO_PIPELINES else out.images
        latents = model.unpack(out, model.token_grid) if family == "flux" else out
        images.append(decode_to_uint8(latents.float(), meta))
    return torch.cat(images)


def our_images(net: Any, diffusion: Any, model: Any, meta: dict, config: Any, prompts: list[str], seeds: list[int],
               num_steps: int) -> torch.Tensor:
    """The same prompts and seeds through sample.py's path (our encoding and sampler, no CFG)."""
    embeddings = encode_for_model(model, meta, prompts, "", config.model.text_encoders, key="model.text_encoders")
    images = [decode_to_uint8(x, meta) for _, _, x in generate_for_prompts(
        net, diffusion, embeddings, seeds, model_shape(meta), int(meta["num_classes"]), torch.device("cpu"),
        batch_size=len(seeds), num_steps=num_steps)]
    return torch.cat(images)


def transformer_difference(model: Any, pipe: Any, meta: dict, config: Any, prompts: list[str]) -> float:
    """Max |ours - pipeline transformer| on one noisy input per prompt, at t = 0.5."""
    embeddings = encode_for_model(model, meta, prompts, "", config.model.text_encoders, key="model.text_encoders")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *model_shape(meta), generator=g)
    noise_level = torch.full((len(prompts),), 500.0)
    labels = torch.zeros(len(prompts), dtype=torch.long)   # unused: text conditioning (not the null label)
    with torch.no_grad():
        ours = model(x, noise_level, labels, cond=embeddings.cond)
        theirs = model.reference_forward(x, noise_level, labels, embeddings.cond, transformer=pipe.transformer)
    return float((ours - theirs).abs().max())


def run(checkpoint: str, prompts: list[str], seeds: list[int], num_steps: int, out: Path) -> dict:
    step_dir = find_checkpoint(checkpoint)
    if not (step_dir / DIFFUSERS_LORA_FILE).is_file():
        raise PipelineError(f"'{step_dir}' holds no {DIFFUSERS_LORA_FILE}: only adapter runs (model.lora) export one.")
    net, diffusion, meta, config = load_for_inference(checkpoint, use_ema=True)
    model, family = net.model, str(config.model.family)
    pipe, factor = build_pipeline(config, meta, base_transformer(config))
    pipe.load_lora_weights(str(step_dir))                       # what a user types, given the step dir
    max_length = meta["conditioning"]["text"].get("max_length")
    export_diff = transformer_difference(full_precision_twin(config, step_dir), pipe, meta, config, prompts)
    run_diff = transformer_difference(model, pipe, meta, config, prompts)
    theirs = pipeline_images(pipe, family, model, prompts, seeds, model_shape(meta), meta, factor, num_steps,
                             max_length)
    ours = our_images(net, diffusion, model, meta, config, prompts, seeds, num_steps)
    captions = [p for p in prompts for _ in seeds]
    out.mkdir(parents=True, exist_ok=True)
    save_captioned_grid(middle_frames(theirs), captions, out / "diffusers_pipeline.png", nrow=len(seeds))
    save_captioned_grid(middle_frames(ours), captions, out / "ours.png", nrow=len(seeds))
    report = {"checkpoint": str(step_dir), "pipeline": type(pipe).__name__, "adapter": DIFFUSERS_LORA_FILE,
              "quantize": config.model.get("quantize"), "prompts": prompts, "seeds": seeds, "num_steps": num_steps,
              "transformer_max_abs_diff_vs_adapter_on_full_precision_base": export_diff,
              "transformer_max_abs_diff_vs_run_model": run_diff,
              "image_max_abs_diff_uint8": int((theirs.int() - ours.int()).abs().max()),
              "image_mean_abs_diff_uint8": float((theirs.float() - ours.float()).abs().mean())}
    (out / "pipeline.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def middle_frames(samples: torch.Tensor) -> torch.Tensor:
    """Decoded clips (N, F, H, W, 3) -> their middle frames, for the grids (images pass unchanged); the differences
    in pipeline.json cover every frame."""
    return samples[:, samples.shape[1] // 2] if samples.dim() == 5 else samples


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="an adapter run dir or checkpoint dir (its newest checkpoint)")
    parser.add_argument("--prompts", nargs="+", required=True, help="prompts to generate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="seeds per prompt (0 1 2 3)")
    parser.add_argument("--num-steps", type=int, default=12, help="sampling steps (12)")
    parser.add_argument("--out", default=None, help="output folder (default: <checkpoint dir>/diffusers)")
    args = parser.parse_args(argv)
    with user_errors(PromptError, PipelineError):
        out = Path(args.out) if args.out else find_checkpoint(args.checkpoint) / "diffusers"
        report = run(args.checkpoint, args.prompts, args.seeds, args.num_steps, out)
        print(json.dumps(report, indent=2))
        print(f"wrote {out / 'diffusers_pipeline.png'} and {out / 'ours.png'}")
