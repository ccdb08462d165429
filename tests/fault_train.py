"""`python tests/fault_train.py FAULT train.py-args...`: train.py with one real fault injected, for
tests/test_faults.py. The faults patch the running code from outside (nothing in the project knows them):

    none             plain train.py
    slow:SEC         every step also sleeps SEC seconds (so a signal or a second run lands mid-training)
    hold:N:PATH      before optimizer step N, wait until the file PATH exists (the test creates it when it has
                     done what must happen mid-training, however long that took)
    kill_in_write:N  SIGKILL this process inside the checkpoint write of step N, after the weights are
                     written and before checkpoint.json and the rename
    kill_in_prune:N  SIGKILL inside the pruning that follows the checkpoint of step N
    kill_at:N        SIGKILL right after optimizer step N (before its log record and checkpoint)
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tread.checkpoint import save as checkpoint  # noqa: E402
from tread.training import step  # noqa: E402
from tread.checkpoint.files import step_of  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "slow":
        call = step.TrainStep.__call__
        step.TrainStep.__call__ = lambda self, b, s: (time.sleep(float(arg)), call(self, b, s))[1]
    elif kind == "hold":
        at, _, release = arg.partition(":")
        call = step.TrainStep.__call__

        def hold_then_step(self, b, s):
            while s + 1 == int(at) and not os.path.exists(release):
                time.sleep(0.05)
            return call(self, b, s)
        step.TrainStep.__call__ = hold_then_step
    elif kind == "kill_in_write":
        write = checkpoint._write_main

        def write_then_die(tmp, state, *a, **k):
            if state.step == int(arg):
                checkpoint.save_tensors(state.state_dict()["model"], tmp / "model.safetensors")
                die()
            return write(tmp, state, *a, **k)
        checkpoint._write_main = write_then_die
    elif kind == "kill_in_prune":
        finalize = checkpoint.finalize

        def finalize_then_die_pruning(final, keep_last):
            if step_of(final) == int(arg):   # the next removal is pruning: die half-way through it
                checkpoint._remove = lambda ckpt: (os.replace(ckpt, checkpoint.trash_dir(ckpt)), die())
            finalize(final, keep_last)
        checkpoint.finalize = finalize_then_die_pruning
    elif kind == "kill_at":
        step_fn = step.TrainStep.__call__
        step.TrainStep.__call__ = lambda self, b, s: (step_fn(self, b, s), die()) if s + 1 == int(arg) \
            else step_fn(self, b, s)
    elif kind != "none":
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    inject(sys.argv[1])
    sys.argv = ["train.py", *sys.argv[2:]]
    import runpy

    os.chdir(Path(__file__).resolve().parents[1])
    runpy.run_path("train.py", run_name="__main__")
