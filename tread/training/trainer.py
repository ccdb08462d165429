"""The Trainer: one object owns a training run. `Trainer.build(config, run_dir, accelerator)` makes its parts,
data, state, evaluator, log and summary (resuming when asked); `fit()` trains until max_steps, the time budget or
a stop signal, and returns the summary."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from accelerate import Accelerator
from tqdm.auto import tqdm

from tread.evaluation.evaluator import Evaluator
from tread.schema.metric_names import METRICS
from tread.models.quantize import quantize_mode
from tread.runtime.preempt import StopRequest, requeue_after, stop_on_signals
from tread.runtime.preempt import requeued
from tread.training.run_dir import prepare_run_dir
from tread.sampling.prompts import learned_unconditional
from tread.schema.train import TrainConfig
from tread.schema.tree import to_yaml
from tread.training.announce import announce
from tread.checkpoint.save import save_checkpoint
from tread.training.feature import Feature
from tread.training.features import build_features
from tread.training.progress import LogWindow, checkpoint_data_meta, due, time_budget_reached
from tread.training.repa import use_stored_targets, with_resolved
from tread.checkpoint.resume import check_resume, config_changes, read_resume, resume_plan
from tread.training.run_log import RunLog
from tread.data.info import DatasetInfo
from tread.training.setup import TrainingParts, build_parts, make_loader, open_dataset, seed_streams, uses_loss_mask
from tread.checkpoint.state import TrainingState
from tread.training.step import StepSettings, StepStats, TrainStep
from tread.training.summary import RunSummary
from tread.utils.threads import ThreadChoice, ThreadGovernor, cpu_threads


class Trainer:
    """A training run's parts and what the loop keeps between steps."""

    def __init__(self, config: TrainConfig, run_dir: Path, parts: TrainingParts, dataset: Any,
                 state: TrainingState, step_fn: TrainStep, evaluator: Optional[Evaluator], summary: RunSummary,
                 saved: dict[str, Any], resumed_from: Optional[Path], use_mask: bool, changes: dict[str, Any]):
        self.config, self.run_dir, self.parts, self.dataset = config, run_dir, parts, dataset
        self.state, self.step_fn, self.evaluator, self.summary = state, step_fn, evaluator, summary
        self.features: list[Feature] = step_fn.features
        self.saved = saved        # the config as checkpoints, config.yaml and the trackers keep it (REPA resolved)
        self.resumed_from, self.use_mask, self.changes = resumed_from, use_mask, changes   # for the start-up lines
        acc, train = parts.accelerator, config.train
        self.log = RunLog(run_dir, acc.is_main_process, list(train.log_with), saved["wandb"], saved,
                          step=state.step)
        self.train_sec_start = state.train_sec    # training time before this launch (resume continues the count)
        self.budget_sec = 60.0 * train.time_budget_min if train.time_budget_min else None
        self.out_of_time = self.budget_sec is not None and state.train_sec >= self.budget_sec
        self.governor = thread_governor(config, parts, summary.data["tokens_fraction"])   # None on a GPU
        self.threads: Optional[ThreadChoice] = None                                      # set when fit() starts

    @classmethod
    def build(cls, config: TrainConfig, run_dir: Path, accelerator: Accelerator,
              overrides: Optional[list[str]] = None) -> "Trainer":
        """Everything a run needs, checked before anything in the run dir is written: parts (routes validated
        against the model), data, the resumed checkpoint (every value checked against this run; a bad one falls
        back to the previous checkpoint), the evaluator, then the run dir prepared."""
        candidates = resume_plan(run_dir, config.resume, requeued())
        parts = build_parts(config, accelerator)
        dataset = open_dataset(config.data, parts.model, config.model.arch)
        repa = config.model.repa
        note = use_stored_targets(parts.repa, dataset, repa.targets if repa is not None else "auto",
                                  f"'{config.data.path}'")
        if note and accelerator.is_main_process:
            print(note, flush=True)
        use_mask = uses_loss_mask(config.train, dataset)
        step_fn = cls.make_step(config, parts, dataset, use_mask)
        state = TrainingState(parts.model, parts.ema.model, parts.optimizer, make_loader(config, dataset, accelerator),
                              accelerator.num_processes)
        saved = with_resolved(config.resolved, parts.repa)
        resume_from, resumed = read_resume(candidates, accelerator.process_index,
                                           lambda read, ckpt: check_resume(state, read, ckpt, saved))
        changes = config_changes(resumed["config"], saved) if resumed else {}
        evaluator = Evaluator(config.eval, dataset, config.paths.cache_dir, accelerator, parts.model,
                              config.model.text_encoders,
                              learned_unconditional(config.train.caption_dropout, config.train.caption_dropout_mode,
                                                    config.model.family)) if config.eval_on else None
        seed_streams(config.train.seed, config.routing.seed, parts.model, config.data_rank(accelerator.process_index))
        if resumed is not None:
            state.load_state_dict(resumed, adapter_only=resumed["adapter_only"], where=str(resume_from))
        if accelerator.is_main_process:
            prepare_run_dir(run_dir, to_yaml(saved), resumed)
        parts.prepare()
        summary = RunSummary(run_dir, overrides, config, parts.model, dataset, state.step, repa=parts.repa)
        summary.data["config_changes"] = changes
        summary.data["mixed_precision"] = accelerator.mixed_precision   # train.mixed_precision=auto resolved
        summary.data["compiled"] = parts.compiled                       # train.compile=auto resolved
        return cls(config, run_dir, parts, dataset, state, step_fn, evaluator, summary, saved, resume_from, use_mask,
                   changes)

    @staticmethod
    def make_step(config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo], use_mask: bool = False
                  ) -> TrainStep:
        """THE training step of a run's parts, with the features its config turns on: what fit() runs and what the
        benchmark and the route planner time (`dataset` None: their synthetic batches)."""
        settings = StepSettings.from_config(config, use_mask, dataset.meta if dataset is not None else None,
                                            parts.model.routing.enabled)
        return TrainStep(parts, settings, build_features(config, parts, dataset))

    def fit(self) -> dict[str, Any]:
        """Train to the end (max_steps, the time budget, or a stop signal: then a checkpoint right away); returns
        summary.json's content. An error is recorded in summary.json and raised."""
        acc, state = self.parts.accelerator, self.state
        with cpu_threads(None):                     # torch's thread count comes back after the run (tests)
            self.start_threads()
            announce(self)
            try:
                with stop_on_signals() as stop:
                    self.run_steps(stop)
            except Exception as err:  # noqa: BLE001 - summary.json says the run failed, and why; the error goes on up
                self.summary.fail(err, state.step, acc.is_main_process)
                raise
        result = self.summary.finish(state.step, state.train_sec, state.train_sec - self.train_sec_start,
                                     self.out_of_time, acc.is_main_process, preempted=stop.name,
                                     measured=(state.tokens_sum, state.tokens_steps),
                                     **{k: v for f in self.features for k, v in f.totals().items()})
        if stop.name is not None and acc.is_main_process:
            note = requeue_after(stop.signum, self.config.train.slurm_requeue)
            if note:
                tqdm.write(note)
        return result

    def run_steps(self, stop: StopRequest) -> None:
        """The loop with its progress bar."""
        bar = tqdm(total=self.config.train.max_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
                   disable=not self.parts.accelerator.is_main_process)
        try:
            self.loop_steps(stop, bar)
        finally:                                    # the bar ends its line, so an error message starts on its own
            bar.close()
            self.log.close()

    def loop_steps(self, stop: StopRequest, bar: tqdm) -> None:
        """A step, then whatever is due (log record, evaluation, checkpoint), until max_steps, the time budget or
        a stop signal (then a checkpoint right away)."""
        train, state, acc = self.config.train, self.state, self.parts.accelerator
        window = LogWindow(acc.device, {f.term: f.weight for f in self.features if f.term is not None})
        batches = iter(state.loader)
        self.parts.net.train()
        while state.step < train.max_steps and not self.out_of_time:
            seconds, stats = self.one_step(batches, window)
            bar.update(1)
            self.recheck_threads(bar)
            if self.budget_sec is not None:
                self.out_of_time = time_budget_reached(state, self.budget_sec, train.log_every_steps, acc)
            stopping = stop.agreed()
            ends = state.step == train.max_steps or self.out_of_time
            if state.step % train.log_every_steps == 0 or ends or stopping:
                self.log_record(window, stats, bar)
            paused = time.time()
            self.between_steps(ends, stopping, stop)
            window.exclude(time.time() - paused)    # evaluation and checkpoint time is not training throughput
            if stopping:
                bar.write(f"{stop.name or 'a stop signal on another process'}: checkpoint written at step "
                          f"{state.step}; stopping (resume=auto continues)")
                break

    def start_threads(self) -> None:
        """A CPU run's thread count for its first steps (summary.json keeps it and each later move: the last bits
        of a run depend on it)."""
        if self.governor is not None:
            self.threads = self.governor.start()
            self.summary.data.update(cpu_threads=self.threads.threads, cpu_thread_moves=[])

    def recheck_threads(self, bar: tqdm) -> None:
        """auto: the thread count follows the other processes' load (at most every RECHECK_SEC), said in one line."""
        moved = self.governor.recheck() if self.governor is not None else None
        if moved is not None:
            self.summary.data["cpu_thread_moves"].append([self.state.step, moved.threads])
            if self.parts.accelerator.is_main_process:
                bar.write(f"cpu threads: {moved.threads} from step {self.state.step} ({moved.why})")

    def one_step(self, batches: Any, window: LogWindow) -> tuple[float, StepStats]:
        """One optimizer update, counted: its seconds and stats."""
        state, start = self.state, time.time()
        stats = self.step_fn(batches, state.step)
        for feature in self.features:
            feature.after_update(stats.nonfinite)
        state.step += 1
        seconds = time.time() - start
        state.train_sec += seconds
        window.add(stats)
        self.summary.add_step(stats.grid if self.summary.bucket_names is not None else None, seconds,
                              stats.tokens_fraction)
        state.tokens_sum, state.tokens_steps = state.tokens_sum + stats.tokens_fraction, state.tokens_steps + 1
        return seconds, stats

    def between_steps(self, ends: bool, stopping: bool, stop: StopRequest) -> None:
        """The evaluation and checkpoint due after this step (train.step_offset shifts the numbering: the paper
        code's repro=paper sets 1)."""
        cfg, state = self.config, self.state
        step = state.step - cfg.train.step_offset
        if self.evaluator is not None and due(cfg.eval.every_steps, step, ends and cfg.eval.at_end):
            if stopping:   # a stop signal wants the checkpoint now; an evaluation can take longer than its grace
                self.skip_evaluation(stop.name or "a stop signal on another process")
            else:
                self.evaluate()
        if due(cfg.checkpoint.every_steps, step, ends or stopping):
            for feature in self.features:
                feature.before_checkpoint(state.step)
            self.checkpoint()

    def log_record(self, window: LogWindow, stats: StepStats, bar: tqdm) -> None:
        """A training record, with the features' keys (the guard's counts are read here, where the loop syncs
        anyway)."""
        record = window.record(self.state, stats.lr, self.summary.batch_at(self.state.step - 1),
                               self.parts.accelerator)
        warnings = [w for w in (f.log(record, self.state.step) for f in self.features) if w]
        self.log.log(record)
        if self.parts.accelerator.is_main_process:
            for line in warnings:
                bar.write(line)
        loss = record["loss"]
        bar.set_postfix(loss="n/a" if loss is None else f"{loss:.4f}", it_s=f"{record['steps_per_sec']:.2f}")

    def evaluate(self) -> None:
        """In-training evaluation of the EMA model: a record, a console line, and the FID in the summary."""
        state, acc = self.state, self.parts.accelerator
        record = {**self.evaluator(self.parts.ema, self.parts.diffusion, state.step, self.run_dir / "samples"),
                  "train_sec": state.train_sec}
        self.log.log(record)
        if acc.is_main_process:
            shown = ", ".join(f"{k} {record[k]:.4g}" for k in METRICS if k in record)
            tqdm.write(f"step {state.step} ({record['features']} features, {record['num_samples']} samples): {shown}")
        if "validation_grid" in record:   # the validation prompts' captioned grid, as an image on the trackers
            self.log.log_image("eval/validation", record["validation_grid"], state.step)
        if "validation_videos" in record:   # a video model's validation samples, one file each
            self.log.log_videos("eval/validation_video", record["validation_videos"], state.step)
        if "fid" in record:
            self.summary.add_fid(state.step, record["fid"])

    def skip_evaluation(self, reason: str) -> None:
        """The evaluation due at this step, skipped because the run stops here: recorded in metrics.jsonl (type
        "eval_skipped") and summary.json; the step's checkpoint is written, so `fid.py mode=bench` can evaluate
        it later."""
        step = self.state.step
        self.log.log({"type": "eval_skipped", "step": step, "reason": reason})
        self.summary.skip_eval(step, reason)
        if self.parts.accelerator.is_main_process:
            tqdm.write(f"step {step}: evaluation skipped ({reason}: stopping); the checkpoint of this step is "
                       f"written, fid.py mode=bench can evaluate it")

    def checkpoint(self) -> Path:
        """Save the run's state (checkpoint.layout: sharded or one set of files); adapter-only runs save the
        trainable weights alone. A quantized base implies adapter-only: it never trains, and the seeded build of a
        resume or of sampling quantizes the same base again."""
        cfg, model = self.config.checkpoint, self.parts.model
        adapter_only = cfg.adapter_only or quantize_mode(model) is not None
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} if adapter_only else None
        return save_checkpoint(self.parts.accelerator, self.run_dir, self.state, self.saved,
                               checkpoint_data_meta(self.dataset, model), cfg.keep_last, trainable,
                               self.config.sharded_checkpoints)


def thread_governor(config: TrainConfig, parts: TrainingParts, tokens_fraction: float) -> Optional[ThreadGovernor]:
    """torch's CPU threads for a run on the CPU (train.cpu_threads; auto caps them by the step's work: about 6
    FLOPs per parameter and processed token of a micro-batch); None on a GPU, where torch's default stays."""
    acc = parts.accelerator
    if acc.device.type != "cpu":
        return None
    params = sum(p.numel() for p in parts.model.parameters())
    step_flops = 6 * params * parts.model.num_tokens * tokens_fraction * config.micro_batch(acc.num_processes)
    return ThreadGovernor(config.train.cpu_threads, step_flops)

