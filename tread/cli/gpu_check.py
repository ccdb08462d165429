"""`make gpu-check`: the project's GPU figures in one command, on a bare GPU machine with its own torch.

    python3 scripts/gpu_check.py --out outputs/gpu_check                    # on the GPU machine, from the repo root
    python3 scripts/gpu_check.py --paper-dir /path/to/CompVis/tread --wheels .whl
    .venv/bin/python scripts/gpu_check.py --download-wheels .whl          # here, with the network: what must travel

Each step runs under its own time limit and --out/report.md gathers the results; a failed step sets exit
status 1. --quick runs the same steps at tiny sizes. What it runs: docs/benchmarks.md, "GPU".
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import MAX_BATCH, Parser, UsageError, int_in, number_in

REPO = Path(__file__).resolve().parents[2]
# The project's dependencies a GPU machine's own Python may lack: import name -> distribution. torch, numpy and the
# standard scientific stack are the machine's; these are what the steps import.
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime",
          "pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
          "typing_inspection": "typing-inspection", "diffusers": "diffusers",
          "importlib_metadata": "importlib-metadata",
          "accelerate": "accelerate", "transformers": "transformers", "peft": "peft", "safetensors": "safetensors",
          "psutil": "psutil", "tqdm": "tqdm", "PIL": "pillow", "scipy": "scipy", "pytest": "pytest", "av": "av"}


# torch's and libraries' log lines (W1126 12:00:00.000 ...: warnings), kept in the step's log, left out of the report
LOG_NOISE = re.compile(r"^([WIE]\d{4} |Unable to import|\s*warnings\.warn|.*Warning: )")


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]            # after the python executable, from the repo root
    timeout: int               # seconds
    cuda: bool = True          # skipped without CUDA (said so in the report)
    markdown: Optional[str] = None   # a file the step writes its table to, under --out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gpu_check.py", description=__doc__)
    add = p.add_argument
    add("--out", default="outputs/gpu_check", help="folder for the logs, JSON and report.md")
    add("--paper-dir", default=None, help="a checkout of CompVis/tread for compare_paper (skipped without it)")
    add("--wheels", default=None, help="a folder of wheels for the missing dependencies (see --download-wheels)")
    add("--xl-batches", type=int_in(1, MAX_BATCH), nargs="+", default=[256, 192, 128, 96, 64],
        help="DiT-XL/2 batch candidates: the largest whose step fits is benchmarked")
    add("--quick", action="store_true", help="tiny sizes everywhere: tries every step in seconds (CPU included)")
    add("--only", nargs="+", default=None, help="run only these steps (names as in the report)")
    add("--budget", type=number_in(0, 86400, low_open=True), default=450,
        help="seconds for all the steps together (each also has its own limit)")
    add("--download-wheels", default=None, metavar="DIR",
        help="instead of checking: download the wheels of NEEDED at this environment's versions into DIR")
    return p


def steps(args: argparse.Namespace, out: Path) -> list[Step]:
    """The checks in order; --quick shrinks every size so that the whole sequence runs on a CPU in a minute."""
    q = args.quick
    xl = ["--arch", "DiT-S/2", "--tokens", "16", "--batch", "4"] if q else \
        ["--arch", "DiT-XL/2", "--tokens", "256", "--fit-batch", *map(str, args.xl_batches)]
    sizes = ["DiT-S/2:8:4"] if q else ["DiT-B/2:32:128", "DiT-XL/2:32:64"]
    flux = ["--preset", "tiny"] if q else ["--preset", "mid", "--fit-batch", "32", "16", "8", "4"]
    bench = ["scripts/benchmark.py", "--precision", "bf16", "--routes", "none", "paper"]
    out_steps = [
        Step("gpu tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"], 300),
        Step("DiT-XL/2 benchmark", [*bench, *xl, *([] if q else ["--compile"]), "--steps", "2" if q else "8",
                                    "--warmup", "1" if q else "3",
                                    "--sampling", "--sampling-steps", "2" if q else "18",
                                    "--json", str(out / "dit_xl2.json"), "--markdown", str(out / "dit_xl2.md")],
             420, cuda=not q, markdown="dit_xl2.md"),
        Step("FLUX mid routed step", [*bench, "--family", "flux", *flux, "--steps", "2" if q else "6", "--warmup",
                                      "1" if q else "2", "--json", str(out / "flux_mid.json"),
                                      "--markdown", str(out / "flux_mid.md")], 300, cuda=not q, markdown="flux_mid.md"),
        Step("compare_paper", ["scripts/compare_paper.py", str(args.paper_dir), "--sizes", *sizes, "--precisions",
                               "fp32" if q else "bf16", "--steps", "2" if q else "6", "--warmup", "1" if q else "3",
                               "--rounds", "1" if q else "2", "--json", str(out / "compare_paper.json")],
             420, cuda=not q),
    ]
    unknown = sorted(set(args.only or ()) - {s.name for s in out_steps})
    if unknown:
        raise SystemExit(f"error: --only {', '.join(unknown)} is not a step; allowed: "
                         f"{', '.join(repr(s.name) for s in out_steps)}")
    if args.paper_dir is None:
        out_steps = [s for s in out_steps if s.name != "compare_paper"]
    return [s for s in out_steps if args.only is None or s.name in args.only]


# ----------------------------------------------------------------------------- dependencies
def missing_modules() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def install_wheels(wheels: Path, site: Path) -> str:
    """pip install --no-index --no-deps every wheel in `wheels` into `site` (the machine's own packages stay as
    they are); '' or pip's complaint."""
    files = sorted(str(w) for w in wheels.glob("*.whl"))
    if not files:
        return f"--wheels {wheels} holds no .whl files"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *files]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return "" if proc.returncode == 0 else proc.stderr.strip()[-2000:]


