"""Writes that cannot half-happen: a full disk, a read-only file system or a refused permission at every write of a
training run (the lock, config.yaml, metrics.jsonl, evaluation images, checkpoints, summary.json) ends the run
with one `error:` line naming the file, no traceback, no temp file, and the earlier files as they were; an
unwritable run dir is refused before Hydra writes into it; Ctrl-C and a SIGTERM inside a checkpoint write stop
at a step with a checkpoint. The launches are real processes (tests/write_fault_train.py injects the faults);
the in-process tests at the end pin the write primitives (tread/utils/io.py)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from bad_input_harness import Forked
from conftest import TINY, start_program
from test_faults import finish, wait_for   # a launch's end, and a condition mid-run: hang guards only
from tread.runtime.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED
from tread.utils.errors import UserError
from tread.utils.io import WriteError, append_whole, atomic_write, atomic_write_text, create_new, unwritable_dir


def launch(faults: str, run: Path, cache: Path, *extra: str) -> Forked:
    """tests/write_fault_train.py, a real process (forked from the session's program server)."""
    return start_program("tests/write_fault_train.py", [faults, *TINY, f"paths.cache_dir={cache}",
                                                        f"hydra.run.dir={run}", *extra])


def files(run: Path, launch_records: bool = False) -> dict[str, bytes]:
    """Every file under `run` and its bytes; without `launch_records`, not Hydra's per-launch records."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and (launch_records or not (p.name == "train.log" or ".hydra" in p.relative_to(run).parts))}


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def assert_no_leftovers(run: Path) -> None:
    """No temp file or directory (atomic writes, the lock's temp file, a checkpoint's step_X.tmp), no lock."""
    assert not list(run.rglob("*.tmp")) and not (run / ".lock").exists(), sorted(run.rglob("*"))


def assert_one_error(code: int, out: str, names: str) -> None:
    errors = error_lines(out)
    assert code == 1 and len(errors) == 1 and names in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A finished 2-step run (config.yaml, metrics.jsonl, samples/step_0000002.png, checkpoint 2, summary.json):
    the earlier files that each faulted launch (resume=auto to step 4) must leave as they are."""
    from conftest import shared_cache

    cache = shared_cache(tmp_path_factory)
    run = tmp_path_factory.mktemp("base") / "run"
    code, out = finish(launch("none", run, cache, "train.max_steps=2"))
    assert code == 0, out[-3000:]
    return run, cache


@pytest.fixture
def earlier_run(base_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base_run[0], run)
    return run, base_run[1], files(run)


# (faults, the file the error names, earlier files the launch may replace, earlier files it may append to)
SITES = {
    "lock_full": ("full:.lock", ".lock", set(), set()),
    "lock_read_only": ("rofs:.lock", ".lock", set(), set()),
    "config": ("full:config.yaml", "config.yaml", set(), set()),
    "metrics": ("full:metrics.jsonl", "metrics.jsonl", {"config.yaml", "summary.json"}, set()),
    "samples_denied": ("denied:/samples/", "samples/step_0000004.png", {"config.yaml", "summary.json"},
                       {"metrics.jsonl"}),
    "samples": ("full:/samples/", "samples/step_0000004.png", {"config.yaml", "summary.json"}, {"metrics.jsonl"}),
    "summary": ("full:summary.json", "summary.json", {"config.yaml"}, {"metrics.jsonl"}),
    "summary_after_failed_checkpoint": ("full:checkpoint.json,full:summary.json",
                                        "checkpoints/step_0000004.tmp/checkpoint.json", {"config.yaml"},
                                        {"metrics.jsonl"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("site", list(SITES))
def test_a_failed_write_is_one_error_line_and_keeps_the_earlier_files(site, earlier_run):
    faults, named, replaced, appended = SITES[site]
    run, cache, before = earlier_run
    code, out = finish(launch(faults, run, cache, "resume=auto", "train.max_steps=4"))
    assert_one_error(code, out, f"'{run / named}'")
    assert_no_leftovers(run)
    after = files(run)
    for name, data in before.items():
        if name in appended:
            assert after[name].startswith(data), name
        elif name not in replaced:
            assert after.get(name) == data, f"{name} changed"
    for line in after["metrics.jsonl"].decode().splitlines():
        json.loads(line)                                            # no torn line
    summary = json.loads(after["summary.json"])
    assert summary["status"] == ("failed" if "summary.json" in replaced else "completed"), summary
    if site == "summary":                                           # the run's work is done and kept
        assert (run / "checkpoints" / "step_0000004" / "checkpoint.json").is_file()
    if site == "summary_after_failed_checkpoint":
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and f"'{run / 'summary.json'}'" in warnings[0], out[-3000:]
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000002"]


@pytest.fixture
def read_only_dir(base_run, tmp_path):
    """A directory holding a copy of the base run that cannot be written: chmod 0o555 as a user; as root (who
    writes there anyway) a tmpfs remounted read-only, skipped where it cannot be mounted."""
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() != 0:
        shutil.copytree(base_run[0], root / "run")
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
        yield root
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here; the injected EROFS test covers the first write")
    try:
        shutil.copytree(base_run[0], root / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True, capture_output=True)
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("below", ["run", "run/new/run"])
def test_an_unwritable_run_dir_is_refused_before_hydra_writes(below, read_only_dir, base_run):
    run = read_only_dir / below
    before = files(read_only_dir, launch_records=True)
    code, out = finish(launch("none", run, base_run[1], "resume=auto"))
    assert_one_error(code, out, f"hydra.run.dir='{run}' cannot be written")
    assert "train:" not in out                                      # no progress bar: nothing started
    assert files(read_only_dir, launch_records=True) == before      # not even Hydra's .hydra/ or train.log


def logged(run: Path, kind: str = "train") -> list[int]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r["step"] for r in map(json.loads, lines) if r["type"] == kind]
    except (OSError, ValueError):   # not there yet, or a line being written right now
        return []


def catches_sigint(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGINT (a bit of /proc/<pid>/status's SigCgt mask)."""
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.slow
def test_ctrl_c_checkpoints_records_the_skipped_evaluation_and_exits_130(base_run, tmp_path):
    run, release = tmp_path / "run", tmp_path / "release"
    proc = launch(f"hold:2:{release}", run, base_run[1])           # evaluation and checkpoint due at step 2
    wait_for(lambda: logged(run) == [1], proc)                      # held before step 2
    proc.send_signal(signal.SIGINT)
    release.touch()
    code, out = finish(proc)
    assert code == EXIT_INTERRUPTED and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert not error_lines(out)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["signal"], summary["final_step"]) == ("interrupted", "SIGINT", 2)
    assert summary["eval_skipped"] == [{"step": 2, "reason": "SIGINT"}] and logged(run, "eval_skipped") == [2]
    assert (run / "checkpoints" / "step_0000002" / "checkpoint.json").is_file()
    assert_no_leftovers(run)


@pytest.mark.slow
def test_a_second_ctrl_c_ends_a_hung_run_at_once(base_run, tmp_path):
    run = tmp_path / "run"
    proc = launch(f"hold:2:{tmp_path / 'never'}", run, base_run[1])   # hangs before step 2 until killed
    wait_for(lambda: logged(run) == [1], proc)
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: not catches_sigint(proc.pid), proc)          # the first one was taken: SIGINT's default now
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc)
    assert code == -signal.SIGINT and "Traceback" not in out, out[-3000:]
    assert not list(run.rglob("*.tmp"))


@pytest.mark.slow
def test_sigterm_inside_a_checkpoint_write_records_the_evaluation_it_skips(base_run, tmp_path):
    run = tmp_path / "run"
    code, out = finish(launch("sigterm_in_write:2", run, base_run[1], "eval.every_steps=1"))
    assert code == EXIT_PREEMPTED and "Traceback" not in out and not error_lines(out), out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["signal"], summary["final_step"]) == ("preempted", "SIGTERM", 3)
    assert logged(run, "eval") == [1, 2] and [s for s, _ in summary["fid"]] == [1, 2]   # step 2's ran before
    assert summary["eval_skipped"] == [{"step": 3, "reason": "SIGTERM"}] and logged(run, "eval_skipped") == [3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000003"]
    assert_no_leftovers(run)


# The write primitives, in process.

def test_write_error_is_one_line_naming_the_file_and_still_an_os_error():
    err = WriteError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/summary.json")
    assert str(err) == "cannot write '/runs/x/summary.json': No space left on device (ENOSPC)"
    assert isinstance(err, UserError) and isinstance(err, OSError) and err.errno == errno.ENOSPC


def full_after(monkeypatch, nbytes: int) -> None:
    """os.write puts out at most `nbytes` more bytes, then fails with ENOSPC (a disk filling up)."""
    real, room = os.write, [nbytes]

    def write(fd, data):
        if not room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data)[:room[0]])
        room[0] -= n
        return n
    monkeypatch.setattr(os, "write", write)


def test_an_append_that_fails_half_way_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_whole(path, b'{"step": 1}\n')
    full_after(monkeypatch, 5)
    with pytest.raises(WriteError, match="metrics.jsonl': No space left on device"):
        append_whole(path, b'{"step": 2, "loss": 0.5}\n')
    assert path.read_bytes() == b'{"step": 1}\n'


def test_a_new_file_that_fails_half_way_is_removed(tmp_path, monkeypatch):
    full_after(monkeypatch, 3)
    with pytest.raises(WriteError, match=r"\.lock'"):
        create_new(tmp_path / ".lock", b'{"pid": 1}\n')
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_that_fails_keeps_the_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_text(path, "before")

    def fail(_f):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    with pytest.raises(WriteError, match=f"'{path}': Disk quota exceeded"):
        atomic_write(path, fail)
    assert path.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_directory_on_a_writable_disk_is_writable_and_a_file_in_the_way_is_left_to_mkdir(tmp_path):
    assert unwritable_dir(tmp_path / "new" / "run") is None
    (tmp_path / "file").write_text("x")
    assert unwritable_dir(tmp_path / "file" / "run") is None
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]          # the probe leaves nothing behind
