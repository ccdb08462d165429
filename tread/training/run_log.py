"""The run's records: metrics.jsonl (always, on the main process) and wandb (optional)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from tread.utils.io import append_whole


class RunLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl on the main process (a line that cannot be
    written whole is not written: WriteError), and mirrors the records to wandb when wandb.mode is offline or
    online."""

    def __init__(self, run_dir: Path, is_main: bool, wandb_cfg: Optional[dict] = None, config: Optional[dict] = None):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        wandb_cfg = wandb_cfg or {}
        if is_main and wandb_cfg.get("mode", "disabled") != "disabled":
            import wandb  # deferred: an optional service client, seconds to import

            self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                    name=wandb_cfg.get("name"), mode=wandb_cfg["mode"], dir=str(run_dir),
                                    config=config)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        append_whole(self.path, (json.dumps(clean) + "\n").encode())   # a whole line, or WriteError and none
        if self.wandb is not None:
            kind = record.get("type", "train")
            self.wandb.log({f"{kind}/{k}": v for k, v in record.items() if k not in ("type", "step")},
                           step=record.get("step"))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
