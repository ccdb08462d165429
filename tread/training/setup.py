"""Building what a training run trains: the accelerator, the model and objective (the one model builder), its
EMA copy, torch.compile, the optimizer, the data and its loader, and the random streams. train() and the
benchmark both build here, so the benchmark times the run's own step."""
from __future__ import annotations

import copy
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from tread.data import LatentLoader, build_dataset, check_dataset
from tread.diffusion.build import build_diffusion
from tread.models import build_model
from tread.models.quantize import frozen_base
from tread.schema import ConfigError
from tread.training.fsdp import check_parallel, shard_backbone
from tread.training.repa import Repa, build_repa
from tread.utils.distributed import rank
from tread.utils.targets import build_target

OPTIMIZERS = {"torch.optim.AdamW": torch.optim.AdamW}


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


def make_accelerator(train_cfg: Any) -> Accelerator:
    """A fresh Accelerator for this run, with train.mixed_precision resolved for its device (auto: mixed_precision)
    and CUDA's fp32 matmuls set by train.tf32. AcceleratorState is a process-wide singleton; it is cleared
    (keeping the process group) so train() can run again in one process with other settings (tests, sweeps)."""
    AcceleratorState._reset_state()
    cpu = train_cfg.cpu or cpu_process_group()
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    set_tf32(train_cfg.tf32, device)
    return Accelerator(mixed_precision=mixed_precision(train_cfg.mixed_precision, device)[0], cpu=cpu)


def mixed_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """(accelerate's mixed_precision, why) for train.mixed_precision on `device`. auto is bf16 autocast where the
    device multiplies bf16 natively (CUDA from Ampere on; a CPU with AVX512-BF16 or AMX, where a bf16 matmul runs
    2-2.5x faster than fp32: docs/benchmarks.md), else fp32 ("no"); no, bf16 and fp16 are taken as given."""
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


def build_parts(cfg: Any, accelerator: Accelerator) -> TrainingParts:
    """Model (routes validated against its depth here), objective, EMA, compile and optimizer, with the same
    initialisation on every process (seeded by train.seed)."""
    check_shared_base(cfg)
    check_parallel(cfg, accelerator.num_processes, accelerator.device.type == "cuda")
    repa = build_repa(cfg, accelerator.device)              # the encoder first: it sizes the REPA head
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    if repa is not None:                                    # the targets' grid: the model's tokens
        repa.grid = model.token_grid
    diffusion = build_diffusion(cfg.diffusion)
    net = diffusion.precondition(model)
    # A quantized frozen base (model.quantize) is shared by the EMA, not copied: it never changes.
    ema = copy.deepcopy(net, frozen_base(model)).requires_grad_(False).eval()
    sharded = maybe_shard(cfg.train, model, ema.model)      # before the optimizer: parameters become shards
    compiled = maybe_compile(cfg.train, model, accelerator.device)
    # LoRA (model.lora) freezes the base weights: only parameters that require grad are optimised.
    optimizer = build_target(cfg.optimizer, OPTIMIZERS, "optimizer")(params=[p for p in net.parameters()
                                                                             if p.requires_grad])
    return TrainingParts(accelerator, model, diffusion, net, ema, optimizer, compiled, sharded, repa)


def check_shared_base(cfg: Any) -> None:
    """The EMA shares a quantized base with the trained model, which per-module FSDP sharding cannot do."""
    if cfg.model.get("quantize") and cfg.train.parallel == "fsdp":
        raise ConfigError(f"model.quantize={cfg.model.quantize} cannot be combined with train.parallel=fsdp (the "
                          f"EMA shares the quantized base, which FSDP would shard twice); allowed: train.parallel="
                          f"ddp, or model.quantize=null.")


def maybe_shard(train_cfg: Any, model: nn.Module, ema_model: nn.Module) -> bool:
    """train.parallel=fsdp: shard the backbone and its EMA copy alike, one FSDP group per routable block (the
    EMA is resharded after every forward: it only samples)."""
    if train_cfg.parallel != "fsdp":
        return False
    shard_backbone(model, train_cfg.fsdp.reshard_after_forward, train_cfg.fsdp.cpu_offload)
    shard_backbone(ema_model, True, train_cfg.fsdp.cpu_offload, forward_only=True)
    return True


