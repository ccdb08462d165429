"""Faults while precomputing (issue 43, "precompute arguments and outputs"): Ctrl-C and SIGTERM stop a run before its
next shard with one line and a rerun resumes; a second precompute into the same --out is refused while the first
holds its lock; what a kill -9 leaves (a stale lock, a staging folder) is taken over and removed by the rerun; a
full disk is one `error:` line with the finished shards kept; a read-only --out is refused before any work.

The runs that get a signal or hold the lock are real subprocesses (WORKER: the command line with encode_shard made
to wait, after shard 0 or in the merge, until the test signals it or opens the gate); reruns are in-process. The tiny
VAE and six 16 px images of tests/test_precompute.py: a whole run takes about a second after the imports.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tread.cli.precompute as pl
import tread.data.precompute.run as work
from tread.data import LatentDataset

from test_precompute import REPO, offline, vae_dir  # noqa: F401  (fixtures: the tiny VAE, no network)

pytestmark = pytest.mark.slow   # five subprocesses (~5 s of imports each)

# The command line, but waiting (at most 60 s) where argv[1] says until a stop signal came or the gate argv[2] exists:
# "shard" after shard 0 is written, "merge" once the merge's staging folder holds its first samples.
WORKER = """
import signal, sys, time
from pathlib import Path
import tread.data.precompute.run as work
import tread.data.writer as writer
from tread.cli.precompute import cli

where, gate = sys.argv[1], Path(sys.argv[2])

def signalled():   # the first stop signal puts the default action back (the merge runs under the defaults)
    return where == "shard" and any(signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGINT, signal.SIGTERM))

def wait():
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline and not signalled():
        time.sleep(0.01)

def after(real, first):
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        if first(*args):
            wait()
        return out
    return call

if where == "shard":
    work.encode_shard = after(work.encode_shard, lambda plan, shard, *rest: shard == 0)
else:
    writer.LatentDatasetWriter.write = after(writer.LatentDatasetWriter.write, lambda self, start, *rest: start == 0)
