"""Activation memory of a video family's training step with gradient checkpointing, routed and not, per frame count:
measured as the bytes autograd saves (saved_bytes), checked against the analytic figure (expected_routed) and
carried to full-size grids by an exact a + b N fit (docs/benchmarks.md, "Video memory").
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

import torch

from tread.models.families import FAMILIES, FAMILY_MODULES, family_module
from tread.perf.benchmark import StepBench, timed
from tread.perf.memory import build_on_meta, count_params, data_channels, memory_per_gpu
from tread.perf.overrides import compose_or_raise, run_overrides
from tread.utils.errors import UserError

ROUTES = ("none", "paper")
CPU_FRAMES, CPU_LATENTS = (1, 3, 5, 9), (8, 12)         # measured here: 4x6 tokens per frame (patch 2x2)
GPU_FRAMES, GPU_LATENTS = (1, 5, 9, 21), (60, 104)      # 480x832 pixels through an 8x VAE: 30x52 tokens per frame
INDEX_BYTES = 8                                         # a kept token's id (int64), kept for the scatter


CAST_OR_VIEW = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0",
                "ExpandBackward0", "UnsqueezeBackward0")


class VideoMemoryError(UserError):
    """A video memory run that names no video family preset, or frames / latents its model cannot take."""


def video_families() -> list[str]:
    """The registered families whose inputs have a frame axis (B, C, T, H, W) and whose module is present."""
    present = [f for f in FAMILIES if importlib.util.find_spec(f"tread.models.families.{FAMILY_MODULES[f]}")]
    return [f for f in present if family_module(f).FAMILY.frames_axis]


@dataclass(frozen=True)
class Saved:
    """Bytes autograd saved for backward: `activations` (parameters and their copies excluded) and `weight_copies`
    (autocast's low-precision casts of trained parameters, which it caches for the forward)."""

    activations: int
    weight_copies: int


def is_weight_copy(t: torch.Tensor, params: set[int], depth: int = 4) -> bool:
    """Autocast's cast of one trained parameter (storage pointer in `params`), or a view of it (a transposed weight):
    its grad_fn chain of casts and views (CAST_OR_VIEW, a cast among them) reaches the parameter's AccumulateGrad."""
    fn, cast = t.grad_fn, False
    for _ in range(depth):
        if fn is None:
            return False
        if hasattr(fn, "variable"):
            return cast and fn.variable.untyped_storage().data_ptr() in params
        inputs = [n for n, _ in fn.next_functions if n is not None]
        if len(inputs) != 1 or fn.name() not in CAST_OR_VIEW:
            return False
        cast, fn = cast or fn.name() == "ToCopyBackward0", inputs[0]
    return False


def saved_bytes(run: Callable[[], Any], params: Iterable[torch.Tensor]) -> Saved:
    """Run `run()` counting the bytes autograd saves for backward, each storage once, `params`' storages left out (a
    checkpointed block saves its inputs only)."""
    params = {p.untyped_storage().data_ptr() for p in params}
    acts: dict[int, int] = {}
    copies: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params:
            (copies if is_weight_copy(t, params) else acts).setdefault(key, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return Saved(sum(acts.values()), sum(copies.values()))


def video_overrides(family: str, preset: str, route: str, latents: Sequence[int], frames: int, precision: str,
                    device: str, sets: Sequence[str] = ()) -> list[str]:
    """train.py overrides of the measured run: the preset with gradient checkpointing and `route`, batch 1 on the
    preset's latent channels, eager, then `sets`."""
    return [f"model={family}", f"model.preset={preset}", f"model.frames={frames}", f"routing={route}",
            "model.gradient_checkpointing=true", f"data.channels={data_channels(family, preset)}",
            f"data.builtin_args.resolution={min(latents)}", "train.batch_size=1", "eval.every_steps=0",
            "eval.at_end=false", *run_overrides(precision, device), *sets]


def build_bench(family: str, preset: str, route: str, latents: Sequence[int], frames: Sequence[int],
                precision: str, device: str, sets: Sequence[str] = ()) -> StepBench:
    if family not in video_families():
        raise VideoMemoryError(f"--video {family}:{preset}: {family!r} is not a video family; allowed: "
                               f"{', '.join(video_families())}.")
    config = compose_or_raise(video_overrides(family, preset, route, latents, min(frames), precision, device, sets),
                              VideoMemoryError)
    return StepBench(config)


def video_batch(bench: StepBench, frames: int, latents: Sequence[int], seed: int = 0) -> tuple:
    """(x (1, C, frames, H, W), labels) on the bench's device; the same draw for every config."""
    model = bench.model
    model.check_size(int(latents[0]), int(latents[1]), int(frames))
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn((1, model.in_channels, frames, *latents), generator=gen)
    return x.to(bench.device), bench.batch[1][:1]


def token_bytes(bench: StepBench) -> Callable[[], int]:
    """A probe of the bytes per token of a block's input (its width x element size), read from the first routable
    block's input when it runs."""
    seen: dict[str, int] = {}

    def hook(_module: Any, args: tuple) -> None:
        seen.setdefault("b", args[0].shape[-1] * args[0].element_size())

    bench.model.routable_blocks()[0].register_forward_pre_hook(hook)
    return lambda: seen["b"]


def measure_config(bench: StepBench, frames: Sequence[int], latents: Sequence[int]) -> list[dict]:
    """One training step per frame count on the bench: tokens, the kept tokens of each route, saved bytes."""
    probe, params, rows = token_bytes(bench), list(bench.model.parameters()), []
    for t in frames:
        batch = video_batch(bench, t, latents)
        saved = saved_bytes(lambda: bench.step(batch), params)
        model = bench.model
        rows.append({"frames": t, "tokens": model.tokens_in(batch[0]), "routes": model.last_route_stats,
                     "processed": model.processed_fraction(), "activations": saved.activations,
                     "weight_copies": saved.weight_copies, "token_bytes": probe()})
    return rows


def expected_routed(dense: dict, routes: Sequence[tuple[int, int, int, int]], batch: int = 1) -> int:
    """The routed step's saved bytes from the dense step's, with checkpointing: per route its blocks keep K tokens'
    inputs instead of N, plus its start's N tokens and the K kept ids (int64)."""
    per_token, out = dense["token_bytes"], dense["activations"]
    for start, end, kept, total in routes:
        out -= batch * ((end - start + 1) * (total - kept) - total) * per_token - batch * kept * INDEX_BYTES
    return out


def activation_rows(family: str, preset: str, frames: Sequence[int] = CPU_FRAMES,
                    latents: Sequence[int] = CPU_LATENTS, routes: Sequence[str] = ROUTES, precision: str = "bf16",
                    device: str = "cpu", sets: Sequence[str] = ()) -> list[dict]:
    """Saved bytes of the real step per route and frame count (one StepBench per route, freed after), with the
    analytic figure of each routed row (expected_routed from the dense row of the same frames)."""
    rows: list[dict] = []
    for route in routes:
        bench = build_bench(family, preset, route, latents, frames, precision, device, sets)
        rows += [{"family": family, "preset": preset, "route": route, "latents": tuple(latents), **r}
                 for r in measure_config(bench, frames, latents)]
        bench.release()
    dense = {r["frames"]: r for r in rows if not r["routes"]}
    for r in rows:
        base = dense.get(r["frames"])
        r["expected"] = expected_routed(base, r["routes"]) if base is not None else None
    return rows


def per_token_fit(points: Sequence[tuple[int, int]]) -> tuple[Fraction, Fraction, Fraction]:
    """(a, b, residual): bytes = a + b * tokens through the first two (tokens, bytes) points, and the largest miss
    of the others (0: the law is exact on every measured point)."""
    (n0, y0), (n1, y1) = points[0], points[1]
    b = Fraction(y1 - y0, n1 - n0)
    a = y0 - b * n0
    return a, b, max((abs(y - a - b * n) for n, y in points[2:]), default=Fraction(0))


def extrapolate(rows: Sequence[dict], tokens: int, route: str) -> tuple[float, Fraction]:
    """Saved bytes of `route` at `tokens` from its measured rows (per_token_fit), and the fit's largest miss."""
    points = [(r["tokens"], r["activations"]) for r in rows if r["route"] == route]
    a, b, miss = per_token_fit(points)
    return float(a + b * tokens), miss


def tokens_at(bench_or_model: Any, frames: int, latents: Sequence[int]) -> int:
    """Video tokens of (frames, H, W) latents for the model's patch (pt, ph, pw)."""
    model = getattr(bench_or_model, "model", bench_or_model)
    pt, ph, pw = model.latent_patch()
    return (frames // pt) * (latents[0] // ph) * (latents[1] // pw)


def peak_step(bench: StepBench, batch: tuple) -> dict:
    """One step on CUDA: the peak allocated during it (absolute and above what was held before), and its saved
    bytes. The optimizer's state exists already (call after a first step)."""
    dev = bench.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    saved = saved_bytes(lambda: bench.step(batch), bench.model.parameters())
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    return {"held": before, "peak": peak, "transient": peak - before, "activations": saved.activations,
            "weight_copies": saved.weight_copies}


def gpu_rows(family: str, preset: str, frames: Sequence[int], latents: Sequence[int], routes: Sequence[str],
             precision: str = "bf16", device: str = "cuda", sets: Sequence[str] = ()) -> list[dict]:
    """Per route and frame count on CUDA: a warm-up step, then peak_step, then a timed step (a step that runs out of
    memory is recorded as such, and the larger frame counts are skipped); per route whether every loss was finite
    and the trained parameters moved."""
    rows = []
    for route in routes:
        bench, oom = build_bench(family, preset, route, latents, frames, precision, device, sets), False
        for t in frames:
            row = {"family": family, "preset": preset, "route": route, "frames": t, "latents": tuple(latents),
                   "tokens": tokens_at(bench, t, latents)}
            if not oom:
                try:
                    batch = video_batch(bench, t, latents)
                    bench.step(batch)
                    row.update(peak_step(bench, batch) if bench.device.type == "cuda" else
                               {"activations": saved_bytes(lambda: bench.step(batch),
                                                           bench.model.parameters()).activations})
                    row["step_ms"] = 1e3 * timed(lambda: bench.step(batch), bench.device)
                except torch.OutOfMemoryError:
                    oom = True
            row["oom"] = oom
            rows.append(row)
        bench.release()
        for row in rows[-len(frames):]:
            row.update({k: v for k, v in bench.loss_record().items() if k != "losses"})
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


MiB = 2 ** 20


def activation_table(rows: Sequence[dict]) -> str:
    """Markdown: per frame count, dense and routed saved bytes (MiB), the measured and the analytic saving."""
    lines = ["| model | T | tokens | kept | dense (MiB) | routed (MiB) | saving measured | saving analytic | "
             "blocks' tokens saved (1 - processed) |", "|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["preset"], r["frames"]): r for r in rows if not r["routes"]}
    for r in rows:
        d = dense.get((r["preset"], r["frames"]))
        if not r["routes"] or d is None:
            continue
        kept = ", ".join(str(k) for _, _, k, _ in r["routes"])
        lines.append(f"| {r['family']} {r['preset']} | {r['frames']} | {r['tokens']} | {kept} | "
                     f"{d['activations'] / MiB:.3f} | {r['activations'] / MiB:.3f} | "
                     f"{1 - r['activations'] / d['activations']:.2%} | {1 - r['expected'] / d['activations']:.2%} | "
                     f"{1 - r['processed']:.2%} |")
    return "\n".join(lines)


def gpu_table(rows: Sequence[dict]) -> str:
    """Markdown of gpu_rows (MiB): peak, held before the step, the step's transient, saved activations, per route,
    and the step's time."""
    keys = ("peak", "held", "transient", "activations")
    lines = ["| model | route | T | tokens | peak (MiB) | held (MiB) | step transient (MiB) | saved activations (MiB) "
             "| step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = ["out of memory"] * 5 if r["oom"] else [f"{r[k] / MiB:,.1f}" if k in r else "-" for k in keys] + [
            f"{r['step_ms']:,.1f}"]
        lines.append(f"| {r['family']} {r['preset']} | {r['route']} | {r['frames']} | {r['tokens']:,} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def static_parts(family: str, preset: str) -> dict[str, int]:
    """Full fine-tuning's static bytes on one GPU (memory_per_gpu, DDP): fp32 weights, gradients, AdamW, EMA."""
    counts = count_params(build_on_meta(family, preset))
    return memory_per_gpu(counts, "ddp", 1, False)


def video_table(rows: Sequence[dict], frames: Sequence[int] = GPU_FRAMES,
                latents: Sequence[int] = GPU_LATENTS) -> str:
    """Markdown: the measured preset at `frames` x `latents` (GiB): static bytes beside the saved activations of
    each route, carried from the measured rows by per_token_fit (its largest miss on the measured points shown)."""
    family, preset = rows[0]["family"], rows[0]["preset"]
    static = static_parts(family, preset)
    model = build_on_meta(family, preset)
    routes = list(dict.fromkeys(r["route"] for r in rows))
    g = 2 ** 30
    head = ["model", "T", "tokens", "weights", "grads", "AdamW", "EMA"] + [f"activations {r}" for r in routes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in frames:
        n = tokens_at(model, t, latents)
        acts = [extrapolate(rows, n, r) for r in routes]
        cells = [f"{family} {preset}", str(t), f"{n:,}"] + [f"{static[k] / g:.2f}" for k in
                                                           ("weights", "grads", "adam", "ema")]
        lines.append("| " + " | ".join(cells + [f"{a / g:.2f}" + ("" if miss == 0 else f" (fit miss {float(miss):.0f} B)")
                                                for a, miss in acts]) + " |")
    return "\n".join(lines)