def maybe_compile(train_cfg: Any, model: nn.Module, device: torch.device) -> bool:
    """torch.compile the backbone's routed forward in place (train.compile: auto = compile_by_default). Parameter
    names and checkpoints are unchanged. The router draws outside the compiled graph and keep counts are
    static per route, so one graph per route shape compiles in the first step and nothing after."""
    setting = train_cfg.compile
    if not (setting is True or (setting == "auto" and compile_by_default(device))):
        return False
    model.compile(backend=train_cfg.compile_backend, mode=train_cfg.compile_mode)
    return True


def compile_by_default(device: torch.device) -> bool:
    """train.compile=auto: on with CUDA, and on a CPU where inductor can build its kernels (a C++ compiler on
    PATH): there a compiled DiT-S/2 step is never slower than the eager one and up to 0.8-0.9x of it (bf16 routed,
    whose casts it fuses; docs/benchmarks.md). Short CPU runs, whose ~40 s compilation the steps do not pay back,
    set train.compile=false (experiment=toy, debug=tiny)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++"))


def micro_batch_size(train_cfg: Any, world_size: int) -> int:
    """The per-process micro-batch: train.batch_size is global, over processes and accumulation steps."""
    denom = world_size * train_cfg.grad_accum_steps
    if train_cfg.batch_size % denom:
        raise ConfigError(
            f"train.batch_size={train_cfg.batch_size} is the global batch and must be divisible by "
            f"num_processes ({world_size}) x train.grad_accum_steps ({train_cfg.grad_accum_steps}) = {denom}.")
    return train_cfg.batch_size // denom


def open_dataset(cfg: Any, model: nn.Module):
    """The run's dataset (a built-in one is made first), checked against the model's input, then its files against
    their integrity record (tread/data/integrity.py: a stat per file when unchanged; a scan for older datasets):
    NaN/inf data is refused, naming the file and the first sample, unless data.allow_nonfinite."""
    dataset = build_dataset(cfg.data)
    if (dataset.channels, dataset.resolution) != (model.in_channels, model.input_size):
        raise ConfigError(
            f"data at '{cfg.data.path}' is {dataset.channels}x{dataset.resolution}x{dataset.resolution} but the model "
            f"expects {model.in_channels}x{model.input_size}x{model.input_size} (model.in_channels/model.input_size).")
    if hasattr(model, "check_text_data"):      # text-conditioned families: the embedding widths
        model.check_text_data(getattr(dataset, "conditioning", None) or {}, f"'{cfg.data.path}'")
    notes, warned = check_dataset(dataset, cfg.data.allow_nonfinite)
    for text in warned:
        warnings.warn(text, UserWarning, stacklevel=2)
    for text in notes if rank() == 0 else ():
        print(text, flush=True)
    return dataset


def uses_loss_mask(cfg: Any, dataset) -> bool:
    """Whether this run weights its loss by the data's loss masks (train.masked_loss: auto | true | false)."""
    has = (getattr(dataset, "conditioning", None) or {}).get("loss_mask") is not None
    if cfg.train.masked_loss is True and not has:
        raise ConfigError(f"train.masked_loss=true but the data at '{dataset.root}' has no loss masks "
                          f"(loss_mask.npy); build it with --loss-masks, use data=toy_masked, or set "
                          f"train.masked_loss=auto.")
    return has and cfg.train.masked_loss is not False


def make_loader(cfg: Any, dataset, accelerator: Accelerator) -> LatentLoader:
    """This process's shard of the data, in the deterministic, resumable order of (train.seed, epoch)."""
    return LatentLoader(dataset, micro_batch_size(cfg.train, accelerator.num_processes), seed=cfg.train.seed,
                        rank=accelerator.process_index, world_size=accelerator.num_processes,
                        num_workers=cfg.train.num_workers, pin_memory=accelerator.device.type == "cuda")


def seed_streams(cfg: Any, model: nn.Module, rank: int) -> None:
    """Each process's training stream (noise, label dropout, moments) and the router's own stream."""
    torch.manual_seed(cfg.train.seed * 1_000_003 + rank)
    model.routing.router.manual_seed(int(cfg.routing.seed) * 1_000_003 + rank)


def ensure_dirs(run_dir: Path) -> None:
    for sub in ("checkpoints", "samples"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
