"""CUDA-only checks of the training step (skipped without a GPU; run them where one is lent:
`pytest -m gpu`). Their CPU counterparts: tests/test_compile.py, tests/test_benchmark.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _routed_dit():
    from models import build_dit
    routing = {"enabled": True, "routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]}
    torch.manual_seed(0)
    return build_dit("DiT-S/2", 16, 4, 1000, routing=routing).cuda()


def test_routed_training_step_has_no_host_syncs():
    """Selection, gather/scatter, loss, backward, fused AdamW and the EMA update never wait on the GPU."""
    from diffusion import EDM
    from training.ema import ema_update
    import copy
    model = _routed_dit()
    edm = EDM()
    net = edm.precondition(model).train()
    ema = copy.deepcopy(net).requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(8, 4, 16, 16, device="cuda"), torch.randint(0, 1000, (8,), device="cuda")
    for sync_mode in (0, "error"):   # warm-up (allocations, lazy init), then the checked step
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = edm.loss(net, x, y).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema_update(ema, net, 0.999)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_compiled_bf16_steps_do_not_recompile():
    import torch._dynamo
    from torch._dynamo.utils import counters
    from diffusion import EDM
    model = _routed_dit()
    torch._dynamo.reset()
    counters.clear()
    model.compile()
    edm = EDM()
    net = edm.precondition(model).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(8, 4, 16, 16, device="cuda"), torch.randint(0, 1000, (8,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = edm.loss(net, x, y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    first = dict(counters["stats"])
    for _ in range(3):
        step()
    assert dict(counters["stats"]) == first
    torch._dynamo.reset()