def download_wheels(folder: Path) -> int:
    """Fetch the wheels of every NEEDED distribution at the version installed here (the set the tests pass with)."""
    pins = [f"{dist}=={importlib.metadata.version(dist)}" for dist in dict.fromkeys(NEEDED.values())]
    print("downloading:", " ".join(pins))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder), *pins]
    return subprocess.run(cmd).returncode


def environment(site: Optional[Path]) -> dict[str, str]:
    """The steps' environment: the repo (not pip-installed there) and the wheels' folder on PYTHONPATH, offline."""
    paths = ([str(site)] if site else []) + [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "PYTHONUNBUFFERED": "1"}


# ----------------------------------------------------------------------------- running
def cuda_available(env: dict[str, str]) -> tuple[bool, str]:
    """(CUDA usable, 'device name, torch version'), asked in a subprocess with the steps' environment."""
    probe = ("import torch; ok = torch.cuda.is_available(); "
             "print(ok, (torch.cuda.get_device_name(0) if ok else 'CPU') + ', torch ' + torch.__version__)")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    ok, _, where = proc.stdout.strip().partition(" ")
    return ok == "True", where or proc.stderr.strip()[-300:]


def run_step(step: Step, env: dict[str, str], out: Path, seconds: float) -> dict:
    """Run one step with its output in out/<name>.log; {name, command, rc, secs, status}."""
    log = out / (step.name.replace(" ", "_").replace("/", "") + ".log")
    command = " ".join(shlex.quote(a) for a in ["python3", *step.argv])
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *step.argv], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=seconds).returncode
            status = "passed" if rc == 0 else f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            rc, status = 124, f"stopped after its {seconds:.0f} s"
    return {"name": step.name, "command": command, "rc": rc, "secs": round(time.monotonic() - start, 1),
            "status": status, "log": log.name}


def run_all(todo: Sequence[Step], env: dict[str, str], out: Path, cuda: bool, budget: float) -> list[dict]:
    """Every step in order within `budget` seconds in all: each gets its own limit or what is left."""
    deadline, results = time.monotonic() + budget, []
    for step in todo:
        left = deadline - time.monotonic()
        if step.cuda and not cuda:
            results.append({"name": step.name, "status": "skipped: no CUDA device", "rc": 0, "secs": 0.0})
        elif left < 20:
            results.append({"name": step.name, "status": f"not run: the {budget:.0f} s budget is spent", "rc": 1,
                            "secs": 0.0})
        else:
            print(f"gpu-check: {step.name} (up to {min(step.timeout, left):.0f} s)", flush=True)
            results.append(run_step(step, env, out, min(step.timeout, left)))
            print(f"gpu-check: {step.name}: {results[-1]['status']} in {results[-1]['secs']} s", flush=True)
    return results


# ----------------------------------------------------------------------------- report
def step_section(result: dict, step: Optional[Step], out: Path) -> list[str]:
    lines = [f"### {result['name']}: {result['status']} ({result['secs']} s)", ""]
    if "command" in result:
        lines += ["```", result["command"], "```", ""]
    table = out / step.markdown if step and step.markdown else None
    log = out / result["log"] if "log" in result else None
    if table and table.is_file():
        lines += [table.read_text().strip(), ""]
    elif log and log.is_file():     # pytest's summary, compare_paper's tables, or why it failed
        text = log.read_text(errors="replace").strip().splitlines()
        tail = [line for line in text if not LOG_NOISE.match(line)][-25:]
        lines += ["```", *tail, "```", ""]
    return lines


def report(results: list[dict], todo: Sequence[Step], out: Path, where: str, missing: list[str], total: float) -> str:
    by_name = {s.name: s for s in todo}
    lines = [f"# gpu-check on {where}", "",
             f"{total:.0f} s in all; {sys.executable} ({sys.version.split()[0]}); missing before: "
             f"{', '.join(NEEDED[m] for m in missing) or 'nothing'}", ""]
    for result in results:
        lines += step_section(result, by_name.get(result["name"]), out)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        sys.exit(f"error: {err}")
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels))
    todo = steps(args, Path(args.out).resolve())      # flags checked before anything runs
    start, out = time.monotonic(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    missing, site = missing_modules(), None
    if missing:
        print(f"gpu-check: this Python lacks {', '.join(NEEDED[m] for m in missing)}; they travel as wheels "
              f"(`python scripts/gpu_check.py --download-wheels .whl` where the registry is reachable, then "
              f"--wheels .whl)")
        if not args.wheels:
            return 1
        site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))       # beside nothing the report keeps
        failure = install_wheels(Path(args.wheels), site)
        if failure:
            print(f"error: --wheels {args.wheels}: {failure}")
            return 1
    env = environment(site)
    cuda, where = cuda_available(env)
    results = run_all(todo, env, out, cuda, args.budget)
    text = report(results, todo, out, where, missing, time.monotonic() - start)
    (out / "report.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"device": where, "steps": results}, indent=2))
    print(f"gpu-check: report in {out / 'report.md'}")
    return int(any(r["rc"] not in (0,) for r in results))
