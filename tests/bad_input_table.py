"""The bad-input acceptance table's machinery, shared by every tests/test_bad_inputs*.py module: a Case (a program,
its arguments, the needles its one `error:` line must hold, and an optional setup that breaks files in the case's
own folder first), the World every case runs in (a finished tiny run, its dataset, broken copies of it, ...;
built once per session by the `world` fixture of tests/conftest.py, which queues every selected case of every
module in the fork-server harness at once), and check_refused, the acceptance rules.

The rules, asserted on what happened (never on how long it took): a non-zero exit status, exactly one `error:`
line naming the key or file and the offending value, no traceback, no work done (no progress bar, and nothing
in the case's folder but what a refused launch may leave: see leftover_work), and nothing already written
(a finished run directory, a dataset) changed. Each case's seconds are recorded (record_property
"refusal_secs") and tests/conftest.py prints them as a figure at the end of the session.

Placeholders in a case's arguments and needles: {run} a finished tiny training run, {data} its (pristine)
dataset, {bad} the folder of broken copies of it (see bad_data), {empty} an empty folder, {imgs} a folder of
three PNGs, {ref} a small existing .npz, {samples} a folder with an earlier samples.npz, {missing} a path that
does not exist, {out} the case's own folder.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch

from bad_input_harness import HANG_SECS, REPO, Harness, digest, fingerprint, leftover_work, run_dir_lock

PRECOMPUTE = "scripts/precompute_latents.py"
CONVERT = "scripts/convert_checkpoint.py"
PREFIX = {"train.py": "", "sample.py": "sample/", "fid.py": "fid/", PRECOMPUTE: "precompute/", CONVERT: "convert/"}
# A tqdm bar ("train:   0%|", "sampling: 25%|"): the program got to its loop (train.py: the training steps).
PROGRESS = re.compile(r"\d+%\|")
# How a case breaks files first: setup(its folder, the world's places) (e.g. a broken copy of {run} in {out}/run).
Setup = Callable[[Path, dict], Any]
REGISTRY: dict[str, "Case"] = {}         # every case of every module, by test id


@dataclass(frozen=True)
class Case:
    id: str
    program: str                      # train.py | sample.py | fid.py | scripts/precompute_latents.py | CONVERT
    args: tuple[str, ...]
    needles: tuple[str, ...]          # each in the error line: the key or file, and the value
    xfail: Optional[str] = None       # known not to be refused cleanly yet: where the fix lies
    setup: Optional[Setup] = field(default=None, compare=False)   # breaks files in the case's folder first

    @property
    def name(self) -> str:
        """The test id: the case id, after the program for those of sample.py, fid.py and the precompute script."""
        return PREFIX[self.program] + self.id

    def __post_init__(self) -> None:
        assert REGISTRY.setdefault(self.name, self) is self, f"case ids must be unique: {self.name}"

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=self.xfail)] if self.xfail else []
        return pytest.param(self, id=self.name, marks=marks)


def train(id: str, *args: str, needles: tuple[str, ...] = (), xfail: Optional[str] = None,
          setup: Optional[Setup] = None) -> Case:
    """A train.py case; without needles, the last argument (key=value) is the needle (sample, fid: the same)."""
    return Case(id, "train.py", args, needles or (args[-1],), xfail, setup)


def sample(id: str, *args: str, needles: tuple[str, ...] = (), ckpt: bool = True,
           xfail: Optional[str] = None, setup: Optional[Setup] = None) -> Case:
    return Case(id, "sample.py", (("checkpoint={run}",) if ckpt else ()) + args, needles or (args[-1],), xfail,
                setup)


def fid(id: str, *args: str, needles: tuple[str, ...] = (), xfail: Optional[str] = None,
        setup: Optional[Setup] = None) -> Case:
    return Case(id, "fid.py", args, needles or (args[-1],), xfail, setup)


def precompute(id: str, *args: str, needles: tuple[str, ...], xfail: Optional[str] = None,
               setup: Optional[Setup] = None) -> Case:
    return Case(id, PRECOMPUTE, args, needles, xfail, setup)


def convert(id: str, *args: str, needles: tuple[str, ...], xfail: Optional[str] = None,
            setup: Optional[Setup] = None) -> Case:
    return Case(id, CONVERT, args, needles, xfail, setup)


# Broken copies of the pristine dataset: name -> how it is broken (given the copy's folder).
BAD_DATA: dict[str, Callable[[Path], Any]] = {}


def bad_data(name: str, *needles: str):
    def register(edit: Callable[[Path], Any]) -> Case:
        BAD_DATA[name] = edit
        return train(f"data_{name}", "data.builtin=null", f"data.path={{bad}}/{name}", needles=needles)
    return register


def copy_run(out: Path, places: dict) -> Path:
    """A copy of the finished run {run} as {out}/run (without its lock); returns its checkpoint's step dir."""
    shutil.copytree(places["run"], out / "run", ignore=shutil.ignore_patterns(".lock"))
    return next((out / "run" / "checkpoints").iterdir())


