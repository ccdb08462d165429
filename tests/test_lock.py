"""tread.runtime.lock.RunDirLock: real processes racing for a run dir, stale locks (killed holders, reused pids,
same SLURM job), foreign hosts, release of our own lock only, unreadable lock files. No test here depends on
how fast the machine is: racers start together on a signal, and waits are hang guards only."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO
from hang_guard import read_line

from tread.runtime.lock import LOCK_NAME, RunDirLock, RunDirLocked, own_record
from tread.runtime.processes import process_start_ticks
from tread.utils.errors import UserError

HANG_SEC = 120                                  # a racer or holder still running then is stuck (normally ~2 s)

# A process that prints "ready", spins until the file argv[2] exists, then tries to lock run dir argv[1]:
# prints one JSON line, {"won": pid} or {"error": message}; a winner holds the lock until its stdin closes.
RACER = r"""
import json, os, sys
from tread.runtime.lock import RunDirLock, RunDirLocked
if sys.argv[3] == "excl":                       # a filesystem without hard links
    def no_link(*args, **kw):
        raise PermissionError(1, "Operation not permitted")
    os.link = no_link
lock = RunDirLock(sys.argv[1])
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    pass
try:
    lock.acquire()
except RunDirLocked as err:
    print(json.dumps({"error": str(err)}), flush=True)
    sys.exit(0)
print(json.dumps({"won": os.getpid()}), flush=True)
sys.stdin.read()
lock.release()
"""

# Takes the lock on argv[1], says so, then sleeps (the test kills it).
HOLDER = r"""
import sys, time
from tread.runtime.lock import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def spawn(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, **kw)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=HANG_SEC)


def write_lock(run_dir, **fields) -> None:
    record = {"pid": 4242, "host": "node-elsewhere", "started": "2024-01-02T03:04:05+00:00",
              "slurm_job_id": None, "argv": ["train.py"], "start_ticks": 1, "boot_id": None, **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(record))


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fresh", "fresh-excl", "stale", "fresh-2", "stale-2"])
def test_processes_racing_for_a_run_dir_exactly_one_wins(tmp_path, scenario):
    """Three processes lock the same dir at the same moment: a new dir (created by the race; with hard links
    or with O_EXCL), or one with a stale lock that all of them judge stale and race to take over."""
    run_dir = tmp_path / "run"      # fresh: not created yet, the racers also race for mkdir
    if scenario.startswith("stale"):
        write_lock(run_dir, **{**own_record(), "pid": dead_pid()})
    go = tmp_path / "go"            # every racer spins until this file exists, however slowly it started
    mode = "excl" if scenario.endswith("excl") else "link"
    procs = [spawn(RACER, str(run_dir), str(go), mode, stdin=subprocess.PIPE) for _ in range(3)]
    try:
        assert [read_line(p, HANG_SEC).strip() for p in procs] == ["ready"] * 3
        go.touch()
        results = [json.loads(read_line(p, HANG_SEC)) for p in procs]
        winners = [r["won"] for r in results if "won" in r]
        assert len(winners) == 1, results
        for r in results:
            if "error" in r:
                assert f"pid {winners[0]} on host {socket.gethostname()}" in r["error"], r
                assert str(run_dir) in r["error"] and "another hydra.run.dir" in r["error"]
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == winners[0]
        for p in procs:
            p.stdin.close()
            assert p.wait(timeout=HANG_SEC) == 0
        assert not (run_dir / LOCK_NAME).exists()              # the winner released it
        assert sorted(os.listdir(run_dir)) == []               # no temp files left behind
    finally:
        for p in procs:
            kill(p)


