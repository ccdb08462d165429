"""The training step issues no operation that makes the host wait for a CUDA device, checked on the CPU.

On CUDA a host sync happens where an operator must hand a device value to the host: `aten._local_scalar_dense`
(`.item()`, `bool(t)`, a tensor given where a Python number is expected) and the operators whose output size
depends on the data (`nonzero`, `masked_select`, ...). Those are the same operators on the CPU, so recording
what the step dispatches on the CPU finds them without a GPU; tests/test_gpu.py checks the same step on a device
with torch.cuda.set_sync_debug_mode("error")."""
from __future__ import annotations

import itertools

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from tread.schema import check_train, compose
from tread.training.ema import ema_update
from tread.training.setup import build_parts, make_accelerator, seed_streams
from tread.training.step import StepSettings, TrainStep

SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.is_nonzero",
           "aten._unique2", "aten.masked_scatter")


class Dispatched(TorchDispatchMode):
    """Every ATen operator called inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def syncing(ops: list[str]) -> list[str]:
    return [op for op in ops if op.startswith(SYNCING)]


def test_ema_update_with_the_guards_flag_never_reads_a_device_value():
    model, ema = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    for skip in (torch.zeros(()), torch.ones(())):
        with Dispatched() as seen:
            ema_update(ema, model, 0.99, skip)
        assert not syncing(seen.ops), seen.ops


def test_ema_update_with_the_guards_flag_equals_the_scalar_update_bit_for_bit():
    """The tensor weight (no sync) computes what the scalar weight of a run without the guard computes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 70), nn.LayerNorm(70))
    ema_a, ema_b = nn.Sequential(nn.Linear(300, 70), nn.LayerNorm(70)), nn.Sequential(nn.Linear(300, 70),
                                                                                       nn.LayerNorm(70))
    ema_b.load_state_dict(ema_a.state_dict())
    before = {k: v.clone() for k, v in ema_a.state_dict().items()}
    ema_update(ema_a, model, 0.9999)
    ema_update(ema_b, model, 0.9999, skip=torch.zeros(()))
    assert all(torch.equal(a, b) for a, b in zip(ema_a.state_dict().values(), ema_b.state_dict().values()))
    assert not torch.equal(ema_a[0].weight, before["0.weight"])
    ema_update(ema_b, model, 0.9999, skip=torch.ones(()))        # a skipped step leaves the EMA as it was
    assert all(torch.equal(a, b) for a, b in zip(ema_a.state_dict().values(), ema_b.state_dict().values()))


def test_a_routed_training_step_issues_no_syncing_operator():
    """The whole step of a routed DiT with the fused optimizer and the non-finite guard on (train.yaml's
    defaults): selection, gather/scatter, loss, backward, gradient norm, AdamW and the EMA update."""
    cfg = compose(["debug=tiny", "train.compile=false", "train.mixed_precision=no"])
    cfg = check_train(cfg)
    accelerator = make_accelerator(cfg.train)
    parts = build_parts(cfg, accelerator)
    seed_streams(cfg.train.seed, cfg.routing.seed, parts.model, accelerator.process_index)
    parts.prepare()
    assert cfg.optimizer.fused and parts.model.routing.routes
    c, r = cfg.data.channels, cfg.data.resolution
    batches = itertools.repeat((torch.randn(4, c, r, r), torch.randint(0, cfg.data.num_classes, (4,))))
    step = TrainStep(parts, StepSettings.from_config(cfg, routed=True))
    step(batches, 0)                                               # lazy initialisation (optimizer state)
    with Dispatched() as seen:
        step(batches, 1)
    assert "aten._foreach_lerp_.List" in seen.ops and any("adamw" in op for op in seen.ops)
    assert not syncing(seen.ops), syncing(seen.ops)