def checkpoint_json(make_run: Callable[[Path, dict], Path], edit: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    """A setup: the run `make_run` makes in {out} (it returns the checkpoint's step dir), its checkpoint.json
    edited."""
    def setup(out: Path, places: dict) -> None:
        path = make_run(out, places) / "checkpoint.json"
        tree = json.loads(path.read_text())
        edit(tree)
        path.write_text(json.dumps(tree))
    return setup


class _Payload:
    """Unpickling this runs a shell command: what a planted checkpoint does."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant_pickle(out: Path, places: dict) -> None:
    """{out}/run with an old-format checkpoint (model.pt) whose unpickling would run `touch <base>/payload_ran`
    (a new file in the world, which every case checks for)."""
    step = copy_run(out, places)
    for f in step.iterdir():
        f.unlink()
    torch.save({"config": {}, "x": _Payload(f"touch {Path(places['run']).parent / 'payload_ran'}")},
               step / "model.pt")


# ----------------------------------------------------------------------------- the world the cases run in

@dataclass
class World:
    base: Path                          # everything made before the cases: no case may change any of it
    harness: Harness
    env: dict[str, str]
    places: dict[str, str]
    stats: dict[str, tuple[int, ...]]   # fingerprint(base) before the cases (updated after a change is reported)
    hashes: dict[str, str]              # digest(base) before the cases, compared after all of them
    forked: dict[str, tuple[Future, Path]] = field(default_factory=dict)   # case name -> (its result, its folder)
    real: dict[str, Future] = field(default_factory=dict)    # case name -> (result, folder) of the real program
    made: dict[str, Any] = field(default_factory=dict)       # the launch that trained {run}: what work looks like
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fill(self, text: str, out: Path) -> str:
        return text.format(**self.places, out=str(out))

    def args(self, case: Case, out: Path) -> list[str]:
        args = [self.fill(a, out) for a in case.args]
        if case.program == "train.py":
            common = ["debug=tiny", "train.compile=false", f"paths.output_dir={out}/outputs"]
            if not any(a.startswith("hydra.run.dir=") for a in args):
                common.append(f"hydra.run.dir={out}/run")
            return common + args
        if case.program == "sample.py":
            return [*args, f"hydra.run.dir={out}/hydra"]
        if case.program == "fid.py":
            return [*args, f"hydra.run.dir={out}/hydra", f"paths.output_dir={out}/outputs"]
        return args

    def finished(self, result: dict[str, Any], out: Path, before: dict[str, tuple[int, ...]]) -> None:
        """As a program ends: the work it left in its own folder (`before`: that folder as it started), and what
        differs in base since the last check (so a change is blamed on the case that made it, or one running
        beside it). New files only count outside Hydra's record of a launch into the run dir (run/.hydra/<time>/:
        a refused launch adds its record, it never rewrites an earlier one); the run dir's lock is not looked at
        (a case beside one that launches into {run} sees it held; test_nothing_written... checks the end)."""
        result["work"] = leftover_work(out, before)
        with self.lock:
            now = {k: v for k, v in fingerprint(self.base).items() if not run_dir_lock(k)}
            result["changes"] = ([f"{k}: changed" for k in self.stats if k in now and now[k] != self.stats[k]] +
                                 [f"{k}: removed" for k in self.stats if k not in now] +
                                 [f"{k}: new" for k in now if k not in self.stats and not k.startswith("run/.hydra")])
            if result["changes"]:
                self.stats = now

    def start(self, case: Case, out: Path) -> None:
        """Queue the case in the harness (its result: self.forked[case.name])."""
        out.mkdir(parents=True, exist_ok=True)
        if case.setup is not None:
            case.setup(out, self.places)
        before = fingerprint(out)
        future = self.harness.submit(case.program, self.args(case, out), out / "log", timeout=HANG_SECS,
                                     on_done=lambda result: self.finished(result, out, before))
        self.forked[case.name] = future, out


def selected(request, test: str, param: str) -> list[Any]:
    """The parameters of the selected tests of one function (in every module), in the order they run."""
    return [item.callspec.params[param] for item in request.session.items if item.originalname == test]


def make_world(tmp_path_factory, request) -> Iterator[World]:
    """The finished run, its dataset and the other folders the cases name; then every selected case is queued
    in the harness (two at a time: the tests only wait for their results) and the selected real programs are
    started one at a time beside them."""
    from PIL import Image

    base = tmp_path_factory.mktemp("bad_inputs")
    cache = base / "cache"
    env = {**os.environ, "TREAD_CACHE_DIR": str(cache), "TREAD_OUTPUT_DIR": str(base / "outputs"),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    harness = Harness(env=env, jobs=2)
    try:
        run = base / "run"
        made = harness.run("train.py", ["debug=tiny", "train.compile=false", "train.max_steps=1",
                                        "checkpoint.every_steps=0", "eval.every_steps=0", "eval.at_end=false",
                                        f"hydra.run.dir={run}"], tmp_path_factory.mktemp("setup"))
        assert made["rc"] == 0, made["stderr"][-3000:]
        data = next(cache.glob("toy_shapes_*"))
        for name, edit in BAD_DATA.items():
            shutil.copytree(data, base / "bad" / name)
            edit(base / "bad" / name)
        (base / "empty").mkdir()
        (base / "imgs" / "cls0").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(base / "imgs" / "cls0" / f"{i}.png")
        (base / "refs").mkdir()
        np.savez(base / "refs" / "ref.npz", mu=np.zeros(4), sigma=np.eye(4))
        (base / "samples").mkdir()
        np.savez(base / "samples" / "samples.npz", arr_0=np.zeros((2, 16, 16, 3), np.uint8))
        places = {"run": str(run), "data": str(data), "bad": str(base / "bad"), "empty": str(base / "empty"),
                  "imgs": str(base / "imgs"), "ref": str(base / "refs" / "ref.npz"), "samples": str(base / "samples"),
                  "missing": str(base / "missing")}
        world = World(base, harness, env, places, fingerprint(base), digest(base), made=made)
        real = [REGISTRY[name] for name in selected(request, "test_harness_matches_the_real_program", "name")]
        for case in selected(request, "test_bad_input_is_refused", "case") + real:
            if case.name not in world.forked:
                world.start(case, tmp_path_factory.mktemp("case") / "case")
        # The real programs take ~4.5 s each (imports): one at a time, beside the harness.
        with ThreadPoolExecutor(1) as pool:
            for case in real:
                world.real[case.name] = pool.submit(run_real, world, case, tmp_path_factory.mktemp("real") / "case")
            yield world
    finally:
        harness.close()


def run_real(world: World, case: Case, out: Path) -> tuple[dict[str, Any], Path]:
    """`python <program> <args>` from the repo root, as a user runs it (killed if it hangs)."""
    out.mkdir(parents=True)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, case.program, *world.args(case, out)], cwd=REPO, env=world.env,
                              capture_output=True, text=True, timeout=HANG_SECS)
        result = {"rc": proc.returncode, "timed_out": False, "stdout": proc.stdout, "stderr": proc.stderr}
    except subprocess.TimeoutExpired as hung:                 # what it printed so far comes as bytes
        stdout, stderr = (x.decode(errors="replace") if x else "" for x in (hung.stdout, hung.stderr))
        result = {"rc": None, "timed_out": True, "stdout": stdout, "stderr": stderr}
    result["secs"] = time.monotonic() - start
    world.finished(result, out, {})
    return result, out


def check_refused(world: World, case: Case, result: dict[str, Any], out: Path) -> str:
    """The acceptance rules, on what happened (never on how long it took); returns the error line (the case's
    folder written as {out})."""
    text = result["stdout"] + result["stderr"]
    assert not result["timed_out"], (f"hung: still running after {result['secs']:.0f} s (the hang guard; a refusal "
                                      f"takes about a second), killed: {text[-2000:]}")
    assert result["rc"] != 0, f"exit status 0: {text[-2000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert not PROGRESS.search(text), f"a progress bar: got to its loop before refusing: {text[-2000:]}"
    assert not result["work"], f"work done before refusing (in the case's folder {out}): {result['work']}"
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
    assert len(lines) == 1, f"{len(lines)} lines start with error: in stderr:\n{result['stderr'][-3000:]}"
    for needle in case.needles:
        assert world.fill(needle, out) in lines[0], f"{world.fill(needle, out)!r} not in {lines[0]!r}"
    assert not result["changes"], f"changed while this case ran (beside at most one other): {result['changes']}"
    return lines[0].replace(str(out), "{out}")




def refused(world: World, case: Case, record_property) -> None:
    """The body of every module's test_bad_input_is_refused: the case's queued result, checked."""
    future, out = world.forked[case.name]
    result = future.result()
    record_property("refusal_secs", result["secs"])      # a figure for the session's report, not a limit
    check_refused(world, case, result, out)
