"""The run's records: metrics.jsonl (always, on the main process) and the trackers of train.log_with
(TensorBoard, wandb) through accelerate's tracker classes; docs/evaluation.md, "Run logs".
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from accelerate.tracking import GeneralTracker, TensorBoardTracker, WandBTracker
from PIL import Image
from tensorboard.compat.proto.summary_pb2 import Summary

from tread.schema.tree import to_yaml
from tread.evaluation.videos import gif_bytes
from tread.utils.io import append_whole

TENSORBOARD_DIR = "tensorboard"   # under the run dir; `tensorboard --logdir <run or sweep dir>` shows it
CONFIG_TAG = "config"             # TensorBoard text: the resolved config as YAML (as config.yaml), per launch


def tracker_names(log_with: Sequence[str], wandb_mode: str) -> list[str]:
    """The trackers a run logs to: train.log_with, plus wandb when wandb.mode is offline or online."""
    names = list(log_with)
    return names + ["wandb"] if wandb_mode != "disabled" and "wandb" not in names else names


def config_text(hparams: dict) -> str:
    """The run's resolved config as a Markdown YAML block (TensorBoard's text plugin renders Markdown)."""
    return f"```yaml\n{to_yaml(hparams)}```"


def start_trackers(run_dir: Path, names: Sequence[str], wandb: Mapping[str, Any], hparams: Optional[dict],
                   step: int) -> list[GeneralTracker]:
    """Started trackers, each given the run's resolved config (`hparams`): TensorBoard as text at `step` (the launch's first step), wandb as
    its run config. wandb's client is imported by WandBTracker.start (deferred there: seconds to import)."""
    trackers: list[GeneralTracker] = []
    if "tensorboard" in names:
        # -> run_dir/tensorboard; purge_step: a SessionLog.START at the first step this launch logs, so that
        # TensorBoard hides an interrupted launch's records after the resumed checkpoint (as metrics.jsonl drops them)
        board = TensorBoardTracker(TENSORBOARD_DIR, Path(run_dir), purge_step=step + 1)
        board.start()
        if hparams is not None:
            board.log({CONFIG_TAG: config_text(hparams)}, step=step)
        trackers.append(board)
    if "wandb" in names:
        run = WandBTracker(wandb.get("project"), entity=wandb.get("entity"), name=wandb.get("name"),
                           mode=wandb["mode"], dir=str(run_dir), config=hparams)
        run.start()
        trackers.append(run)
    return trackers


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (metrics.jsonl writes the others as null or text)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class RunLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl on the main process (a line that cannot be
    written whole is not written: WriteError), and mirrors each record to the trackers as `<type>/<key>`:
    every value to wandb, the finite numbers to TensorBoard."""

    def __init__(self, run_dir: Path, is_main: bool, log_with: Sequence[str] = (),
                 wandb: Optional[Mapping[str, Any]] = None, hparams: Optional[dict] = None, step: int = 0):
        """`wandb`: the wandb section as plain data ({mode, project, entity, name}; None: no wandb)."""
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        wandb = wandb or {"mode": "disabled"}
        names = tracker_names(log_with, wandb["mode"])
        self.trackers = start_trackers(Path(run_dir), names, wandb, hparams, step) if is_main else []

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        append_whole(self.path, (json.dumps(clean) + "\n").encode())   # a whole line, or WriteError and none
        kind = record.get("type", "train")
        values = {f"{kind}/{k}": v for k, v in record.items() if k not in ("type", "step")}
        for tracker in self.trackers:
            tracker.log(values if tracker.name == "wandb" else scalars(values), step=record.get("step"))

    def log_image(self, tag: str, path: str, step: int) -> None:
        """An image file (the validation grid PNG) on every tracker at `step`, as RGB uint8 pixels."""
        if not self.trackers:
            return
        pixels = np.asarray(Image.open(path).convert("RGB"))                   # (H, W, 3) uint8
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({tag: pixels[None]}, step=step, dataformats="NHWC")
                tracker.writer.flush()                                        # log_images leaves it to flush_secs
            else:
                tracker.log_images({tag: [pixels]}, step=step)                 # a list of one wandb.Image

    def log_videos(self, tag: str, paths: Sequence[str], step: int) -> None:
        """Video files (the validation videos) on every tracker at `step`, each as `<tag>/<file stem>`: an animated
        GIF in a TensorBoard image summary, a wandb.Video on wandb."""
        if not self.trackers:
            return
        tags = {f"{tag}/{Path(p).stem}": Path(p) for p in paths}
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                for name, path in tags.items():
                    tracker.writer.file_writer.add_summary(gif_summary(name, gif_bytes(path)), step)
                tracker.writer.flush()
            else:
                import wandb    # deferred: seconds to import, and only a run that logs to wandb gets here
                tracker.log({name: wandb.Video(str(path)) for name, path in tags.items()}, step=step)

    def close(self) -> None:
        """Ends the trackers (TensorBoard: the writer closed; wandb: the run finished); a second call does nothing."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()


def gif_summary(tag: str, gif: bytes) -> Summary:
    """An image summary of animated-GIF bytes (what torch's add_video writes, without moviepy)."""
    width, height = Image.open(io.BytesIO(gif)).size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
