"""A fork server that runs the entry points (train.py, sample.py, fid.py, scripts/precompute_latents.py,
scripts/convert_checkpoint.py) on many inputs without paying their imports (about 3.4 s of a 4.5 s bad-input run)
each time.

The server imports the entry modules once and composes each program's config once, does no torch compute (so
forking is safe with OpenMP's thread pools, which start only with the first parallel op), then reads one JSON
request per stdin line:

    {"id": 7, "program": "train.py", "args": [...], "out": "<dir for stdout.txt / stderr.txt>", "env": {...},
     "timeout": 1200}

For each it forks a child that: starts its own process group, sets os.environ and sys.argv, points fds 0/1/2
at /dev/null and the two files (os.dup2), chdirs to the repo root, runs the program file as __main__ (runpy: the
script's own `if __name__ == "__main__":` block, with its imports already loaded; Hydra finds configs/ next to
it), and leaves with the real program's exit status via os._exit: SystemExit's code (None: 0; a string: printed
to stderr, 1, as the interpreter does), or an uncaught exception's traceback and 1. Up to --jobs children run at
once; for each the server answers one JSON line {"id", "rc", "secs" (fork to exit), "timed_out"}. The timeout
is a hang guard, not a speed limit: a child still running after it (HANG_SECS by default, minutes where a
refusal takes about a second) is stuck, and its process group is killed.

    harness = Harness(env, jobs=2)
    result = harness.run("train.py", ["train.seed=abc"], out_dir)       # or harness.submit(...) -> a Future
    harness.close()

A request with "world": N forks N ranks of one run, each with the variables torchrun sets (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...): the multi-process tests (FSDP against DDP, context parallelism) get
their gloo worlds without N interpreters importing torch. A failed rank kills the others and the request's rc is
the first failure; rank i > 0 writes stdout.rank<i>.txt (rank_file). The server answers {"id", "pids"} as soon
as the children are forked, so `Harness.popen()` can hand back a Popen-like `Forked` (pid, poll, wait,
communicate, send_signal, kill) for the fault tests, which signal and kill -9 the real training process.

Also here: what a refused launch may leave (fingerprint, leftover_work: the check that no work was done) and
refusal_report, the line of refusal times tests/conftest.py prints at the end of a session (a figure, never
asserted: a loaded machine makes every refusal slower, and it is still a refusal).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import runpy
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
# program -> the module it imports its work from (imported once by the server; the script itself is run anew)
PROGRAMS = {"train.py": "tread.cli.train", "sample.py": "tread.cli.sample", "fid.py": "tread.cli.fid",
            "scripts/precompute_latents.py": "tread.cli.precompute",
            "scripts/convert_checkpoint.py": "tread.cli.convert_checkpoint"}
# A program still running after this long is hung, and is killed so that the session ends. Only a hang guard: a
# refusal takes about 1 s in the harness and 5 s as a real program (14 s of CPU: the imports), but on 2 cores
# shared with other test sessions and CPU hogs (load average 12) we saw 200 s and over 300 s.
HANG_SECS = 1200.0
JOB_LOGS = {f"{Path(program).stem}.log" for program in PROGRAMS}      # Hydra's log of a job: train.log, ...


# ----------------------------------------------------------------------------- the server (its own process)

def _child(request: dict[str, Any], rank: int) -> None:
    """In the forked child: become the program (rank `rank` of the request's world), then _exit with its status.
    Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        out = Path(request["out"])
        os.environ.update(request.get("env") or {})
        world = int(request.get("world", 1))
        if world > 1:                                   # what torchrun hands each process it starts
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                              ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(request["master_port"]))
        os.chdir(REPO)
        sys.argv = [str(REPO / request["program"]), *request["args"]]
        null = os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(out / rank_file("stdout", rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        stderr = os.open(out / rank_file("stderr", rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in (null, stdout, stderr):
            os.close(fd)
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:                                   # sys.exit("error: ...") prints the message, status 1
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught exception
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill(pid: int) -> int:
    """Kill a child's process group (and the child); its exit status."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except ProcessLookupError:
            pass
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _warm_up() -> None:
    """Compose each program's config once (no torch compute): Hydra's plugin discovery and the override
    grammar are then loaded in every child (about half of a case's time otherwise)."""
    from tread.schema import compose

    for name in ("train", "sample", "fid"):
        compose([], name)


def serve(jobs: int) -> None:
    # Answers go to the original stdout; anything else printed here (an import's warning) goes to stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    for name in (*PROGRAMS.values(), "hydra", "torch._dynamo"):   # torch._dynamo: the schema's backend check
        importlib.import_module(name)
    _warm_up()
    print(json.dumps({"ready": True}), file=reply, flush=True)

    def answer(request: dict[str, Any], rc: int, start: float, timed_out: bool) -> None:
        print(json.dumps({"id": request.get("id"), "rc": rc, "secs": time.monotonic() - start,
                          "timed_out": timed_out}), file=reply, flush=True)

    queue: deque = deque()
    running: list[_Launch] = []
    pending, eof = b"", False
    while not (eof and not queue and not running):
        if not eof and select.select([0], [], [], 0.005 if running or queue else None)[0]:
            chunk = os.read(0, 1 << 16)
            eof = not chunk
            pending += chunk
            *lines, pending = pending.split(b"\n")
            queue.extend(json.loads(line) for line in lines if line.strip())
        elif eof:
            time.sleep(0.005)
        while queue and len(running) < jobs:
            running.append(_Launch(queue.popleft(), reply))
            print(json.dumps({"id": running[-1].request.get("id"), "pids": list(running[-1].pids)}), file=reply,
                  flush=True)
        for launch in list(running):
            if launch.poll():
                answer(launch.request, launch.rc(), launch.start, launch.timed_out)
                running.remove(launch)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a multi-process test's rendezvous: two such tests may run at once (one per
    pytest-xdist worker), so none may rely on torch.distributed's default 29500."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_file(stream: str, rank: int) -> str:
    """Where a child's stdout/stderr goes: stdout.txt for rank 0 (or a single process), stdout.rank1.txt, ..."""
    return f"{stream}.txt" if rank == 0 else f"{stream}.rank{rank}.txt"


class _Launch:
    """One request's processes (one, or `world` ranks forked together): as torchrun, when a rank fails the others
    are killed, and the launch's status is the first failure's."""

    def __init__(self, request: dict[str, Any], reply: Any):
        self.request, self.start, self.timed_out = request, time.monotonic(), False
        self.codes: dict[int, int] = {}                       # rank -> exit status
        self.pids: dict[int, int] = {}                        # pid -> rank, while running
        self.failed: Optional[int] = None                     # the first rank seen failing
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(int(request.get("world", 1))):
            pid = os.fork()
            if pid == 0:
                reply.close()
                _child(request, rank)
            self.pids[pid] = rank

    def poll(self) -> bool:
        """Reap what has exited; kill the rest after a failure or past the timeout. True when all are done."""
        for pid, rank in list(self.pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[rank] = os.waitstatus_to_exitcode(status)
                del self.pids[pid]
                if self.codes[rank] != 0 and self.failed is None:
                    self.failed = rank
        if self.pids and time.monotonic() - self.start > float(self.request.get("timeout", HANG_SECS)):
            self.timed_out = True
        if self.pids and (self.timed_out or self.failed is not None):
            for pid, rank in list(self.pids.items()):
                code = _kill(pid)
                self.codes.setdefault(rank, code)
                del self.pids[pid]
        return not self.pids

    def rc(self) -> int:
        if self.timed_out and self.failed is None:
            return next((c for c in self.codes.values() if c != 0), -signal.SIGKILL)
        return self.codes[self.failed] if self.failed is not None else 0


# ----------------------------------------------------------------------------- what a refused launch leaves

def fingerprint(root: Path) -> dict[str, tuple[int, ...]]:
    """Every file under root: (size, mtime_ns, ctime_ns, inode), so that any write, rename or chmod shows; every
    folder: that it is there."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = () if path.is_dir() else (st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                                                      st.st_ino)
    return out


def digest(root: Path) -> dict[str, str]:
    """Every file under root: the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def launch_record(path: str) -> bool:
    """What every launch leaves, refused or not: the harness's copy of its output (log/) and Hydra's record of
    the launch (a .hydra/ folder, and the job's log: <run dir>/train.log)."""
    parts = Path(path).parts
    return parts[0] == "log" or ".hydra" in parts or parts[-1] in JOB_LOGS


def run_dir_lock(path: str) -> bool:
    """The run dir's lock (.lock) and the temp files of taking it (.lock.<pid>...tmp; tread/runtime/lock.py): a
    launch into an existing run dir holds them only while it runs, so a case beside it may see them come and go."""
    name = Path(path).name
    return name == ".lock" or name.startswith(".lock.")


def leftover_work(root: Path, before: dict[str, tuple[int, ...]]) -> list[str]:
    """What a launch did under `root` besides its records, against `before` (fingerprint(root) as it started):
    every file that is new or changed, everything removed. Work writes files:
      train.py       config.yaml as the run starts; then metrics.jsonl, checkpoints/, samples/, summary.json
      sample.py      samples.npz, images/, grid.png
      fid.py         its metrics JSON, reference statistics, benchmark tables
      precompute     the dataset folder's latents, labels, meta.json, reference statistics
    The folders a launch makes (Hydra's run dir, an empty output folder) are not work."""
    now = fingerprint(root)
    return ([f"{k}: new" for k, v in now.items() if k not in before and v != () and not launch_record(k)] +
            [f"{k}: changed" for k, v in before.items() if k in now and now[k] != v] +
            [f"{k}: removed" for k in before if k not in now])


def refusal_report(harness: dict[str, float], real: dict[str, float]) -> str:
    """One line of refusal times (case -> seconds from start to exit), e.g. "bad inputs: 131 cases (harness),
    median 0.31 s, 95th percentile 0.9 s, slowest 2.4 s (family_pretrained_missing); real programs: 6, median
    4.1 s, slowest 5.0 s (resume_missing)"."""
    def figures(times: dict[str, float]) -> str:
        secs = sorted(times.values())
        slowest = max(times, key=times.get)
        p95 = secs[max(0, math.ceil(0.95 * len(secs)) - 1)]            # nearest rank
        return (f"median {statistics.median(secs):.2f} s, 95th percentile {p95:.2f} s, slowest {secs[-1]:.2f} s "
                f"({slowest})")
    parts = [f"bad inputs: {len(harness)} cases (harness), {figures(harness)}"] if harness else []
    if real:
        parts.append(f"real programs: {len(real)}, {figures(real)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- the client (the test process)

class Forked:
    """A program the server forked, as a test drives a subprocess.Popen: the child is a real process (its own
    process group) that signals reach directly; its output is read from its files once it has exited."""

    def __init__(self, result: Future, pid: int):
        self._result, self.pid, self.returncode = result, pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._result.done():
            self.returncode = self._result.result()["rc"]
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.communicate(timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """(stdout, stderr) once it has exited; subprocess.TimeoutExpired if it is still running after timeout."""
        try:
            result = self._result.result(timeout=timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
        self.returncode = result["rc"]
        return result["stdout"], result["stderr"]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Harness:
    """The server as a subprocess. submit() queues one program invocation (a Future of its result); up to `jobs`
    run at once. `on_done(result)` runs (in the reader thread) as each finishes, before its Future is set."""

    def __init__(self, env: Optional[dict[str, str]] = None, jobs: int = 1, python: str = sys.executable):
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--jobs", str(jobs)], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready or not json.loads(ready).get("ready"):
            self.close()
            raise RuntimeError(f"bad-input harness did not start (exit status {self.proc.returncode}; its stderr "
                               f"says why)")
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, Path, Any]] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def submit(self, program: str, args: list[str], out: Path, env: Optional[dict[str, str]] = None,
               timeout: float = HANG_SECS, on_done: Any = None, world: int = 1) -> Future:
        """`python <program> <args>` from the repo root: a Future of {rc, secs, timed_out, stdout, stderr}. With
        world > 1, that many ranks with torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT, ...); stdout and
        stderr are then rank 0's followed by each other rank's."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        future: Future = Future()
        future.started = Future()                       # set to the processes' pids once they are forked
        with self._lock:
            self._next += 1
            self._pending[self._next] = future, out, on_done, world
            request = {"id": self._next, "program": program, "args": [str(a) for a in args], "out": str(out),
                       "env": env or {}, "timeout": timeout, "world": world, "master_port": free_port()}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        return future

    def run(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.submit(*args, **kwargs).result()

    def popen(self, program: str, args: list[str], out: Path, env: Optional[dict[str, str]] = None) -> "Forked":
        """`python <program> <args>` started now, as a handle with subprocess.Popen's pid, poll, send_signal, kill
        and communicate (a test's faults: signals, kill -9, a second run beside the first)."""
        future = self.submit(program, args, out, env)
        return Forked(future, future.started.result(timeout=HANG_SECS)[0])

    def _read(self) -> None:
        for line in self.proc.stdout:
            result = json.loads(line)
            with self._lock:
                if "pids" in result:
                    self._pending[result["id"]][0].started.set_result(result["pids"])
                    continue
                future, out, on_done, world = self._pending.pop(result.pop("id"))
            try:
                for stream in ("stdout", "stderr"):
                    result[stream] = "".join((out / rank_file(stream, r)).read_text(errors="replace")
                                             for r in range(world))
                if on_done is not None:
                    on_done(result)
                future.set_result(result)
            except Exception as err:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(err)
        with self._lock:
            left, self._pending = list(self._pending.values()), {}
        for future, *_ in left:
            future.set_exception(RuntimeError(f"bad-input harness died (exit status {self.proc.poll()})"))

    def close(self) -> None:
        """End the server once its queue is done (its stdin closed ends its loop)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the bad-input fork server (see the module doc)")
    parser.add_argument("--jobs", type=int, default=1, help="children running at once")
    serve(parser.parse_args().jobs)
