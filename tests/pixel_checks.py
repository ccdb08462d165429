"""Comparing uint8 pixels that two float computations gave.

Two decodes of the same latents that order their floating-point sums differently (another batch shape, another
convolution kernel, another CPU's vector width, another intra-op thread count) agree only to float32 rounding: a
value that lands within ~1e-4 of a rounding boundary (k + 0.5 grey levels) may round to k in one and to k + 1 in the
other. So such pixels are compared within one grey level, in a small share of the values; a real difference (the
wrong clip, a missing normalisation, another timestep) moves most values, and by far more than one level. Where the
two computations are literally the same (same function, inputs and shapes), compare bit for bit instead.
"""
from __future__ import annotations

import numpy as np
import torch

# Observed: 1 value in 13,824 (0.007 %) on an AVX2-only CPU; 1 % leaves a wide margin and still fails any real change.
PIXEL_SHARE = 0.01


def assert_pixels_close(got, want, *, share: float = PIXEL_SHARE, what: str = "pixels") -> None:
    """`got` and `want` (uint8 tensors or arrays) have one shape and differ by at most one grey level, in at most
    `share` of the values."""
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.dtype == want.dtype == np.uint8, f"{what}: dtypes {got.dtype} and {want.dtype}, not uint8"
    assert got.shape == want.shape, f"{what}: shapes {got.shape} and {want.shape}"
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    n, biggest = int(np.count_nonzero(diff)), int(diff.max(initial=0))
    assert biggest <= 1 and n <= share * diff.size, (
        f"{what}: {n} of {diff.size} values differ, by up to {biggest} grey levels; allowed: at most 1 grey level in "
        f"at most {share:.0%} of the values (two float decodes that order their sums differently may round a value "
        f"near k + 0.5 either way; more than that is a real difference)")
