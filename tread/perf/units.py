"""Human-readable FLOPs and bytes for the tools' tables."""
from __future__ import annotations


def fmt_flops(f: float) -> str:
    for unit, s in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if f >= s:
            return f"{f / s:.2f} {unit}F"
    return f"{f:.0f} F"


def fmt_bytes(b: int) -> str:
    return f"{b / 2 ** 30:.2f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"
