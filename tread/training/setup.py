"""Building what a training run trains: the accelerator, the model and objective (the one model builder), its
EMA copy, torch.compile, the optimizer, the data and its loader, and the random streams. train() and the
benchmark both build here, so the benchmark times the run's own step."""
from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from tread.data import (BucketedDataset, LatentLoader, PhasedSampler, ShardedBatchSampler, build_dataset,
                        check_dataset, make_sampler)
from tread.data.loader import PHASE_STRIDE
from tread.schema.builders import build, build_diffusion, build_model
from tread.models.backbone import Backbone
from tread.schema import ConfigError
from tread.schema.train import TrainConfig, micro_batch
from tread.training.context_parallel import check_context_parallel, split_backbone
from tread.training.ema import make_ema
from tread.training.fsdp import check_parallel, shard_backbone
from tread.schema.phases import TrainPhases
from tread.training.repa import Repa, build_repa, with_resolved
from tread.evaluation.evaluator import decode_options
from tread.utils.distributed import rank
from tread.utils.errors import UserError





@dataclass
class TrainingParts:
    """The trained objects of a run."""

    accelerator: Accelerator
    model: nn.Module        # the backbone (compiled in place when train.compile is on)
    diffusion: Any          # the objective: preconditioning, loss, sampler
    net: nn.Module          # the preconditioned backbone; DDP-wrapped by prepare() on several processes
    ema: nn.Module          # EMA copy of net, made before compiling: evaluation stays eager
    optimizer: torch.optim.Optimizer
    compiled: bool
    sharded: bool = False   # train.parallel=fsdp: backbone and EMA are sharded per block (tread/training/fsdp.py)
    repa: Optional[Repa] = None   # model.repa: the frozen encoder and weight of the alignment loss

    def prepare(self) -> None:
        """Hand net and optimizer to accelerate (device placement, DDP); after a resume has loaded them. A
        sharded net is placed and synchronised by FSDP already: accelerate wraps only its optimizer."""
        if self.sharded:
            self.optimizer = self.accelerator.prepare(self.optimizer)
            return
        self.net, self.optimizer = self.accelerator.prepare(self.net, self.optimizer)
        self.ema.to(self.accelerator.device)


def make_accelerator(train: Any) -> Accelerator:
    """A fresh Accelerator for this run, with train.mixed_precision resolved for its device (auto: mixed_precision)
    and CUDA's fp32 matmuls set by train.tf32. AcceleratorState is a process-wide singleton; it is cleared
    (keeping the process group) so train() can run again in one process with other settings (tests, sweeps)."""
    AcceleratorState._reset_state()
    cpu = train.cpu or cpu_process_group()
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    set_tf32(train.tf32, device)
    return Accelerator(mixed_precision=mixed_precision(train.mixed_precision, device)[0], cpu=cpu)


def mixed_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """(accelerate's mixed_precision, why) for train.mixed_precision on `device`: auto is bf16 autocast where the
    device multiplies bf16 natively (CUDA from Ampere on; a CPU with AVX512-BF16 or AMX), else fp32 ("no");
    no, bf16 and fp16 are taken as given."""
    if setting != "auto":
        return setting, "train.mixed_precision"
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16", "auto: this GPU computes in bf16 natively"
    if device.type == "cpu" and native_cpu_bf16():
        return "bf16", "auto: this CPU has native bf16 matmuls (AVX512-BF16 or AMX); train.mixed_precision=no for fp32"
    return "no", f"auto: this {device.type.upper()} has no native bf16 matmuls"


def native_cpu_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles) through oneDNN."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return torch.backends.mkldnn.is_available() and any(check is not None and check() for check in checks)


def set_tf32(enabled: bool, device: torch.device) -> None:
    """train.tf32: fp32 matmuls and convolutions on CUDA in TensorFloat-32 (as the paper code's train.py sets), or in
    full fp32 (false). Process-wide flags; CPU runs leave them alone."""
    if device.type == "cuda":
        precision = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


def cpu_process_group(env: Mapping[str, str] = os.environ) -> bool:
    """Several processes (WORLD_SIZE > 1: accelerate launch, torchrun, SLURM tasks) on a machine without CUDA:
    accelerate forms a (gloo) process group only with cpu=True; without it each process would train alone
    into the same run directory."""
    return int(env.get("WORLD_SIZE") or 1) > 1 and not torch.cuda.is_available()


