"""tread.runtime.collectives: two real gloo ranks on localhost; one stops itself (SIGSTOP), dies (SIGKILL),
raises or dawdles before an all_reduce, and the other must end with one line naming it. Also
tread.utils.distributed.rank_zero_call. Nothing here asserts how long that took: HANG_SEC only ends a rank
that is stuck, and the dawdling rank sleeps far longer than the timeout, so that a loaded machine cannot
turn "busy" into "in time"."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import REPO, free_port
from hang_guard import communicate

from tread.runtime.collectives import CollectiveTimeout, heartbeat_period, is_comm_error, roll_call_sec, timeout_delta
from tread.utils.errors import UserError

pytestmark = pytest.mark.slow

TIMEOUT_MIN = 0.05            # 3 s: the all_reduce gives up after it, then a 2 s roll call
SLOW_SEC = 10                 # the dawdling rank: well past the timeout, even if rank 0 comes late to it
HANG_SEC = 300                # a rank still running then is stuck (a run normally ends within 10-20 s)

# One rank: argv = rank, port, what rank `victim` does before the second all_reduce (stop | die | raise |
# sleep [seconds] | none), victim, timeout in minutes. Prints "ready" after a first all_reduce, then
# "error: <message>" (exit 1) or "done" (exit 0); "log: ..." lines are the early notices.
RANK = r"""
import logging, os, signal, sys, time
import torch, torch.distributed as dist
from tread.runtime.collectives import CollectiveTimeout, watch_collectives
logging.basicConfig(level=logging.WARNING, format="log: %(message)s", stream=sys.stdout)
rank, port, action, victim = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    with watch_collectives(float(sys.argv[5])):
        t = torch.ones(1)
        dist.all_reduce(t)
        print("ready", flush=True)
        if rank == victim:
            if action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "raise":
                raise ValueError("a bug of this rank")
            elif action == "sleep":
                time.sleep(float(sys.argv[6]))
        dist.all_reduce(t)
        if action == "none":                  # rank_zero_call: rank 0's value, or its user error, everywhere
            from tread.utils.distributed import rank_zero_call
            from tread.utils.errors import UserError
            def refuse():
                assert rank == 0
                raise UserError("refused on rank 0")
            try:
                rank_zero_call(refuse)
            except UserError as err:
                print(f"zero: {err}", flush=True)
            print(rank_zero_call(lambda: f"value of rank {rank}"), flush=True)
except CollectiveTimeout as err:
    print(f"error: {err}", flush=True)
    os._exit(1)
