"""The statistics of a seeded comparison: paired or Welch t-test, a 95% interval of the difference, Holm's
correction over a declared family and the difference detectable with 80% power. Fewer than MIN_SEEDS seeds
makes no claim; settings identical on every shared seed are left out of the family.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np
from scipy import stats as scipy_stats
from scipy.optimize import brentq

ALPHA = 0.05          # family-wise error rate (Holm)
POWER = 0.8           # the power at which the detectable difference is stated
MIN_SEEDS = 5         # seeds per setting before a difference is claimed


def _empty(test: str, n: int, verdict: str) -> dict[str, Any]:
    return {"test": test, "n": n, "diff": None, "se": None, "t": None, "df": None, "p": None, "ci": None,
            "detectable": None, "verdict": verdict}


def _finish(test: str, n: int, diff: float, se: float, df: float) -> dict[str, Any]:
    """The t statistic, two-sided p, the 95% interval and the 80%-power detectable difference at the unadjusted
    level (holm() restates it at the family's strictest level)."""
    t = diff / se
    half = float(scipy_stats.t.ppf(1 - ALPHA / 2, df)) * se
    return {"test": test, "n": n, "diff": diff, "se": se, "t": t, "df": df,
            "p": float(2 * scipy_stats.t.sf(abs(t), df)), "ci": (diff - half, diff + half),
            "detectable": detectable(se, df, ALPHA), "verdict": None}


def detectable(se: float, df: float, alpha: float) -> float:
    """The true difference a two-sided t-test at level `alpha` detects with probability POWER, given the standard
    error `se` and degrees of freedom `df`: solved exactly on the noncentral t distribution (the usual
    (z_alpha + z_power) x se shortcut understates it by ~10% at 4 degrees of freedom)."""
    crit = float(scipy_stats.t.ppf(1 - alpha / 2, df))

    def short(nc: float) -> float:    # the far tail is negligible here, and scipy's nct.cdf is NaN at some nc
        return float(scipy_stats.nct.sf(crit, df, nc)) + float(np.nan_to_num(scipy_stats.nct.cdf(-crit, df, nc))) - POWER
    hi = crit + 3.0
    while short(hi) < 0:      # widen until the power is reached
        hi *= 2
    return float(brentq(short, 0.0, hi)) * se


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Welch's t-test of mean(b) - mean(a) (unequal variances, Welch-Satterthwaite degrees of freedom)."""
    if len(a) < 2 or len(b) < 2:
        return _empty("Welch", min(len(a), len(b)), "n/a")
    ma, mb, va, vb = statistics.fmean(a), statistics.fmean(b), statistics.variance(a), statistics.variance(b)
    se = math.sqrt(va / len(a) + vb / len(b))
    if se == 0:
        return {**_empty("Welch", min(len(a), len(b)), "identical" if ma == mb else "no spread"), "diff": mb - ma}
    df = se ** 4 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    return _finish("Welch", min(len(a), len(b)), mb - ma, se, df)


def paired(diffs: Sequence[float]) -> dict[str, Any]:
    """The paired t-test of per-seed differences b_s - a_s (n - 1 degrees of freedom)."""
    n = len(diffs)
    if n < 2:
        return _empty("paired", n, "n/a")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return {**_empty("paired", n, "identical" if mean == 0 else "no spread"), "diff": mean}
    return _finish("paired", n, mean, sd / math.sqrt(n), n - 1)


def compare(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> dict[str, Any]:
    """b against a, each a mapping seed -> value: paired over the shared seeds when both settings ran the same
    seeds (at least 2), else Welch over all values."""
    shared = sorted(set(a) & set(b), key=str)
    if len(shared) >= 2 and set(a) == set(b):
        return paired([b[s] - a[s] for s in shared])
    return welch(list(a.values()), list(b.values()))


def holm(rows: list[dict[str, Any]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Holm's step-down correction, in place, over the rows that are comparisons: each gets p_holm, family,
    detectable and a verdict ("differs", "not shown" or "too few seeds")."""
    tested = sorted((r for r in rows if r.get("p") is not None), key=lambda r: r["p"])
    m, running = len(tested), 0.0
    for i, r in enumerate(tested):
        running = max(running, min(1.0, (m - i) * r["p"]))
        r["p_holm"], r["family"] = running, m
        r["detectable"] = detectable(r["se"], r["df"], alpha / m)
        if r["n"] < MIN_SEEDS:
            r["verdict"] = "too few seeds"
        else:
            r["verdict"] = "differs" if running < alpha else "not shown"
    for r in rows:
        r.setdefault("p_holm", None)
        r.setdefault("family", m)
    return rows


def power_sentence(rows: Sequence[dict[str, Any]], unit: str = "") -> Optional[str]:
    """One sentence on what the design can detect: the range of the family's detectable differences."""
    found = [r["detectable"] for r in rows if r.get("p_holm") is not None and r.get("detectable") is not None]
    if not found:
        return None
    n = sorted({r["n"] for r in rows if r.get("p_holm") is not None})
    seeds = "/".join(str(k) for k in n)
    size = f"{min(found):.3g}" + ("" if f"{min(found):.3g}" == f"{max(found):.3g}" else f" to {max(found):.3g}")
    return (f"Power: with {seeds} seeds per setting and the spread observed, a true difference of "
            f"{size}{unit} (per comparison) would be detected with {POWER:.0%} "
            f"probability at the Holm level alpha/{rows[0].get('family') or 1}; smaller differences may exist "
            f"unseen: 'not shown' is absence of evidence, not evidence of no effect.")