def build_parts(config: TrainConfig, accelerator: Accelerator) -> TrainingParts:
    """Model (routes validated against its depth here), objective, EMA, compile and optimizer, with the same
    initialisation on every process (seeded by train.seed)."""
    train = config.train
    check_shared_base(config.model, train)
    check_parallel(train, config.eval, accelerator.num_processes, accelerator.device.type == "cuda")
    check_context_parallel(train, accelerator.num_processes, accelerator.device.type == "cuda")
    repa = build_repa(config.model, config.data.resolution, config.paths.cache_dir, decode_options(config.eval),
                      accelerator.device)           # the encoder first: it sizes the REPA head
    torch.manual_seed(train.seed)
    model = build_model(with_resolved({"model": config.model.plain()}, repa)["model"])
    if repa is not None:                                    # the targets' grid: each batch's tokens
        repa.patch = model_patch(model)
    diffusion = build_diffusion(config.diffusion.plain())
    net = diffusion.precondition(model)
    # ema.mode (tread/training/ema.py): a copy (a quantized frozen base shared), the trained parameters only, ...
    ema = make_ema(net, model, config.ema.mode)
    split_backbone(train, model, accelerator.device)        # the EMA samples whole sequences: it stays unsplit
    sharded = maybe_shard(train, model, ema.model)          # before the optimizer: parameters become shards
    compiled = maybe_compile(train, model, accelerator.device)
    # LoRA (model.lora) freezes the base weights: only parameters that require grad are optimised.
    optimizer = build("optimizer", config.optimizer.plain())(
        params=[p for p in net.parameters() if p.requires_grad])
    return TrainingParts(accelerator, model, diffusion, net, ema, optimizer, compiled, sharded, repa)


def check_shared_base(model: Any, train: Any) -> None:
    """The EMA shares a quantized base with the trained model, which per-module FSDP sharding cannot do."""
    if model.quantize and train.parallel == "fsdp":
        raise ConfigError(f"model.quantize={model.quantize} cannot be combined with train.parallel=fsdp (the "
                          f"EMA shares the quantized base, which FSDP would shard twice); allowed: train.parallel="
                          f"ddp, or model.quantize=null.")


def maybe_shard(train: Any, model: nn.Module, ema_model: nn.Module) -> bool:
    """train.parallel=fsdp: shard the backbone and its EMA copy alike, one FSDP group per routable block (the
    EMA is resharded after every forward: it only samples)."""
    if train.parallel != "fsdp":
        return False
    shard_backbone(model, train.fsdp.reshard_after_forward, train.fsdp.cpu_offload)
    shard_backbone(ema_model, True, train.fsdp.cpu_offload, forward_only=True)
    return True


def maybe_compile(train: Any, model: nn.Module, device: torch.device) -> bool:
    """torch.compile the backbone's routed forward in place (train.compile: auto = compile_by_default). Parameter
    names and checkpoints are unchanged. The router draws outside the compiled graph and keep counts are
    static per route, so one graph per route shape compiles in the first step and nothing after."""
    setting = train.compile
    if train.context_parallel.degree > 1 and setting == "auto":      # true is refused (check_context_parallel)
        return False
    if not (setting is True or (setting == "auto" and compile_by_default(device))):
        return False
    model.compile(backend=train.compile_backend, mode=train.compile_mode)
    return True


