"""The training loop as importable pieces: setup, step, evaluation, checkpointing.

`train(cfg, run_dir)` is what train.py calls; tests call it directly with tiny configs.
"""
from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from diffusion.guidance import GuidanceError
from data import LatentDatasetError, LatentLoader, build_dataset, draw_latents
from evaluation.metrics import METRICS
from routing import RouteConfigError, tokens_processed_fraction
from training import ConfigError
from training import checkpoint as ckpt_io
from training.ema import ema_decay_at, ema_update
from training.evaluate import Evaluator, decode_options, metric_names
from training.flops import model_forward_flops, train_step_flops
from training.metrics import MetricsLogger
from models.families.base import FamilyConfigError
from models.lora import LoraConfigError, adapter_state_dict, has_lora

MIXED_PRECISION = ("no", "bf16", "fp16")


# Errors that mean "your input is wrong": entry points print them without a traceback.
USER_ERRORS = (ConfigError, RouteConfigError, LatentDatasetError, FamilyConfigError, LoraConfigError, GuidanceError,
               FileNotFoundError, FileExistsError)


@dataclass
class TrainState:
    step: int = 0
    train_sec: float = 0.0   # training time over all segments of the run (resume continues it): the time budget


def validate_config(cfg: DictConfig, world_size: int) -> int:
    """Check the keys users set most; returns the per-process micro-batch size."""
    t = cfg.train
    for key in ("max_steps", "batch_size", "grad_accum_steps", "log_every_steps"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]!r} must be a positive integer.")
    budget = t.get("time_budget_min")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise ConfigError(f"train.time_budget_min={budget!r} must be null (no budget) or a positive number of "
                          f"minutes of training time.")
    if not 0.0 <= t.label_dropout < 1.0:
        raise ConfigError(f"train.label_dropout={t.label_dropout} must lie in [0, 1).")
    if not 0.0 <= cfg.ema.decay < 1.0:
        raise ConfigError(f"ema.decay={cfg.ema.decay} must lie in [0, 1).")
    for group in ("eval", "checkpoint"):
        if not isinstance(cfg[group].every_steps, int) or cfg[group].every_steps < 0:
            raise ConfigError(f"{group}.every_steps={cfg[group].every_steps!r} must be an integer >= 0 (0 disables).")
    if (cfg.eval.every_steps or cfg.eval.at_end) and cfg.eval.num_samples < 2:
        raise ConfigError(f"eval.num_samples={cfg.eval.num_samples} must be >= 2 to estimate a covariance.")
    metric_names(cfg.eval, "eval.metrics")
    decode_options(cfg.eval, "eval.")
    denom = world_size * t.grad_accum_steps
    if t.batch_size % denom:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is the global batch and must be divisible by "
            f"num_processes ({world_size}) x train.grad_accum_steps ({t.grad_accum_steps}) = {denom}.")
    return t.batch_size // denom


