"""Shared fixtures: compose the real Hydra configs with tiny, CPU-only overrides."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Under pytest-xdist, one intra-op thread per worker (see pytest_configure), set before torch and numpy load:
# numpy's OpenBLAS reads OMP_NUM_THREADS once, as it loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
from transformers import Dinov2Config, Dinov2Model
from xdist.scheduler import LoadGroupScheduling

from bad_input_harness import Forked, Harness, free_port, refusal_report  # noqa: F401 - free_port: for the tests
from bad_input_table import make_world
from tread.encoders.dinov2 import DINO_SIZE
from tread.schema import compose

REPO = Path(__file__).resolve().parents[1]
# Tests never download: diffusers/huggingface_hub fail at once instead of probing the network
# (inherited by the CLI subprocesses too).
os.environ["HF_HUB_OFFLINE"] = "1"

# A few-second training config: configs/debug/tiny.yaml (tiny DiT, a small built-in dataset, cheap evaluation).
TINY = ["debug=tiny"]


_SERVER: list[Harness] = []     # the programs' fork server, started by the first launch of a session
_LOGS: list[Path] = []          # where the launches' stdout/stderr files go (removed as the session ends)


def program_server() -> Harness:
    """One fork server a session (tests/bad_input_harness.py) that has imported the entry points once, so a launch
    does not pay the imports (about 3-4 s of CPU a process, 10 s a 2-process torchrun). Its children are real
    processes with one intra-op thread (the server's OMP_NUM_THREADS: OpenMP reads it once, as torch loads)."""
    if not _SERVER:
        _SERVER.append(Harness(env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, jobs=16))
        _LOGS.append(Path(tempfile.mkdtemp(prefix="tread-test-launches-")))
    return _SERVER[0]


def _log_dir() -> Path:
    program_server()
    return Path(tempfile.mkdtemp(dir=_LOGS[0]))


def start_program(program: str, args: list[str]) -> Forked:
    """`python <program> <args>` (a path from the repo root) in this test's environment, started now: a handle
    with subprocess.Popen's pid, poll, send_signal, kill and communicate, for tests that signal or kill it."""
    return program_server().popen(program, [str(a) for a in args], _log_dir(), env=dict(os.environ))


def launch_ranks(program: str, args: list[str], world: int = 2) -> dict:
    """`torchrun --nproc_per_node <world> <program> <args>` on the CPU (gloo), as far as the program can tell: each
    rank is a forked real process with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and, as
    under torchrun, a failed rank ends the others. The real launchers are proved in tests/test_train.py
    (accelerate launch --multi_gpu, which runs torchrun), tests/test_train_buckets.py and tests/test_fid.py.
    {rc, stdout, stderr, secs, timed_out}: the ranks' output in rank order."""
    return program_server().run(program, [str(a) for a in args], _log_dir(), env=dict(os.environ), timeout=1200,
                                world=world)


def pytest_sessionfinish(session):
    for harness in _SERVER:
        harness.close()
    for logs in _LOGS:
        shutil.rmtree(logs, ignore_errors=True)


def compose_cfg(config_name: str = "train", overrides: list[str] | None = None):
    return compose(overrides, config_name)


@pytest.fixture
def cache_dir(tmp_path_factory) -> Path:
    """One cache (built-in data, toy classifier, reference stats) shared by a session's tests."""
    return shared_cache(tmp_path_factory)


_CACHE: dict[str, Path] = {}


def shared_cache(tmp_path_factory) -> Path:
    if "dir" not in _CACHE:
        _CACHE["dir"] = Path(os.environ.get("TREAD_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    return _CACHE["dir"]


@pytest.fixture(scope="session")
def dino_dir(tmp_path_factory) -> Path:
    """A tiny random transformers Dinov2Model (width 32) saved as a local weights folder: REPA's and FDD's DINOv2
    without a download."""
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          patch_size=14, image_size=DINO_SIZE)
    path = tmp_path_factory.mktemp("dinov2")
    Dinov2Model(config).eval().save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """Tiny CPU models: one intra-op thread is faster and avoids OpenMP spin contention on shared cores
    (family test files opt in: pytestmark = pytest.mark.usefixtures("one_thread"))."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_cfg(cache_dir):
    def make(*extra: str):
        return compose_cfg("train", TINY + [f"paths.cache_dir={cache_dir}", *extra])
    return make


def blob_images(n, size=32, seed=0):
    """Synthetic uint8 NHWC images: coloured rectangles on a dark background."""
    import numpy as np

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 40, (n, size, size, 3), dtype=np.uint8)
    for img in images:
        y, x = rng.integers(0, size // 2, 2)
        h, w = rng.integers(size // 4, size // 2, 2)
        img[y:y + h, x:x + w] = rng.integers(100, 256, 3)
    return images


# Test files that share one session fixture run on one pytest-xdist worker (make test: -n 2 --dist loadgroup):
# the bad-input tables share `world` (a trained run and the harness; test_memory_options.py has a table too: in a
# group of its own its worker built a second world, which ran every queued case again); every other file is a group
# of its own, so module fixtures (a trained toy run, tiny encoders) are built once and a file's tests never race.
SHARED_GROUPS = {"test_bad_inputs": "bad_inputs", "test_memory_options": "bad_inputs"}


def xdist_group(path: Path) -> str:
    stem = path.stem
    return next((group for prefix, group in SHARED_GROUPS.items() if stem.startswith(prefix)), stem)


class FileGroupScheduling(LoadGroupScheduling):
    """--dist loadgroup with each test's group taken from its file (xdist_group). pytest-xdist 3.8 passes a test's
    xdist_group mark to the scheduler by rewriting `item._nodeid` to `<id>@<group>`, which pytest 9.2 (structured
    node ids) no longer reads (pytest-dev/pytest-xdist#1386): every test was then a unit of its own, a file's tests
    ran on both workers, and each worker built the file's module fixtures and the session's `world` (which
    queues every bad-input case) again. Groups go out as xdist orders them (most tests first), except LONG_FIRST:
    few tests that keep one worker busy for minutes, which at the end would leave the other worker idle."""
    # test_slurm: 4 tests, ~2.5 min of one worker where SLURM is installed (make test-all); test_faults and test_fsdp:
    # 7 tests each (by count among the last 20 of ~100 groups), about 2 and 1.5 min of real faults and 2-process runs;
    # test_precompute_faults: 7 tests, about 1.5 min of signalled and racing precompute subprocesses;
    # test_context_parallel: its 2- and 4-process spawns and 2-process training runs, about 3 min.
    LONG_FIRST = ("test_slurm", "test_faults", "test_fsdp", "test_context_parallel", "test_precompute_faults")

    def schedule(self) -> None:
        initial = self.collection is None
        super().schedule()
        for group in reversed(self.LONG_FIRST if initial else ()):
            if group in self.workqueue:
                self.workqueue.move_to_end(group, last=False)

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):                    # an xdist that does mark the id
            return nodeid.split("@")[-1]
        return xdist_group(Path(nodeid.split("::")[0]))


@pytest.hookimpl(optionalhook=True)         # a hook of pytest-xdist's: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return FileGroupScheduling(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    """Each test's xdist group mark (its file's, see SHARED_GROUPS; FileGroupScheduling is what groups them);
    `gpu` tests need CUDA: skipped (and reported as such) on machines without it, such as CI."""
    import torch
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.path)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Under pytest-xdist each worker, and every program its tests start, computes on one intra-op thread: two
    workers share the two cores, and a second thread per process would only oversubscribe them (OpenMP threads
    spin while they wait). A test may still set its programs' OMP_NUM_THREADS itself. The variable is set at the
    top of this file too: here it comes after numpy loaded, and numpy's OpenBLAS (FID's 2048-d eigh, ...) kept a
    thread per core, 10x slower on cores the other worker and the programs it started kept busy."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter):
    """How fast bad inputs were refused (tests/test_bad_inputs.py records each case's seconds): a figure to read,
    never a pass/fail limit, since a busy machine slows every refusal without making it any less a refusal."""
    times: dict[str, dict[str, float]] = {"refusal_secs": {}, "real_refusal_secs": {}}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, secs in getattr(report, "user_properties", ()):
                if name in times and getattr(report, "when", "call") == "call":
                    times[name][report.nodeid.rpartition("[")[2].partition("]")[0]] = secs   # the id, without "@group"
    if times["refusal_secs"] or times["real_refusal_secs"]:
        terminalreporter.write_sep("-", "bad-input refusal times (a figure, not a limit)")
        terminalreporter.write_line(refusal_report(times["refusal_secs"], times["real_refusal_secs"]))


@pytest.fixture(scope="session")
def world(tmp_path_factory, request):
    """The bad-input tables' world (tests/bad_input_table.py): a finished tiny run, its dataset, broken copies,
    and every selected case of every tests/test_bad_inputs*.py module queued in the fork-server harness."""
    yield from make_world(tmp_path_factory, request)


class _NoBf16Torch:
    """`torch` for a module whose bfloat16 is float32 (everything else delegated)."""

    def __getattr__(self, name: str):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


@pytest.fixture
def no_bf16_rounding(monkeypatch):
    """Kandinsky 5: diffusers' apply_rotary rounds q and k to bfloat16 even in float32 models (ours does the same), so another
    summation order (a permuted sequence, a masked instead of a trimmed softmax) may flip a rounding, ~1e-4 with live
    gates: for the exact comparisons both round to float32 instead."""
    from diffusers.models.transformers import transformer_kandinsky

    import tread.models.families.kandinsky5 as ours

    for module in (transformer_kandinsky, ours):
        monkeypatch.setattr(module, "torch", _NoBf16Torch())