print("done", flush=True)
os._exit(0)
"""


def start_ranks(action: str, victim: int = 1, *extra: str) -> list[subprocess.Popen]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, action, str(victim), str(TIMEOUT_MIN),
                              *extra], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT) for r in range(2)]


def wait_out(proc: subprocess.Popen) -> tuple[int, str]:
    """Exit status and output of a rank (stderr is in stdout); HANG_SEC only ends a stuck one."""
    return communicate(proc, HANG_SEC, "a rank")


def error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out
    return lines[0][len("error: "):]


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()            # SIGKILL also ends a stopped process
        p.wait(timeout=HANG_SEC)


def test_a_stopped_rank_is_named_by_the_one_waiting_for_it():
    procs = start_ranks("stop")
    try:
        code, out = wait_out(procs[0])
        assert procs[1].poll() is None                                 # stopped, not dead
        assert code == 1, out
        host, pid = socket.gethostname(), procs[1].pid
        assert error_line(out) == (
            f"rank 0 waited {TIMEOUT_MIN:g} min (train.collective_timeout_min) in a collective for rank 1, which "
            f"did not answer (stopped: pid {pid} on host {host}); the run ends here")
        # the early notice (what names the rank under NCCL, whose watchdog kills the process)
        assert f"log: rank 0: rank 1 (pid {pid} on host {host}) has not answered for" in out
    finally:
        kill_all(procs)


def test_a_killed_rank_is_named():
    procs = start_ranks("die")
    try:
        code, out = wait_out(procs[0])
        assert procs[1].wait(timeout=HANG_SEC) == -signal.SIGKILL
        assert code == 1, out
        assert error_line(out) == (f"rank 0 lost rank 1 in a collective: it did not answer (process gone: pid "
                                   f"{procs[1].pid} on host {socket.gethostname()}); the run ends here")
    finally:
        kill_all(procs)


def test_a_stopped_rank_0_is_named_through_its_silent_store():
    """Rank 0 hosts the rendezvous store (tcp://): when it stops, the store stops answering too."""
    procs = start_ranks("stop", 0)
    try:
        code, out = wait_out(procs[1])
        assert code == 1, out
        assert error_line(out).startswith(
            f"rank 1 waited {TIMEOUT_MIN:g} min (train.collective_timeout_min) in a collective, and rank 0, which "
            f"hosts the rendezvous store at 127.0.0.1:")
        assert error_line(out).endswith(", does not answer (stopped or lost); the run ends here")
    finally:
        kill_all(procs)


def test_a_slow_rank_is_not_called_lost_and_learns_the_others_gave_up():
    """Rank 1 is alive but busy for longer than the timeout: rank 0 says so (no rank to blame); rank 1,
    arriving late, is told that rank 0 gave up on it."""
    procs = start_ranks("sleep", 1, str(SLOW_SEC))
    try:
        code0, out0 = wait_out(procs[0])
        code1, out1 = wait_out(procs[1])
        assert code0 == 1 and code1 == 1, (out0, out1)
        assert error_line(out0).startswith(
            f"rank 0 waited {TIMEOUT_MIN:g} min (train.collective_timeout_min) in a collective, but every rank is "
            f"alive: one is busy elsewhere")
        assert error_line(out1) == (
            f"rank 1's collective failed after rank 0 had given up waiting in one (longer than {TIMEOUT_MIN:g} min, "
            f"train.collective_timeout_min); if this rank was busy that long (evaluation, checkpoint, data), raise "
            f"train.collective_timeout_min; the run ends here")
    finally:
        kill_all(procs)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_fails_on_its_own_is_cited_by_the_others(victim):
    """A rank whose own code raises (not a collective) ends with its own traceback; the other rank's
    collective then fails, and it says which rank ended and with what (also when that rank hosted the store)."""
    procs = start_ranks("raise", victim)
    try:
        code_v, out_v = wait_out(procs[victim])
        code_o, out_o = wait_out(procs[1 - victim])
        assert code_v == 1 and "ValueError: a bug of this rank" in out_v and "error: " not in out_v, out_v
        assert code_o == 1, out_o
        assert error_line(out_o) == (f"rank {1 - victim}'s collective failed after rank {victim} ended with an error "
                                     f"of its own (ValueError: a bug of this rank); the run ends here")
    finally:
        kill_all(procs)


def test_healthy_ranks_pass():
    procs = start_ranks("none")
    try:
        for p in procs:
            code, out = wait_out(p)
            assert code == 0 and out.splitlines()[-3:] == ["zero: refused on rank 0", "value of rank 0", "done"], out
            assert "Traceback" not in out and "TCPStore" not in out, out   # no store call after rank 0 left
    finally:
        kill_all(procs)


def test_helpers():
    assert issubclass(CollectiveTimeout, UserError)
    assert timeout_delta(0.1).total_seconds() == pytest.approx(6.0)
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="train.collective_timeout_min must be a positive number"):
            timeout_delta(bad)
    assert heartbeat_period(3.0) == pytest.approx(0.15) and heartbeat_period(1800.0) == 5.0
    assert roll_call_sec(3.0) == 2.0 and roll_call_sec(1800.0) == 20.0
    assert is_comm_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                      "waiting 3000ms for recv operation to complete"))
    assert not is_comm_error(RuntimeError("DataLoader timed out after 5 seconds"))
    assert not is_comm_error(ValueError("shape mismatch"))
    try:
        try:
            raise RuntimeError("Connection reset by peer [gloo/transport/tcp/pair.cc]")
        except RuntimeError as inner:
            raise KeyError("wrapped") from inner
    except KeyError as outer:
        assert is_comm_error(outer)
