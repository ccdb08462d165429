"""Time THE training step of a model under several route configs on this device; the project's benchmark.

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-T/4 --resolution 32 --channels 3 --batch 64 --routes none paper balanced
    python scripts/benchmark.py --arch DiT-XL/2 --tokens 256 --batch 64 --precision bf16 --compile \\
        --routes none paper '[{"selection_ratio":0.75,"start_layer_idx":2,"end_layer_idx":-4}]' \\
        --sampling --eval-features --json bench.json --markdown bench.md
    python scripts/benchmark.py --family flux --preset tiny --resolution 16 --channels 3 --batch 32
    python scripts/benchmark.py --family all --preset tiny          # every diffusers family, one table
    python scripts/benchmark.py --arch DiT-B/2 --set train.grad_accum_steps=2 --set train.grad_clip=1.0

A step is what train.py runs: tread.training.step.TrainStep of the config `python train.py <overrides>` composes
(accumulation, label dropout, autocast, clipping, the optimizer step with its lr, the EMA update), built by
training.setup as train() builds it. The flags are overrides: --arch A (model=tread model.arch=A; dense:
model=dit), --family X --preset P (model=X model.preset=P), --resolution/--tokens/--channels (data.resolution /
data.channels; the dataset is never opened; default: the arch's usual data, see tread/perf/geometry.py), --batch
(train.batch_size), --routes (routing=<preset>, routing.routes=[...], or routing=none), --precision
(train.mixed_precision; default: the config's), --compile (train.compile=true, else false) with
--compile-backend (train.compile_backend; default: the config's, inductor), --gradient-checkpointing
(model.gradient_checkpointing), --unfused-adamw (optimizer.fused=false), --device cpu (train.cpu=true),
--cache-dir (paths.cache_dir), and --set KEY=VALUE for any other key (repeatable).

Every route config (--routes: "none"/"dense", a preset of configs/routing, or a JSON list of routes) is built
from its composed config (same train.seed: same initial weights) and timed on the same synthetic batch; the
first dense config is the baseline (one is added in front if none is given). After --warmup steps per config,
--steps timed steps per config run in --rounds interleaved rounds; the median is reported.

Per config: step time, images/s, tokens/s, peak memory (static = parameters + optimizer state + EMA, plus the
step's transient peak: tread/perf/memory.py), theoretical FLOPs per step (3 x forward x batch, tread/models/flops.py),
FLOPs ratio and speedup vs dense, the fraction of the FLOPs bound achieved, on CUDA the MFU against the
device's bf16 dense peak (tread/perf/peaks.py), and with --compile the graphs compiled, recompiles and graph breaks.
--sampling times the sampler of the dense config's EMA net (EDM Heun or rectified-flow Euler),
--eval-features the FID feature extractor, --data-loader the training data loader.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tread.cli.errors import user_errors
from tread.models.families import FAMILIES
from tread.perf.benchmark import StepBench, Timed, allow_compiled_configs, split_steps, step_records, time_interleaved
from tread.perf.geometry import choose_geometry, resolution_for_tokens
from tread.perf.memory import MemoryMeter
from tread.perf.overrides import (DEVICES, check_device, check_sets, compose_or_raise, precision_name, run_overrides)
from tread.perf.peaks import device_name, device_peak_flops
from tread.perf.routes import label_of, routing_overrides
from tread.perf.units import fmt_bytes, fmt_flops
from tread.perf.throughput import eval_feature_throughput, loader_throughput, sampling_throughput
from tread.schema import CONFIG_DIR
from tread.utils.errors import UserError

DENSE_NAMES = ("none", "dense")
RESERVED = {"model": "--arch / --family", "model.arch": "--arch", "model.preset": "--preset",
            "routing": "--routes", "routing.routes": "--routes", "routing.enabled": "--routes"}


class BenchError(UserError):
    """A bad benchmark input; printed as one line, 'error: ...'."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--arch", default="DiT-S/2", help="DiT size, e.g. DiT-S/2, DiT-XL/2, DiT-T/4 (model.arch)")
    add("--family", default="dit", choices=["dit", "all", *FAMILIES],
        help="dit (--arch) or a diffusers family (--preset); 'all' times every family")
    add("--preset", default="tiny", help="family preset (tiny, mid, ...)")
    add("--resolution", type=int, default=None, help="latent side (default: the arch's usual data)")
    add("--tokens", type=int, default=None, help="tokens per image (square); sets the resolution")
    add("--channels", type=int, default=None, help="latent channels (default: the arch's usual data)")
    add("--batch", type=int, default=32, help="global batch per step (train.batch_size)")
    add("--routes", nargs="+", default=["paper"],
        help="route configs: none/dense, a configs/routing preset, or a JSON list of routes; a dense baseline "
             "is added first when none is given")
    add("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="a Hydra override of the training config, as for train.py (repeatable)")
    add("--steps", type=int, default=10, help="timed steps per config")
    add("--warmup", type=int, default=3, help="untimed steps per config (compilation happens here)")
    add("--rounds", type=int, default=2, help="interleaved timing rounds the steps are split into")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add("--device", default="auto", choices=DEVICES, help="auto (accelerate's choice), cpu (train.cpu), cuda")
    add("--precision", choices=["fp32", "bf16"], default=None, help="train.mixed_precision (default: the config's)")
    add("--gradient-checkpointing", action="store_true",
        help="recompute every block in backward (model.gradient_checkpointing): less memory, more time")
    add("--unfused-adamw", action="store_true", help="torch's default AdamW instead of the fused one "
        "(optimizer.fused=false)")
    add("--compile", action="store_true", help="torch.compile the routed forward (train.compile=true)")
    add("--compile-backend", default=None, help="train.compile_backend (default: the config's, inductor)")
    add("--cache-dir", default=None, help="paths.cache_dir: the toy classifier and built-in data")
    add("--sampling", action="store_true", help="also time the dense config's sampler")
    add("--sampling-steps", type=int, default=40, help="sampler steps (EDM Heun / RF Euler)")
    add("--eval-features", action="store_true", help="also time the FID feature extractor")
    add("--features", default="toy_classifier", choices=["toy_classifier", "inception"])
    add("--inception-weights", default=None, help="local Inception weights (--features inception)")
    add("--image-size", type=int, default=32, help="image side for --eval-features")
    add("--eval-batch", type=int, default=None, help="images per extractor call (default --batch)")
    add("--eval-repeats", type=int, default=5)
    add("--data-loader", action="store_true",
        help="also time the training data loader (--data-path, default the built-in toy data)")
    add("--data-path", default=None, help="a latent dataset directory for --data-loader")
    add("--loader-workers", type=int, default=0, help="DataLoader workers for --data-loader")
    add("--json", default=None, help="also write the results here")
    add("--markdown", default=None, help="also write the Markdown table here")
    return p


# ----------------------------------------------------------------------------- flags -> configs
def route_configs(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(label, routing overrides) per --routes entry, with a dense config first when none is dense."""
    configs = [("dense" if s in DENSE_NAMES else s, routing_spec(s)) for s in specs]
    if not any(is_dense(ov) for _, ov in configs):
        configs.insert(0, ("dense", ["routing=none"]))
    return configs


def is_dense(routing_ov: Sequence[str]) -> bool:
    return list(routing_ov) == ["routing=none"]


def routing_spec(spec: str) -> list[str]:
    """A preset name from configs/routing (paper, balanced, ...), none/dense, or a JSON list of routes."""
    presets = sorted(p.stem for p in (CONFIG_DIR / "routing").glob("*.yaml") if not p.stem.startswith("_"))
    if spec in DENSE_NAMES:
        return ["routing=none"]
    if spec in presets:
        routing = compose_or_raise([f"routing={spec}"], BenchError).routing
        return [f"routing={spec}"] if routing.enabled and routing.routes else ["routing=none"]
    try:
        routes = json.loads(spec)
    except json.JSONDecodeError as err:
        raise BenchError(f"--routes {spec!r} is neither none/dense, a preset ({', '.join(presets)}) nor JSON: "
                         f"{err}") from None
    try:
        return routing_overrides([routes] if isinstance(routes, dict) else routes)
    except (KeyError, TypeError):
        raise BenchError(f"--routes {spec!r}: each route is a JSON object with selection_ratio, start_layer_idx "
                         f"and end_layer_idx") from None


def model_overrides(args: argparse.Namespace, family: Optional[str], dense: bool) -> list[str]:
    if family is None:
        return [f"model={'dit' if dense else 'tread'}", f"model.arch={args.arch}"]
    return [f"model={family}", f"model.preset={args.preset}"]


def base_overrides(args: argparse.Namespace, family: Optional[str]) -> tuple[list[str], Any]:
    """Everything but the model and routing overrides, and the geometry (see tread/perf/geometry.py)."""
    tail = ([f"train.batch_size={args.batch}"]
            + run_overrides(args.precision, args.device, args.compile, args.compile_backend)
            + (["model.gradient_checkpointing=true"] if args.gradient_checkpointing else [])
            + (["optimizer.fused=false"] if args.unfused_adamw else [])
            + ([f"paths.cache_dir={args.cache_dir}"] if args.cache_dir else []))
    probe = compose_or_raise(model_overrides(args, family, True) + tail + list(args.sets), BenchError)
    resolution = args.resolution if args.tokens is None else resolution_for_tokens(probe, args.tokens)
    geometry = choose_geometry(probe, resolution, args.channels)
    return geometry.overrides + tail, geometry


def config_overrides(args: argparse.Namespace, family: Optional[str]) -> tuple[list[tuple[str, list[str], bool]],
                                                                         Any, list[str]]:
    """(label, overrides, dense) per route config, the geometry, and the overrides all configs share."""
    tail, geometry = base_overrides(args, family)
    configs = [(label, model_overrides(args, family, is_dense(ov)) + tail + ov + list(args.sets), is_dense(ov))
               for label, ov in route_configs(args.routes)]
    return configs, geometry, model_overrides(args, family, False) + tail + list(args.sets)


# ----------------------------------------------------------------------------- one model, all configs
def bench_model(args: argparse.Namespace, family: Optional[str], peak: Optional[float]) -> dict:
    """Build every route config of one model, time them interleaved; records, model info and sampling."""
    configs, geometry, shared = config_overrides(args, family)
    allow_compiled_configs(len(configs))
    benches = [StepBench(compose_or_raise(overrides, BenchError)) for _, overrides, _ in configs]
    dev = benches[0].device
    meter = MemoryMeter(dev)
    meas = time_interleaved(benches, args.steps, args.warmup, args.rounds, meter)
    timed = [Timed(label, b, m) for (label, _, _), b, m in zip(configs, benches, meas)]
    base = next(i for i, (_, _, dense) in enumerate(configs) if dense)
    cfg, model = timed[base].bench.cfg, timed[base].bench.model
    name = str(cfg.model.arch) if family is None else f"{family}/{args.preset}"
    info = {"model": name, "family": family or "dit", "resolution": int(model.input_size),
            "channels": int(model.in_channels), "tokens": int(model.num_tokens), "depth": int(model.depth),
            "params": sum(p.numel() for p in model.parameters()),
            "geometry": geometry.line(model.num_tokens, "timing", "--resolution/--tokens/--channels time others"),
            "flops_source": ("analytic (tread/models/flops.py, = DiT.forward_flops)" if hasattr(model, "forward_flops")
                             else "torch FlopCounterMode, one forward (tread/models/flops.py)"),
            "overrides": shared, "cfg": cfg, "meter": meter.method, "device": dev}
    out = {"info": info, "results": step_records(timed, base, peak, name, meter.method)}
    if args.sampling:
        out["sampling"] = sampling_throughput(timed[base].bench, args.sampling_steps, name)
    return out


def settings_of(args: argparse.Namespace, infos: list[dict], peak: Optional[float], note: str) -> dict:
    first, cfg = infos[0], infos[0]["cfg"]
    t = cfg.train
    return {
        "model": first["model"] if len(infos) == 1 else "all families", "family": args.family,
        "arch": args.arch if args.family == "dit" else None, "preset": args.preset if args.family != "dit" else None,
        "resolution": first["resolution"], "channels": first["channels"], "tokens": first["tokens"],
        "depth": first["depth"], "params": first["params"], "geometry": first["geometry"],
        "models": [{k: v for k, v in i.items() if k not in ("cfg", "meter", "device")} for i in infos],
        "overrides": first["overrides"], "batch": int(t.batch_size), "grad_accum_steps": int(t.grad_accum_steps),
        "lr": float(cfg.optimizer.lr), "label_dropout": float(t.label_dropout), "grad_clip": t.grad_clip,
        "ema_decay": float(cfg.ema.decay), "device": str(first["device"]), "device_name": device_name(first["device"]),
        "threads": torch.get_num_threads(), "precision": precision_name(t, first["device"]),
        "compile": bool(args.compile),
        "compile_backend": str(t.compile_backend) if args.compile else None,
        "fused_adamw": bool(cfg.optimizer.get("fused", False)),
        "gradient_checkpointing": bool(cfg.model.gradient_checkpointing), "torch": torch.__version__,
        "steps": args.steps, "warmup": args.warmup, "rounds": len(split_steps(args.steps, args.rounds)),
        "route_specs": [label for label, _ in route_configs(args.routes)], "flops_source": first["flops_source"],
        "flops_per_step": "3 x forward FLOPs per sample x batch (multiply-add = 2)",
        "step": "tread.training.step.TrainStep of the composed config (what train.py runs)",
        "peak_flops": peak, "mfu_note": note, "peak_mem_method": first["meter"]}


# ----------------------------------------------------------------------------- output
def result_row(r: dict) -> str:
    routes = label_of(r["routes"])
    label = r["config"] if r["config"] == routes else f"{r['config']} ({routes})"
    mfu_s = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"| {r['model']} | {label} | {fmt_flops(r['train_flops_per_step'])} | {r['flops_ratio']:.3f} | "
            f"{r['step_ms']:.1f} ms | {r['speedup']:.3f}x | {r['speedup_bound']:.3f}x | "
            f"{100 * r['fraction_of_bound']:.1f}% | {r['images_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{fmt_bytes(r['peak_mem_bytes'])} | {mfu_s} |")


def extra_lines(out: dict) -> list[str]:
    lines = []
    samp = out.get("sampling")
    for sm in ([samp] if isinstance(samp, dict) else samp or []):
        lines.append(f"\nSampling {sm['model']}: {sm['sampler']}, {sm['num_steps']} steps ({sm['nfe']} NFE), batch "
                     f"{sm['batch']}: {sm['images_per_s']:.2f} images/s ({sm['ms_per_nfe']:.1f} ms/NFE)")
    if out.get("eval"):
        e = out["eval"]
        lines.append(f"\nEval features {e['features']} at {e['image_size']} px, batch {e['batch']}: "
                     f"{e['images_per_s']:.1f} images/s")
    if out.get("loader"):
        d = out["loader"]
        lines.append(f"\nData loader ({d['data']}, {d['workers']} workers, batch {d['batch']}): {d['ms_per_batch']:.2f} "
                     f"ms per batch ({d['images_per_s']:.0f} images/s); the dense step takes {d['step_ms']:.1f} ms, "
                     f"so a step waits {d['wait_ms_per_step']:.2f} ms for data")
    compiled = [r for r in out["results"] if "compile" in r]
    for i, r in enumerate(compiled):
        c = r["compile"]
        lines.append(f"{'' if i else chr(10)}Compiled ({c['backend']}) {r['model']} {r['config']}: "
                     f"{c['warmup']['unique_graphs']} graphs in the warm-up, {c['graph_breaks']} graph breaks, "
                     f"{c['recompiles_timed']} recompiles while timed")
    return lines


def markdown(out: dict) -> str:
    s = out["settings"]
    comp = f"compile ({s['compile_backend']})" if s["compile"] else "eager"
    clip = f"clip {s['grad_clip']:g}" if s["grad_clip"] else "no clipping"
    lines = [s["geometry"],
             f"{s['model']}, {s['tokens']} tokens, batch {s['batch']} (accumulation {s['grad_accum_steps']}, lr "
             f"{s['lr']:g}, label dropout {s['label_dropout']:g}, {clip}, EMA {s['ema_decay']:g}); "
             f"{s['device_name']} ({s['device']}), {s['threads']} threads, {s['precision']}, {comp}, "
             f"torch {s['torch']}", "",
             "| model | routes | FLOPs/step | FLOPs ratio | step | speedup | FLOPs bound | of bound | images/s | "
             "tokens/s | peak mem | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [result_row(r) for r in out["results"]] + extra_lines(out)
    if s.get("mfu_note"):
        lines.append(f"\nMFU: {s['mfu_note']}. Peak memory: {s['peak_mem_method']}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def check_args(args: argparse.Namespace) -> None:
    for flag, v in {"--steps": args.steps, "--rounds": args.rounds, "--batch": args.batch,
                    "--resolution": args.resolution, "--channels": args.channels, "--tokens": args.tokens,
                    "--threads": args.threads, "--sampling-steps": args.sampling_steps}.items():
        if v is not None and v < 1:
            raise BenchError(f"{flag} {v} is not allowed; it must be an integer >= 1")
    if args.warmup < 0:
        raise BenchError(f"--warmup {args.warmup} is not allowed; it must be an integer >= 0")
    check_sets(args.sets, RESERVED, BenchError)
    check_device(args.device, BenchError)


def run(args: argparse.Namespace) -> dict:
    check_args(args)
    families = [None] if args.family == "dit" else (list(FAMILIES) if args.family == "all" else [args.family])
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    peak, note = device_peak_flops(device_name(torch.device("cuda")) if cuda else None)
    if cuda and args.precision != "bf16" and peak:
        note += "; MFU is against the bf16 peak whatever the run's precision"
    runs = [bench_model(args, family, peak) for family in families]
    out: dict[str, Any] = {"settings": settings_of(args, [r["info"] for r in runs], peak, note),
                           "results": [rec for r in runs for rec in r["results"]]}
    samplings = [r["sampling"] for r in runs if "sampling" in r]
    if samplings:
        out["sampling"] = samplings[0] if len(samplings) == 1 else samplings
    cfg, device = runs[0]["info"]["cfg"], runs[0]["info"]["device"]
    if args.eval_features:
        out["eval"] = eval_feature_throughput(args.features, args.image_size, args.eval_batch or args.batch,
                                              args.eval_repeats, device, str(cfg.paths.cache_dir),
                                              args.inception_weights)
    if args.data_loader:
        out["loader"] = loader_throughput(args.data_path, str(cfg.paths.cache_dir), args.batch, args.loader_workers,
                                          max(10, args.steps), device, out["results"][0]["step_ms"])
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the benchmark; returns {"settings", "results"[, "sampling", "eval", "loader"]} (what --json writes).
    A bad input exits with one line, 'error: ...'."""
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with user_errors():
            out = run(args)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their thread count
    table = markdown(out)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return out
