"""Waiting for real processes in tests without a speed limit: the limits here only end a process that is
stuck (minutes, several times a normal run on a loaded machine), and the test then fails with its output."""
from __future__ import annotations

import subprocess
import threading

import pytest


def communicate(proc: subprocess.Popen, seconds: float, what: str) -> tuple[int, str]:
    """Exit status and all output (stdout, then stderr) of `proc`. Still running after `seconds`: it is
    stuck; killed, and the test fails naming `what`."""
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} still running after {seconds:g} s (stuck); its output ends:\n"
                    f"{((out or '') + (err or ''))[-3000:]}")
    return proc.returncode, (out or "") + (err or "")


def read_line(proc: subprocess.Popen, seconds: float) -> str:
    """The next line `proc` prints. Nothing for `seconds`: it is stuck; killed, and the test fails."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    if not box:
        proc.kill()
        pytest.fail(f"pid {proc.pid} printed nothing for {seconds:g} s (stuck)")
    return box[0]
