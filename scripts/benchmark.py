"""Time training steps of a model under several route configs on the current device; the project's benchmark.

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-T/4 --resolution 32 --channels 3 --batch 64 --routes none paper balanced
    python scripts/benchmark.py --arch DiT-XL/2 --tokens 256 --batch 64 --precision bf16 --compile \\
        --routes none paper '[{"selection_ratio":0.75,"start_layer_idx":2,"end_layer_idx":-4}]' \\
        --sampling --eval-features --json bench.json --markdown bench.md
    python scripts/benchmark.py --family flux --preset tiny --resolution 16 --channels 3 --batch 32
    python scripts/benchmark.py --family all --preset tiny          # every diffusers family, one table

A step is what train.py does: the loss forward (EDM for DiT, rectified flow for the diffusers families),
backward, AdamW step. Every route config (--routes: "none"/"dense", a preset of configs/routing, or a JSON
list of routes) is timed with the same weights and inputs; the first dense config is the baseline (one is
added in front if none is given). After --warmup steps per config, --steps timed steps per config are run in
--rounds interleaved rounds (so slow drift of the machine hits all configs alike); the median is reported.

Per config: step time, images/s, tokens/s, peak memory, theoretical FLOPs of the step (3 x forward x batch;
DiT: analytic, training/flops.py == DiT.forward_flops; families: torch's FlopCounterMode on one forward),
FLOPs ratio and speedup vs dense, the fraction of the FLOPs bound achieved (speedup / (dense / route FLOPs)),
and on CUDA the MFU against the device's bf16 dense peak (null for devices not in training/flops.py).

Peak memory = static bytes (parameters + AdamW state of that config's model) + the step's transient peak above
what was resident when its timed chunk began: CUDA max_memory_allocated (reset per config and round); CPU
the process peak RSS (VmHWM in /proc/self/status, reset through /proc/self/clear_refs; where that cannot be
reset, the ru_maxrss growth, which only sees new peaks). CPU figures are approximate (allocator caching).

--sampling times the dense model's sampler: the EDM Heun sampler (2 x steps - 1 evaluations) for DiT,
rectified-flow Euler for the families. --eval-features times the FID feature extractor (toy classifier by
default, which is available offline; --features inception --inception-weights PATH for Inception).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from diffusion import EDM, RectifiedFlow  # noqa: E402
from models import build_dit  # noqa: E402
from models.families import FAMILIES, build_family  # noqa: E402
from training.flops import (counted_forward_flops, device_peak_flops, dit_forward_flops, fraction_of_bound,  # noqa: E402
                            mfu, parse_dit_arch, train_step_flops)

PRESETS = ROOT / "configs" / "routing"
DENSE_NAMES = ("none", "dense")


# ----------------------------------------------------------------------------- route configs
def load_routes(spec: str) -> dict:
    """A preset name from configs/routing (paper, balanced, ...), none/dense, or a JSON list of routes."""
    if spec in DENSE_NAMES:
        return {"enabled": False, "routes": []}
    if (PRESETS / f"{spec}.yaml").is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(PRESETS / f"{spec}.yaml"))
        return {"enabled": bool(cfg["enabled"]), "routes": cfg["routes"] or []}
    try:
        routes = json.loads(spec)
    except json.JSONDecodeError as e:
        presets = sorted(p.stem for p in PRESETS.glob("*.yaml"))
        raise SystemExit(f"--routes {spec!r} is neither none/dense, a preset ({', '.join(presets)}) nor JSON: {e}")
    if isinstance(routes, dict):
        routes = [routes]
    return {"enabled": bool(routes), "routes": routes}


def is_dense(routing: dict) -> bool:
    return not routing.get("enabled") or not routing.get("routes")


def route_configs(specs: list[str]) -> list[tuple[str, dict]]:
    """(label, routing) per --routes entry, with a dense config first when none is given."""
    configs = [("dense" if s in DENSE_NAMES else s, load_routes(s)) for s in specs]
    if not any(is_dense(r) for _, r in configs):
        configs.insert(0, ("dense", load_routes("none")))
    return configs


def routes_str(routes: list[dict]) -> str:
    if not routes:
        return "dense"
    return "; ".join(f"{r['selection_ratio']:g} @ {r['start_layer_idx']}..{r['end_layer_idx']}" for r in routes)


# ----------------------------------------------------------------------------- memory
def _proc_status_kb(key: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class MemoryMeter:
    """Transient peak bytes of a code region, see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.method = "cuda_max_memory_allocated"
        elif self._reset_hwm() and _proc_status_kb("VmHWM") is not None:
            self.method = "cpu_vmhwm_clear_refs"
        else:
            self.method = "cpu_ru_maxrss_delta"

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            self._reset_hwm()
            self.base = _proc_status_kb("VmRSS") * 1024
        else:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def stop(self) -> int:
        if self.method.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "cpu_vmhwm_clear_refs":
            peak = _proc_status_kb("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, int(peak - self.base))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------- compile
def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - torch without dynamo
        return {"unique_graphs": 0, "graph_breaks": 0}
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# ----------------------------------------------------------------------------- one config's training step
class Stepper:
    """One config's model (optionally torch.compile'd), wrapped by the objective, with its AdamW."""

    fused_adamw = True  # as configs/optimizer/adamw.yaml (fused: true); --unfused-adamw measures torch's default

    gradient_checkpointing = False  # --gradient-checkpointing: recompute blocks in backward (memory for time)

    def __init__(self, model: torch.nn.Module, objective, device: torch.device, dtype, compile_backend=None):
        model.gradient_checkpointing = self.gradient_checkpointing
        self.model = model.to(device).train()
        backbone = torch.compile(self.model, backend=compile_backend) if compile_backend else self.model
        self.net = objective.precondition(backbone).to(device).train()
        self.objective, self.device, self.dtype = objective, device, dtype
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4,
                                     fused=True if self.fused_adamw else None)

    def step(self, x, y) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.objective.loss(self.net, x, y).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, x, y, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.step(x, y)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def static_bytes(self) -> int:
        state = [t for s in self.opt.state.values() for t in s.values()]
        return tensor_bytes(self.model.parameters()) + tensor_bytes(state)


