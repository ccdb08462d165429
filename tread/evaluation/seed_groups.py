"""Seeds and noise in a sweep report: runs that differ only in train.seed form a group; each group's metric is
reported as mean ± sample std over its seeds, and every pair of groups is compared with Welch's t-test, so a
report says which differences exceed the seed noise (|t| above the two-sided 95% Student-t critical value for
Welch's degrees of freedom) and which do not.

A run's metrics: its final FID (summary.json), its final training loss (the mean logged loss over the last tenth of
its steps, metrics.jsonl) and, for --at-step S, its FID at evaluation step S (metrics.jsonl), which compares runs
that trained for equal time at equal steps.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from scipy import stats as scipy_stats

NOT_SETTING = re.compile(r"^[+~]*(train\.seed|resume)=")


def group_key(summary: dict[str, Any]) -> tuple[str, ...]:
    """The run's command-line overrides that define its setting: without its seed and without `resume=` (a
    resumed run is the same run), sorted (runs of separate multiruns group alike)."""
    return tuple(sorted(o for o in summary.get("overrides") or [] if not NOT_SETTING.match(o)))


def final_loss(run: dict[str, Any]) -> Optional[float]:
    """The mean of the training losses logged over the last tenth of the run's steps (at least the last record):
    the end of its loss curve, less noisy than one logging window."""
    train = [r for r in run["records"] if r.get("type") == "train" and r.get("loss") is not None]
    if not train:
        return None
    last = train[-1]["step"]
    tail = [float(r["loss"]) for r in train if r["step"] > 0.9 * last] or [float(train[-1]["loss"])]
    return statistics.fmean(tail)


def fid_at(run: dict[str, Any], step: int) -> Optional[float]:
    """The run's FID at evaluation step `step` (None when it was not evaluated there)."""
    found = [r["fid"] for r in run["records"] if r.get("type") == "eval" and r.get("step") == step
             and r.get("fid") is not None]
    return float(found[-1]) if found else None


def run_tokens(summary: dict[str, Any]) -> tuple[Optional[float], str]:
    """A run's token share over its whole run (the measured one where recorded) and, for a summary.json written
    before the whole-run keys, what the fallback covers: "" (the whole run), "one launch" (a resumed run's
    tokens_fraction_measured) or "start phase" (tokens_fraction of a routing schedule's first phase)."""
    for key in ("tokens_fraction_measured_run", "tokens_fraction_run"):
        if summary.get(key) is not None:
            return float(summary[key]), ""
    if summary.get("tokens_fraction_measured") is not None:
        return float(summary["tokens_fraction_measured"]), "one launch" if summary.get("start_step") else ""
    share = summary.get("tokens_fraction")
    return (None, "") if share is None else (float(share), "start phase" if summary.get("schedule") else "")


@dataclass
class Group:
    """The completed runs of one setting."""

    key: tuple[str, ...]
    label: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def values(self, metric: str) -> list[float]:
        """The runs' `metric`: "final_fid" (or any summary key), "fid@S" or "final_loss" (final_loss())."""
        if metric.startswith("fid@"):
            got = [fid_at(r, int(metric[4:])) for r in self.runs]
        elif metric == "final_loss":
            got = [final_loss(r) for r in self.runs]
        else:
            got = [r["summary"].get(metric) for r in self.runs]
        return [float(v) for v in got if v is not None]

    def mean(self, metric: str) -> Optional[float]:
        v = self.values(metric)
        return statistics.fmean(v) if v else None

    def std(self, metric: str) -> Optional[float]:
        v = self.values(metric)
        return statistics.stdev(v) if len(v) > 1 else None


def seed_groups(runs: Sequence[dict[str, Any]]) -> list[Group]:
    """Completed runs grouped by group_key, labelled by the overrides that tell the groups apart, in the
    order of their first run (sorted by selection ratio where the runs have one)."""
    done = [r for r in runs if r["summary"].get("status") == "completed"]
    groups: dict[tuple[str, ...], Group] = {}
    for run in done:
        key = group_key(run["summary"])
        groups.setdefault(key, Group(key, "")).runs.append(run)
    shared = set.intersection(*(set(k) for k in groups)) if groups else set()
    for g in groups.values():
        g.label = " ".join(short(o) for o in g.key if o not in shared) or "all runs"
    return list(groups.values())


