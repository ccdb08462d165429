"""Time a dense and a TREAD training step on the current device (median after warm-up).

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-T/4 --resolution 32 --channels 3 --batch 64 --routes balanced

A step is what train.py does: EDM loss forward, backward, AdamW step. Both models
share weights and inputs; only the routes differ. Prints both times, the measured
speedup, the theoretical FLOPs ratio of the routes and the fraction of the bound achieved.
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

from diffusion import EDM  # noqa: E402
from models import build_dit  # noqa: E402
from routing import routing_from_config  # noqa: E402

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "routing"


def load_routes(spec: str) -> dict:
    """A preset name from configs/routing (paper, balanced, ...) or a JSON list of routes."""
    if (PRESETS / f"{spec}.yaml").is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(PRESETS / f"{spec}.yaml"))
        return {"enabled": cfg["enabled"], "routes": cfg["routes"]}
    return {"enabled": True, "routes": json.loads(spec)}


def time_steps(model, x, y, steps: int, warmup: int, device: torch.device, dtype) -> list[float]:
    edm = EDM()
    net = edm.precondition(model).to(device).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = edm.loss(net, x, y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="DiT-S/2", help="DiT size, e.g. DiT-S/2, DiT-XL/2, DiT-T/4")
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