def split_steps(steps: int, rounds: int) -> list[int]:
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def time_configs(steppers: list[Stepper], x, y, steps: int, warmup: int, rounds: int, meter: MemoryMeter,
                 compiled: bool) -> list[dict]:
    """Warm every config up, then time them in interleaved rounds; per config times, memory, compile counts."""
    out = [{"times": [], "transient": 0} for _ in steppers]
    for st, o in zip(steppers, out):
        before = dynamo_counts()
        for _ in range(warmup):
            st.step(x, y)
        if compiled:
            o["compile"] = _delta(dynamo_counts(), before)
    for n in split_steps(steps, rounds):
        for st, o in zip(steppers, out):
            before = dynamo_counts()
            meter.start()
            o["times"] += st.timed(x, y, n)
            o["transient"] = max(o["transient"], meter.stop())
            if compiled:
                d = _delta(dynamo_counts(), before)
                o.setdefault("timed", {"unique_graphs": 0, "graph_breaks": 0})
                o["timed"] = {k: o["timed"][k] + d[k] for k in d}
    for st, o in zip(steppers, out):
        o["static"] = st.static_bytes()
    return out


# ----------------------------------------------------------------------------- models
def dit_resolution(args) -> int:
    if args.tokens is None:
        return args.resolution
    patch = parse_dit_arch(args.arch)[3]
    side = math.isqrt(args.tokens)
    if side * side != args.tokens:
        raise SystemExit(f"--tokens {args.tokens} is not a square number of tokens")
    return side * patch


