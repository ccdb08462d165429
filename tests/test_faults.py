"""Real faults in real processes: kill -9 (also inside checkpoint writes and pruning), SIGTERM, two runs in
one directory, a full disk, and checkpoints planted with code. Each resumed run must end bit-identical to an
uninterrupted one, with each step logged once (tests/fault_train.py injects the faults). What happens
mid-training waits for the run to be there (a held step), never for a time: the timeouts are hang guards."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, start_program
from bad_input_harness import Forked
from hang_guard import communicate
from tread.runtime.preempt import EXIT_PREEMPTED
from tread.training.run_log import read_metrics
from tread.checkpoint.files import list_checkpoints, load_model_file

pytestmark = pytest.mark.slow
HANG_SEC = 900            # a launch still running then is stuck (a 12-step launch takes 10-60 s)
STEPS = 12
COMMON = [*TINY, "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=4", "checkpoint.keep_last=2",
          f"train.max_steps={STEPS}", "train.lr_warmup_steps=3"]


def launch(fault: str, run: Path, cache: Path, *extra: str) -> Forked:
    """tests/fault_train.py, a real process (forked from the session's program server, conftest.start_program)."""
    return start_program("tests/fault_train.py", [fault, *COMMON, f"paths.cache_dir={cache}", f"hydra.run.dir={run}",
                                                  *extra])


def finish(proc: Forked) -> tuple[int, str]:
    return communicate(proc, HANG_SEC, "a launch")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    file = load_model_file(list_checkpoints(run)[-1])
    return {**{f"model.{k}": v for k, v in file["model"].items()}, **{f"ema.{k}": v for k, v in file["ema"].items()}}


def train_steps(run: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(run) if r["type"] == "train"]
    except ValueError:  # a line being written right now
        return []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (in its own process, like the faulted ones)."""
    from conftest import shared_cache

    cache = shared_cache(tmp_path_factory)
    run = tmp_path_factory.mktemp("reference") / "run"
    code, out = finish(launch("none", run, cache))
    assert code == 0, out[-3000:]
    return run, cache


def assert_same_as_reference(run: Path, reference: Path) -> None:
    assert train_steps(run) == list(range(1, STEPS + 1))
    a, b = final_weights(reference), final_weights(run)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not differ, differ
    assert not list((run / "checkpoints").glob("*.tmp")) and not list((run / "checkpoints").glob("*.trash"))


@pytest.mark.parametrize("fault", ["kill_at:6", "kill_in_write:8", "kill_in_prune:12"])
def test_kill_9_then_resume_is_exact(fault, reference, tmp_path):
    ref, cache = reference
    run = tmp_path / "run"
    code, out = finish(launch(fault, run, cache))
    assert code == -signal.SIGKILL, out[-2000:]
    code, out = finish(launch("none", run, cache, "resume=auto"))
    assert code == 0, out[-3000:]
    assert_same_as_reference(run, ref)


def wait_for(condition, proc: Forked) -> None:
    """Poll until `condition()`; fails if `proc` ended first or nothing happened for HANG_SEC (a hang)."""
    end = time.monotonic() + HANG_SEC
    while not condition():
        assert proc.poll() is None, f"the launch ended first (exit {proc.returncode})"
        assert time.monotonic() < end, f"still waiting after {HANG_SEC} s"
        time.sleep(0.05)


def test_sigterm_checkpoints_and_resume_is_exact(reference, tmp_path):
    ref, cache = reference
    run = tmp_path / "run"
    release = tmp_path / "release"
    proc = launch(f"hold:6:{release}", run, cache)
    wait_for(lambda: len(train_steps(run)) >= 5, proc)          # held before step 6
    proc.send_signal(signal.SIGTERM)
    release.touch()
    code, out = finish(proc)
    assert code == EXIT_PREEMPTED, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["signal"] == "SIGTERM"
    stopped = summary["final_step"]
    assert stopped == 6 and list_checkpoints(run)[-1].name == f"step_{stopped:07d}"   # the step then running
    code, out = finish(launch("none", run, cache, "resume=auto"))
    assert code == 0, out[-3000:]
    assert_same_as_reference(run, ref)


def test_a_second_run_into_a_busy_run_dir_fails_naming_the_holder(reference, tmp_path):
    _, cache = reference
    run = tmp_path / "run"
    release = tmp_path / "release"
    first = launch(f"hold:2:{release}", run, cache)
    wait_for(lambda: len(train_steps(run)) >= 1, first)      # it holds the lock, held before step 2
    code, out = finish(launch("none", run, cache, "train.seed=7", "resume=auto"))
    release.touch()
    assert code != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pid {first.pid}" in errors[0] and socket.gethostname() in errors[0], out[-2000:]
    assert "Traceback" not in out
    code, out = finish(first)
    assert code == 0, out[-3000:]
    assert "seed: 0" in (run / "config.yaml").read_text() and train_steps(run) == list(range(1, STEPS + 1))


def test_a_stale_lock_of_a_killed_run_is_taken_over(reference, tmp_path):
    _, cache = reference
    run = tmp_path / "run"
    code, _ = finish(launch("kill_at:3", run, cache))
    assert code == -signal.SIGKILL and (run / ".lock").is_file()
    code, out = finish(launch("none", run, cache, "resume=auto"))
    assert code == 0 and "stale lock" in out, out[-3000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB tmpfs: room for one tiny checkpoint (33 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected-OSError test covers the logic")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(reference, small_disk):
    _, cache = reference
    run = small_disk / "run"
    code, out = finish(launch("none", run, cache, "checkpoint.keep_last=null"))
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "disk full" in errors[0] and str(run / "checkpoints" / "step_0000008.tmp") in errors[0]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000004"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
