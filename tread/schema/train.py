"""The training config (configs/train.yaml and its groups), checked once at start-up: `check_train`."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from omegaconf import DictConfig
from pydantic import Field

from tread.encoders.dinov2 import FDD_DINOV2, check_dinov2_folder
from tread.encoders.videomae import check_videomae_folder
from tread.schema.base import (SEED_LIMIT, ConfigError, Flag, Number, PositiveNumber, Section, check, check_dirs, key,
                               one_of, show)
from tread.schema.builders import section_types
from tread.schema.data import DATA, LatentsData, WdsData
from tread.schema.model import (SPRINT_TARGET, AdamW, AdamW8bit, DiTModel, EDMConfig,
                                FamilyModel, RFConfig, Routing)
from tread.schema.phases import TrainPhases
from tread.schema.sampling import (NEGATIVE_PROMPT, PROMPTS, DecodeSettings, MetricSettings, Prompt, SamplingSettings,
                             check_guidance)
from tread.schema.tree import container, pick
from tread.utils.threads import MAX_CPU_THREADS

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
WANDB_MODES = ("disabled", "offline", "online")
NONFINITE = ("skip", "stop")
TRACKERS = ("wandb", "tensorboard")   # train.log_with: accelerate's trackers (tread/training/run_log.py)
PARALLEL = ("ddp", "fsdp")
CONTEXT_MODES = ("ulysses", "ring")   # train.context_parallel.mode (tread/runtime/context_parallel.py)
EMA_MODES = ("full", "trained", "cpu", "off")   # ema.mode (tread/training/ema.py make_ema)


class Fsdp(Section):
    """train.fsdp (read with train.parallel=fsdp: tread/training/fsdp.py)"""

    reshard_after_forward: Flag = key("true (free a block's gathered weights after its forward and gather them "
                                      "again in backward: least memory) or false (keep them to backward: one "
                                      "all-gather less per block, more memory)")
    cpu_offload: Flag = key("true (sharded weights, gradients and optimizer state live in host memory; CUDA "
                            "only) or false")


class ContextParallelSettings(Section):
    """train.context_parallel (tread/training/context_parallel.py; docs/scaling.md)"""

    degree: int = key("a positive integer dividing the number of processes (processes one sample's sequence is "
                      "split over; 1: none)", ge=1, default=1)
    mode: Literal[CONTEXT_MODES] = key("ulysses (attention heads exchanged by all-to-all: the degree divides the "
                                       "heads) or ring (key/value blocks passed round the group; CUDA)",
                                       default="ulysses")


class Train(Section):
    """train"""

    max_steps: int = key("a positive integer (optimizer steps)", ge=1)
    time_budget_min: Optional[Number] = key("null (no budget) or a positive number of minutes of training time",
                                            gt=0)
    batch_size: int = key("a positive integer (the global batch over processes and accumulation)", ge=1)
    grad_accum_steps: int = key("a positive integer (micro-batches per optimizer step)", ge=1)
    seed: int = key("an integer in [0, 2**32) (run seed: init, noise, label dropout, data order)", ge=0,
                    lt=SEED_LIMIT)
    mixed_precision: Literal[MIXED_PRECISION] = key(one_of(MIXED_PRECISION) + " (auto: bf16 where the device "
                                                    "multiplies bf16 natively, else no)")
    tf32: Flag = key("true (fp32 matmuls and convolutions on CUDA in TensorFloat-32) or false (full fp32)")
    grad_clip: Optional[Number] = key("null (no clipping) or a max gradient norm > 0", gt=0)
    label_dropout: Number = key("a probability in [0, 1)", ge=0, lt=1)
    caption_dropout: Number = key("a probability in [0, 1) (text data: a sample's caption is replaced by the "
                                  "unconditional input; needs a text-conditioned model.family)", ge=0, lt=1,
                                  default=0.0)
    caption_dropout_mode: Literal["auto", "empty", "zeros"] = key(
        "auto (the family pipeline's unconditional input: docs/data.md), empty (the encoded empty prompt, stored by "
        "precompute --empty-prompt) or zeros (zero text embeddings, as label dropout)", default="auto")
    i2v_probability: Number = key("a probability in (0, 1] (model.i2v: the share of samples trained image-to-video, "
                                  "on their clip's first frame; the others text-to-video)", gt=0, le=1, default=1.0)
    lr_warmup_steps: int = key("an integer >= 0 (linear warm-up steps; 0: none)", ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = key(
        "constant, linear or cosine (after the warm-up; linear and cosine reach 0 at max_steps, as diffusers' "
        "get_scheduler)", default="constant")
    step_offset: int = key("an integer >= 0: eval.every_steps and checkpoint.every_steps fire after k * every_steps + "
                           "step_offset updates, k >= 1 (the paper code: 1)", ge=0, default=0)
    log_every_steps: int = key("a positive integer", ge=1)
    log_with: list[Literal[TRACKERS]] = key("a list of trackers among wandb, tensorboard, e.g. [tensorboard] or "
                                            "[wandb, tensorboard] ([]: metrics.jsonl only)")
    num_workers: int = key("an integer >= 0 (DataLoader workers per process)", ge=0)
    cpu: Flag
    cpu_threads: Union[Literal["auto"], Annotated[int, Field(ge=1, le=MAX_CPU_THREADS)]] = key(
        f"auto (the usable cores other processes leave free, capped by the step's size, re-checked as it runs; "
        f"OMP_NUM_THREADS when set) or an integer in "
        f"[1, {MAX_CPU_THREADS}] (torch's intra-op threads on the CPU)")
    compile: Union[Literal["auto"], bool] = key("auto (on with CUDA, or on CPU with a C++ compiler), true or false")
    compile_backend: str = key("a torch.compile backend, e.g. inductor or aot_eager")
    compile_mode: Optional[Literal[COMPILE_MODES]] = key(f"null or {one_of(COMPILE_MODES)}")
    masked_loss: Union[Literal["auto"], bool] = key("auto (use the data's loss masks when it has them), true "
                                                    "(require them) or false (ignore them)")
    mask_force_keep: Flag
    nonfinite: Literal[NONFINITE] = key("skip (skip the update, counted and logged) or stop (end the run) on a "
                                        "non-finite loss or gradient norm")
    max_nonfinite_skips: int = key("a positive integer (consecutive skipped steps that end the run)", ge=1)
    collective_timeout_min: PositiveNumber = key("a number > 0 (minutes a process waits in a collective for the "
                                                 "other ranks)")
    slurm_requeue: Flag = key("true or false (requeue the SLURM job after a time-limit warning's checkpoint)")
    parallel: Literal[PARALLEL] = key("ddp (every process holds the whole model) or fsdp (weights, gradients, "
                                      "optimizer state and EMA sharded over the processes, one group per routable "
                                      "block; needs >= 2 processes)")
    fsdp: Fsdp
    context_parallel: ContextParallelSettings


class EMA(Section):
    """ema"""

    decay: Number = key("a number in [0, 1)", ge=0, lt=1)
    warmup: Flag
    mode: Literal[EMA_MODES] = key(one_of(EMA_MODES) + " (full: a copy of the model; trained: only the trained "
                                   "parameters, the frozen base shared; cpu: those in host memory; off: no EMA, the "
                                   "model itself; tread/training/ema.py)", default="full")


CHECKPOINT_LAYOUTS = ("auto", "single", "sharded")


class Checkpoint(Section):
    """checkpoint"""

    every_steps: int = key("an integer >= 0 (0 disables periodic checkpoints)", ge=0)
    keep_last: Optional[int] = key("null (keep all) or an integer >= 1", ge=1)
    adapter_only: Flag
    layout: Literal[CHECKPOINT_LAYOUTS] = key(one_of(CHECKPOINT_LAYOUTS) + " (auto: sharded with train.parallel=fsdp, "
                                              "else single)")


class Wandb(Section):
    """wandb"""

    mode: Literal[WANDB_MODES] = key(one_of(WANDB_MODES))
    project: Optional[str] = key("null or a project name")
    entity: Optional[str] = key("null or an entity name")
    name: Optional[str] = key("null or a run name")


class Paths(Section):
    """paths"""

    cache_dir: str = key("a directory (built-in data, feature networks, reference statistics)", min_length=1)
    output_dir: str = key("a directory (run and sweep directories)", min_length=1)


class Eval(SamplingSettings, DecodeSettings, MetricSettings):
    """eval (in-training evaluation; sampling, decoding and metric keys as in sample.py / fid.py)"""

    every_steps: int = key("an integer >= 0 (0 disables periodic evaluation)", ge=0)
    at_end: Flag
    num_samples: int = key("an integer >= 2 (a covariance needs two samples)", ge=2)
    batch_size: int = key("a positive integer (sampling batch per process)", ge=1)
    reference: Optional[str] = key("null (built from the dataset and cached) or a reference .npz")
    reference_max_images: Optional[int] = key("null or an integer >= 2", ge=2)
    fdd_reference: Optional[str] = key("null (FDD's reference built from the dataset's VAE reconstructions) or an "
                                       "FDD reference .npz of real images (fid.py mode=ref fdd_out=...)", default=None)
    fdd_reference_max_images: Optional[int] = key("null or an integer >= 2 (images of the auto-built FDD "
                                                  "reference)", ge=2, default=None)
    fvd_reference: Optional[str] = key("null or an FVD reference .npz of real clips (scripts/precompute_latents.py "
                                       "--fvd-out, fid.py mode=ref fvd_out=...); needed by the fvd metric",
                                       default=None)
    grid_size: int = key("an integer >= 1 (images in the saved sample grid)", ge=1)
    validation_prompts: Optional[list[Prompt]] = key(
        f"null or {PROMPTS}: sampled at every evaluation into a captioned grid (not counted in the metrics)",
        min_length=1)
    validation_per_prompt: int = key("a positive integer (images per validation prompt: seeds 0..n-1)", ge=1)
    seed_offset: int = key("an integer >= 0: samples use seeds seed_offset..seed_offset+num_samples-1 (the paper "
                           "code's FID-5K: 100000)", ge=0, default=0)
    negative_prompt: str = key(NEGATIVE_PROMPT)

    @property
    def runs(self) -> bool:
        """Whether the run evaluates (periodically or at its end)."""
        return bool(self.every_steps or self.at_end)


ModelSection = Union[DiTModel, FamilyModel]    # a checked config's model and data sections
DataSection = Union[LatentsData, WdsData]

# Checked in this order: data before model, whose keys take data's by interpolation (model.frames: ${data.frames}),
# so a bad value is named by the key the user set.
SECTIONS = {"train": Train, "ema": EMA, "checkpoint": Checkpoint, "wandb": Wandb, "paths": Paths, "eval": Eval,
            "routing": Routing, "data": DATA, "model": section_types("model"),
            "diffusion": section_types("diffusion"), "optimizer": section_types("optimizer")}
TOP_KEYS = ("resume", *SECTIONS)


@dataclass(frozen=True)
class TrainConfig:
    """A checked training config: its typed sections, the values derived from them (computed once), and the
    whole config as plain data, resolved once (config.yaml, checkpoints, trackers)."""

    train: Train
    ema: EMA
    checkpoint: Checkpoint
    wandb: Wandb
    paths: Paths
    eval: Eval
    routing: Routing
    model: ModelSection
    data: DataSection
    diffusion: Union[EDMConfig, RFConfig]
    optimizer: Union[AdamW, AdamW8bit]
    resume: Optional[str]
    resolved: dict[str, Any]

    @property
    def eval_on(self) -> bool:
        return self.eval.runs

    @cached_property
    def phases(self) -> TrainPhases:
        """Each step's hyperparameters: the config's, overridden by routing.schedule's phases."""
        return TrainPhases.from_sections(self.train, self.optimizer.lr, self.routing, self.model.sprint)

    @property
    def sharded_checkpoints(self) -> bool:
        return sharded_layout(self.checkpoint.layout, self.train.parallel)

    def micro_batch(self, world_size: int) -> int:
        """The per-process micro-batch: train.batch_size is global, over data-parallel replicas (the processes, a
        context group of train.context_parallel.degree counting once) and accumulation steps."""
        return micro_batch(self.train.batch_size, self.data_world(world_size), self.train.grad_accum_steps,
                           "train.batch_size")

    def data_world(self, world_size: int) -> int:
        """Data-parallel replicas of `world_size` processes: the processes of a context group share a batch."""
        return max(1, world_size // self.train.context_parallel.degree)

    def data_rank(self, process_index: int) -> int:
        """The data-parallel replica a process belongs to (its batches, noise and route draws)."""
        return process_index // self.train.context_parallel.degree


def sharded_layout(layout: str, parallel: str) -> bool:
    """checkpoint.layout resolved: sharded, or auto under train.parallel=fsdp."""
    return layout == "sharded" or (layout == "auto" and parallel == "fsdp")


def micro_batch(batch: int, world_size: int, accum: int, name: str) -> int:
    """A global batch split over processes and accumulation steps, or one error line naming the key."""
    denom = world_size * accum
    if batch % denom:
        raise ConfigError(f"{name}={batch} is the global batch and must be divisible by the data-parallel processes "
                          f"({world_size}: processes / train.context_parallel.degree) x train.grad_accum_steps ({accum}) = {denom}.")
    return batch // denom


def check_train(cfg: Union[DictConfig, dict], unset_ok: tuple[str, ...] = ()) -> TrainConfig:
    """Check every key of a composed training config. ConfigError names the first bad key, its value and what is
    allowed. Runtime facts (the world size, the dataset, the model's depth) are checked where they become known,
    still before training starts. `unset_ok`: mandatory keys a caller that never reads them may leave ??? (the
    planner and the benchmark time synthetic batches: data.path)."""
    tree = container(cfg, required_ok=unset_ok + (("eval.reference",) if not _eval_on(cfg) else ()))
    unknown = sorted(set(tree) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a known key; the training config takes {list(TOP_KEYS)}.")
    resume = tree.get("resume")
    if resume is not None and not (isinstance(resume, str) and resume):
        raise ConfigError(f"resume={show(resume)} is not allowed; allowed: null (fresh run), auto (the latest checkpoint "
                          f"in the run dir) or a checkpoint / run directory path.")
    out = {name: check(pick(kind, tree.get(name), name), tree.get(name), name) for name, kind in SECTIONS.items()}
    _cross_checks(out)
    check_dirs({"paths.cache_dir": out["paths"].cache_dir, "paths.output_dir": out["paths"].output_dir})
    return TrainConfig(**out, resume=resume, resolved=tree)


def check_train_files(config: TrainConfig) -> None:
    """The files a checked training config names that must exist before any work (the data's own files are
    checked when it opens, right after): the evaluation reference, and FDD's DINOv2 weights (eval.dinov2_weights)."""
    reference = config.eval.reference if config.eval_on else None
    if reference is not None and not Path(reference).expanduser().is_file():
        raise ConfigError(f"eval.reference={reference!r} does not exist; allowed: null (built from the dataset and "
                          f"cached) or a reference .npz (`python fid.py mode=ref ...` builds one).")
    if config.eval_on and "fdd" in config.eval.metrics:    # FDD's DINOv2 folder: its files' headers
        check_dinov2_folder(config.eval.dinov2_weights, "eval.dinov2_weights", FDD_DINOV2)
    if config.eval_on and "fvd" in config.eval.metrics:    # FVD's VideoMAE folder and its reference of real clips
        check_videomae_folder(config.eval.videomae_weights, "eval.videomae_weights")
        if not config.eval.fvd_reference or not Path(config.eval.fvd_reference).expanduser().is_file():
            raise ConfigError(f"eval.fvd_reference={config.eval.fvd_reference!r} is not a file; fvd needs an FVD "
                              f"reference .npz of real clips: scripts/precompute_latents.py --videos ... --fvd-out "
                              f"REF.npz --videomae-weights DIR (or fid.py mode=ref fvd_out=...) builds one.")


def _eval_on(cfg: Any) -> bool:
    return bool(cfg["eval"]["every_steps"] or cfg["eval"]["at_end"])


def _cross_checks(s: dict[str, Any]) -> None:
    """Rules between sections."""
    for name in ("model", "diffusion", "optimizer", "data"):
        s[name].check()
    check_guidance(s["eval"], "eval.")
    _check_trackers(s["train"].log_with, s["wandb"].mode)
    _check_i2v(s["train"], s["model"])
    if s["train"].caption_dropout > 0 and not isinstance(s["model"], FamilyModel):
        raise ConfigError(f"train.caption_dropout={s['train'].caption_dropout} needs a text-conditioned model "
                          f"(model=flux|sd3|pixart|...); this model is class-conditional: allowed: 0 (use "
                          f"train.label_dropout for classifier-free guidance).")
    if s["checkpoint"].adapter_only and s["model"].lora is None:
        raise ConfigError("checkpoint.adapter_only=true needs LoRA adapters (model.lora={rank: ..., target_modules: "
                          "[...]}); without them every weight trains and must be saved.")
    _check_memory_options(s)
    _check_context_parallel(s["train"], s["ema"].mode)
    _check_phases(s)
    if s["train"].compile is not False:
        _check_backend(s["train"].compile_backend)


def _check_i2v(train: Train, model: Any) -> None:
    """train.i2v_probability is model.i2v's: set away from its default without it, it can only be a mistake."""
    default = Train.model_fields["i2v_probability"].default
    if train.i2v_probability != default and not model.i2v:
        said = (f"model.i2v={show(model.i2v)}" if model.i2v is not None
                else f"model._target_={model.target} (no model.i2v)")
        raise ConfigError(f"train.i2v_probability={train.i2v_probability} is read with model.i2v=true only (the share "
                          f"of clips trained image-to-video); {said} trains none. Allowed: "
                          f"model.i2v=true (a video family: model=wan|ltx_video|hunyuan_video, data with first "
                          f"frames), or train.i2v_probability left at {default}.")


def _check_phases(s: dict[str, Any]) -> None:
    """routing.schedule phases' hyperparameters against the rest: path_drop_prob is model=sprint's, a batch splits
    over train.grad_accum_steps (and, when training starts, over the processes)."""
    for i, phase in enumerate(s["routing"].schedule or []):
        if phase.path_drop_prob is not None and s["model"].target != SPRINT_TARGET:
            raise ConfigError(f"routing.schedule[{i}].path_drop_prob={phase.path_drop_prob} is a key of model=sprint "
                              f"(model._target_={SPRINT_TARGET}); model._target_={s['model'].target} has no deep path "
                              f"to drop. Allowed: model=sprint, or no path_drop_prob in the phase.")
        batch, accum = phase.train.batch_size if phase.train else None, s["train"].grad_accum_steps
        if batch is not None and batch % accum:
            raise ConfigError(f"routing.schedule[{i}].train.batch_size={batch} is not allowed; allowed: a global "
                              f"batch divisible by train.grad_accum_steps={accum}.")


def _check_context_parallel(train: Train, ema_mode: str) -> None:
    """train.context_parallel against the other keys (the launch's checks: tread/training/context_parallel.py): the
    EMA samples whole sequences on each process, so it cannot be the split model itself, and the split's
    collectives run eagerly."""
    degree = train.context_parallel.degree
    if degree == 1:
        return
    if ema_mode == "off":
        raise ConfigError(f"ema.mode=off cannot be combined with train.context_parallel.degree={degree} (evaluation "
                          f"would sample the split model, each process its own seeds); allowed: ema.mode=full, "
                          f"trained or cpu.")
    if train.compile is True:
        raise ConfigError(f"train.compile=true cannot be combined with train.context_parallel.degree={degree} (the "
                          f"split's collectives run eagerly); allowed: train.compile=false or auto (off here).")


def _check_memory_options(s: dict[str, Any]) -> None:
    """ema.mode, model.base_dtype and optimizer=adamw8bit are for DDP runs with single-file checkpoints: FSDP shards
    the EMA like the model (a shared base would be sharded twice), all-gathers one dtype per block, and the sharded
    checkpoint layout does not take 8-bit moments."""
    fsdp, base = s["train"].parallel == "fsdp", s["model"].base_dtype
    if fsdp and s["ema"].mode != "full":
        raise ConfigError(f"ema.mode={s['ema'].mode} cannot be combined with train.parallel=fsdp (the EMA is sharded "
                          f"like the model there); allowed: ema.mode=full with fsdp, or train.parallel=ddp.")
    if fsdp and base != "fp32":
        raise ConfigError(f"model.base_dtype={base} cannot be combined with train.parallel=fsdp (FSDP all-gathers one "
                          f"dtype per block); allowed: model.base_dtype=fp32 with fsdp, or train.parallel=ddp.")
    sharded = sharded_layout(s["checkpoint"].layout, s["train"].parallel)
    if s["optimizer"].target == "torchao.optim.AdamW8bit" and sharded:
        which = "train.parallel=fsdp" if fsdp else "checkpoint.layout=sharded"
        raise ConfigError(f"optimizer=adamw8bit cannot be combined with {which} (sharded checkpoints do not take its "
                          f"8-bit moments); allowed: optimizer=adamw there, or train.parallel=ddp with "
                          f"checkpoint.layout=auto|single.")


def _check_trackers(log_with: list[str], wandb_mode: str) -> None:
    """train.log_with against wandb.mode: wandb.mode=offline|online alone implies wandb; wandb listed with
    wandb.mode=disabled contradicts it. TensorBoard needs its package (a dependency, checked before any work)."""
    if len(set(log_with)) != len(log_with):
        raise ConfigError(f"train.log_with={show(log_with)} repeats a tracker; allowed: each of {list(TRACKERS)} once.")
    if "wandb" in log_with and wandb_mode == "disabled":
        raise ConfigError(f"train.log_with={show(log_with)} asks for wandb but wandb.mode='disabled'; allowed: "
                          f"wandb.mode=offline or online with it (which alone implies wandb), or train.log_with "
                          f"without wandb.")
    if "tensorboard" in log_with and not any(find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise ConfigError("train.log_with=[tensorboard] needs the tensorboard package, which is not installed; "
                          "allowed: pip install tensorboard==2.21.0 (pyproject.toml's pin), or train.log_with "
                          "without tensorboard.")


def _check_backend(backend: str) -> None:
    import torch._dynamo  # deferred: a second of import time, only when compiling may happen

    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ConfigError(f"train.compile_backend={backend!r} is not a torch.compile backend; allowed: "
                          f"{sorted(backends)}.")
