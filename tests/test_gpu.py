"""CUDA-only checks of the training step (skipped without a GPU; run them where one is lent:
`pytest -m gpu`). They run the one training step (tread/training/step.py) that train.py and the benchmark run.
Their CPU counterparts: tests/test_compile.py, tests/test_benchmark.py."""
from __future__ import annotations

import itertools

import pytest
import torch

from tread.schema import check_train, compose
from tread.training.setup import build_parts, make_accelerator, seed_streams
from tread.training.step import StepSettings, TrainStep

pytestmark = pytest.mark.gpu


def routed_step(*overrides: str):
    """The training step of a routed DiT-S/2 (paper route) in bf16 on CUDA, and an endless fixed batch."""
    cfg = compose(["debug=tiny", "model.arch=DiT-S/2", "data.channels=4", "data.resolution=16",
                   "data.num_classes=1000", "train.mixed_precision=bf16", "train.batch_size=8", *overrides])
    cfg = check_train(cfg)
    accelerator = make_accelerator(cfg.train)
    parts = build_parts(cfg, accelerator)
    seed_streams(cfg.train.seed, cfg.routing.seed, parts.model, accelerator.process_index)
    parts.prepare()
    batch = (torch.randn(8, 4, 16, 16, device="cuda"), torch.randint(0, 1000, (8,), device="cuda"))
    return TrainStep(parts, StepSettings.from_config(cfg, routed=True)), itertools.repeat(batch)


def test_routed_training_step_has_no_host_syncs():
    """Selection, gather/scatter, loss, backward, clipping, fused AdamW and the EMA update never wait on the GPU."""
    step, batches = routed_step("train.compile=false")
    for i, sync_mode in enumerate((0, "error")):   # warm-up (allocations, lazy init), then the checked step
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            step(batches, i)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_compiled_bf16_steps_have_one_graph_and_do_not_recompile():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step, batches = routed_step("train.compile=true")
    step(batches, 0)
    first = dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for i in range(3):
        step(batches, i + 1)
    assert dict(counters["stats"]) == first
    torch._dynamo.reset()


def test_a_cuda_run_gets_tf32_matmuls_and_auto_precision():
    """train.tf32 and train.mixed_precision=auto on the GPU: TF32 fp32 matmuls, bf16 autocast where it is native."""
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        accelerator = make_accelerator(compose(["debug=tiny", "train.mixed_precision=auto"]).train)
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        assert accelerator.mixed_precision == ("bf16" if native else "no")
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before