SHORT = (("experiment=", ""), ("routing.routes.0.selection_ratio=", "ratio "), ("train.max_steps=", "steps "))


def short(override: str) -> str:
    """A label's part: 'experiment=study_tread' -> 'study_tread', 'routing.routes.0.selection_ratio=0.5' ->
    'ratio 0.5', 'train.max_steps=858' -> 'steps 858'; other overrides as they are."""
    for prefix, name in SHORT:
        if override.startswith(prefix):
            return name + override[len(prefix):]
    return override


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Welch's t-test of mean(b) - mean(a): difference, standard error, t, degrees of freedom, the two-sided
    95% critical value and the verdict ("exceeds noise" | "within noise" | "n/a" with fewer than 2 runs each)."""
    if len(a) < 2 or len(b) < 2:
        return {"diff": None, "se": None, "t": None, "df": None, "crit": None, "verdict": "n/a"}
    ma, mb, va, vb = statistics.fmean(a), statistics.fmean(b), statistics.variance(a), statistics.variance(b)
    se = math.sqrt(va / len(a) + vb / len(b))
    diff = mb - ma
    if se == 0:
        return {"diff": diff, "se": 0.0, "t": None, "df": None, "crit": None,
                "verdict": "exceeds noise" if diff else "within noise"}
    df = se ** 4 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    crit = float(scipy_stats.t.ppf(0.975, df))
    t = diff / se
    return {"diff": diff, "se": se, "t": t, "df": df, "crit": crit,
            "verdict": "exceeds noise" if abs(t) > crit else "within noise"}


def comparisons(groups: Sequence[Group], metric: str) -> list[dict[str, Any]]:
    """Every pair of groups (i < j) compared on `metric` (mean of the second minus mean of the first)."""
    return [{"a": a.label, "b": b.label, "metric": metric, **welch(a.values(metric), b.values(metric))}
            for i, a in enumerate(groups) for b in groups[i + 1:]]


def _num(x: Optional[float], digits: str = ".2f") -> str:
    return "-" if x is None else format(x, digits)


def _digits(metric: str) -> str:
    """Decimals a metric is printed with: losses (~0.1) need four, FIDs two."""
    return ".4f" if metric == "final_loss" else ".2f"


def metric_name(metric: str) -> str:
    return f"FID at step {metric[4:]}" if metric.startswith("fid@") else metric.replace("_", " ").replace("fid", "FID")


def group_table(groups: Sequence[Group], metrics: Sequence[str]) -> list[str]:
    """Markdown: one row per group: n, each metric's mean ± std [min..max], mean steps, training time and the
    whole-run token share (group_tokens)."""
    head = ["setting", "seeds"] + [f"{metric_name(m)} (mean ± std [min..max])" for m in metrics] + \
        ["steps", "training time (s)", "tokens processed (whole run)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [g.label, str(len(g.runs))]
        for m in metrics:
            v = g.values(m)
            d = _digits(m)
            cells.append(f"{_num(g.mean(m), d)} ± {_num(g.std(m), d)} [{_num(min(v), d)}..{_num(max(v), d)}]"
                         if v else "-")
        cells += [_num(g.mean("final_step"), ".0f"), _num(g.mean("train_sec"), ".0f"), group_tokens(g)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def group_tokens(g: Group) -> str:
    """The group's mean whole-run token share, e.g. "70.8%", with what older summaries cover where they fall back
    (run_tokens), e.g. "70.8% (start phase)"."""
    got = [run_tokens(r["summary"]) for r in g.runs]
    shares, notes = [v for v, _ in got if v is not None], sorted({n for _, n in got if n})
    if not shares:
        return "-"
    return f"{100 * statistics.fmean(shares):.1f}%" + (f" ({', '.join(notes)})" if notes else "")


def comparison_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: each pair's difference, its standard error, Welch's t against the 95% critical value, verdict."""
    head = ["metric", "A", "B", "difference (B - A)", "std. error", "Welch t (95% critical)", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = "-" if r["t"] is None else f"{r['t']:.2f} ({r['crit']:.2f}, df {r['df']:.1f})"
        d = _digits(r["metric"])
        lines.append(f"| {metric_name(r['metric'])} | {r['a']} | {r['b']} | {_num(r['diff'], '+' + d)} | "
                     f"{_num(r['se'], d)} | {t} | {r['verdict']} |")
    return lines
