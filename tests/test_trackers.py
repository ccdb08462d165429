"""train.log_with: TensorBoard and wandb through accelerate's trackers (tread/training/run_log.py), read back with
TensorBoard's own reader (EventAccumulator) and from wandb's offline run folder."""
from __future__ import annotations

import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from wandb.proto import wandb_internal_pb2 as pb

from conftest import REPO, TINY, compose_cfg, shared_cache
from tread.encoders.tiny_text import save_tiny_text_encoders
from tread.schema import ConfigError, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics, tracker_names

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 32768   # wandb's run file: LevelDB's log format (its blocks)


def board(run_dir: Path) -> EventAccumulator:
    """Every event of run_dir/tensorboard (size_guidance 0: keep all), as TensorBoard's backend reads them."""
    return EventAccumulator(str(run_dir / "tensorboard"),
                            size_guidance={"scalars": 0, "images": 0, "tensors": 0}).Reload()


def config_text(acc: EventAccumulator) -> list[tuple[int, str]]:
    """(step, text) of each launch's config entry (add_text writes the tag `config/text_summary`)."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("config/text_summary")]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny FLUX trained 2 steps on toy_text, evaluated at both steps with validation prompts, logging to
    TensorBoard (train.log_with) and to wandb offline (wandb.mode=offline alone implies it; WANDB_MODE=offline
    too, and wandb's home folders under tmp)."""
    root = tmp_path_factory.mktemp("trackers")
    encoders = save_tiny_text_encoders("flux", root / "encoders")
    cfg = compose_cfg("train", TINY + [
        f"paths.cache_dir={shared_cache(tmp_path_factory)}", "model=flux", "data=toy_text",
        f"model.text_encoders={encoders}", "data.builtin_args.num_per_class=4", "train.max_steps=2",
        "eval.every_steps=1", "eval.at_end=false", "eval.num_samples=4", "eval.batch_size=4", "eval.grid_size=4",
        "eval.metrics=[fid]", 'eval.validation_prompts=["a red disc", "a lime X"]', "train.log_with=[tensorboard]",
        "wandb.mode=offline"])
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": root,
                            "WANDB_CONFIG_DIR": root / "wandb_config", "WANDB_CACHE_DIR": root / "wandb_cache",
                            "WANDB_DATA_DIR": root / "wandb_data"}.items():
            mp.setenv(name, str(value))
        train(cfg, root / "run")
    return root / "run"


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's finite numbers as TensorBoard scalars: tag <type>/<key>, (step, value as float32)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_metrics(run_dir):
        for k, v in r.items():
            if k not in ("type", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(f"{r['type']}/{k}", []).append((r["step"], float(np.float32(v))))
    return out


def test_tensorboard_scalars_are_metrics_jsonl(text_run):
    acc = board(text_run)
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    want = expected_scalars(text_run)
    assert got == want
    assert [s for s, _ in got["train/loss"]] == [1, 2] and [s for s, _ in got["eval/fid"]] == [1, 2]


def test_tensorboard_has_the_validation_grids_and_the_config(text_run):
    acc = board(text_run)
    grids = [r["validation_grid"] for r in read_metrics(text_run) if r["type"] == "eval"]
    events = acc.Images("eval/validation")
    assert [e.step for e in events] == [1, 2] and len(grids) == 2
    for event, path in zip(events, grids):
        shown = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        assert np.array_equal(shown, np.asarray(Image.open(path).convert("RGB")))
    assert config_text(acc) == [(0, f"```yaml\n{(text_run / 'config.yaml').read_text()}```")]


def wandb_records(path: Path) -> list[pb.Record]:
    """The records of a wandb offline run file (run-<id>.wandb): a 7-byte header, then 32 KiB blocks of chunks
    (crc32, length: 2 bytes little-endian, type: 1 full, 2 first, 3 middle, 4 last), each record a protobuf."""
    data, pos, chunks, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:                                     # a block's tail too short for a header
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(chunks))
            chunks = b""
    return records


def wandb_history(records: list[pb.Record]) -> dict[int, dict[str, Any]]:
    """{step: {key: value}} of the history records (a nested key, as an image's, as nested dicts)."""
    rows: dict[int, dict[str, Any]] = {}
    for r in (r.history for r in records if r.WhichOneof("record_type") == "history"):
        for item in r.item:
            *parents, leaf = list(item.nested_key) or [item.key]
            node = rows.setdefault(r.step.num, {})
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = json.loads(item.value_json)
    return rows


