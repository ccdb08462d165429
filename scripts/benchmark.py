"""Time a dense and a TREAD training step on the current device (median after warm-up).

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-T/4 --resolution 32 --channels 3 --batch 64 --routes balanced
    python scripts/benchmark.py --family flux --preset tiny --resolution 16 --channels 3 --batch 32
    python scripts/benchmark.py --family all --preset tiny          # every diffusers family, one table

A step is what train.py does: the loss forward (EDM for DiT, rectified flow for the diffusers families),
backward, AdamW step. Both models share weights and inputs; only the routes differ. Prints both times,
the measured speedup, the theoretical FLOPs ratio of the routes and the fraction of the bound achieved.
DiT FLOPs come from DiT.forward_flops (analytic); family FLOPs are counted by torch's FlopCounterMode
on one forward pass (matmuls and attention), dense and routed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from diffusion import EDM, RectifiedFlow  # noqa: E402
from models import build_dit  # noqa: E402
from models.families import FAMILIES, build_family  # noqa: E402
from routing import routing_from_config  # noqa: E402

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "routing"


def load_routes(spec: str) -> dict:
    """A preset name from configs/routing (paper, balanced, ...) or a JSON list of routes."""
    if (PRESETS / f"{spec}.yaml").is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(PRESETS / f"{spec}.yaml"))
        return {"enabled": cfg["enabled"], "routes": cfg["routes"]}
    return {"enabled": True, "routes": json.loads(spec)}


def time_steps(model, x, y, steps: int, warmup: int, device: torch.device, dtype, objective=None) -> list[float]:
    objective = objective or EDM()
    net = objective.precondition(model).to(device).train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = objective.loss(net, x, y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def counted_flops(model, x, y) -> float:
    """Forward FLOPs of `model` on one sample, counted by torch's FlopCounterMode (routes as configured)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, torch.enable_grad():
        model(x[:1], torch.full((1,), 500.0, device=x.device), y[:1])
    return float(counter.get_total_flops())


def bench_family(family: str, args, device: torch.device, dtype, routing: dict) -> dict:
    """Dense vs routed rectified-flow training steps of one diffusers family preset."""
    kw = dict(input_size=args.resolution, in_channels=args.channels, num_classes=1000, preset=args.preset)
    torch.manual_seed(0)
    dense = build_family(family, **kw).to(device)
    routed = build_family(family, routing=routing, **kw).to(device)
    routed.load_state_dict(dense.state_dict())
    x = torch.randn(args.batch, args.channels, args.resolution, args.resolution, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    flops_d, flops_r = counted_flops(dense.train(), x, y), counted_flops(routed.train(), x, y)
    rf = RectifiedFlow()
    t_dense, t_routed = [], []
    for _ in range(2):
        t_dense += time_steps(dense, x, y, args.steps // 2, args.warmup, device, dtype, rf)
        t_routed += time_steps(routed, x, y, args.steps // 2, args.warmup, device, dtype, rf)
    med_d, med_r = statistics.median(t_dense), statistics.median(t_routed)
    speedup, bound = med_d / med_r, flops_d / flops_r
    return {"family": family, "preset": args.preset, "params_m": sum(p.numel() for p in dense.parameters()) / 1e6,
            "tokens": dense.num_tokens, "depth": dense.depth, "batch": args.batch, "device": str(device),
            "threads": torch.get_num_threads(), "precision": args.precision,
            "routes": [r.__dict__ for r in routed.routing.routes], "dense_step_ms": med_d * 1e3,
            "tread_step_ms": med_r * 1e3, "speedup": speedup, "flops_ratio": flops_r / flops_d,
            "speedup_bound": bound, "fraction_of_bound": speedup / bound}


def family_table(results: list[dict]) -> str:
    r0 = results[0]
    lines = [f"{r0['device']}, {r0['threads']} threads, {r0['precision']}, batch {r0['batch']}",
             "", "| family | preset | params | tokens | depth | routes | dense step | TREAD step | speedup | "
             "FLOPs bound | share of bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        routes = "; ".join(f"{x['selection_ratio']:g} @ {x['start_layer_idx']}..{x['end_layer_idx']}"
                           for x in r["routes"])
        lines.append(f"| {r['family']} | {r['preset']} | {r['params_m']:.2f}M | {r['tokens']} | {r['depth']} | "
                     f"{routes} | {r['dense_step_ms']:.1f} ms | {r['tread_step_ms']:.1f} ms | {r['speedup']:.3f}x | "
                     f"{r['speedup_bound']:.3f}x | {100 * r['fraction_of_bound']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="DiT-S/2", help="DiT size, e.g. DiT-S/2, DiT-XL/2, DiT-T/4")
    p.add_argument("--family", default="dit", choices=["dit", "all", *FAMILIES],
                   help="dit (--arch) or a diffusers family (--preset); 'all' times every family")
    p.add_argument("--preset", default="tiny", help="family preset (tiny, mid, ...)")
    p.add_argument("--markdown", default=None, help="also write a Markdown table here")
    p.add_argument("--resolution", type=int, default=16, help="latent side (16 with /2 = 64 tokens)")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--routes", default="paper", help="routing preset name or JSON list of routes")
    p.add_argument("--steps", type=int, default=10, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    routing = load_routes(args.routes)
    if args.family != "dit":
        families = FAMILIES if args.family == "all" else [args.family]
        results = [bench_family(f, args, device, dtype, routing) for f in families]
        table = family_table(results)
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        if args.markdown:
            Path(args.markdown).write_text(table + "\n")
        return results if args.family == "all" else results[0]
    torch.manual_seed(0)
    dense = build_dit(args.arch, args.resolution, args.channels, 1000)
    routed = build_dit(args.arch, args.resolution, args.channels, 1000, routing=routing)
    routed.load_state_dict(dense.state_dict())
    routes = routing_from_config(routing, dense.depth)
    x = torch.randn(args.batch, args.channels, args.resolution, args.resolution, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)

    # Interleave short rounds so slow drift of the machine hits both configs alike.
    t_dense, t_routed = [], []
    rounds = 2
    for _ in range(rounds):
        t_dense += time_steps(dense, x, y, args.steps // rounds, args.warmup, device, dtype)
        t_routed += time_steps(routed, x, y, args.steps // rounds, args.warmup, device, dtype)
    med_d, med_r = statistics.median(t_dense), statistics.median(t_routed)
    flops_d, flops_r = dense.forward_flops([]), dense.forward_flops(routes)
    speedup, bound = med_d / med_r, flops_d / flops_r
    result = {
        "arch": args.arch, "tokens": dense.num_tokens, "batch": args.batch, "device": str(device),
        "threads": torch.get_num_threads(), "precision": args.precision,
        "routes": [r.__dict__ for r in routes],
        "dense_step_ms": med_d * 1e3, "tread_step_ms": med_r * 1e3, "speedup": speedup,
        "flops_ratio": flops_r / flops_d, "speedup_bound": bound, "fraction_of_bound": speedup / bound,
        "train_gflops_per_step_dense": 3 * flops_d * args.batch / 1e9,
    }
    print(f"{args.arch} ({dense.num_tokens} tokens), batch {args.batch}, {device}, {torch.get_num_threads()} threads, "
          f"{args.precision}; routes {args.routes}")
    print(f"  dense step : {med_d * 1e3:8.1f} ms")
    print(f"  TREAD step : {med_r * 1e3:8.1f} ms")
    print(f"  speedup    : {speedup:.3f}x   (FLOPs ratio {flops_r / flops_d:.3f}, bound {bound:.3f}x, "
          f"{100 * speedup / bound:.1f}% of bound)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
