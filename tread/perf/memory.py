"""Memory of a training step: the static bytes a run keeps (weights, optimizer state, EMA), the transient peak
of a code region, and (memory_per_gpu) the static bytes per GPU of DDP vs FSDP for a model's parameter counts.

Transient peak = the peak above what was resident when the region began: CUDA max_memory_allocated (reset
per region); on the CPU the process peak RSS (VmHWM in /proc/self/status, reset through /proc/self/clear_refs;
where that cannot be reset, the ru_maxrss growth, which only sees new peaks). CPU figures are approximate
(allocator caching)."""
from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

from tread.models.dit import build_dit
from tread.models.families import FAMILIES, build_family, family_module
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


def _reset_hwm() -> bool:
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
        elif _reset_hwm() and proc_status_kb("VmHWM") is not None:
            self.method = "cpu_vmhwm_clear_refs"
        else:
            self.method = "cpu_ru_maxrss_delta"

    def start(self) -> None:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            _reset_hwm()
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


def static_bytes(parts: TrainingParts) -> int:
    """What a run holds between steps: the backbone's parameters, the optimizer state and the EMA copy."""
    state = [t for s in parts.optimizer.state.values() for t in s.values()]
    return (tensor_bytes(parts.model.parameters()) + tensor_bytes(state)
            + tensor_bytes(parts.ema.parameters()) + tensor_bytes(parts.ema.buffers()))


# -- Static memory per GPU by parallelism (scripts/memory_table.py) ---------------------------------------------
# Bytes per value: fp32 master weights and gradients (bf16 autocast computes in bf16 but keeps fp32 masters),
# AdamW's two fp32 moments. Activations are not counted (they depend on batch, tokens, routes and checkpointing).
FP32 = 4
ADAM_STATES = 2
LORA_TARGETS = {"dit": ("attn.qkv", "attn.proj")}   # a family's: its class's lora_targets
# Stored bits per quantized weight value and the values one fp32 scale covers (int8: one per output row, set
# per layer; int4/nf4: blocks of 64 as bitsandbytes' nf4 / int4 kernels store them).
QUANT_BITS = {"int8": (8, None), "int4": (4, 64), "nf4": (4, 64)}


@dataclass(frozen=True)
class ParamCounts:
    """What the memory estimate needs from a model: total parameters, the largest routable block and the
    parameters outside the blocks (FSDP's root group), LoRA adapter parameters and the adapted Linear weights."""

    total: int
    largest_block: int
    root: int
    lora: int
    linear_weights: tuple[tuple[int, int], ...]    # (out_features, in_features) of every base nn.Linear

    @property
    def quantizable(self) -> int:
        return sum(o * i for o, i in self.linear_weights)


def count_params(model: nn.Module, lora_rank: int = 16, lora_targets: Sequence[str] = ()) -> ParamCounts:
    """Counts of a built model (meta tensors count alike): LoRA adds rank x (in + out) per targeted Linear."""
    blocks = model.routable_blocks()
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    total = sum(p.numel() for p in model.parameters())
    lora = sum(lora_rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(n == t or n.endswith("." + t) for t in lora_targets))
    linears = tuple((m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear))
    return ParamCounts(total, max(sum(p.numel() for p in b.parameters()) for b in blocks), total - in_blocks,
                       lora, linears)


def quantized_bytes(counts: ParamCounts, mode: Optional[str]) -> int:
    """Stored bytes of the frozen base: its Linear weights at QUANT_BITS[mode] plus fp32 scales, the rest (biases,
    norms, embeddings) fp32; mode None: all fp32."""
    if mode is None:
        return FP32 * counts.total
    bits, block = QUANT_BITS[mode]
    quant = sum(o * i * bits // 8 + FP32 * (o if block is None else -(-o * i // block))
                for o, i in counts.linear_weights)
    return quant + FP32 * (counts.total - counts.quantizable)


def memory_per_gpu(counts: ParamCounts, parallel: str, world: int, lora: bool,
                   quantize: Optional[str] = None) -> dict[str, int]:
    """Static bytes per GPU: weights, gradients, AdamW moments and the EMA (tread/training/setup.py: an EMA copy of
    the whole backbone), each divided by `world` under fsdp, plus FSDP's transient all-gathered weights (the root
    group and two blocks: the running one and the prefetched next). LoRA trains only the adapters; `quantize`
    stores the frozen base quantized (LoRA only; not sharded: FSDP2 cannot shard integer storage, so the
    quantized columns are for ddp, QLoRA's setup)."""
    trainable = counts.lora if lora else counts.total
    base = quantized_bytes(counts, quantize) if lora else FP32 * counts.total
    parts = {"weights": base + (FP32 * counts.lora if lora else 0), "grads": FP32 * trainable,
             "adam": FP32 * ADAM_STATES * trainable, "ema": base + (FP32 * counts.lora if lora else 0)}
    if parallel == "ddp":
        return {**parts, "gathered": 0, "total": sum(parts.values())}
    shards = {k: -(-v // world) for k, v in parts.items()}
    gathered = FP32 * (counts.root + 2 * counts.largest_block)
    return {**shards, "gathered": gathered, "total": sum(shards.values()) + gathered}


DIT_PRESETS = ("DiT-B/2", "DiT-XL/2")


def table_presets() -> list[tuple[str, str]]:
    """(family, preset) of the table: DiT-B/2 and DiT-XL/2, and every non-tiny preset of each family."""
    return [("dit", a) for a in DIT_PRESETS] + [(f, p) for f in FAMILIES for p in family_module(f).PRESETS
                                                 if p != "tiny"]


def data_channels(family: str, preset: str) -> int:
    """Latent channels of the data a family preset trains on, from the family module's own statements: the
    preset's transformer in_channels mapped back through the family's data_config (FLUX packs 2x2 latent cells
    into a token: 4 per data channel), or, for a preset that leaves them to the data (tiny, mid), those of the
    family's first released geometry (the first preset that fixes them: its VAE's latent channels)."""
    module = family_module(family)
    per_data_channel = int(module.FAMILY.data_config(1, 64, {})["in_channels"])
    stated = [c["in_channels"] for c in module.PRESETS.values() if "in_channels" in c]
    own = module.PRESETS[preset].get("in_channels")
    return int(own if own is not None else stated[0]) // per_data_channel


def build_on_meta(family: str, preset: str) -> nn.Module:
    """The backbone a preset describes, on the meta device (no memory, no weights): DiT on ImageNet-256 latents
    (4x32x32, 1000 classes); a family with its text conditioning only (no class table) at its preset's sample
    size (64 where it has none)."""
    with torch.device("meta"):
        if family == "dit":
            return build_dit(preset, input_size=32, in_channels=4, num_classes=1000)
        config = family_module(family).PRESETS[preset]
        extra = {"guidance": 3.5} if config.get("guidance_embeds") else {}
        return build_family(family, input_size=int(config.get("sample_size", 64)),
                            in_channels=data_channels(family, preset), num_classes=0, preset=preset, **extra)


def memory_rows(worlds: Sequence[int] = (2, 8), lora_rank: int = 16,
                presets: Optional[Sequence[tuple[str, str]]] = None) -> list[dict]:
    """One row per preset: parameter counts and GiB per GPU for full fine-tuning and LoRA, DDP and FSDP at each
    world size, and LoRA over a quantized frozen base (DDP)."""
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
        for q in QUANT_BITS:
            row[f"lora {q} ddp"] = memory_per_gpu(counts, "ddp", 1, True, q)["total"]
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
