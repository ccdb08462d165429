"""Memory of a training step: static bytes (weights, optimizer state, EMA), the transient peak of a code region
(CUDA max_memory_allocated, or the process peak RSS on the CPU, approximate), and memory_per_gpu, the static
bytes per GPU of DDP vs FSDP with the memory options (docs/scaling.md).
"""
from __future__ import annotations

import ctypes
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from tread.models.dit import build_dit
from tread.models.families import FAMILIES, build_family, family_module
from tread.models.quantize import plain_tensors
from tread.training.setup import TrainingParts


def proc_status_kb(key: str) -> Optional[int]:
    """A kB figure of /proc/self/status (VmRSS, VmHWM), None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_hwm() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """start() ... stop() -> transient peak bytes of the region (see the module docstring); `method` names how."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0
        if device.type == "cuda":
            self.method = "cuda_max_memory_allocated"
        elif reset_hwm() and proc_status_kb("VmHWM") is not None:
            self.method = "cpu_vmhwm_clear_refs"
        else:
            self.method = "cpu_ru_maxrss_delta"

    def start(self) -> None:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            reset_hwm()
            self.base = proc_status_kb("VmRSS") * 1024
        else:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def stop(self) -> int:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            peak = proc_status_kb("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, int(peak - self.base))


def tensor_bytes(tensors: Iterable) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def unique_bytes(tensors: Iterable) -> int:
    """Bytes of the storages behind `tensors` (a quantized weight or an 8-bit moment: the codes and scales it
    stores), each storage once: a frozen base the EMA shares is counted once, as is a tied weight."""
    seen, total = set(), 0
    for t in tensors:
        for x in plain_tensors(t) if isinstance(t, torch.Tensor) else ():
            storage = x.untyped_storage()
            ident = (x.device, storage.data_ptr()) if storage.data_ptr() else id(x)
            if ident not in seen:
                seen.add(ident)
                total += storage.nbytes()
    return total


def static_bytes(parts: TrainingParts) -> int:
    """What a run holds between steps: the backbone's parameters and buffers, the optimizer state and the EMA, each
    stored tensor once (unique_bytes)."""
    state = [t for s in parts.optimizer.state.values() for t in s.values()]
    return unique_bytes([*parts.model.parameters(), *parts.model.buffers(), *state, *parts.ema.parameters(),
                         *parts.ema.buffers()])


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim), so RSS shows what is held; no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve every allocation of `threshold` bytes or more by its own mapping (glibc's M_MMAP_THRESHOLD), so a freed
    tensor leaves the RSS at once and the peak RSS counts live memory; process-wide, a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)     # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


# -- Static memory per GPU (scripts/memory_table.py) -----------------------------------------------------------
# Bytes per value: fp32 master weights and gradients (bf16 autocast computes in bf16 but keeps fp32 masters),
# AdamW's two fp32 moments. Activations are not counted (they depend on batch, tokens, routes and checkpointing).
FP32, BF16 = 4, 2
ADAM_STATES = 2
LORA_TARGETS = {"dit": ("attn.qkv", "attn.proj")}   # a family's: its class's lora_targets
# Stored bits per quantized weight value and the values one fp32 scale covers (int8: one per output row, set
# per layer; int4/nf4: blocks of 64 as bitsandbytes' nf4 / int4 kernels store them).
QUANT_BITS = {"int8": (8, None), "int4": (4, 64), "nf4": (4, 64)}
# optimizer=adamw8bit (torchao.optim.AdamW8bit): a moment of a tensor with at least ADAM8_MIN values, a multiple of
# the block (optimizer.block_size, 256 by default), is uint8 codes + one fp32 scale per block + its own code table
# of 256 fp32 values; smaller tensors keep fp32 moments.
ADAM8_MIN, ADAM8_BLOCK, ADAM8_QMAP = 4096, 256, 256
LEAN = {"ema": "trained", "adam_block": ADAM8_BLOCK}   # ema.mode=trained + optimizer=adamw8bit


class LinearShape(NamedTuple):
    """A base nn.Linear: its weight (out, inp), whether it has a bias, and whether it lies in a routable block (the
    layers model.quantize and model.base_dtype=fp8 store in low bits)."""

    out: int
    inp: int
    bias: bool = False
    in_block: bool = True


@dataclass(frozen=True)
class ParamCounts:
    """What the memory estimate needs from a model: total parameters, the largest routable block and the
    parameters outside the blocks (FSDP's root group), LoRA adapter parameters, the base Linear layers, and the
    values of each parameter and of each adapter matrix (whose size decides 8-bit moments)."""

    total: int
    largest_block: int
    root: int
    lora: int
    linears: tuple[LinearShape, ...]
    sizes: tuple[int, ...] = ()          # values of each parameter (full fine-tuning trains them all)
    lora_sizes: tuple[int, ...] = ()     # values of each adapter matrix: rank x in (A), out x rank (B)


