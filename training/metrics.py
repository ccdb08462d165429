"""Run logging: metrics.jsonl (always), wandb (optional), console via tqdm."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

WANDB_MODES = ("disabled", "offline", "online")


class MetricsLogger:
    """Appends one JSON object per line to run_dir/metrics.jsonl on the main process."""

    def __init__(self, run_dir: Path, is_main: bool, wandb_cfg: Optional[dict] = None, config: Optional[dict] = None):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        mode = (wandb_cfg or {}).get("mode", "disabled")
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={mode!r} is not allowed; use one of {list(WANDB_MODES)}.")
        if is_main and mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                    name=wandb_cfg.get("name"), mode=mode, dir=str(run_dir), config=config)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
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