def test_wandb_offline_run_holds_the_config_records_and_images(text_run):
    (run_file,) = (text_run / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    rows = wandb_history(records)
    metrics = [r for r in read_metrics(text_run) if r["type"] in ("train", "eval")]
    assert sorted(rows) == [1, 2] and len(metrics) == 4
    for r in metrics:
        assert all(rows[r["step"]][f"{r['type']}/{k}"] == v for k, v in r.items() if k not in ("type", "step"))
    for r in (r for r in metrics if r["type"] == "eval"):                # the grid, pixel for pixel
        image = rows[r["step"]]["eval/validation"]
        assert image["_type"] == "images/separated" and image["count"] == 1
        saved = run_file.parent / "files" / image["filenames"][0]
        assert np.array_equal(np.asarray(Image.open(saved).convert("RGB")),
                              np.asarray(Image.open(r["validation_grid"]).convert("RGB")))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == OmegaConf.to_container(OmegaConf.load(text_run / "config.yaml"))


def test_resume_appends_and_tensorboard_shows_the_resumed_launchs_steps(tiny_cfg, tmp_path):
    """A launch killed after logging steps 3-4 but before their checkpoint (step 4's removed): the resume from
    step 2, at another lr, logs 3-4 again into a second event file in the same folder; TensorBoard's reader hides
    the first launch's 3-4 (the resume's SessionLog.START at step 3) and shows what metrics.jsonl keeps."""
    common = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=2", "train.log_with=[tensorboard]"]
    run = tmp_path / "run"
    train(tiny_cfg(*common, "optimizer.lr=0.001"), run)
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    train(tiny_cfg(*common, "optimizer.lr=0.002", "resume=auto"), run)
    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    raw = [(e.step, e.summary.value[0].tensor.float_val[0]) for f in files for e in EventFileLoader(str(f)).Load()
           if e.summary.value and e.summary.value[0].tag == "train/lr"]             # every event, as written
    a, b = float(np.float32(0.001)), float(np.float32(0.002))
    assert len(files) == 2 and raw == [(1, a), (2, a), (3, a), (4, a), (3, b), (4, b)]
    acc, want = board(run), expected_scalars(run)
    assert [s for s, _ in want["train/lr"]] == [1, 2, 3, 4]
    assert all([(e.step, e.value) for e in acc.Scalars(tag)] == want[tag] for tag in ("train/lr", "train/loss"))
    assert [step for step, _ in config_text(acc)] == [0, 2]              # each launch's config at its first step


BAD = [
    ("train.log_with=[tb]", "train.log_with[0]='tb' is not allowed; allowed: a list of trackers among wandb, "
                            "tensorboard, e.g. [tensorboard] or [wandb, tensorboard] ([]: metrics.jsonl only)."),
    ("train.log_with=tensorboard", "train.log_with='tensorboard' is not allowed; allowed: a list of trackers"),
    ("train.log_with=[tensorboard,tensorboard]", "train.log_with=['tensorboard', 'tensorboard'] repeats a tracker"),
    ("train.log_with=[wandb]", "train.log_with=['wandb'] asks for wandb but wandb.mode='disabled'; allowed: "
                               "wandb.mode=offline or online with it"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[o for o, _ in BAD])
def test_bad_log_with_is_one_line_naming_key_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=[override]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tensorboard_without_its_package_is_refused_before_work(monkeypatch):
    import tread.schema.train

    monkeypatch.setattr(tread.schema.train, "find_spec", lambda name: None)       # neither tensorboard nor X
    with pytest.raises(ConfigError, match=r"^train.log_with=\[tensorboard\] needs the tensorboard package.*"
                                          r"pip install tensorboard==2.21.0"):
        check_train(compose_cfg(overrides=["train.log_with=[tensorboard]"]))
    check_train(compose_cfg(overrides=["wandb.mode=offline"]))                     # asked for by tensorboard only


def test_how_log_with_and_wandb_mode_combine():
    for overrides, names in (([], []), (["wandb.mode=offline"], ["wandb"]),
                             (["train.log_with=[tensorboard]", "wandb.mode=online"], ["tensorboard", "wandb"]),
                             (["train.log_with=[wandb,tensorboard]", "wandb.mode=offline"], ["wandb", "tensorboard"])):
        cfg = compose_cfg(overrides=overrides)
        check_train(cfg)
        assert tracker_names(cfg.train.log_with, cfg.wandb.mode) == names


def test_a_bad_tracker_name_is_one_error_line_from_train_py(tmp_path):
    env = {**os.environ, "TREAD_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "train.py", "train.log_with=[tb]", f"hydra.run.dir={tmp_path / 'r'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "train.log_with[0]='tb'" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()
