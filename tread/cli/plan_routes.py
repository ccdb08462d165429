"""Plan TREAD routes for a model, data size and target: list candidates, count FLOPs, optionally time the
best, recommend (every rule: docs/ablations.md, "Route planning").

    python scripts/plan_routes.py --arch DiT-B/2 --target-speedup 1.3                 # FLOPs only, seconds
    python scripts/plan_routes.py --arch DiT-B/2 --batch 64 --target-speedup 1.3 --measure 3   # + timing
    python scripts/plan_routes.py --model flux --preset tiny --target-speedup 1.2 --measure 3
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import Parser
from tread.cli.errors import user_errors
from tread.perf.plan import PAPER_END_FROM_END, RULE, PlanError, TimeFn
from tread.perf.planner import PRECISIONS, PlanRequest, plan

EPILOG = ("Target: at least one of --target-speedup, --flops-fraction, --gflops-per-sample; all given must hold. "
          "Output: the Markdown table on stdout (--markdown too), everything with --json; progress on stderr. "
          "Rules (geometry, candidates, timing order, the recommendation, pilots): docs/ablations.md.")

__all__ = ["PlanError", "PlanRequest", "RULE", "main", "parse_args", "plan", "request_of"]


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = Parser(prog="plan_routes.py", description=__doc__, epilog=EPILOG, error_type=PlanError)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tread", help="a configs/model config: tread (default), dit, flux, sd3, ...")
    g.add_argument("--arch", default=None, help="DiT size for model=tread|dit, e.g. DiT-B/2 (default: the data's)")
    g.add_argument("--preset", default=None, help="family preset for model=flux|sd3|... (default: the config's)")
    g.add_argument("--data", default=None, help="a configs/data config (default: the composed one, toy)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override, as for train.py (repeatable)")
    g.add_argument("--resolution", type=int, default=None, help="latent side (default: the arch's usual data)")
    g.add_argument("--channels", type=int, default=None, help="latent channels (default: the arch's usual data)")
    g.add_argument("--batch", type=int, default=None, help="global batch per step (default: train.batch_size)")
    g.add_argument("--context-parallel", type=int, default=1, metavar="D",
                   help="processes per context group: add what one sends per step by all-to-all (default 1: none)")
    g = p.add_argument_group("target (at least one)")
    g.add_argument("--target-speedup", type=float, default=None, help="step speedup vs dense >= X (X > 1)")
    g.add_argument("--flops-fraction", type=float, default=None, help="training FLOPs <= F x dense (0 < F < 1)")
    g.add_argument("--gflops-per-sample", type=float, default=None,
                   help="training GFLOPs per sample (3 x forward) <= G")
    g = p.add_argument_group("candidates")
    g.add_argument("--min-start", type=int, default=2, help="first block a route may start at (default 2)")
    g.add_argument("--max-end", type=int, default=-PAPER_END_FROM_END,
                   help="last block a route may end at; negative counts from the end (default -4 = depth-4)")
    g.add_argument("--min-blocks", type=int, default=1, help="shortest route, in blocks (default 1)")
    g.add_argument("--max-ratio", type=float, default=0.5, help="largest selection ratio (default 0.5)")
    g.add_argument("--ratio-step", type=float, default=0.25, help="ratio grid step: step, 2 step, ... <= max-ratio")
    g.add_argument("--ratios", type=float, nargs="+", default=None, help="explicit ratios instead of the grid")
    g = p.add_argument_group("timing")
    g.add_argument("--measure", type=int, default=0, help="candidates to time (default 0: FLOPs only)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per config and pairing")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per config and pairing")
    g.add_argument("--rounds", type=int, default=2, help="interleaved rounds the timed steps are split into")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="train.mixed_precision of the timed steps and pilots (default: the config's)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the timed steps and the pilot runs (train.compile; default: eager)")
    g = p.add_argument_group("pilot trainings")
    g.add_argument("--pilot", type=int, default=0, metavar="N", help="train dense + top candidates N steps each")
    g.add_argument("--pilot-seconds", type=float, default=None, metavar="S",
                   help="pilot at equal training time: each run stops after S seconds of training (train."
                        "time_budget_min), after --pilot N steps at most when N is given")
    g.add_argument("--pilot-top", type=int, default=2, metavar="K", help="candidates in the pilot (default 2)")
    g.add_argument("--pilot-fid", action="store_true", help="rank the pilot by FID at its end (eval.at_end)")
    g.add_argument("--out", default=None, help="pilot run dirs go here (default outputs/plan_routes/<timestamp>)")
    g = p.add_argument_group("output")
    g.add_argument("--show", type=int, default=15, help="qualifying candidates listed in the table (default 15)")
    g.add_argument("--json", default=None, help="write the result here")
    g.add_argument("--markdown", default=None, help="write the Markdown table here")
    return p.parse_args(argv)


def request_of(a: argparse.Namespace) -> PlanRequest:
    """The parsed flags as the planner's request (checked as it is built)."""
    return PlanRequest(**{k: v for k, v in vars(a).items() if k not in ("json", "markdown")})


def main(argv: Optional[Sequence[str]] = None, time_fn: Optional[TimeFn] = None) -> dict:
    """Plan routes; returns the result dict (what --json writes). Bad input: SystemExit('error: ...').
    time_fn replaces the timing (tests): candidate row -> {"dense_s", "step_s"}."""
    with user_errors():
        a = parse_args(argv)
        res = plan(request_of(a), time_fn)
    print(res["markdown"])
    for path, text in ((a.json, json.dumps(res, indent=2)), (a.markdown, res["markdown"] + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    return res
