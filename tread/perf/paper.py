"""The paper code's training step (CompVis/tread), built from a checkout the user provides, for timing beside
ours in one process (scripts/compare_paper.py; docs/benchmarks.md). Nothing of it is vendored: its licence
forbids copying.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tempfile
import types
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from tread.perf.benchmark import timed
from tread.training.setup import set_tf32
from tread.utils.errors import UserError

PAPER_FILES = ("dit.py", "edm.py", "routing_module.py", "utils/train_helper.py", "utils/edm_helper.py")
PAPER_MODULES = ("dit", "edm", "utils.train_helper")
PAPER_TOP_LEVEL = ("dit", "edm", "routing_module", "autoencoder", "utils")   # what its step imports
CLASS_DROP_PROB = 0.1          # its configs/config.yaml train.general.class_drop_prob
LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8


class PaperCodeError(UserError):
    """PAPER_DIR is not a checkout of CompVis/tread, or it does not import."""


def check_paper_dir(paper_dir: Path) -> None:
    missing = [f for f in PAPER_FILES if not (paper_dir / f).is_file()]
    if missing:
        raise PaperCodeError(f"PAPER_DIR '{paper_dir}' is not a checkout of CompVis/tread: missing "
                             f"{', '.join(missing)}; allowed: the folder of "
                             f"`git clone https://github.com/CompVis/tread`")


# The paper's utils/edm_helper.py imports these for a ZeRO-3 helper its step never calls.
DEEPSPEED_STUB = {"deepspeed/__init__.py": "", "deepspeed/runtime/__init__.py": "",
                  "deepspeed/runtime/zero/__init__.py": "",
                  "deepspeed/runtime/zero/partition_parameters.py": "ZeroParamStatus = None\n"}


class _PaperFinder(importlib.abc.MetaPathFinder):
    """Finds the paper's top-level modules (PAPER_TOP_LEVEL) in PAPER_DIR ahead of sys.path, and `deepspeed` in
    `stubs` when given; every other name resolves as usual."""

    def __init__(self, paper_dir: Path, stubs: Optional[Path]):
        self.folders = dict.fromkeys(PAPER_TOP_LEVEL, paper_dir)
        if stubs is not None:
            self.folders["deepspeed"] = stubs

    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname not in self.folders:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(self.folders[fullname])])


@contextlib.contextmanager
def _paper_importable(paper_dir: Path) -> Iterator[None]:
    """While the block runs, the paper's modules are importable by their own names (with an empty `deepspeed` stub
    when it is not installed); what was imported stays imported."""
    with tempfile.TemporaryDirectory(prefix="paper_stubs_") as stubs:
        need_stub = importlib.util.find_spec("deepspeed") is None
        if need_stub:
            for name, text in DEEPSPEED_STUB.items():
                (Path(stubs) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(stubs) / name).write_text(text)
        finder = _PaperFinder(paper_dir, Path(stubs) if need_stub else None)
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            sys.meta_path.remove(finder)


def _imported_elsewhere(paper_dir: Path) -> list[str]:
    """The paper's top-level modules imported before from somewhere else (a previous PAPER_DIR, another `dit`):
    the import system hands out what is imported, so these would shadow the paper's."""
    out = []
    for name in PAPER_TOP_LEVEL:
        module = sys.modules.get(name)
        where = [getattr(module, "__file__", None)] + list(getattr(module, "__path__", []))
        if module is not None and not any(w and Path(w).is_relative_to(paper_dir) for w in where):
            out.append(f"{name} from {next((w for w in where if w), 'nowhere')}")
    return out


def import_paper(paper_dir: Path) -> types.SimpleNamespace:
    """The paper's dit, edm and utils.train_helper modules from `paper_dir`, imported under their own names."""
    paper_dir = Path(paper_dir).expanduser().resolve()
    check_paper_dir(paper_dir)
    elsewhere = _imported_elsewhere(paper_dir)
    if elsewhere:
        raise PaperCodeError(f"the paper code in '{paper_dir}' cannot be imported beside modules of its names "
                             f"imported before ({'; '.join(elsewhere)}); allowed: one PAPER_DIR per process")
    with _paper_importable(paper_dir):
        try:
            mods = {name.split(".")[-1]: importlib.import_module(name) for name in PAPER_MODULES}
        except ImportError as err:
            raise PaperCodeError(f"the paper code in '{paper_dir}' does not import here: {err}") from None
    return types.SimpleNamespace(**mods)


class PaperBench:
    """The paper code's training step for one DiT, routes and precision, on a fixed synthetic batch; the
    interface of tread.perf.benchmark.StepBench that time_interleaved uses (step, timed, device, static_bytes)."""

    def __init__(self, paper: types.SimpleNamespace, arch: str, resolution: int, channels: int, batch: tuple,
                 routes: Optional[Sequence[dict]], bf16: bool, seed: int = 0):
        torch.manual_seed(seed)
        params = {"num_classes": 1000, "in_channels": channels, "input_size": resolution, "cond_mode": "adaln",
                  "enable_routing": bool(routes), "routes": [dict(r) for r in routes or []]}
        self.diffuser = paper.edm.EDMDiffusion()
        device = batch[0].device
        self.net = self.diffuser.wrap_model_with_precond(paper.dit.get_model(arch, params)).to(device)
        if device.type == "cuda":     # its train.py: cudnn.allow_tf32 and cuda.matmul.allow_tf32 = True
            set_tf32(True, device)
        self.ema = copy.deepcopy(self.net)
        self.ema.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.update_ema = paper.train_helper.update_ema
        self.batch, self.bf16 = batch, bf16
        self.net.train()

    @property
    def device(self) -> torch.device:
        return self.batch[0].device

    def step(self) -> torch.Tensor:
        x, y = self.batch
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.diffuser.get_training_loss(self.net, x, y, class_drop_prob=CLASS_DROP_PROB).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.update_ema(self.ema, self.net)
        return loss.detach()

    def timed(self, steps: int) -> list[float]:
        return [timed(self.step, self.device) for _ in range(steps)]

    def static_bytes(self) -> int:
        return 0