sys.exit(cli(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Six 16x16 RGB images in one class folder: three shards of two."""
    root = tmp_path_factory.mktemp("faults") / "imgs"
    (root / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "a" / f"{i}.png")
    return root


def argv(images: Path, out: Path, vae: Path) -> list[str]:
    return ["--images", str(images), "--out", str(out), "--vae", str(vae), "--resolution", "16", "--device", "cpu",
            "--batch-size", "2", "--shard-size", "2", "--workers", "0"]


def start(where: str, gate: Path, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", WORKER, where, str(gate), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(path: Path, proc: subprocess.Popen, glob: str = "") -> None:
    """Until `path` exists (or, with `glob`, holds a match); the worker must still be running."""
    deadline = time.monotonic() + 120
    while not (any(path.glob(glob)) if glob and path.is_dir() else not glob and path.exists()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def counted(monkeypatch) -> list[int]:
    """The shards the next in-process run encodes."""
    calls: list[int] = []
    real = work.encode_shard
    monkeypatch.setattr(work, "encode_shard", lambda plan, shard, *a, **k: calls.append(shard) or real(plan, shard,
                                                                                                     *a, **k))
    return calls


def one_line(text: str, start: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(start)]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 75)], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_ends_the_run_at_a_shard_and_a_rerun_resumes(tmp_path, images, vae_dir, signum, status,
                                                                   monkeypatch, capsys):  # noqa: F811
    out, parts = tmp_path / "ds", tmp_path / "ds.parts"
    proc = start("shard", tmp_path / "gate", argv(images, out, vae_dir))
    wait_for(parts / "shard_00000.npz", proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    name = signal.Signals(signum).name
    assert one_line(err, "stopped") == (f"stopped by {name}: 1 of 3 shards are finished in '{parts}'; rerun the same "
                                        f"command to resume")
    assert "KeyboardInterrupt" not in err and "error:" not in err
    assert not out.exists() and sorted(p.name for p in parts.iterdir()) == ["settings.json", "shard_00000.npz"]
    calls = counted(monkeypatch)
    assert pl.cli(argv(images, out, vae_dir)) == 0
    assert calls == [1, 2] and len(LatentDataset(out)) == 6 and not parts.exists()


def test_a_second_precompute_into_the_same_out_is_refused(tmp_path, images, vae_dir, capsys):  # noqa: F811
    out, gate = tmp_path / "ds", tmp_path / "gate"
    first = start("shard", gate, argv(images, out, vae_dir))
    try:
        wait_for(tmp_path / "ds.parts" / "shard_00000.npz", first)
        before = sorted((tmp_path / "ds.parts").iterdir())
        assert pl.cli(argv(images, out, vae_dir)) == 2
        line = one_line(capsys.readouterr().err, "error:")
        assert f"--out '{out}' is being written by another precompute: pid {first.pid} on host" in line
        assert f"'{tmp_path / 'ds.parts' / '.lock'}'" in line
        assert sorted((tmp_path / "ds.parts").iterdir()) == before
    finally:
        gate.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert len(LatentDataset(out)) == 6


def test_what_a_kill_9_leaves_is_removed_by_the_rerun(tmp_path, images, vae_dir, monkeypatch, capsys,
                                                      caplog):  # noqa: F811
    out = tmp_path / "ds"
    proc = start("merge", tmp_path / "gate", argv(images, out, vae_dir))
    wait_for(tmp_path, proc, ".ds.tmp-*/latents.npy")
    proc.kill()
    proc.communicate(timeout=60)
    staging = list(tmp_path.glob(".ds.tmp-*"))
    assert len(staging) == 1 and (tmp_path / "ds.parts" / ".lock").exists() and not out.exists()
    calls = counted(monkeypatch)
    assert pl.cli(argv(images, out, vae_dir)) == 0
    captured = capsys.readouterr()
    assert one_line(captured.out, "note: removed") == (f"note: removed what an interrupted precompute into '{out}' "
                                                       f"left: {staging[0]}")
    assert "took over a stale lock" in caplog.text and "error:" not in captured.err
    assert calls == [] and len(LatentDataset(out)) == 6          # every shard was kept: only the merge ran again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_a_full_disk_is_one_error_and_the_finished_shards_are_kept(tmp_path, images, vae_dir, monkeypatch,
                                                                   capsys):  # noqa: F811
    """Simulated: the second shard file's write fails with ENOSPC (as it does on a full disk)."""
    out, parts = tmp_path / "ds", tmp_path / "ds.parts"
    real, writes = np.savez, []

    def savez(f, **arrays):
        writes.append(1)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(f, **arrays)

    monkeypatch.setattr(np, "savez", savez)
    assert pl.cli(argv(images, out, vae_dir)) == 2
    line = one_line(capsys.readouterr().err, "error:")
    assert line.startswith(f"error: cannot write '{parts / 'shard_00001.npz'}': No space left on device (ENOSPC); "
                           f"the disk is full") and "resumes from the finished shards" in line
    assert sorted(p.name for p in parts.iterdir()) == ["settings.json", "shard_00000.npz"] and not out.exists()
    monkeypatch.setattr(np, "savez", real)
    calls = counted(monkeypatch)
    assert pl.cli(argv(images, out, vae_dir)) == 0
    assert calls == [1, 2] and len(LatentDataset(out)) == 6


@contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` for the block (root only; the test is skipped where mount is refused)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("needs root and mount -t tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_tmpfs_refuses_the_merge_and_a_rerun_with_space_resumes(tmp_path, images, vae_dir, monkeypatch,
                                                                       capsys):  # noqa: F811
    """9 pages: the three shards (2 pages each), settings.json and the lock fit, the 6 KiB of latents do not."""
    with tmpfs(tmp_path / "disk", "size=36k") as disk:
        out = disk / "ds"
        assert pl.cli(argv(images, out, vae_dir)) == 2
        line = one_line(capsys.readouterr().err, "error:")
        assert line.startswith(f"error: cannot write '{out}': No space left on device: the dataset needs 6.0 KiB")
        assert "the disk is full" in line
        assert sorted(p.name for p in (disk / "ds.parts").iterdir()) == [
            "settings.json", "shard_00000.npz", "shard_00001.npz", "shard_00002.npz"]
        assert sorted(p.name for p in disk.iterdir()) == ["ds.parts"]               # no staging folder left
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        calls = counted(monkeypatch)
        assert pl.cli(argv(images, out, vae_dir)) == 0
        assert calls == [] and len(LatentDataset(out)) == 6


def test_a_read_only_out_is_refused_before_any_work(tmp_path, images, vae_dir, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(work, "make_plan", lambda request: pytest.fail("work started"))
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        assert pl.cli(argv(images, ro / "ds", vae_dir)) == 2
        line = one_line(capsys.readouterr().err, "error:")
        assert line == (f"error: --out '{ro / 'ds'}' cannot be written: no file can be made in '{ro}' (Read-only "
                        f"file system, EROFS); make it writable or choose another path")
