"""The metric names of the suite, shared by tread/evaluation/metrics.py (which computes them) and
tread/evaluation/reference.py (which loads what they need from a reference file)."""
from __future__ import annotations

from typing import Iterable, Union

# fdd: DINOv2 features (tread/evaluation/fdd.py); fvd: VideoMAE clip features (tread/evaluation/fvd.py); TOY_METRICS: the built-in data's independent evaluator
# (tread/evaluation/toy_checks.py), networks of their own.
TOY_METRICS = ("fd_ae", "class_acc", "shape_acc", "colour_acc")
METRICS = ("fid", "sfid", "is", "precision", "recall", "kid", "fdd", "fvd", *TOY_METRICS)
ROW_METRICS = ("precision", "recall", "kid")  # need the pool feature rows of samples and reference images


def without_toy(metrics: Iterable[str]) -> tuple[str, ...]:
    """`metrics` less the toy evaluator's (TOY_METRICS), which the main feature network does not compute."""
    return tuple(m for m in metrics if m not in TOY_METRICS)


def check_metrics(metrics: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """Metric names as a tuple without repeats (a single name may be given as a string)."""
    metrics = (metrics,) if isinstance(metrics, str) else tuple(dict.fromkeys(metrics))
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise ValueError(f"metrics={list(metrics)} is not valid: choose a non-empty list from {list(METRICS)}")
    return metrics
