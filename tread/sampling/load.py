"""Loading a checkpoint for inference (sample.py, fid.py mode=bench): the backbone and objective its config
describes, built with the one model builder, with its EMA (or raw) weights."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from tread.data import LatentDatasetError, build_dataset
from tread.schema.builders import build_diffusion, build_model
from tread.checkpoint.saved_config import SavedConfig, check_saved_config
from tread.models.lora import load_weights, weights_mismatch
from tread.sampling.generate import CondFn, text_conditioning_for_seeds
from tread.sampling.guidance import backbone
from tread.checkpoint.files import WEIGHT_FILES, CheckpointError, find_checkpoint, load_model_file


def load_for_inference(checkpoint: str | Path, use_ema: bool = True, device: str | torch.device = "cpu"):
    """-> (net, diffusion, data_meta, config: SavedConfig) from a run dir, a checkpoint dir or a file in it."""
    path = find_checkpoint(checkpoint)
    state = load_model_file(path)       # tensors and plain data only; foreign `_target_`s are refused
    config = check_saved_config(state["config"], path)
    torch.manual_seed(config.seed)      # the training's initialisation: the base of adapter-only checkpoints
    model = build_model(config.model.plain())
    which = "ema" if use_ema else "model"
    problem = weights_mismatch(state[which], model.state_dict(), bool(state.get("adapter_only")))
    if problem:
        raise CheckpointError(f"'{path / WEIGHT_FILES[which]}': {problem}; it is not a checkpoint of the model its "
                              f"config builds, or it is corrupt")
    load_weights(model, state[which], bool(state.get("adapter_only")), str(path))
    diffusion = build_diffusion(config.diffusion.plain())
    net = diffusion.precondition(model).to(device).eval().requires_grad_(False)
    return net, diffusion, state["data_meta"], config


def text_conditioning(net, meta: dict, saved: SavedConfig) -> Optional[CondFn]:
    """For a text-conditioned checkpoint, a cond_fn(seeds) giving sample i the text embeddings (and Kontext
    references) of training item i mod N; None for class-conditional checkpoints."""
    from_data = (meta.get("conditioning") or {}).get("text") or "reference_latents" in (meta.get("files") or {})
    if not backbone(net).text_conditioned or not from_data:
        return None
    try:
        dataset = build_dataset(saved.data)
    except (LatentDatasetError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"this checkpoint is text-conditioned: samples take their text embeddings (reference latents) from the "
            f"training data "
            f"(data.path={saved.data.get('path')!r}), which cannot be read here: {err}") from None
    return text_conditioning_for_seeds(dataset, net)
