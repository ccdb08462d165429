"""Which of many tensors holds a NaN or an infinity, in one pass and one host sync: a foreach 2-norm screens them
all, and only a tensor whose norm is not finite is looked at element by element (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> Optional[str]:
    """The name of the first floating-point tensor holding a non-finite value (None: all finite)."""
    names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not names:
        return None
    norms = torch._foreach_norm([tensors[n].detach() for n in names], 2)
    finite = torch.stack([n.float() for n in norms]).isfinite().cpu()
    suspects = [names[i] for i in (~finite).nonzero().flatten().tolist()]
    return next((n for n in suspects if not bool(torch.isfinite(tensors[n]).all())), None)