def count_params(model: nn.Module, lora_rank: int = 16, lora_targets: Sequence[str] = ()) -> ParamCounts:
    """Counts of a built model (meta tensors count alike): LoRA adds rank x in and out x rank per targeted Linear."""
    blocks = model.routable_blocks()
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    total = sum(p.numel() for p in model.parameters())
    targets = [m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(n == t or n.endswith("." + t) for t in lora_targets)]
    lora_sizes = tuple(n for m in targets for n in (lora_rank * m.in_features, m.out_features * lora_rank))
    linears = tuple(LinearShape(m.out_features, m.in_features, m.bias is not None, id(m) in in_blocks)
                    for m in model.modules() if isinstance(m, nn.Linear))
    block_params = sum(p.numel() for b in blocks for p in b.parameters())
    return ParamCounts(total, max(sum(p.numel() for p in b.parameters()) for b in blocks), total - block_params,
                       sum(lora_sizes), linears, tuple(p.numel() for p in model.parameters()), lora_sizes)


def linear_bytes(layer: LinearShape, quantize: Optional[str], base_dtype: str) -> Optional[int]:
    """Stored bytes of one frozen Linear's weight and bias under model.quantize / base_dtype (None: it stays fp32)."""
    weight, bias = layer.out * layer.inp, layer.out if layer.bias else 0
    if quantize is not None:
        if not layer.in_block:
            return None
        bits, block = QUANT_BITS[quantize]
        return weight * bits // 8 + FP32 * (layer.out if block is None else -(-weight // block)) + FP32 * bias
    if base_dtype == "fp8" and layer.in_block:
        return weight + FP32 * layer.out + BF16 * bias
    return BF16 * (weight + bias) if base_dtype in ("bf16", "fp8") else None


def base_bytes(counts: ParamCounts, quantize: Optional[str] = None, base_dtype: str = "fp32") -> int:
    """Stored bytes of the frozen base: its Linear layers as linear_bytes stores them, everything else (norms,
    embeddings, convolutions) fp32; fp32 with neither."""
    stored = [(layer, linear_bytes(layer, quantize, base_dtype)) for layer in counts.linears]
    low = [(layer.out * layer.inp + (layer.out if layer.bias else 0), b) for layer, b in stored if b is not None]
    return sum(b for _, b in low) + FP32 * (counts.total - sum(n for n, _ in low))