def family_resolution(family: str, args) -> int:
    if args.tokens is None:
        return args.resolution
    side = math.isqrt(args.tokens)
    if side * side != args.tokens:
        raise SystemExit(f"--tokens {args.tokens} is not a square number of tokens")
    probe = build_family(family, input_size=args.resolution, in_channels=args.channels, num_classes=1000,
                         preset=args.preset)
    patch = probe.latent_patch()[1]
    del probe
    return side * patch


def build_models(args, family: Optional[str], configs, device) -> dict:
    """Models of every route config with the baseline's weights, inputs, FLOPs and sampler hooks."""
    torch.manual_seed(0)
    if family is None:
        res = dit_resolution(args)
        build = lambda routing: build_dit(args.arch, res, args.channels, 1000, routing=routing)  # noqa: E731
        name, objective, sampler = args.arch, EDM(), "edm_heun"
    else:
        res = family_resolution(family, args)
        kw = dict(input_size=res, in_channels=args.channels, num_classes=1000, preset=args.preset)
        build = lambda routing: build_family(family, routing=routing, **kw)  # noqa: E731
        name, objective, sampler = f"{family}/{args.preset}", RectifiedFlow(), "rf_euler"
    base_idx = next(i for i, (_, r) in enumerate(configs) if is_dense(r))
    base = build(None)
    state = base.state_dict()
    models = []
    for i, (_, routing) in enumerate(configs):
        if i == base_idx:
            models.append(base)
            continue
        m = build(None if is_dense(routing) else routing)
        m.load_state_dict(state)
        models.append(m)
    x = torch.randn(args.batch, args.channels, res, res, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    routes = [[r.__dict__ for r in m.routing.routes] if not is_dense(c) else [] for m, (_, c) in zip(models, configs)]
    if family is None:
        fwd = [dit_forward_flops(args.arch, res, args.channels, rt) for rt in routes]
        for m, rt, f in zip(models, routes, fwd):  # the importable arithmetic is the model's own count
            from routing.spec import Route
            assert math.isclose(m.forward_flops([Route(**r) for r in rt]), f), (m.forward_flops(), f)
        flops_source = "analytic (training/flops.py, = DiT.forward_flops)"
    else:
        fwd = [counted_forward_flops(m.to(device).train(), x, y) for m in models]
        flops_source = "torch FlopCounterMode, one forward"
    return {"name": name, "family": family, "resolution": res, "models": models, "base_idx": base_idx,
            "objective": objective, "sampler": sampler, "x": x, "y": y, "routes": routes, "forward_flops": fwd,
            "flops_source": flops_source, "tokens": base.num_tokens, "depth": base.depth,
            "params": sum(p.numel() for p in base.parameters())}


# ----------------------------------------------------------------------------- extra measurements
def bench_sampling(bundle: dict, args, device, dtype) -> dict:
    """Images/s of the dense model's sampler (EDM Heun for DiT, rectified-flow Euler for families)."""
    model = bundle["models"][bundle["base_idx"]].to(device).eval()
    steps = args.sampling_steps
    obj = EDM(num_steps=steps) if bundle["family"] is None else RectifiedFlow(num_steps=steps)
    net = obj.precondition(model).eval()
    nfe = obj.sampling_nfe(steps) if hasattr(obj, "sampling_nfe") else steps
    gen = torch.Generator(device).manual_seed(0)
    x = bundle["x"]
    noise = torch.randn(x.shape, generator=gen, device=device)
    y = torch.randint(0, 1000, (x.shape[0],), generator=gen, device=device)

    def run(n):
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            obj.sample(net, noise, y, null_label=1000, num_steps=n)

    run(1 if bundle["family"] is not None else 2)  # warm-up
    sec = timed(lambda: run(steps), device)
    model.train()
    return {"model": bundle["name"], "sampler": bundle["sampler"], "num_steps": steps, "nfe": nfe,
            "batch": int(x.shape[0]), "routes": [], "cfg_scale": 1.0, "seconds": sec,
            "images_per_s": x.shape[0] / sec, "ms_per_nfe": 1e3 * sec / nfe}


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of fn takes, synchronising CUDA around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def bench_loader(args, device, step_ms: float) -> dict:
    """The training data loader alone (LatentLoader: sharded sampler, workers, pinned memory, prefetch) on
    --data-path or the built-in toy data; with workers a batch is fetched while the step runs, so the wait
    per step is what the loader cannot hide behind a step of `step_ms`. train.py logs the real wait
    (data_wait_frac in metrics.jsonl)."""
    from data import LatentDataset, LatentLoader, ensure_toy_dataset
    path = args.data_path or ensure_toy_dataset(Path(args.cache_dir) / "toy_shapes_r16_n1000_s0",
                                                num_per_class=1000, resolution=16, seed=0)
    dataset = LatentDataset(path)
    loader = LatentLoader(dataset, args.batch, seed=0, num_workers=args.loader_workers,
                          pin_memory=device.type == "cuda")
    it = iter(loader)
    for _ in range(3):
        next(it)
    n = max(10, args.steps)
    start = time.perf_counter()
    for _ in range(n):
        batch = next(it)
        batch[0].to(device, non_blocking=True)
    ms = 1e3 * (time.perf_counter() - start) / n
    wait = ms if args.loader_workers == 0 else max(0.0, ms - step_ms)
    return {"data": str(path), "workers": args.loader_workers, "batch": args.batch, "ms_per_batch": ms,
            "images_per_s": 1e3 * args.batch / ms, "step_ms": step_ms, "wait_ms_per_step": wait}


def bench_eval_features(args, device) -> dict:
    """Images/s of the FID feature extractor's forward (forward_all: pool, spatial and logits when it has one)."""
    from evaluation.features import build_feature_extractor

    ext = build_feature_extractor(args.features, inception_weights=args.inception_weights,
                                  cache_dir=args.cache_dir, device=device, resolution=args.image_size)
    fwd: Callable = getattr(ext, "forward_all", ext)
    gen = torch.Generator("cpu").manual_seed(0)
    imgs = torch.randint(0, 256, (args.eval_batch or args.batch, 3, args.image_size, args.image_size),
                         generator=gen, dtype=torch.uint8).to(device)
    with torch.no_grad():
        fwd(imgs)  # warm-up
        times = [timed(lambda: fwd(imgs), device) for _ in range(args.eval_repeats)]
    med = statistics.median(times)
    return {"features": args.features, "image_size": args.image_size, "batch": int(imgs.shape[0]),
            "repeats": args.eval_repeats, "median_batch_s": med, "images_per_s": imgs.shape[0] / med,
            "dim": int(getattr(ext, "dim", 0))}


# ----------------------------------------------------------------------------- one model, all configs
def bench_model(args, family: Optional[str], configs, device, dtype, peak, peak_note) -> tuple[dict, list[dict]]:
    b = build_models(args, family, configs, device)
    backend = args.compile_backend if args.compile else None
    steppers = [Stepper(m, b["objective"], device, dtype, backend) for m in b["models"]]
    meter = MemoryMeter(device)
    meas = time_configs(steppers, b["x"], b["y"], args.steps, args.warmup, args.rounds, meter, args.compile)
    base = b["base_idx"]
    med = [statistics.median(m["times"]) for m in meas]
    flops = [train_step_flops(f, args.batch) for f in b["forward_flops"]]
    results = []
    for i, ((label, _), m) in enumerate(zip(configs, meas)):
        speedup = med[base] / med[i]
        achieved = flops[i] / med[i]
        rec = {
            "model": b["name"], "family": family or "dit", "preset": args.preset if family else None,
            "config": label, "dense": not b["routes"][i], "baseline": i == base, "routes": b["routes"][i],
            "tokens": b["tokens"], "batch": args.batch,
            "step_ms": 1e3 * med[i], "step_ms_all": [1e3 * t for t in m["times"]],
            "images_per_s": args.batch / med[i], "tokens_per_s": args.batch * b["tokens"] / med[i],
            "peak_mem_bytes": m["static"] + m["transient"], "static_mem_bytes": m["static"],
            "step_mem_bytes": m["transient"], "peak_mem_method": meter.method,
            "forward_flops_per_sample": b["forward_flops"][i], "train_flops_per_step": flops[i],
            "flops_ratio": flops[i] / flops[base], "speedup": speedup,
            "speedup_bound": flops[base] / flops[i],
            "fraction_of_bound": fraction_of_bound(speedup, flops[base], flops[i]),
            "achieved_flops_per_s": achieved, "mfu": mfu(achieved, peak) if device.type == "cuda" else None,
        }
        if args.compile:
            rec["compile"] = {"backend": args.compile_backend, "warmup": m.get("compile"),
                              "recompiles_timed": m.get("timed", {}).get("unique_graphs", 0),
                              "graph_breaks_timed": m.get("timed", {}).get("graph_breaks", 0)}
        results.append(rec)
    info = {"model": b["name"], "family": family or "dit", "resolution": b["resolution"], "tokens": b["tokens"],
            "depth": b["depth"], "params": b["params"], "flops_source": b["flops_source"]}
    sampling = bench_sampling(b, args, device, dtype) if args.sampling else None
    del steppers, b
    return {"info": info, "sampling": sampling}, results


# ----------------------------------------------------------------------------- output
def fmt_flops(f: float) -> str:
    for unit, s in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if f >= s:
            return f"{f / s:.2f} {unit}F"
    return f"{f:.0f} F"


def fmt_bytes(b: int) -> str:
    return f"{b / 2 ** 30:.2f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"


def markdown(out: dict) -> str:
    s = out["settings"]
    comp = f"compile ({s['compile_backend']})" if s["compile"] else "eager"
    lines = [f"{s['model']}, {s['tokens']} tokens, batch {s['batch']}; {s['device_name']} ({s['device']}), "
             f"{s['threads']} threads, {s['precision']}, {comp}, torch {s['torch']}", "",
             "| model | routes | FLOPs/step | FLOPs ratio | step | speedup | FLOPs bound | of bound | images/s | "
             "tokens/s | peak mem | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        label = r["config"] if r["config"] == routes_str(r["routes"]) else f"{r['config']} ({routes_str(r['routes'])})"
        mfu_s = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r['model']} | {label} | {fmt_flops(r['train_flops_per_step'])} | {r['flops_ratio']:.3f} | "
                     f"{r['step_ms']:.1f} ms | {r['speedup']:.3f}x | {r['speedup_bound']:.3f}x | "
                     f"{100 * r['fraction_of_bound']:.1f}% | {r['images_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{fmt_bytes(r['peak_mem_bytes'])} | {mfu_s} |")
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
                     f"ms per batch ({d['images_per_s']:.0f} images/s); the dense step takes "
                     f"{d['step_ms']:.1f} ms, so a step waits {d['wait_ms_per_step']:.2f} ms for data")
    if s.get("mfu_note"):
        lines.append(f"\nMFU: {s['mfu_note']}. Peak memory: {s['peak_mem_method']}.")
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="DiT-S/2", help="DiT size, e.g. DiT-S/2, DiT-XL/2, DiT-T/4")
    p.add_argument("--family", default="dit", choices=["dit", "all", *FAMILIES],
                   help="dit (--arch) or a diffusers family (--preset); 'all' times every family")
    p.add_argument("--preset", default="tiny", help="family preset (tiny, mid, ...)")
    p.add_argument("--resolution", type=int, default=16, help="latent side (16 with /2 = 64 tokens)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per image (square); overrides --resolution")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--routes", nargs="+", default=["paper"],
                   help="route configs: none/dense, a configs/routing preset, or a JSON list of routes; a dense "
                        "baseline is added first when none is given")
    p.add_argument("--steps", type=int, default=10, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per config (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds the steps are split into")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--data-loader", action="store_true",
                   help="also time the training data loader (--data-path, default the built-in toy data)")
    p.add_argument("--data-path", default=None, help="a latent dataset directory for --data-loader")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader workers for --data-loader")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute every block in backward (model.gradient_checkpointing): less memory, more time")
    p.add_argument("--unfused-adamw", action="store_true",
                   help="torch's default AdamW implementation instead of the fused one the training config uses")
    p.add_argument("--compile", action="store_true", help="torch.compile the model of every config")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    p.add_argument("--sampling", action="store_true", help="also time the dense model's sampler")
    p.add_argument("--sampling-steps", type=int, default=40, help="sampler steps (EDM Heun / RF Euler)")
    p.add_argument("--eval-features", action="store_true", help="also time the FID feature extractor")
    p.add_argument("--features", default="toy_classifier", choices=["toy_classifier", "inception"])
    p.add_argument("--inception-weights", default=None, help="local Inception weights (--features inception)")
    p.add_argument("--image-size", type=int, default=32, help="image side for --eval-features")
    p.add_argument("--eval-batch", type=int, default=None, help="images per extractor call (default --batch)")
    p.add_argument("--eval-repeats", type=int, default=5)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache"), help="where the toy classifier is cached")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--markdown", default=None, help="also write the Markdown table here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark; returns {"settings", "results"[, "sampling", "eval"]} (also what --json writes)."""
    args = parse_args(argv)
    Stepper.fused_adamw = not args.unfused_adamw
    Stepper.gradient_checkpointing = bool(args.gradient_checkpointing)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their thread count


