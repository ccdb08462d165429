"""train.cpu_threads (issue 43, "runs that keep their pace on a shared machine"): auto picks torch's CPU thread count
from the cores this process may use (affinity, cgroup quota, the run's processes on this machine), less the cores
other processes hold (/proc/stat less this process's own CPU time), at most what the step's work can use, and
re-checks it at step boundaries; a number is taken as given; OMP_NUM_THREADS, when set, wins over auto. The choice
is printed at start and kept in summary.json. The pace it keeps beside busy processes is a benchmark figure
(docs/benchmarks.md, "CPU threads"), never asserted here: the load is fed in as /proc/stat samples."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, compose_cfg
from tread.schema import ConfigError, check_train
from tread.utils import threads
from tread.utils.threads import (FLOPS_PER_THREAD, CpuSample, ThreadGovernor, cgroup_cores, others_hold, sample_cpu,
                                 usable_cores)

REPO = Path(__file__).resolve().parents[1]
BIG = 1e18                      # a step large enough for any number of threads


@pytest.fixture
def eight_cores(monkeypatch):
    """auto on a machine of 8 usable cores, OMP_NUM_THREADS unset; torch's count comes back after the test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(threads, "affinity_cores", lambda: frozenset(range(8)))
    monkeypatch.setattr(threads, "PROBE_SEC", 0.0)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def feed(monkeypatch, others: list[float]) -> None:
    """sample_cpu returns samples 1 s apart in which other processes hold `others[i]` cores and this one none."""
    clock = {"i": 0}

    def sample(cores):
        i = clock["i"]
        clock["i"] += 1
        busy = sum(others[:i])
        return CpuSample(busy=busy, total=8.0 * i, own=0.0, wall=float(i), cores=8)
    monkeypatch.setattr(threads, "sample_cpu", sample)


def test_others_hold_is_the_busy_cores_less_this_process():
    before, after = CpuSample(10.0, 100.0, 5.0, 50.0, 2), CpuSample(11.6, 102.0, 5.6, 51.0, 2)   # 2 cores, 1 s
    assert others_hold(before, after) == pytest.approx(1.0)
    assert others_hold(after, after) is None                      # no time passed: nothing to say
    rounded = CpuSample(10.2, 102.0, 5.6, 51.0, 2)                # ticks rounded: less busy time than this process's
    assert others_hold(before, rounded) == 0.0


def test_sample_cpu_counts_only_the_cores_this_process_may_use(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  300 0 300 400 0 0 0 0 0 0\ncpu0 100 0 100 200 0 0 0 0 0 0\n"
                    "cpu1 200 0 200 200 0 0 0 0 0 0\nintr 1 2 3\n")
    monkeypatch.setattr(threads, "PROC_STAT", stat)
    hz = os.sysconf("SC_CLK_TCK")
    one = sample_cpu(frozenset({1}))
    assert (one.busy, one.total) == pytest.approx((400 / hz, 600 / hz))
    both = sample_cpu(frozenset({0, 1}))
    assert (both.busy, both.total) == pytest.approx((600 / hz, 1000 / hz))
    monkeypatch.setattr(threads, "PROC_STAT", tmp_path / "missing")
    assert sample_cpu(frozenset({0})) is None


def test_real_samples_count_this_process_among_the_busy():
    """/proc/stat's busy time of this process's cores holds this process's own CPU time (what others_hold takes
    off), within a few clock ticks."""
    cores = threads.affinity_cores()
    first = sample_cpu(cores)
    if first is None:
        pytest.skip("no /proc/stat on this system")
    deadline = first.wall + 0.3
    while threads.clock() < deadline:                             # 0.3 s of this process's CPU time, or less
        sum(range(10_000))
    second = sample_cpu(cores)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert second.cores == len(cores) and second.busy - first.busy >= second.own - first.own - 4 * tick * len(cores)
    assert 0.0 <= others_hold(first, second) <= len(cores)


