"""A real single-node SLURM cluster (scripts/slurm_cluster.sh): `train.py -m hydra/launcher=slurm` sweeps,
a two-task (world size 2, gloo) job, preemption by `scontrol requeue` and a time-limit warning, all on CPU
with tiny configs.

The session fixture uses a cluster that is already up, or starts one and stops it at the end; when SLURM is
not installed or does not start, every test here is skipped with the reason. Each test waits with a timeout
and, on failure, prints squeue, `scontrol show job`, the jobs' logs and slurmctld's log.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
from conftest import REPO, TINY, shared_cache

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
STATE = Path(os.environ.get("TREAD_SLURM_DIR") or "/tmp/tread-slurm")
# One CPU task per job on a CPU node: no GPUs, one process (tasks_per_node follows gpus_per_node otherwise).
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=1",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10"]
NO_EVAL = [o for o in TINY if not o.startswith("eval.every")] + ["eval.every_steps=0", "eval.at_end=false"]
QUICK = NO_EVAL + ["train.max_steps=2", "checkpoint.every_steps=0"]
# Runs that last a given training time, however fast this machine is today: the time budget ends them, and it
# carries over a resume. Every step is logged, so metrics.jsonl must hold 1..final_step exactly once.
LONG = NO_EVAL + ["train.max_steps=1000000", "train.log_every_steps=1", "checkpoint.every_steps=0"]


# --- the cluster ----------------------------------------------------------------------------------------

@dataclass
class Cluster:
    env: dict[str, str]   # SLURM_CONF and the state dir's bin/ (the sacct wrapper) on PATH

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as err:
            return subprocess.CompletedProcess(list(cmd), 1, "", f"{cmd[0]}: {err}")


def cluster_script(command: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TREAD_SLURM_DIR": str(STATE)}
    try:
        return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(err.cmd, 1, "", f"timed out after {timeout:.0f}s")


@pytest.fixture(scope="session")
def slurm():
    """The local cluster: the one already up, or one started here (and stopped at the end of the session)."""
    started = False
    if cluster_script("status", 30).returncode != 0:
        path = f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin"   # where Debian puts the daemons
        if shutil.which("slurmctld", path=path) is None or shutil.which("munged", path=path) is None:
            pytest.skip("slurmctld not installed: run scripts/slurm_cluster.sh install")
        if os.geteuid() != 0:
            pytest.skip("the local SLURM cluster runs its daemons as root: run scripts/slurm_cluster.sh start as root")
        out = cluster_script("start", 120)
        if out.returncode != 0:
            why = next((line for line in out.stderr.splitlines() if line.startswith("slurm_cluster:")),
                       (out.stderr + out.stdout).strip()[-300:])
            pytest.skip(f"the local SLURM cluster did not start (scripts/slurm_cluster.sh start): {why} "
                        f"(logs: {STATE / 'log'})")
        started = True
    env = {**os.environ, "SLURM_CONF": str(STATE / "slurm.conf"),
           "PATH": f"{STATE / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    yield Cluster(env)
    if started:
        cluster_script("stop", 60)


# --- sweeps on it ---------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """One `python train.py -m hydra/launcher=slurm ...` submitting process and what it writes."""

    cluster: Cluster
    dir: Path
    proc: subprocess.Popen
    log_dir: Path
    started: float = field(default_factory=time.time)

    def job_ids(self) -> list[str]:
        """SLURM ids of this sweep's jobs, from submitit's folders: <array id>_<index> (a sweep is one job array;
        the array's own <array id> folder holds the submission script) or a plain <job id>."""
        folder = self.dir / ".submitit"
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
        tasks = sorted(n for n in names if re.fullmatch(r"\d+_\d+", n))
        return tasks or sorted(n for n in names if n.isdigit())

    def job_log(self, job: str, task: int = 0) -> str:
        """A task's stdout and stderr (srun's own messages, such as an exit code, go to task 0's stderr)."""
        folder = self.dir / ".submitit" / job
        return "".join(p.read_text(errors="replace") for p in (folder / f"{job}_{task}_log.out",
                                                               folder / f"{job}_{task}_log.err") if p.is_file())

    def diagnostics(self) -> str:
        """What to look at when a test fails: the queue, the jobs, their logs, the controller's log."""
        out = [f"--- sweep {self.dir} ({time.time() - self.started:.0f}s)"]
        for cmd in (["squeue", "-a", "-o", "%i %T %r %M %l %S"], ["sinfo", "-N"]):
            res = self.cluster.run(*cmd)
            out.append(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}")
        for job in self.job_ids():
            res = self.cluster.run("scontrol", "show", "job", job)
            out.append(f"$ scontrol show job {job}\n{res.stdout}{res.stderr}")
        for path in sorted(self.dir.glob(".submitit/*/*_log.*")) + sorted(self.log_dir.glob("submitter.*")):
            out.append(f"--- {path} (last lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
        for path in sorted(self.dir.glob("*/summary.json")):
            out.append(f"--- {path}\n{path.read_text()[:2000]}")
        ctld = STATE / "log" / "slurmctld.log"
        if ctld.is_file():
            out.append(f"--- {ctld} (last lines)\n" + "\n".join(ctld.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(out)

    def cancel(self) -> None:
        """Stop the submitting process and this sweep's jobs (a failed test leaves nothing queued)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for job in self.job_ids():
            self.cluster.run("scancel", job)

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\n{self.diagnostics()}", pytrace=False)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float, poll: float = 0.5) -> None:
        """Poll `ready` until true; fail (with diagnostics) on timeout or if the submitter ended first."""
        deadline = time.time() + timeout
        while not ready():
            if self.proc.poll() is not None:
                self.fail(f"the sweep ended (exit {self.proc.returncode}) before {what}")
            if time.time() > deadline:
                self.fail(f"no {what} within {timeout:.0f}s")
            time.sleep(poll)

    def finish(self, timeout: float, watch: Optional[Callable[[], None]] = None) -> None:
        """Wait for the submitting process (it returns once every job has finished); it must succeed."""
        deadline = time.time() + timeout
        while self.proc.poll() is None:
            if watch is not None:
                watch()
            if time.time() > deadline:
                self.fail(f"the sweep did not finish within {timeout:.0f}s")
            time.sleep(0.25)
        if self.proc.returncode != 0:
            self.fail(f"the sweep exited with {self.proc.returncode}")


@pytest.fixture
def sweep(slurm, tmp_path, tmp_path_factory):
    """Start `train.py -m` with the SLURM preset: sweep(*overrides) -> Sweep; cancelled at the end if still running."""
    started: list[Sweep] = []
    cache = shared_cache(tmp_path_factory)

    def start(*overrides: str) -> Sweep:
        sweep_dir = tmp_path / f"sweep{len(started)}"
        log_dir = tmp_path / f"submitter{len(started)}"
        log_dir.mkdir()
        # One intra-op thread per task: a task has one core (cpus_per_task=1), and two share this node.
        env = {**slurm.env, "TREAD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        args = [sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}",
                f"paths.output_dir={tmp_path / 'outputs'}"]
        with open(log_dir / "submitter.out", "w") as out, open(log_dir / "submitter.err", "w") as err:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err)
        started.append(Sweep(slurm, sweep_dir, proc, log_dir))
        return started[-1]

    yield start
    for s in started:
        s.cancel()


def summary(run: Path) -> dict:
    path = run / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):   # not written yet (or being replaced)
        return {}


def train_steps(run: Path) -> list[int]:
    """The "step" of every training record in metrics.jsonl, in file order (a half-written last line is skipped)."""
    path = run / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "train" and "step" in record:
            steps.append(record["step"])
    return steps


class StatusWatch:
    """Every (status, signal) summary.json shows while a run is requeued: the preempted launch's summary is
    replaced by the next launch's, so it is sampled while the sweep runs."""

    def __init__(self, run: Path):
        self.run, self.seen = run, []

    def __call__(self) -> None:
        s = summary(self.run)
        key = (s.get("status"), s.get("signal"), s.get("final_step"))
        if s and key not in self.seen:
            self.seen.append(key)

    def preempted(self, sig: str) -> list[tuple]:
        return [k for k in self.seen if k[0] == "preempted" and k[1] == sig]


def check_resumed_run(s: Sweep, run: Path, watch: StatusWatch, sig: str) -> dict:
    """The shared end state of a preempted and requeued run: completed, resumed from a checkpoint, with each
    training step exactly once in metrics.jsonl."""
    final = summary(run)
    if final.get("status") != "completed":
        s.fail(f"final status {final.get('status')!r}, expected 'completed'; statuses seen: {watch.seen}")
    if not watch.preempted(sig):
        s.fail(f"no summary.json with status 'preempted' and signal {sig!r} was seen; statuses seen: {watch.seen}")
    stopped_at = watch.preempted(sig)[0][2]
    if not (final.get("start_step") or 0) > 0:
        s.fail(f"the last launch did not resume (start_step {final.get('start_step')!r}); statuses seen: {watch.seen}")
    steps = train_steps(run)
    if steps != list(range(1, final["final_step"] + 1)):
        dupes = sorted({x for x in steps if steps.count(x) > 1})
        s.fail(f"metrics.jsonl: {len(steps)} train records for {final['final_step']} steps; duplicated {dupes[:20]}, "
               f"missing {sorted(set(range(1, final['final_step'] + 1)) - set(steps))[:20]}")
    assert stopped_at is not None and 0 < stopped_at < final["final_step"]
    assert (run / "checkpoints" / f"step_{final['final_step']:07d}").is_dir()
    return final


# --- the tests ------------------------------------------------------------------------------------------

def test_route_sweep_runs_as_two_slurm_jobs(sweep):
    """The README's sweep, for real: one SLURM job per selection ratio (a job array), both complete."""
    s = sweep(*LAUNCHER, "routing.routes.0.selection_ratio=0.25,0.5", *QUICK)
    s.finish(timeout=300)
    jobs = s.job_ids()
    assert len(jobs) == 2 and len({j.split("_")[0] for j in jobs}) == 1, jobs   # one array, two tasks
    for num, ratio in (("0", 0.25), ("1", 0.5)):
        result = summary(s.dir / num)
        if result.get("status") != "completed":
            s.fail(f"job {num}: status {result.get('status')!r}")
        assert result["routes"][0]["selection_ratio"] == ratio and result["final_step"] == 2
        assert f"routing.routes.0.selection_ratio={ratio}" in result["overrides"]


def test_two_task_job_is_one_world_size_2_run(sweep):
    """tasks_per_node=2: srun starts two processes, tread/runtime/slurm.py makes them ranks 0 and 1 of one gloo run.
    train.cpu=true: without it accelerate forms no process group on a machine without GPUs (each task would
    train alone), as with `accelerate launch` in tests/test_train.py."""
    s = sweep(*LAUNCHER, "hydra.launcher.tasks_per_node=2", *QUICK, "train.cpu=true")
    s.finish(timeout=300)
    run, (job,) = s.dir / "0", s.job_ids()
    result = summary(run)
    if result.get("status") != "completed":
        s.fail(f"status {result.get('status')!r}")
    assert result["final_step"] == 2
    rank0, rank1 = s.job_log(job, 0), s.job_log(job, 1)
    assert "world size 2" in rank0, rank0[-3000:]                 # train()'s start-up line (main process)
    assert "SLURM task 0/2" in rank0 and "SLURM task 1/2" in rank1, (rank0[-2000:], rank1[-2000:])
    (ckpt,) = sorted((run / "checkpoints").iterdir())            # the final checkpoint: one RNG file per process
    assert sorted(p.name.split(".")[0] for p in ckpt.glob("rng_rank*")) == ["rng_rank0", "rng_rank1"]


def test_scontrol_requeue_preempts_checkpoints_and_resumes(sweep, slurm):
    """`scontrol requeue` (what preemption does): SIGTERM -> the step finishes, a checkpoint, summary.json
    'preempted', exit 75; SLURM requeues the job, which resumes from that checkpoint and completes."""
    s = sweep(*LAUNCHER, *LONG, "train.time_budget_min=0.2")   # 12 s of training in all
    run = s.dir / "0"
    s.wait_for("3 logged training steps", lambda: len(train_steps(run)) >= 3, timeout=240)
    (job,) = s.job_ids()
    res = slurm.run("scontrol", "requeue", job)
    if res.returncode:
        s.fail(f"scontrol requeue {job}: {res.stderr}")
    watch = StatusWatch(run)
    s.finish(timeout=300, watch=watch)
    watch()
    check_resumed_run(s, run, watch, "SIGTERM")
    assert "exit code 75" in s.job_log(job), s.job_log(job)[-3000:]   # srun: "task 0: Exited with exit code 75"


def test_time_limit_warning_checkpoints_requeues_and_finishes(sweep, slurm):
    """A 1-minute job that needs more: SLURM's warning (submitit: --signal=USR2@signal_delay_s) makes train()
    checkpoint and requeue it; the job resumes, again as often as needed, and finishes without ever being killed
    by the limit. slurmctld checks limits every 30 s: with signal_delay_s=5 the warning comes 25-55 s after a
    launch starts (late enough for train() to be handling signals), the kill would come at 60-90 s."""
    s = sweep(*LAUNCHER, "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=5", *LONG,
              "train.time_budget_min=1.05")   # 63 s of training: more than fits in one 1-minute job
    run = s.dir / "0"
    watch = StatusWatch(run)
    s.finish(timeout=540, watch=watch)
    watch()
    final = check_resumed_run(s, run, watch, "SIGUSR2")
    assert final["train_sec_total"] >= 60
    (job,) = s.job_ids()
    log = s.job_log(job)
    assert "DUE TO TIME LIMIT" not in log and "DUE TO JOB REQUEUE" in log, log[-3000:]