def compile_by_default(device: torch.device) -> bool:
    """train.compile=auto: on with CUDA, and on a CPU where inductor can build its kernels (a C++ compiler on
    PATH); measurements in docs/benchmarks.md. Short CPU runs set train.compile=false (experiment=toy, debug=tiny)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++"))


def open_dataset(data: Any, model: nn.Module, arch: str):
    """The run's dataset (the data section's; a built-in one is made first), checked against the model (`arch`:
    model.arch) and its files against their integrity record: NaN/inf data is refused, naming the file and the
    first sample, unless data.allow_nonfinite."""
    dataset = build_dataset(data.plain())
    if isinstance(dataset, BucketedDataset):
        check_bucket_grids(data, dataset, model, arch)
    elif (dataset.channels, dataset.resolution) != (model.in_channels, model.input_size):
        raise ConfigError(
            f"data at '{data.path}' is {dataset.channels}x{dataset.resolution}x{dataset.resolution} but the model "
            f"expects {model.in_channels}x{model.input_size}x{model.input_size} (model.in_channels/model.input_size).")
    check_frames(data, dataset, model, arch)
    model.check_text_data(dataset.conditioning or {}, f"'{data.path}'")   # a text family: the embedding widths
    notes, warned = check_dataset(dataset, data.allow_nonfinite)
    for text in warned:
        warnings.warn(text, UserWarning, stacklevel=2)
    for text in notes if rank() == 0 else ():
        print(text, flush=True)
    return dataset


def check_frames(data: Any, dataset: Any, model: nn.Module, arch: str) -> None:
    """Video data (meta "video": (C, T, H, W) latents) needs a video family (model.frames), and single-shape data
    has the latent frames data.frames says and, for a video family, model.frames (1 for images); model.i2v needs the
    clips' first-frame latents; one error line."""
    first = dataset.parts[0]
    video, frames = first.video, first.frames
    takes_video = model.frames_axis
    if model.i2v and (first.conditioning or {}).get("first_frame") is None:
        raise ConfigError(f"model.i2v=true but the data at '{data.path}' has no first-frame latents "
                          f"(first_frame_latents.npy): precompute the clips with --first-frame, or set model.i2v=false.")
    if video is not None and not takes_video:
        raise ConfigError(f"data at '{data.path}' is video ({video['frames']} frames per clip, latents "
                          f"{list(first.shape)}) but model {arch} takes images; use a video family "
                          f"(model=wan) or image data.")
    if isinstance(dataset, BucketedDataset):     # frame buckets: every bucket its own T, whole temporal patches
        pt = model.latent_patch()[0] if takes_video else 1
        off = [f"{b.name} (T={shape[1]})" for b, shape in zip(dataset.buckets, dataset.shapes)
               if len(shape) == 4 and shape[1] % pt]
        if off:
            raise ConfigError(f"bucket(s) {', '.join(off)} of '{data.path}' are not whole {pt}-frame temporal "
                              f"patches of {arch}: precompute with --frame-buckets giving T a multiple "
                              f"of {pt}.")
        return
    want = data.frames
    if frames != want or (takes_video and int(model.frames) != frames):
        model_frames = f", model.frames={model.frames}" if takes_video else ""
        raise ConfigError(f"data at '{data.path}' has {frames} latent frame(s) per sample"
                          f"{' (images)' if video is None else ''} but data.frames={want}{model_frames}; set "
                          f"data.frames={frames} (video families take model.frames from it).")


def model_patch(model: Backbone) -> tuple[int, int]:
    """The latent (height, width) one token covers: DiT's patch, a family's latent patch (or 2x2 packing)."""
    return tuple(model.latent_patch()[1:])


def check_bucket_grids(data: Any, dataset: BucketedDataset, model: nn.Module, arch: str) -> None:
    """Bucketed data: the model's channels, and every bucket a whole token grid (its latent sides multiples of
    the patch); one error line naming the buckets that are not."""
    if dataset.channels != model.in_channels:
        raise ConfigError(f"data at '{data.path}' has {dataset.channels} channels but the model expects "
                          f"{model.in_channels} (model.in_channels).")
    ph, pw = model_patch(model)
    off = [f"{b.name} (latents {h}x{w})" for b, (*_, h, w) in zip(dataset.buckets, dataset.shapes)
           if h % ph or w % pw]
    if off:
        raise ConfigError(f"bucket(s) {', '.join(off)} of '{data.path}' are not whole {ph}x{pw}-latent patches "
                          f"of {arch}: precompute with --bucket-stride = the VAE factor x {max(ph, pw)}.")
    for bucket, (*_, h, w) in zip(dataset.buckets, dataset.shapes):   # a family's limits (position tables, ...)
        try:
            model.check_size(h, w)
        except UserError as err:
            raise ConfigError(f"bucket {bucket.name} of '{data.path}': {err}") from None
    # train.compile: one graph per bucket shape (and per route shape within it); dynamo's default of 8 graphs per
    # function would send the 9th bucket to eager for good.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(dataset.buckets))


