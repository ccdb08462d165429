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
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import MAX_BATCH, Parser, UsageError, int_in, number_in
from tread.cli.gpu_steps import Step, steps

REPO = Path(__file__).resolve().parents[2]
# The project's dependencies a GPU machine's own Python may lack: import name -> distribution. torch, numpy and the
# standard scientific stack are the machine's; these are what the steps import.
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime",
          "pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
          "typing_inspection": "typing-inspection", "diffusers": "diffusers",
          "importlib_metadata": "importlib-metadata",
          "accelerate": "accelerate", "transformers": "transformers", "peft": "peft", "safetensors": "safetensors",
          "torchao": "torchao", "psutil": "psutil", "tqdm": "tqdm", "PIL": "pillow", "scipy": "scipy", "pytest": "pytest", "av": "av"}


# torch's and libraries' log lines (W1126 12:00:00.000 ...: warnings), kept in the step's log, left out of the report
LOG_NOISE = re.compile(r"^([WIE]\d{4} |Unable to import|\s*warnings\.warn|.*Warning: )")


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
    add("--budget", type=number_in(0, 86400, low_open=True), default=480,
        help="seconds for all the steps together (each also has its own limit)")
    add("--download-wheels", default=None, metavar="DIR",
        help="instead of checking: download the wheels of NEEDED at this environment's versions into DIR")
    return p


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


def run_step(step: Step, env: dict[str, str], out: Path, seconds: float, suffix: str = "") -> dict:
    """Run one step with its output in out/<name><suffix>.log, then judge its JSON (step.check);
    {name, command, rc, secs, status, log}."""
    log = out / (step.name.replace(" ", "_").replace("/", "") + suffix + ".log")
    command = " ".join(shlex.quote(a) for a in ["python3", *step.argv])
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *step.argv], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=seconds).returncode
            status = "passed" if rc == 0 else f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            rc, status = 124, f"stopped after its {seconds:.0f} s"
    if rc == 0 and step.check is not None:
        problems = judged(step, out)
        if problems:
            rc, status = 1, "failed: " + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                                                      if len(problems) > 8 else "")
    return {"name": step.name, "command": command, "rc": rc, "secs": round(time.monotonic() - start, 1),
            "status": status, "log": log.name}


def judged(step: Step, out: Path) -> list[str]:
    """step.check on the JSON the step wrote; a missing or unreadable file is itself the problem."""
    try:
        return step.check(out / step.output)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"its output {step.output} could not be judged ({type(err).__name__}: {err})"]


def run_one(step: Step, env: dict[str, str], out: Path, cuda: bool, left: float) -> dict:
    """run_step, and for a step that asks for it, a failure on CUDA run again with CUDA_LAUNCH_BLOCKING=1 (the
    failing kernel named where it fails, not at the next sync), its log kept beside the first."""
    result = run_step(step, env, out, min(step.timeout, left))
    if result["rc"] and step.blocking_rerun and cuda and left - result["secs"] > 20:
        again = run_step(step, {**env, "CUDA_LAUNCH_BLOCKING": "1"}, out, min(step.timeout, left - result["secs"]),
                         "_blocking")
        result["blocking_rerun"] = {k: again[k] for k in ("status", "secs", "log")}
    return result


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
            results.append(run_one(step, env, out, cuda, left))
            print(f"gpu-check: {step.name}: {results[-1]['status']} in {results[-1]['secs']} s", flush=True)
    return results


# ----------------------------------------------------------------------------- report
def log_tail(log: Path, lines: int = 25) -> list[str]:
    """The last lines of a step's log, less torch's and the libraries' log noise, fenced."""
    text = log.read_text(errors="replace").strip().splitlines()
    return ["```", *[line for line in text if not LOG_NOISE.match(line)][-lines:], "```", ""]


def step_section(result: dict, step: Optional[Step], out: Path) -> list[str]:
    lines = [f"### {result['name']}: {result['status']} ({result['secs']} s)", ""]
    if "command" in result:
        lines += ["```", result["command"], "```", ""]
    table = out / step.markdown if step and step.markdown else None
    log = out / result["log"] if "log" in result else None
    if table and table.is_file():
        lines += [table.read_text().strip(), ""]
    elif log and log.is_file():     # pytest's summary, compare_paper's tables, or why it failed
        lines += log_tail(log)
    again = result.get("blocking_rerun")
    if again:
        lines += [f"Again with CUDA_LAUNCH_BLOCKING=1: {again['status']} ({again['secs']} s)", ""]
        lines += log_tail(out / again["log"], 40) if (out / again["log"]).is_file() else []
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