def build(node: DictConfig, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, re-raising our own config errors unwrapped so the user
    sees "routing.routes[0].selection_ratio=1.5 is out of range ..." first, not a Hydra trace."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, TypeError, FileNotFoundError)):
            raise err.__cause__ from None
        raise


def build_model_and_diffusion(cfg: DictConfig):
    """Instantiate backbone (routes validated here) and diffusion; return (diffusion, net)."""
    model = build(cfg.model)
    diffusion = build(cfg.diffusion)
    return diffusion, diffusion.precondition(model)


def backbone_of(net: nn.Module) -> nn.Module:
    return net.model


def drop_labels(labels: torch.Tensor, p: float, null_label: int) -> torch.Tensor:
    """Classifier-free guidance training: replace labels by the null class with probability p."""
    if p <= 0:
        return labels
    drop = torch.rand(labels.shape, device=labels.device) < p
    return torch.where(drop, torch.full_like(labels, null_label), labels)


def split_batch(batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x, y) or (x, y, extras) from the loader, on `device`; extras: text / text_mask / pooled / loss_mask."""
    x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
    extras = {k: v.to(device, non_blocking=True) for k, v in (batch[2] if len(batch) > 2 else {}).items()}
    return x, y, extras


def batch_conditioning(extras: dict, use_mask: bool) -> tuple[dict, Optional[torch.Tensor]]:
    """Split loader extras into model conditioning (text embeddings) and the loss mask (or None)."""
    cond = {k: extras[k] for k in ("text", "text_mask", "pooled") if k in extras}
    return cond, (extras.get("loss_mask") if use_mask else None)


def reduce_loss(loss: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of the unreduced loss (B, C, ...); with a loss mask (B, 1, h, w) in [0, 1], the mask-weighted mean
    over the covered latent cells (the mask is area-resized to the latent grid)."""
    if mask is None:
        return loss.mean()
    from data import resize_loss_mask
    weight = resize_loss_mask(mask, loss.shape[-2:]).to(loss.dtype)
    if loss.dim() == 5:  # video (B, C, T, H, W): the same mask for every frame
        weight = weight.unsqueeze(2)
    return (loss * weight).sum() / (weight.sum() * loss.shape[1]).clamp_min(1e-8)


def processed_fraction(model: nn.Module, num_tokens: int) -> float:
    """Fraction of token-block evaluations of the last forward (1.0 dense); force-kept tokens raise it."""
    stats = getattr(model, "last_route_stats", None) or []
    saved = sum((end - start + 1) * (total - kept) for start, end, kept, total in stats)
    return 1.0 - saved / (model.depth * num_tokens)


def maybe_compile(cfg: DictConfig, model: nn.Module, device: torch.device) -> bool:
    """torch.compile the backbone in place (train.compile: auto = only with CUDA). Parameter names and
    checkpoints are unchanged. Keep counts are static per route, so shapes never change between steps
    and nothing recompiles after the first step (tests/test_compile.py counts recompiles)."""
    setting = cfg.train.get("compile", "auto")
    if setting not in ("auto", True, False):
        raise ConfigError(f"train.compile={setting!r} is not allowed; use auto (on with CUDA), true or false.")
    mode = cfg.train.get("compile_mode")
    if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise ConfigError(f"train.compile_mode={mode!r} is not allowed; use null, default, reduce-overhead, "
                          f"max-autotune or max-autotune-no-cudagraphs.")
    if not (setting is True or (setting == "auto" and device.type == "cuda")):
        return False
    backend = cfg.train.get("compile_backend") or "inductor"
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ConfigError(f"train.compile_backend={backend!r} is not a torch.compile backend; available: "
                          f"{sorted(backends)}.")
    model.compile(backend=backend, mode=mode)
    return True


def check_loss_mask(cfg: DictConfig, dataset) -> bool:
    """Whether this run uses the data's loss masks (train.masked_loss: auto | true | false)."""
    setting = cfg.train.get("masked_loss", "auto")
    if setting not in ("auto", True, False):
        raise ConfigError(f"train.masked_loss={setting!r} is not allowed; use auto (use the data's loss masks when it "
                          f"has them), true (require them) or false (ignore them).")
    if not isinstance(cfg.train.get("mask_force_keep", True), bool):
        raise ConfigError(f"train.mask_force_keep={cfg.train.mask_force_keep!r} must be true or false.")
    has = (getattr(dataset, "conditioning", None) or {}).get("loss_mask") is not None
    if setting is True and not has:
        raise ConfigError(f"train.masked_loss=true but the data at '{dataset.root}' has no loss masks "
                          f"(loss_mask.npy); build it with --loss-masks, use data=toy_masked, or set "
                          f"train.masked_loss=auto.")
    return has and setting is not False


def check_run_dir(run_dir: Path, resume_from: Optional[Path], resume: Any) -> None:
    """Never overwrite a run: a directory with checkpoints needs resume=auto or another dir.
    Every process checks (before any collective), so none is left waiting at a barrier."""
    if resume_from is None and ckpt_io.list_checkpoints(run_dir):
        raise FileExistsError(
            f"Run directory '{run_dir}' already holds checkpoints and resume={resume!r}. Use resume=auto to continue "
            f"it, or a new hydra.run.dir to start fresh; nothing was overwritten.")


def train(cfg: DictConfig, run_dir: str | Path, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """Train per `cfg`, writing checkpoints, samples, metrics.jsonl and summary.json under `run_dir`;
    `overrides` (the command-line overrides, e.g. a sweep job's) are recorded in summary.json."""
    run_dir = Path(run_dir)
    if cfg.train.mixed_precision not in MIXED_PRECISION:  # before accelerate sees it
        raise ConfigError(f"train.mixed_precision={cfg.train.mixed_precision!r} is not allowed; "
                          f"use one of {list(MIXED_PRECISION)}.")
    # AcceleratorState is a process-wide singleton; clear it (keeping the process group)
    # so train() can run again in one process with other settings (tests, notebooks, sweeps).
    AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, cpu=cfg.train.cpu)
    rank, world = accelerator.process_index, accelerator.num_processes
    if world > 1:  # Hydra's ${now:...} run dirs differ between ranks started in different seconds: use rank 0's
        from accelerate.utils import broadcast_object_list
        run_dir = Path(broadcast_object_list([str(run_dir)], from_process=0)[0])
    micro_batch = validate_config(cfg, world)
    resume_from = ckpt_io.resolve_resume(cfg.resume, run_dir)
    check_run_dir(run_dir, resume_from, cfg.resume)

    # Routes are validated when the model is built: bad ones fail here, within seconds.
    torch.manual_seed(cfg.train.seed)                 # identical init on every process
    diffusion, net = build_model_and_diffusion(cfg)
    model = backbone_of(net)
    trainable_names(cfg, model)  # checkpoint.adapter_only without LoRA fails here, before any work
    # No main_process_first here: an error on one rank must not leave the others at a
    # barrier, and building the built-in data is atomic, so every rank may try.
    dataset = build_dataset(cfg.data)
    if (dataset.channels, dataset.resolution) != (model.in_channels, model.input_size):
        raise ConfigError(
            f"data at '{cfg.data.path}' is {dataset.channels}x{dataset.resolution}x{dataset.resolution} but the model "
            f"expects {model.in_channels}x{model.input_size}x{model.input_size} (model.in_channels/model.input_size).")
    if accelerator.is_main_process:
        for sub in ("checkpoints", "samples"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    evaluator = Evaluator(cfg.eval, dataset, cfg.paths.cache_dir, accelerator) \
        if (cfg.eval.every_steps or cfg.eval.at_end) else None

    ema = copy.deepcopy(net).requires_grad_(False).eval()
    compiled = maybe_compile(cfg, model, accelerator.device)  # after the EMA copy: evaluation stays eager
    # LoRA (model.lora) freezes the base weights: only parameters that require grad are optimised.
    optimizer = build(cfg.optimizer)(params=[p for p in net.parameters() if p.requires_grad])
    loader = LatentLoader(dataset, micro_batch, seed=cfg.train.seed, rank=rank, world_size=world,
                          num_workers=cfg.train.num_workers, pin_memory=accelerator.device.type == "cuda")
    state = TrainState()
    # Each process has its own training RNG stream; the router has its own generator too.
    torch.manual_seed(cfg.train.seed * 1_000_003 + rank)
    model.routing.router.manual_seed(int(cfg.routing.get("seed") or 0) * 1_000_003 + rank)
    if resume_from is not None:
        load_resume_state(resume_from, rank, net, ema, optimizer, loader, state)
    net, optimizer = accelerator.prepare(net, optimizer)
    ema.to(accelerator.device)

    logger = MetricsLogger(run_dir, accelerator.is_main_process, OmegaConf.to_container(cfg.wandb),
                           OmegaConf.to_container(cfg, resolve=True))
    num_tokens = model.num_tokens
    tokens_fraction = tokens_processed_fraction(model.routing.routes, model.depth, num_tokens)
    use_mask = check_loss_mask(cfg, dataset)
    # Text embeddings in the data condition the diffusers families; DiT is class-conditional and ignores them.
    takes_text = hasattr(model, "conditioning")
    # Theoretical training FLOPs (3 x forward, matmuls incl. attention) with the configured routes.
    sample_cond = None
    if takes_text and (getattr(dataset, "conditioning", None) or {}).get("text"):
        sample_cond = batch_conditioning(dataset.__getitems__([0])[2], False)[0]   # one sample's text
    flops_per_step = train_step_flops(model_forward_flops(model, sample_cond), cfg.train.batch_size)
    summary: dict[str, Any] = {
        "status": "running", "run_dir": str(run_dir), "overrides": list(overrides or []),
        "model": str(cfg.model.get("arch") or cfg.model.get("family")),
        "routes": [r.__dict__ for r in model.routing.routes], "start_step": state.step,
        "tokens_fraction": tokens_fraction, "train_flops_per_step": flops_per_step}
    if accelerator.is_main_process:
        routes = ", ".join(f"{r.selection_ratio:g} over blocks {r.start_layer_idx}..{r.end_layer_idx}"
                           for r in model.routing.routes) or "none (dense)"
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        tqdm.write(f"{cfg.model.arch} ({n_params:.2f}M params, {num_tokens} tokens, depth {model.depth}); routes: {routes}; "
                   f"tokens processed {100 * tokens_fraction:.1f}%\n"
                   f"data: {dataset.root} ({len(dataset)} samples) | world size {world}, global batch "
                   f"{cfg.train.batch_size} ({micro_batch} per micro-batch) | {accelerator.device}, "
                   f"mixed precision {cfg.train.mixed_precision}"
                   f"{', torch.compile (' + str(cfg.train.compile_backend) + ')' if compiled else ''}\n"
                   f"run dir: {run_dir}")
        if resume_from is not None:
            tqdm.write(f"Resumed from {resume_from} at step {state.step}.")
        if (getattr(dataset, "conditioning", None) or {}).get("text") and not takes_text:
            tqdm.write("note: the data has text embeddings but this model is class-conditional; they are ignored.")
        if use_mask:
            tqdm.write(f"masked loss: on (loss_mask.npy); masked tokens force-kept: "
                       f"{bool(cfg.train.mask_force_keep and model.routing.enabled)}")

    bar = tqdm(total=cfg.train.max_steps, initial=state.step, disable=not accelerator.is_main_process,
               desc="train", dynamic_ncols=True)
    null_label = model.num_classes
    window_loss = torch.zeros((), device=accelerator.device)
    window_steps, window_tokens, window_data, window_start, run_start = 0, 0.0, 0.0, time.time(), time.time()
    data_iter = iter(loader)
    net.train()
    tokens_sum = 0.0                     # measured token share, summed over steps
    train_sec_start = state.train_sec    # training time (evaluation/checkpoints excluded) before this launch
    budget_sec = 60.0 * cfg.train.time_budget_min if cfg.train.get("time_budget_min") else None
    out_of_time = budget_sec is not None and state.train_sec >= budget_sec  # a resumed run already past it
    while state.step < cfg.train.max_steps and not out_of_time:
        step_start = time.time()
        lr = set_lr(optimizer, cfg, state.step)
        for micro in range(cfg.train.grad_accum_steps):
            t_data = time.perf_counter()
            x, y, extras = split_batch(next(data_iter), accelerator.device)
            window_data += time.perf_counter() - t_data  # time the step waited for data (0 when prefetch keeps up)
            x = draw_latents(x, dataset.meta)  # moments data: one latent drawn per read (training RNG)
            y = drop_labels(y, cfg.train.label_dropout, null_label)
            cond, mask = batch_conditioning(extras, use_mask)
            kwargs = {"cond": cond} if cond and takes_text else {}
            if mask is not None and cfg.train.mask_force_keep and model.routing.enabled:
                kwargs["force_keep"] = model.tokens_from_mask(mask)      # tokens > half under the mask
            sync = micro == cfg.train.grad_accum_steps - 1
            with accelerator.no_sync(net) if not sync else contextlib.nullcontext():
                with accelerator.autocast():
                    loss = reduce_loss(diffusion.loss(net, x, y, **kwargs), mask)
                accelerator.backward(loss / cfg.train.grad_accum_steps)
            window_loss += loss.detach() / cfg.train.grad_accum_steps
            fraction = processed_fraction(model, num_tokens) / cfg.train.grad_accum_steps
            window_tokens += fraction
            tokens_sum += fraction
        if cfg.train.grad_clip:
            accelerator.clip_grad_norm_(net.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema_update(ema, accelerator.unwrap_model(net), ema_decay_at(state.step, cfg.ema.decay, cfg.ema.warmup))
        state.step += 1
        window_steps += 1
        state.train_sec += time.time() - step_start
        bar.update(1)
        if budget_sec is not None:
            out_of_time = time_budget_reached(state, budget_sec, cfg.train.log_every_steps, accelerator)
        last = state.step == cfg.train.max_steps or out_of_time

        if state.step % cfg.train.log_every_steps == 0 or last:
            elapsed = time.time() - window_start
            mean_loss = accelerator.reduce(window_loss, reduction="mean").item() / window_steps
            record = {"type": "train", "step": state.step, "loss": mean_loss, "lr": lr,
                      "steps_per_sec": window_steps / elapsed,
                      "images_per_sec": window_steps * cfg.train.batch_size / elapsed,
                      "tokens_fraction": window_tokens / window_steps, "data_wait_frac": window_data / elapsed,
                      "elapsed_sec": time.time() - run_start, "train_sec": state.train_sec}
            logger.log(record)
            bar.set_postfix(loss=f"{mean_loss:.4f}", it_s=f"{record['steps_per_sec']:.2f}")
            window_loss.zero_()
            window_steps, window_tokens, window_data, window_start = 0, 0.0, 0.0, time.time()

        if evaluator is not None and ((cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0)
                                      or (last and cfg.eval.at_end)):
            record = {**evaluator(ema, diffusion, state.step, run_dir / "samples"), "train_sec": state.train_sec}
            logger.log(record)
            if accelerator.is_main_process:
                shown = ", ".join(f"{k} {record[k]:.4g}" for k in METRICS if k in record)
                tqdm.write(f"step {state.step} ({record['features']} features, {record['num_samples']} samples): "
                           f"{shown}")
            if "fid" in record:
                summary.setdefault("fid", []).append((state.step, record["fid"]))
            window_start = time.time()  # evaluation time is not training throughput
        if (cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0) or last:
            save_checkpoint(accelerator, run_dir, cfg, state, net, ema, optimizer, loader, dataset.meta)
            window_start = time.time()
    bar.close()
    logger.close()
    steps_run = state.step - summary["start_step"]
    train_sec = state.train_sec - train_sec_start
    summary.update({"status": "completed", "final_step": state.step, "wall_sec": time.time() - run_start,
                    "stop_reason": "time_budget" if out_of_time else "max_steps",
                    "time_budget_min": cfg.train.get("time_budget_min"), "train_sec_total": state.train_sec,
                    "train_sec": train_sec, "steps_per_sec": steps_run / train_sec if train_sec else None,
                    "images_per_sec": steps_run * cfg.train.batch_size / train_sec if train_sec else None,
                    "train_flops_total": flops_per_step * steps_run,
                    "tokens_fraction_measured": tokens_sum / steps_run if steps_run else None})
    if accelerator.is_main_process:
        fids = [f for _, f in summary.get("fid", [])]
        summary.update({"final_fid": fids[-1] if fids else None, "best_fid": min(fids) if fids else None})
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    accelerator.wait_for_everyone()
    return summary


def time_budget_reached(state: TrainState, budget_sec: float, every: int, accelerator) -> bool:
    """Whether the run's training time has reached train.time_budget_min. One process decides alone at every
    step; with several, rank 0 decides at logging steps and broadcasts, so every rank stops at the same step
    (a per-step broadcast would add a host sync to every step)."""
    if accelerator.num_processes == 1:
        return state.train_sec >= budget_sec
    if state.step % every:
        return False
    flag = torch.tensor([float(state.train_sec >= budget_sec)], device=accelerator.device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


def trainable_names(cfg: DictConfig, model: nn.Module) -> Optional[set[str]]:
    """checkpoint.adapter_only: the names to save (trainable parameters); None saves everything."""
    if not cfg.checkpoint.get("adapter_only", False):
        return None
    if not has_lora(model):
        raise ConfigError("checkpoint.adapter_only=true needs LoRA adapters (model.lora={rank: ..., target_modules: "
                          "[...]}); without them every weight trains and must be saved.")
    return {n for n, p in model.named_parameters() if p.requires_grad}


def export_adapter(model: nn.Module, path: Path) -> None:
    """Write the LoRA adapter of `model`'s diffusers transformer as peft-format safetensors."""
    from safetensors.torch import save_file
    target = getattr(model, "transformer", model)
    state = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(target).items()}
    save_file(state, str(path))


def record_failure(run_dir: str | Path, overrides: list[str], err: BaseException) -> Path:
    """summary.json of a job that failed (sweeps go on; ablation_report lists it as failed)."""
    import traceback
    path = Path(run_dir) / "summary.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    summary = {**previous, "status": "failed", "run_dir": str(run_dir), "overrides": list(overrides),
               "error": f"{type(err).__name__}: {err}",
               "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    return path


def set_lr(optimizer: torch.optim.Optimizer, cfg: DictConfig, step: int) -> float:
    """Linear warm-up to the configured lr, then constant (the paper's schedule)."""
    base = cfg.optimizer.lr
    warm = cfg.train.lr_warmup_steps
    lr = base * min(1.0, (step + 1) / warm) if warm else base
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def save_checkpoint(accelerator, run_dir: Path, cfg: DictConfig, state: TrainState, net, ema, optimizer,
                    loader, data_meta: dict) -> Path:
    """Every process saves its RNG; the main process writes weights and renames the dir."""
    final = ckpt_io.checkpoint_dir(run_dir, state.step)
    tmp = ckpt_io.tmp_dir(final)
    accelerator.wait_for_everyone()
    raw = accelerator.unwrap_model(net)
    router = backbone_of(raw).routing.router
    ckpt_io.save_rank_rng(tmp, accelerator.process_index, {"router": router.state_dict()})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        config = OmegaConf.to_container(cfg, resolve=True)
        trainable = trainable_names(cfg, backbone_of(raw))
        model_state = {"step": state.step, "config": config, "data_meta": data_meta,
                       "model": ckpt_io.model_weights(backbone_of(raw), trainable),
                       "ema": ckpt_io.model_weights(backbone_of(ema), trainable), "adapter_only": trainable is not None}
        if has_lora(backbone_of(raw)):  # the EMA adapter alone in peft's format, for diffusers pipelines
            export_adapter(backbone_of(ema), tmp / "adapter_model.safetensors")
        train_state = {"step": state.step, "train_sec": state.train_sec, "optimizer": optimizer.state_dict(),
                       "loader": loader.state_dict(), "world_size": accelerator.num_processes}
        ckpt_io.finalize(final, model_state, train_state, cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()
    return final


def load_resume_state(ckpt: Path, rank: int, net, ema, optimizer, loader, state: TrainState) -> None:
    model_state = ckpt_io.load_model_file(ckpt)
    train_state, rng = ckpt_io.load_train_state(ckpt, rank)
    adapter_only = bool(model_state.get("adapter_only"))
    ckpt_io.load_model_weights(backbone_of(net), model_state["model"], adapter_only, str(ckpt))
    ckpt_io.load_model_weights(backbone_of(ema), model_state["ema"], adapter_only, str(ckpt))
    optimizer.load_state_dict(train_state["optimizer"])
    loader.load_state_dict(train_state["loader"])
    state.step = int(train_state["step"])
    state.train_sec = float(train_state.get("train_sec", 0.0))
    if rng is not None:  # a resume on a different process count starts fresh streams on new ranks
        ckpt_io.set_rng_state(rng)
        backbone_of(net).routing.router.load_state_dict(rng["router"])