def uses_loss_mask(train: Any, dataset) -> bool:
    """Whether this run weights its loss by the data's loss masks (train.masked_loss: auto | true | false)."""
    has = (dataset.conditioning or {}).get("loss_mask") is not None
    if train.masked_loss is True and not has:
        raise ConfigError(f"train.masked_loss=true but the data at '{dataset.root}' has no loss masks "
                          f"(loss_mask.npy); build it with --loss-masks, use data=toy_masked, or set "
                          f"train.masked_loss=auto.")
    return has and train.masked_loss is not False


def make_loader(config: TrainConfig, dataset, accelerator: Accelerator) -> LatentLoader:
    """This process's shard of the data, in the deterministic, resumable order of (train.seed, epoch); bucketed
    data draws each batch from one bucket (data.resolution_schedule: the phases' buckets), a bucket too small
    for a batch on every process is dropped with a warning."""
    train, data, phases = config.train, config.data, config.phases
    # a context group's processes are one replica: they read the same batches
    batch, rank, world = config.micro_batch(accelerator.num_processes), config.data_rank(accelerator.process_index), \
        config.data_world(accelerator.num_processes)
    sampler = None
    if phases.changes_batch():          # routing.schedule phases with their own train.batch_size
        sampler = batch_phase_sampler(train, data.path, dataset, phases, rank, world)
    elif isinstance(dataset, BucketedDataset):
        schedule = [phase.plain() for phase in data.resolution_schedule] if data.resolution_schedule else None
        sampler = make_sampler(dataset, batch, train.seed, rank, world, schedule, train.grad_accum_steps)
        warn_dropped_buckets(dataset, sampler, batch * world)
    elif data.resolution_schedule:
        raise ConfigError(f"data.resolution_schedule needs bucketed data (precompute --buckets/--bucket-pixels); "
                          f"'{data.path}' has one shape: set data.resolution_schedule=null")
    return LatentLoader(dataset, batch, seed=train.seed, rank=rank, world_size=world,
                        num_workers=train.num_workers, pin_memory=accelerator.device.type == "cuda",
                        sampler=sampler)


def batch_phase_sampler(train: Any, path: str, dataset, phases: TrainPhases, rank: int, world: int
                        ) -> PhasedSampler:
    """Batch sizes by routing.schedule phase (single-shape data at `path`): one ShardedBatchSampler per run of steps
    with one global batch, from the first micro-batch of its first step; run k draws with train.seed +
    PHASE_STRIDE * k (run 0 as a run without phases), from its own position 0."""
    runs, accum = phases.batch_phases(), train.grad_accum_steps
    first = next(i for _, _, i in runs if i is not None)
    if isinstance(dataset, BucketedDataset):
        raise ConfigError(f"routing.schedule[{first}].train.batch_size is set but the data at '{path}' is "
                          f"bucketed; allowed: phase batch sizes with single-shape data only (or no batch_size in "
                          f"the phases).")
    out = []
    for k, (start, batch, index) in enumerate(runs):
        name = "train.batch_size" if index is None else f"routing.schedule[{index}].train.batch_size"
        micro = micro_batch(batch, world, accum, name)
        try:
            sampler = ShardedBatchSampler(len(dataset), micro, train.seed + PHASE_STRIDE * k, rank, world)
        except ValueError as err:
            raise ConfigError(f"{name}={batch}: {err}") from None
        out.append((start * accum, sampler))
    return PhasedSampler(out)


def warn_dropped_buckets(dataset: BucketedDataset, sampler: Any, need: int) -> None:
    """One warning naming the buckets with fewer samples than a batch on every process (never drawn)."""
    phases = getattr(sampler, "phases", None) or [(0, sampler)]
    dropped = sorted({b for _, s in phases for b in s.dropped})
    if dropped:
        names = ", ".join(f"{dataset.buckets[b].name} ({dataset.bucket_sizes[b]})" for b in dropped)
        warnings.warn(f"bucket(s) {names} of '{dataset.root}' hold fewer samples than one batch on every process "
                      f"({need}): dropped, their samples are never drawn. Lower train.batch_size or merge buckets "
                      f"to use them.", UserWarning, stacklevel=2)


def seed_streams(train_seed: int, routing_seed: int, model: nn.Module, rank: int) -> None:
    """Each data-parallel replica's training stream (noise, label dropout, moments) and the router's own stream; `rank`
    is the replica's (the processes of a context group draw alike: their noise and routes must agree)."""
    torch.manual_seed(train_seed * 1_000_003 + rank)
    model.routing.router.manual_seed(routing_seed * 1_000_003 + rank)