@pytest.mark.slow
@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_a_lock_of_a_killed_process_is_taken_over(tmp_path, reap):
    holder = spawn(HOLDER, str(tmp_path))
    try:
        assert read_line(holder, HANG_SEC).strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host "):
            RunDirLock(tmp_path).acquire()                     # alive: refused
        os.kill(holder.pid, signal.SIGKILL)
        if reap:
            holder.wait(timeout=HANG_SEC)
        else:                                                  # killed but not yet reaped by its parent
            deadline = time.monotonic() + HANG_SEC
            while psutil.Process(holder.pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, "the killed holder never became a zombie"
                time.sleep(0.01)
        with RunDirLock(tmp_path) as lock:
            assert lock.note == (f"took over a stale lock of pid {holder.pid} on host {socket.gethostname()} "
                                 f"(process gone)")
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        assert not lock.path.exists()
    finally:
        kill(holder)


def test_a_reused_pid_is_not_the_holder(tmp_path):
    mine = own_record()
    write_lock(tmp_path, host=mine["host"], pid=os.getpid(), start_ticks=(mine["start_ticks"] or 0) + 1,
               boot_id=mine["boot_id"])
    with RunDirLock(tmp_path) as lock:
        assert "process gone, its pid now belongs to another process" in lock.note


def test_a_lock_of_another_host_is_refused(tmp_path):
    write_lock(tmp_path, pid=31337, host="gpu-node-7", slurm_job_id="999")
    with pytest.raises(RunDirLocked) as err:
        RunDirLock(tmp_path).acquire()
    msg = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in msg
    assert msg == (f"run dir {tmp_path} is in use by another training process: pid 31337 on host gpu-node-7, "
                   f"SLURM job 999, running since 2024-01-02T03:04:05+00:00; wait for it to finish, use another "
                   f"hydra.run.dir, or delete {tmp_path / LOCK_NAME} if that process is gone")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == 31337    # untouched


def test_the_same_slurm_job_takes_over_from_another_host(tmp_path, monkeypatch):
    write_lock(tmp_path, pid=31337, host="gpu-node-7", slurm_job_id="123456")
    monkeypatch.setenv("SLURM_JOB_ID", "654321")                # another job: refused
    with pytest.raises(RunDirLocked, match="pid 31337 on host gpu-node-7"):
        RunDirLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "123456")                # the requeued job itself
    lock = RunDirLock(tmp_path)
    note = lock.acquire()
    try:
        assert note == ("took over a stale lock of pid 31337 on host gpu-node-7, SLURM job 123456 "
                        "(same SLURM job 123456, requeued)")
        assert json.loads(lock.path.read_text())["slurm_job_id"] == "123456"
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    finally:
        assert lock.release()


def test_the_same_slurm_job_on_this_host_respects_a_live_holder(tmp_path, monkeypatch):
    holder = spawn(HOLDER, str(tmp_path))
    try:
        assert read_line(holder, HANG_SEC).strip() == "held"
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "slurm_job_id": "77"}))
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} "):
            RunDirLock(tmp_path).acquire()
    finally:
        kill(holder)


def test_release_removes_only_our_own_lock(tmp_path):
    lock = RunDirLock(tmp_path)
    assert lock.acquire() is None and lock.held
    record = json.loads(lock.path.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert set(record) == {"pid", "host", "started", "slurm_job_id", "argv", "start_ticks", "boot_id"}
    assert record["start_ticks"] == process_start_ticks(os.getpid())
    # someone else's lock now (taken over by hand): ours to keep no longer
    write_lock(tmp_path, pid=31337, host="gpu-node-7")
    assert lock.release() is False
    assert json.loads(lock.path.read_text())["pid"] == 31337
    assert lock.release() is False                              # idempotent
    lock.path.unlink()
    with RunDirLock(tmp_path) as again:
        assert again.path.exists()
    assert not again.path.exists()
    assert again.release() is False                             # after the block: nothing to do


def test_a_second_lock_in_this_process_is_refused_a_leftover_one_taken_over(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} "):
            RunDirLock(tmp_path).acquire()
    write_lock(tmp_path, **own_record())                        # left behind by this process
    with RunDirLock(tmp_path) as lock:
        assert lock.note.endswith("(left by this same process)")


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'{"pid": 0, "host": "h"}',
                                     b'{"pid": 99999999999, "host": "h"}', b'{"pid": 7}', b"\xff\xfe"])
def test_an_unreadable_lock_is_refused_naming_the_file(tmp_path, content, monkeypatch):
    monkeypatch.setattr("tread.runtime.lock._PARTIAL_RETRY_SEC", 0.0)
    (tmp_path / LOCK_NAME).write_bytes(content)
    with pytest.raises(RunDirLocked) as err:
        RunDirLock(tmp_path).acquire()
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"run dir {tmp_path} has a lock file that cannot be read (")
    assert f"delete {tmp_path / LOCK_NAME}" in msg
    assert (tmp_path / LOCK_NAME).read_bytes() == content                     # untouched