@pytest.mark.parametrize("others, flops, expected", [
    (0.0, BIG, 8),              # a quiet machine: every usable core
    (2.4, BIG, 6),              # 5.6 cores free
    (7.6, BIG, 1),              # never below one
    (0.0, 3 * FLOPS_PER_THREAD, 3),   # a small step: one thread per FLOPS_PER_THREAD
    (0.0, 1.0, 1),
])
def test_auto_takes_the_free_cores_up_to_the_works_cap(eight_cores, monkeypatch, others, flops, expected):
    feed(monkeypatch, [others])
    choice = ThreadGovernor("auto", flops).start()
    assert choice.threads == expected == torch.get_num_threads()
    assert "8 usable cores" in choice.why and f"other processes hold {others:.1f}" in choice.why


def test_auto_follows_the_load_at_step_boundaries(eight_cores, monkeypatch):
    """The load rises, then falls: the count moves down, then back up, each move said once; within RECHECK_SEC
    nothing is looked at."""
    feed(monkeypatch, [0.0, 6.0, 6.0, 0.0])
    monkeypatch.setattr(threads, "RECHECK_SEC", 0.5)
    times = iter([1.2, 2.0, 3.0, 4.0])                       # the samples are 1 s apart from 0 s
    monkeypatch.setattr(threads, "clock", lambda: next(times))
    governor = ThreadGovernor("auto", BIG)
    assert governor.start().threads == 8
    assert governor.recheck() is None                        # 0.2 s after the start-up look: too soon
    down = governor.recheck()
    assert (down.threads, down.why) == (2, "other processes now hold 6.0 of 8 cores")
    assert governor.recheck() is None                        # the same load: no move
    assert governor.recheck().threads == 8 == torch.get_num_threads()


def test_without_proc_stat_auto_takes_the_usable_cores(eight_cores, monkeypatch):
    monkeypatch.setattr(threads, "sample_cpu", lambda cores: None)
    governor = ThreadGovernor("auto", BIG)
    choice = governor.start()
    assert choice.threads == 8 and "other processes" not in choice.why
    assert governor.recheck() is None


def test_a_number_is_taken_as_given_and_omp_num_threads_wins_over_auto(eight_cores, monkeypatch):
    feed(monkeypatch, [7.0, 0.0])
    fixed = ThreadGovernor(3, BIG)
    assert fixed.start() == threads.ThreadChoice(3, "train.cpu_threads")
    assert fixed.recheck() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    choice = ThreadGovernor("auto", BIG).start()
    assert (choice.threads, choice.why) == (1, "auto: OMP_NUM_THREADS is set")


@pytest.mark.parametrize("text, cores", [("max 100000", None), ("150000 100000", 2), ("100000 100000", 1),
                                         ("50000 100000", 1), ("garbage", None)])
def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch, text, cores):
    (tmp_path / "cpu.max").write_text(text + "\n")
    monkeypatch.setattr(threads, "CGROUP_V2", tmp_path / "cpu.max")
    assert cgroup_cores() == cores


def test_the_run_processes_on_one_machine_share_its_cores(monkeypatch):
    monkeypatch.setattr(threads, "cgroup_cores", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = usable_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert usable_cores() == max(1, alone // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")          # not ours to refuse: read as one process
    assert usable_cores() == alone


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "true", "100000"])
def test_bad_thread_counts_are_one_line_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"train.cpu_threads='?{value}'? .*auto .* \[1, 4096\]"):
        check_train(compose_cfg("train", [*TINY, f"train.cpu_threads={value}"]))


@pytest.mark.slow
def test_a_cpu_run_prints_its_choice_and_records_it(tmp_path):
    """A real launch without OMP_NUM_THREADS: the start-up line says the count and why; summary.json keeps it
    (how many threads depends on this machine's cores and load)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *TINY, "train.max_steps=1", "eval.every_steps=0",
                           "eval.at_end=false", "checkpoint.every_steps=0", f"hydra.run.dir={run}",
                           f"paths.output_dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in (proc.stdout + proc.stderr).splitlines() if l.startswith("cpu threads:"))
    summary = json.loads((run / "summary.json").read_text())
    assert line.startswith(f"cpu threads: {summary['cpu_threads']} (auto: ") and "TFLOP per step" in line, line
    assert 1 <= summary["cpu_threads"] <= usable_cores() and summary["cpu_thread_moves"] == []
