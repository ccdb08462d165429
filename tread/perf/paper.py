"""The paper code's training step (CompVis/tread), built from a checkout the user provides, for timing beside ours
in one process (scripts/compare_paper.py). Nothing of it is vendored here: its licence (CC BY-NC-SA) forbids
copying, so PAPER_DIR is imported as it is.

Its step, as its train.py runs it: `dit.get_model(arch, params)` (blocks and final layer under the
`@torch.compile` they ship with; routes on when given), wrapped by `edm.EDMDiffusion().wrap_model_with_precond`,
`get_training_loss(net, x, y, class_drop_prob=0.1).mean()` under autocast, `zero_grad`, `backward`, `AdamW(lr 1e-4,
betas (0.9, 0.999), eps 1e-8, no weight decay)` as its config builds it (torch's default implementation for the
device), and `utils.train_helper.update_ema` (decay 0.9999).

Importing it: the paper's modules are top-level names (`dit`, `edm`, `routing_module`, `autoencoder`, and a
`utils` package that clashes with ours), so they are imported with PAPER_DIR first on sys.path and our `utils`
set aside, then ours is put back (the paper's modules keep what they bound). Its `utils/edm_helper.py` imports
deepspeed for a ZeRO-3 EMA helper the step never calls; when deepspeed is not installed an empty stand-in module
satisfies that import.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from tread.perf.benchmark import timed
from tread.utils.errors import UserError

PAPER_FILES = ("dit.py", "edm.py", "routing_module.py", "utils/train_helper.py", "utils/edm_helper.py")
PAPER_MODULES = ("dit", "edm", "utils.train_helper")
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


def _stand_in_deepspeed() -> list[str]:
    """Empty deepspeed modules for the paper's unused ZeRO-3 import (only when deepspeed is not installed)."""
    try:
        importlib.import_module("deepspeed")
        return []
    except ImportError:
        pass
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)   # find_spec works; no metadata
    sys.modules["deepspeed.runtime.zero.partition_parameters"].ZeroParamStatus = None
    return names


def _paper_utils(paper_dir: Path) -> types.ModuleType:
    """The paper's utils package. Its folder has no __init__.py: a namespace package loses to any regular `utils`
    on sys.path (ours, when the project root is there), so it is made by hand and its submodules resolve inside
    PAPER_DIR/utils; inspect.getmodule (which torch.compile calls) needs it to have a __file__."""
    spec = importlib.machinery.ModuleSpec("utils", None, is_package=True)
    spec.submodule_search_locations = [str(paper_dir / "utils")]
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(paper_dir / "utils")
    return module


@contextlib.contextmanager
def _paper_on_path(paper_dir: Path) -> Iterator[None]:
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "utils" or k.startswith("utils.")}
    stand_ins: list[str] = []
    sys.path.insert(0, str(paper_dir))
    try:
        stand_ins = _stand_in_deepspeed()
        sys.modules["utils"] = _paper_utils(paper_dir)
        yield
    finally:
        sys.path.remove(str(paper_dir))
        for k in [k for k in sys.modules if k == "utils" or k.startswith("utils.")] + stand_ins:
            sys.modules.pop(k, None)
        sys.modules.update(ours)


def import_paper(paper_dir: Path) -> types.SimpleNamespace:
    """The paper's dit, edm and utils.train_helper modules from `paper_dir`."""
    paper_dir = Path(paper_dir).expanduser().resolve()
    check_paper_dir(paper_dir)
    with _paper_on_path(paper_dir):
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
        self.net = self.diffuser.wrap_model_with_precond(paper.dit.get_model(arch, params))
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
