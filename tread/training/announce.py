"""The start-up lines of a training run: model, routes, data, devices, run dir, resume and notes."""
from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from tread.checkpoint.resume import describe_changes
from tread.training.ema import EMA_NOTES
from tread.training.setup import mixed_precision


def reference_share(run: Any) -> str:
    """With a never-routed reference (FLUX Kontext, Qwen-Image-Edit, FLUX.2 editing), the share of all image tokens
    processed: the target share above counts only the routable half of the sequence."""
    share = run.summary.data.get("tokens_fraction_with_reference")
    if share is None:
        return ""
    return f" of the target's, {100 * share:.1f}% of all image tokens (the reference is never routed)"


def announce(run: Any) -> None:
    """The start-up lines of a Trainer: model, routes, data, devices, run dir."""
    cfg, model, acc, dataset = run.config, run.parts.model, run.parts.accelerator, run.dataset
    resume_from, use_mask, changes = run.resumed_from, run.use_mask, run.changes
    if not acc.is_main_process:
        return
    routes = ", ".join(f"{r.selection_ratio:g} over blocks {r.start_layer_idx}..{r.end_layer_idx}"
                       for r in model.routing.routes) or "none (dense)"
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    compiled = f", torch.compile ({cfg.train.compile_backend})" if run.parts.compiled else ""
    precision_why = mixed_precision(cfg.train.mixed_precision, acc.device)[1]
    tqdm.write(f"{cfg.model.arch} ({n_params:.2f}M params, {model.num_tokens} tokens, depth {model.depth}); routes: "
               f"{routes}; tokens processed {100 * run.summary.data['tokens_fraction']:.1f}%{reference_share(run)}\n"
               f"data: {dataset.root} ({len(dataset)} samples) | world size {acc.num_processes}{context_groups(cfg, acc)}, "
               f"global batch "
               f"{cfg.train.batch_size} ({cfg.micro_batch(acc.num_processes)} per micro-batch) | "
               f"{acc.device}, mixed precision {acc.mixed_precision} ({precision_why}){compiled}\n"
               f"run dir: {run.run_dir}")
    if run.threads is not None:
        tqdm.write(f"cpu threads: {run.threads.threads} ({run.threads.why})")
    if dataset.buckets is not None:
        tqdm.write("buckets (image width x height: samples): " + ", ".join(
            f"{b.name}: {n}" for b, n in zip(dataset.buckets, dataset.bucket_sizes)))
    phases = run.summary.data.get("schedule")
    if phases:
        tqdm.write("routing schedule: " + "; ".join(
            f"steps {p['start_step']}-{'' if p['end_step'] is None else p['end_step'] - 1}: {p['routes']}"
            for p in phases))
    if resume_from is not None:
        tqdm.write(f"Resumed from {resume_from} at step {run.state.step}.")
        if changes:
            tqdm.write(f"config changes since that checkpoint: {describe_changes(changes)}")
    if (dataset.conditioning or {}).get("text") and not model.text_conditioned:
        tqdm.write("note: the data has text embeddings but this model is class-conditional; they are ignored.")
    if use_mask:
        tqdm.write(f"masked loss: on (loss_mask.npy); masked tokens force-kept: "
                   f"{bool(cfg.train.mask_force_keep and model.routing.enabled)}")
    if cfg.ema.mode in EMA_NOTES:
        tqdm.write(EMA_NOTES[cfg.ema.mode])


def context_groups(cfg: Any, acc: Any) -> str:
    """The start-up line's note of train.context_parallel: how the processes group (nothing without a split)."""
    degree = cfg.train.context_parallel.degree
    if degree == 1:
        return ""
    groups = cfg.data_world(acc.num_processes)
    return f" ({groups} context group{'s' if groups > 1 else ''} of {degree}: one sequence over each)"