def adam_bytes(sizes: Sequence[int], block: Optional[int] = None) -> int:
    """AdamW's state bytes for parameters of `sizes` values: two fp32 moments (block None), or adamw8bit's with `block`
    values per scale, plus the per-parameter step count."""
    eight = [n for n in sizes if block is not None and n >= ADAM8_MIN and n % block == 0]
    return ADAM_STATES * (sum(n + FP32 * (n // block + ADAM8_QMAP) for n in eight)
                          + FP32 * (sum(sizes) - sum(eight))) + FP32 * len(sizes)


def memory_per_gpu(counts: ParamCounts, parallel: str, world: int, lora: bool, quantize: Optional[str] = None, *,
                   base_dtype: str = "fp32", ema: str = "full", adam_block: Optional[int] = None) -> dict[str, int]:
    """Static bytes per GPU: weights, gradients, AdamW moments and the EMA (each divided by `world` under fsdp, plus
    FSDP's all-gathered root group and two blocks). LoRA trains only the adapters over a base stored as
    `quantize` / `base_dtype` say; the EMA follows ema.mode; adam_block: adamw8bit's block (None: fp32 moments)."""
    trainable = counts.lora if lora else counts.total
    sizes = (counts.lora_sizes if lora else counts.sizes) or (trainable,)
    base = base_bytes(counts, quantize, base_dtype) if lora else FP32 * counts.total
    own = FP32 * counts.lora if lora else 0                       # the adapters beside the frozen base
    shared = lora and (quantize is not None or base_dtype == "fp8")
    copy = FP32 * trainable if shared else base + own
    parts = {"weights": base + own, "grads": FP32 * trainable, "adam": adam_bytes(sizes, adam_block),
             "ema": {"full": copy, "trained": FP32 * trainable, "cpu": 0, "off": 0}[ema]}
    if parallel == "ddp":
        return {**parts, "gathered": 0, "total": sum(parts.values())}
    shards = {k: -(-v // world) for k, v in parts.items()}
    gathered = FP32 * (counts.root + 2 * counts.largest_block)
    return {**shards, "gathered": gathered, "total": sum(shards.values()) + gathered}


# The table's DDP columns beside full fine-tuning and plain LoRA: (LoRA?, memory_per_gpu's options).
VARIANTS = {"full": {"full lean": LEAN},
            "lora": {"lora bf16": {"base_dtype": "bf16"}, "lora bf16 lean": {"base_dtype": "bf16", **LEAN},
                     "lora fp8 lean": {"base_dtype": "fp8", **LEAN},
                     **{f"lora {q}": {"quantize": q} for q in QUANT_BITS}}}


DIT_PRESETS = ("DiT-B/2", "DiT-XL/2")


def table_presets() -> list[tuple[str, str]]:
    """(family, preset) of the table: DiT-B/2 and DiT-XL/2, and every non-tiny preset of each family."""
    return [("dit", a) for a in DIT_PRESETS] + [(f, p) for f in FAMILIES for p in family_module(f).PRESETS
                                                 if p != "tiny"]


def data_channels(family: str, preset: str) -> int:
    """Latent channels of the data a family preset trains on: the preset's out_channels, else its in_channels mapped
    back through data_config, else those of the family's first released geometry."""
    module = family_module(family)
    in_key, out_key = module.FAMILY.channel_keys
    out_per_channel = module.FAMILY.data_config(1, 64, {}).get(out_key)
    if module.PRESETS[preset].get(out_key) and out_per_channel:   # the predicted latent: the data's channels
        return int(module.PRESETS[preset][out_key]) // int(out_per_channel)   # (Cosmos V2W: in = data + mask)
    fixed = int(module.FAMILY.data_config(0, 64, {})[in_key])     # e.g. HunyuanVideo 1.5's mask channel
    per_data_channel = int(module.FAMILY.data_config(1, 64, {})[in_key]) - fixed
    stated = [c[in_key] for c in module.PRESETS.values() if in_key in c]
    own = module.PRESETS[preset].get(in_key)
    return (int(own if own is not None else stated[0]) - fixed) // per_data_channel


def build_on_meta(family: str, preset: str) -> nn.Module:
    """The backbone a preset describes, on the meta device: DiT on ImageNet-256 latents (4x32x32, 1000 classes), a
    family with text conditioning only at its preset's sample size (64 where it has none)."""
    with torch.device("meta"):
        if family == "dit":
            return build_dit(preset, input_size=32, in_channels=4, num_classes=1000)
        config = family_module(family).PRESETS[preset]
        extra = {"guidance": 3.5} if config.get("guidance_embeds") else {}
        return build_family(family, input_size=int(config.get("sample_size", 64)),
                            in_channels=data_channels(family, preset), num_classes=0, preset=preset, **extra)


def memory_rows(worlds: Sequence[int] = (2, 8), lora_rank: int = 16,
                presets: Optional[Sequence[tuple[str, str]]] = None) -> list[dict]:
    """One row per preset: parameter counts and GiB per GPU for full fine-tuning and LoRA, DDP and FSDP at each world
    size, and the DDP memory-option VARIANTS."""
    rows = []
    for family, preset in presets or table_presets():
        model = build_on_meta(family, preset)
        targets = LORA_TARGETS["dit"] if family == "dit" else family_module(family).FAMILY.lora_targets
        counts = count_params(model, lora_rank, targets)
        row = {"model": preset if family == "dit" else f"{family} {preset}", "params": counts.total,
               "lora_params": counts.lora}
        for mode, lora in (("full", False), ("lora", True)):
            row[f"{mode} ddp"] = memory_per_gpu(counts, "ddp", 1, lora)["total"]
            for w in worlds:
                row[f"{mode} fsdp{w}"] = memory_per_gpu(counts, "fsdp", w, lora)["total"]
            for name, options in VARIANTS[mode].items():
                row[f"{name} ddp"] = memory_per_gpu(counts, "ddp", 1, lora, **options)["total"]
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Rows of memory_rows() as a markdown table: parameters in millions, memory in GiB per GPU."""
    keys = [k for k in rows[0] if k not in ("model", "params", "lora_params")]
    head = ["model", "params (M)", "LoRA params (M)"] + [f"{k} (GiB)" for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], f"{r['params'] / 1e6:,.1f}", f"{r['lora_params'] / 1e6:,.2f}"]
        lines.append("| " + " | ".join(cells + [f"{r[k] / 2 ** 30:,.1f}" for k in keys]) + " |")
    return "\n".join(lines)
