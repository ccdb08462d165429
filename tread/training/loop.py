"""The training loop: `train(cfg, run_dir)` is what train.py calls; tests call it directly with tiny configs.

    check the config -> set up (accelerator, run dir, model, data, evaluator) -> resume -> loop -> finish

Each step is tread.training.step.TrainStep; logging, evaluation, checkpoints and the time budget happen between
steps, and their time is not counted as training time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from tread.evaluation.evaluator import Evaluator
from tread.evaluation.metric_names import METRICS
from tread.models.quantize import quantize_mode
from tread.runtime.collectives import watch_collectives
from tread.sampling.prompts import learned_unconditional
from tread.runtime.preempt import StopRequest, requeue_after, stop_on_signals
from tread.runtime.run_dir import (clean_run_dir, config_changes, describe_changes, lock_run_dir,
                                   read_resume, resume_plan, shared_run_dir, trim_metrics)
from tread.schema import check_train, check_train_files
from tread.training.checkpoint import save_checkpoint
from tread.training.ema import EMA_NOTES
from tread.training.guard import NonFiniteGuard
from tread.training.repa import use_stored_targets
from tread.training.resume_check import check_resume
from tread.training.run_log import RunLog
from tread.training.setup import (TrainingParts, build_parts, ensure_dirs, make_accelerator, make_loader,
                                  mixed_precision, micro_batch_size, open_dataset, seed_streams, uses_loss_mask)
from tread.training.state import TrainingState
from tread.training.step import StepSettings, StepStats, TrainStep
from tread.training.summary import RunSummary
from tread.utils.io import WriteError, atomic_write_text


def train(cfg: DictConfig, run_dir: str | Path, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """Train per `cfg`, writing checkpoints, samples, metrics.jsonl and summary.json under `run_dir`;
    `overrides` (the command-line overrides, e.g. a sweep job's) are recorded in summary.json. A stop signal
    ends the run at the next step with a checkpoint and status "preempted" ("interrupted" for Ctrl-C)
    (tread/runtime/preempt.py)."""
    check_train(cfg)                                          # every key, before any work
    check_train_files(cfg)
    accelerator = make_accelerator(cfg.train)
    micro_batch_size(cfg.train, accelerator.num_processes)    # the batch splits over processes and accumulation
    with watch_collectives(cfg.train.collective_timeout_min):  # a stopped or lost rank is named, not waited for
        run_dir = shared_run_dir(Path(run_dir))
        with lock_run_dir(run_dir, accelerator.is_main_process):  # one launch at a time in a run dir
            return _train(cfg, run_dir, overrides, accelerator)


def _train(cfg: DictConfig, run_dir: Path, overrides: Optional[list[str]], accelerator: Accelerator) -> dict:
    candidates = resume_plan(run_dir, cfg.resume)
    parts = build_parts(cfg, accelerator)                     # routes are validated here, within seconds
    dataset = open_dataset(cfg, parts.model)
    note = use_stored_targets(parts.repa, dataset, (cfg.model.get("repa") or {}).get("targets") or "auto",
                              f"'{cfg.data.path}'")
    if note and accelerator.is_main_process:
        print(note, flush=True)
    use_mask = uses_loss_mask(cfg, dataset)
    settings = StepSettings.from_config(cfg, use_mask, dataset.meta, parts.model.routing.enabled, dataset)
    state = TrainingState(parts.model, parts.ema.model, parts.optimizer, make_loader(cfg, dataset, accelerator),
                          accelerator.num_processes)
    # Every value of the checkpoint is checked against this run (a bad one: the previous checkpoint), and loaded,
    # before anything in the run dir is written.
    config = OmegaConf.to_container(cfg, resolve=True)
    resume_from, resumed = read_resume(candidates, accelerator.process_index,
                                       lambda read, ckpt: check_resume(state, read, ckpt, config))
    changes = config_changes(resumed["config"], config) if resumed else {}
    evaluator = Evaluator(cfg.eval, dataset, cfg.paths.cache_dir, accelerator, parts.model, cfg.model,
                          learned_unconditional(cfg)) \
        if eval_on(cfg) else None
    seed_streams(cfg, parts.model, accelerator.process_index)
    if resumed is not None:
        state.load_state_dict(resumed, adapter_only=resumed["adapter_only"], where=str(resume_from))
    if accelerator.is_main_process:
        prepare_run_dir(run_dir, cfg, resumed)
    parts.prepare()
    step = TrainStep(parts, settings)
    summary = RunSummary(run_dir, overrides, cfg, parts.model, dataset, state.step, repa=parts.repa)
    summary.data["config_changes"] = changes
    summary.data["mixed_precision"] = parts.accelerator.mixed_precision   # train.mixed_precision=auto resolved
    summary.data["compiled"] = parts.compiled                             # train.compile=auto resolved
    run = Run(cfg, run_dir, parts, dataset, state, evaluator, summary)
    announce(run, resume_from, use_mask, changes)
    try:
        with stop_on_signals() as stop:
            run_steps(run, step, stop)
    except Exception as err:  # noqa: BLE001 - summary.json says the run failed, and why; the error goes on up
        run.summary.fail(err, state.step, accelerator.is_main_process)
        raise
    result = run.summary.finish(state.step, state.train_sec, state.train_sec - run.train_sec_start, run.out_of_time,
                                cfg, accelerator.is_main_process, preempted=stop.name,
                                nonfinite_skips=run.nonfinite_skips, measured=(state.tokens_sum, state.tokens_steps))
    if stop.name is not None and accelerator.is_main_process:
        note = requeue_after(stop.signum, cfg.train.slurm_requeue)
        if note:
            tqdm.write(note)
    return result


def eval_on(cfg: Any) -> bool:
    return bool(cfg.eval.every_steps or cfg.eval.at_end)


def prepare_run_dir(run_dir: Path, cfg: DictConfig, resumed: Optional[dict]) -> None:
    """Main process: remove what an interrupted launch left, cut metrics.jsonl back to the resumed step, write
    config.yaml."""
    try:
        _prepare_run_dir(run_dir, cfg, resumed)
    except WriteError:
        raise
    except OSError as err:              # a full or read-only disk: one line naming the file (or the run dir)
        raise WriteError(err.errno, err.strerror or str(err), str(err.filename or run_dir)) from err


def _prepare_run_dir(run_dir: Path, cfg: DictConfig, resumed: Optional[dict]) -> None:
    ensure_dirs(run_dir)
    for name in clean_run_dir(run_dir):
        tqdm.write(f"removed {run_dir / 'checkpoints' / name} (left by an interrupted launch)")
    step = int(resumed["step"]) if resumed is not None else 0
    dropped = trim_metrics(run_dir, step)
    if dropped:
        tqdm.write(f"metrics.jsonl: dropped {dropped} record(s) after step {step} (logged by an interrupted launch "
                   f"after its last checkpoint; those steps are trained and logged again)")
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))   # whole, or WriteError


@dataclass
class Run:
    """A training run's pieces and what the loop keeps between steps."""

    cfg: Any
    run_dir: Path
    parts: TrainingParts
    dataset: Any
    state: TrainingState
    evaluator: Optional[Evaluator]
    summary: RunSummary
    log: RunLog = field(init=False)
    train_sec_start: float = field(init=False)   # training time before this launch (resume continues the count)
    out_of_time: bool = False
    guard: NonFiniteGuard = field(init=False)
    nonfinite_skips: int = 0

    def __post_init__(self) -> None:
        acc = self.parts.accelerator
        self.log = RunLog(self.run_dir, acc.is_main_process, list(self.cfg.train.log_with),
                          OmegaConf.to_container(self.cfg.wandb), OmegaConf.to_container(self.cfg, resolve=True),
                          step=self.state.step)
        self.train_sec_start = self.state.train_sec
        budget = self.cfg.train.time_budget_min
        self.budget_sec = 60.0 * budget if budget else None
        self.out_of_time = self.budget_sec is not None and self.state.train_sec >= self.budget_sec
        self.guard = NonFiniteGuard(self.cfg.train.nonfinite, self.cfg.train.max_nonfinite_skips, acc.device)


def reference_share(run: Run) -> str:
    """With a never-routed reference (FLUX Kontext, Qwen-Image-Edit, FLUX.2 editing), the share of all image tokens
    processed: the target share above counts only the routable half of the sequence."""
    share = run.summary.data.get("tokens_fraction_with_reference")
    if share is None:
        return ""
    return f" of the target's, {100 * share:.1f}% of all image tokens (the reference is never routed)"


def announce(run: Run, resume_from: Optional[Path], use_mask: bool, changes: dict) -> None:
    """The start-up lines: model, routes, data, devices, run dir."""
    cfg, model, acc, dataset = run.cfg, run.parts.model, run.parts.accelerator, run.dataset
    if not acc.is_main_process:
        return
    routes = ", ".join(f"{r.selection_ratio:g} over blocks {r.start_layer_idx}..{r.end_layer_idx}"
                       for r in model.routing.routes) or "none (dense)"
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    compiled = f", torch.compile ({cfg.train.compile_backend})" if run.parts.compiled else ""
    precision_why = mixed_precision(cfg.train.mixed_precision, acc.device)[1]
    tqdm.write(f"{cfg.model.arch} ({n_params:.2f}M params, {model.num_tokens} tokens, depth {model.depth}); routes: "
               f"{routes}; tokens processed {100 * run.summary.data['tokens_fraction']:.1f}%{reference_share(run)}\n"
               f"data: {dataset.root} ({len(dataset)} samples) | world size {acc.num_processes}, global batch "
               f"{cfg.train.batch_size} ({micro_batch_size(cfg.train, acc.num_processes)} per micro-batch) | "
               f"{acc.device}, mixed precision {acc.mixed_precision} ({precision_why}){compiled}\n"
               f"run dir: {run.run_dir}")
    if hasattr(dataset, "buckets"):
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
    if (getattr(dataset, "conditioning", None) or {}).get("text") and not hasattr(model, "conditioning"):
        tqdm.write("note: the data has text embeddings but this model is class-conditional; they are ignored.")
    if use_mask:
        tqdm.write(f"masked loss: on (loss_mask.npy); masked tokens force-kept: "
                   f"{bool(cfg.train.mask_force_keep and model.routing.enabled)}")
    if cfg.ema.get("mode", "full") in EMA_NOTES:
        tqdm.write(EMA_NOTES[cfg.ema.mode])


def run_steps(run: Run, step_fn: TrainStep, stop: StopRequest) -> None:
    """The loop with its progress bar."""
    bar = tqdm(total=run.cfg.train.max_steps, initial=run.state.step, desc="train", dynamic_ncols=True,
               disable=not run.parts.accelerator.is_main_process)
    try:
        loop_steps(run, step_fn, stop, bar)
    finally:                                    # the bar ends its line, so an error message starts on its own
        bar.close()
        run.log.close()


def loop_steps(run: Run, step_fn: TrainStep, stop: StopRequest, bar: tqdm) -> None:
    """A step, then whatever is due (log record, evaluation, checkpoint), until max_steps, the time budget or a
    stop signal (then a checkpoint right away)."""
    cfg, state, acc = run.cfg, run.state, run.parts.accelerator
    window = LogWindow(acc.device, run.parts.repa.weight if run.parts.repa is not None else 0.0)
    batches = iter(state.loader)
    run.parts.net.train()
    while state.step < cfg.train.max_steps and not run.out_of_time:
        start = time.time()
        stats = step_fn(batches, state.step)
        run.guard.update(stats.nonfinite)
        state.step += 1
        seconds = time.time() - start
        state.train_sec += seconds
        window.add(stats)
        run.summary.add_step(stats.grid if run.summary.bucket_names is not None else None, seconds,
                             stats.tokens_fraction)
        state.tokens_sum, state.tokens_steps = state.tokens_sum + stats.tokens_fraction, state.tokens_steps + 1
        bar.update(1)
        if run.budget_sec is not None:
            run.out_of_time = time_budget_reached(state, run.budget_sec, cfg.train.log_every_steps, acc)
        stopping = stop.agreed()
        ends = state.step == cfg.train.max_steps or run.out_of_time
        last = ends or stopping
        if state.step % cfg.train.log_every_steps == 0 or last:
            log_record(run, window, stats, bar)
        paused = time.time()
        step = state.step - cfg.train.step_offset            # the paper code's numbering: repro=paper sets 1
        if run.evaluator is not None and due(cfg.eval.every_steps, step, ends and cfg.eval.at_end):
            if stopping:   # a stop signal wants the checkpoint now; an evaluation can take longer than its grace
                skip_evaluation(run, stop.name or "a stop signal on another process")
            else:
                evaluate(run)
        if due(cfg.checkpoint.every_steps, step, last):
            run.nonfinite_skips += run.guard.check(state.step)    # never checkpoint past a stop condition
            checkpoint(run)
        window.exclude(time.time() - paused)    # evaluation and checkpoint time is not training throughput
        if stopping:
            bar.write(f"{stop.name or 'a stop signal on another process'}: checkpoint written at step {state.step}; "
                      f"stopping (resume=auto continues)")
            break


def log_record(run: Run, window: "LogWindow", stats: StepStats, bar: tqdm) -> None:
    """A training record (the guard's counts are read here, where the loop syncs anyway)."""
    skipped = run.guard.check(run.state.step)
    run.nonfinite_skips += skipped
    record = window.record(run.state, stats.lr, run.summary.batch_at(run.state.step - 1), run.parts.accelerator)
    record["nonfinite_skips"] = skipped
    if run.parts.repa is not None:        # this process's seconds on REPA targets in the window (decode + encoder)
        record["repa_target_sec"] = run.parts.repa.timer.take()
    run.log.log(record)
    if skipped and run.parts.accelerator.is_main_process:
        bar.write(f"warning: {skipped} step(s) before step {run.state.step} had a non-finite loss or gradient norm; "
                  f"their updates were skipped (train.nonfinite={run.cfg.train.nonfinite})")
    loss = record["loss"]
    bar.set_postfix(loss="n/a" if loss is None else f"{loss:.4f}", it_s=f"{record['steps_per_sec']:.2f}")


def due(every: int, step: int, anyway: bool) -> bool:
    """Whether a periodic action fires after update `step` (less train.step_offset): every `every` steps from `every`
    on (0: never), or `anyway`."""
    return bool(anyway or (every and step > 0 and step % every == 0))


class LogWindow:
    """Training records average over the steps since the previous record: loss, throughput, token share."""

    def __init__(self, device: torch.device, repa_weight: float = 0.0):
        self.repa_weight = repa_weight               # model.repa.weight: loss = diffusion loss + weight x REPA term
        self.sums = torch.zeros(3, device=device)    # (loss, count, REPA term) summed over steps with a finite loss
        self.repa = False                            # whether the steps report a REPA term (model.repa)
        self.run_start = time.time()
        self.restart()

    def restart(self) -> None:
        self.steps, self.tokens, self.data_sec, self.start = 0, 0.0, 0.0, time.time()
        self.sums.zero_()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (spent on evaluation or checkpoints) out of the window's elapsed time."""
        self.start += seconds

    def add(self, stats: StepStats) -> None:
        finite = 1.0 - stats.nonfinite
        repa = stats.repa_loss if stats.repa_loss is not None else torch.zeros_like(stats.loss)
        self.repa = stats.repa_loss is not None
        self.sums += torch.stack([torch.where(finite > 0, stats.loss, 0.0), finite,      # on the device: no sync
                                  torch.where(finite > 0, repa, 0.0)])
        self.steps += 1
        self.tokens += stats.tokens_fraction
        self.data_sec += stats.data_sec

    def record(self, state: TrainingState, lr: float, batch_size: int, accelerator: Accelerator) -> dict[str, Any]:
        """The record of this window (one host sync: the loss mean over processes and finite steps; None when
        every step was skipped); starts the next window."""
        elapsed = time.time() - self.start
        loss_sum, count, repa_sum = accelerator.reduce(self.sums, reduction="sum").tolist()
        mean_loss = loss_sum / count if count else None
        record = {"type": "train", "step": state.step, "loss": mean_loss, "lr": lr,
                  "steps_per_sec": self.steps / elapsed, "images_per_sec": self.steps * batch_size / elapsed,
                  "tokens_fraction": self.tokens / self.steps, "data_wait_frac": self.data_sec / elapsed,
                  "elapsed_sec": time.time() - self.run_start, "train_sec": state.train_sec}
        if self.repa:   # the alignment term inside `loss` (loss = diffusion loss + model.repa.weight x repa_loss)
            record["repa_loss"] = repa_sum / count if count else None
            record["diffusion_loss"] = mean_loss - self.repa_weight * record["repa_loss"] if count else None
        self.restart()
        return record


def evaluate(run: Run) -> None:
    """In-training evaluation of the EMA model: a record, a console line, and the FID in the summary."""
    state, acc = run.state, run.parts.accelerator
    record = {**run.evaluator(run.parts.ema, run.parts.diffusion, state.step, run.run_dir / "samples"),
              "train_sec": state.train_sec}
    run.log.log(record)
    if acc.is_main_process:
        shown = ", ".join(f"{k} {record[k]:.4g}" for k in METRICS if k in record)
        tqdm.write(f"step {state.step} ({record['features']} features, {record['num_samples']} samples): {shown}")
    if "validation_grid" in record:   # the validation prompts' captioned grid, as an image on the trackers
        run.log.log_image("eval/validation", record["validation_grid"], state.step)
    if "validation_videos" in record:   # a video model's validation samples, one file each
        run.log.log_videos("eval/validation_video", record["validation_videos"], state.step)
    if "fid" in record:
        run.summary.add_fid(state.step, record["fid"])


def skip_evaluation(run: Run, reason: str) -> None:
    """The evaluation due at this step, skipped because the run stops here: recorded in metrics.jsonl (type
    "eval_skipped") and summary.json ("eval_skipped"); the step's checkpoint is written, so `fid.py mode=bench`
    can evaluate it later."""
    step = run.state.step
    run.log.log({"type": "eval_skipped", "step": step, "reason": reason})
    run.summary.skip_eval(step, reason)
    if run.parts.accelerator.is_main_process:
        tqdm.write(f"step {step}: evaluation skipped ({reason}: stopping); the checkpoint of this step is written, "
                   f"fid.py mode=bench can evaluate it")


def checkpoint(run: Run) -> Path:
    """Save the run's state (checkpoint.layout: sharded or one set of files); adapter-only runs save the trainable
    weights alone. A quantized base
    (model.quantize) implies adapter-only: it never trains, and the seeded build of a resume or of sampling
    quantizes the same base again."""
    cfg = run.cfg
    adapter_only = cfg.checkpoint.adapter_only or quantize_mode(run.parts.model) is not None
    trainable = {n for n, p in run.parts.model.named_parameters() if p.requires_grad} if adapter_only else None
    layout = cfg.checkpoint.layout
    sharded = layout == "sharded" or (layout == "auto" and cfg.train.parallel == "fsdp")
    return save_checkpoint(run.parts.accelerator, run.run_dir, run.state, OmegaConf.to_container(cfg, resolve=True),
                           checkpoint_data_meta(run.dataset, run.parts.model), cfg.checkpoint.keep_last, trainable,
                           sharded)


def checkpoint_data_meta(dataset: Any, model: Any) -> dict:
    """The data meta a checkpoint keeps (sampling reads its shape, classes and decoding): the data's; for
    bucketed data the buckets' shared meta at the model's square default grid (video: model.frames latent frames),
    with the bucket names."""
    if not hasattr(dataset, "buckets"):
        return dataset.meta
    meta = dataset.meta
    size = [model.input_size, model.input_size]
    video = meta.get("video")
    if video is None:
        return {**meta, "shape": [meta["shape"][0], *size], "buckets": [b.name for b in dataset.buckets]}
    frames = int(model.frames)            # video buckets: the model's default clip, T latent frames
    video = {**video, "frames": (frames - 1) * int(video.get("temporal_factor", 1)) + 1}
    return {**meta, "shape": [meta["shape"][0], frames, *size], "video": video,
            "buckets": [b.name for b in dataset.buckets]}


def time_budget_reached(state: TrainingState, budget_sec: float, every: int, accelerator: Accelerator) -> bool:
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