def run(args) -> dict:
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    if args.compile:
        args.compile_backend = args.compile_backend or ("inductor" if device.type == "cuda" else "aot_eager")
        import torch._dynamo.config as dcfg
        for key in ("recompile_limit", "cache_size_limit"):  # one compiled instance per route config
            if hasattr(dcfg, key):
                setattr(dcfg, key, max(getattr(dcfg, key), 16 * len(args.routes) + 16))
    configs = route_configs(args.routes)
    name = device_name(device)
    peak, peak_note = device_peak_flops(name if device.type == "cuda" else None)
    if device.type == "cuda" and args.precision != "bf16" and peak:
        peak_note += "; the run is fp32, so MFU is against the bf16 peak"

    families = [None] if args.family == "dit" else (FAMILIES if args.family == "all" else [args.family])
    infos, results, samplings = [], [], []
    for fam in families:
        extra, res = bench_model(args, fam, configs, device, dtype, peak, peak_note)
        infos.append(extra["info"])
        results += res
        if extra["sampling"]:
            samplings.append(extra["sampling"])
    settings = {
        "model": infos[0]["model"] if len(infos) == 1 else "all families",
        "family": args.family, "arch": args.arch if args.family == "dit" else None,
        "preset": args.preset if args.family != "dit" else None,
        "resolution": infos[0]["resolution"], "channels": args.channels, "tokens": infos[0]["tokens"],
        "depth": infos[0]["depth"], "params": infos[0]["params"], "models": infos,
        "batch": args.batch, "device": str(device), "device_name": name, "threads": torch.get_num_threads(),
        "precision": args.precision, "compile": bool(args.compile), "fused_adamw": not args.unfused_adamw,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "compile_backend": args.compile_backend if args.compile else None, "torch": torch.__version__,
        "steps": args.steps, "warmup": args.warmup, "rounds": len(split_steps(args.steps, args.rounds)),
        "route_specs": [label for label, _ in configs], "flops_source": infos[0]["flops_source"],
        "flops_per_step": "3 x forward FLOPs per sample x batch (multiply-add = 2)",
        "peak_flops": peak, "mfu_note": peak_note, "peak_mem_method": results[0]["peak_mem_method"],
    }
    out: dict[str, Any] = {"settings": settings, "results": results}
    if samplings:
        out["sampling"] = samplings[0] if len(samplings) == 1 else samplings
    if args.eval_features:
        out["eval"] = bench_eval_features(args, device)
    if args.data_loader:
        out["loader"] = bench_loader(args, device, results[0]["step_ms"])
    table = markdown(out)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return out


if __name__ == "__main__":
    main()
