"""Seeds and noise in a sweep report: runs differing only in train.seed form a group reported as mean ± std, and a
declared family of comparisons is tested (paired or Welch, Holm-corrected, with the detectable difference);
docs/ablations.md, "Seeds, budgets and the declared family".
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tread.analysis.along_run import AT, budget_key, budget_name, common_budget, value_at
from tread.analysis.stats import compare, holm

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


def run_seed(summary: dict[str, Any]) -> Optional[int]:
    """The run's train.seed from its overrides (None when not set on the command line)."""
    found = [o.split("=", 1)[1] for o in summary.get("overrides") or [] if re.match(r"^[+~]*train\.seed=", o)]
    return int(found[-1]) if found and found[-1].lstrip("-").isdigit() else None


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


def run_value(run: dict[str, Any], metric: str) -> Optional[float]:
    """A run's `metric`: a summary key ("final_fid", "train_sec"), "final_loss" (final_loss()), "fid@S" (the FID
    evaluated at step S), a metric at a budget ("fid@time=118.5", along_run.value_at) or "final_<eval metric>"
    (the last evaluation's value where the summary does not hold it, e.g. final_fd_ae)."""
    if AT.match(metric):
        v = value_at(run, metric)
    elif metric.startswith("fid@"):
        v = fid_at(run, int(metric[4:]))
    elif metric == "final_loss":
        v = final_loss(run)
    elif run["summary"].get(metric) is None and metric.startswith("final_"):
        found = [r[metric[6:]] for r in run["records"] if r.get("type") == "eval" and r.get(metric[6:]) is not None]
        v = found[-1] if found else None
    else:
        v = run["summary"].get(metric)
    return None if v is None else float(v)


@dataclass
class Group:
    """The completed runs of one setting."""

    key: tuple[str, ...]
    label: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def values(self, metric: str) -> list[float]:
        """The runs' `metric` (run_value), those that have it."""
        return [v for v in (run_value(r, metric) for r in self.runs) if v is not None]

    def by_seed(self, metric: str) -> dict[Any, float]:
        """The runs' `metric` by train.seed (a run without a seed on its command line keys by its folder, so it
        pairs with nothing)."""
        out: dict[Any, float] = {}
        for r in self.runs:
            v = run_value(r, metric)
            seed = run_seed(r["summary"])
            if v is not None:
                out[seed if seed is not None else ("run", r["run"])] = v
        return out

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


def declared_pairs(groups: Sequence[Group], spec: Sequence[str] = ()) -> list[tuple[Group, Group]]:
    """The family of comparisons: "B:A" specs (each setting B against its baseline A, by label), or by default
    every other setting against the first (the baseline: the lowest selection ratio in a ratio sweep). A label
    that names no setting is a ReportError-style ValueError naming the labels there are."""
    by_label = {g.label: g for g in groups}
    if not spec:
        return [(groups[0], g) for g in groups[1:]]
    pairs = []
    for item in spec:
        b, _, a = item.partition(":")
        bad = [x for x in (a, b) if x not in by_label]
        if bad or not a:
            raise ValueError(f"--compare {item!r}: give B:A with both labels among the settings "
                             f"{sorted(by_label)} (B is compared against its baseline A)")
        pairs.append((by_label[a], by_label[b]))
    return pairs


def comparisons(groups: Sequence[Group], metric: str, spec: Sequence[str] = (),
                axis: Optional[str] = None) -> list[dict[str, Any]]:
    """The declared family compared on `metric` (mean of B minus mean of A): paired or Welch, Holm-corrected. With
    `axis` ("step" | "time" | "flops") each pair is read at the largest budget both settings reached."""
    rows = []
    for a, b in declared_pairs(groups, spec):
        key = metric
        if axis is not None:
            x = common_budget(a.runs + b.runs, axis)
            key = budget_key(metric, axis, x if x is not None else 0.0)   # None: a run without evaluations
        rows.append({"a": a.label, "b": b.label, "metric": key, **compare(a.by_seed(key), b.by_seed(key))})
    return holm(rows)


def _num(x: Optional[float], digits: str = ".2f") -> str:
    return "-" if x is None else format(x, digits)


def _digits(metric: str) -> str:
    """Decimals a metric is printed with: losses (~0.1) need four, FIDs two."""
    name = metric.split("@")[0].removeprefix("final_")
    return ".4f" if name in ("loss", "class_acc", "shape_acc", "colour_acc") else ".2f"


def describe(metric: str) -> str:
    """A metric's display name: 'final_fid' -> 'final FID', 'fd_ae' -> 'FD (autoencoder)'."""
    return NAMES.get(metric) or metric.replace("_", " ").replace("fid", "FID")


NAMES = {"fd_ae": "FD (autoencoder)", "class_acc": "class accuracy", "shape_acc": "shape accuracy",
         "colour_acc": "colour accuracy", "fdd": "FDD", "fid": "FID"}


def metric_name(metric: str) -> str:
    """The display name of a metric key: 'fid@342' -> 'FID at step 342', 'fid@time=118' -> 'FID at 118.0 s of
    training', 'final_fd_ae' -> 'final FD (autoencoder)'."""
    if AT.match(metric):
        return budget_name(metric, describe)
    if metric.startswith("fid@"):
        return f"FID at step {metric[4:]}"
    return "final " + describe(metric[6:]) if metric.startswith("final_") else describe(metric)


def group_table(groups: Sequence[Group], metrics: Sequence[str]) -> list[str]:
    """Markdown: one row per group: n, each metric's mean ± std [min..max], mean steps, training time and the
    whole-run token share (group_tokens)."""
    head = ["setting", "seeds"] + [f"{metric_name(m)} (mean ± std [min..max])" for m in metrics] + \
        ["steps", "training time (s)", "tokens processed (whole run)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        have = len(g.values(metrics[0])) if metrics else len(g.runs)
        cells = [g.label, str(len(g.runs)) if have == len(g.runs) else f"{have} of {len(g.runs)}"]
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
    """Markdown: each declared comparison's test (paired or Welch) and seeds, difference with its 95% interval,
    t, p, Holm-adjusted p over the family, the difference detectable with 80% power, and the verdict."""
    head = ["metric", "A (baseline)", "B", "test, seeds", "difference B - A [95% CI]", "t (df)", "p",
            "p Holm (family)", "detectable (80%)", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        d = _digits(r["metric"])
        ci = "" if r["ci"] is None else f" [{r['ci'][0]:+{d}}, {r['ci'][1]:+{d}}]"
        t = "-" if r["t"] is None else f"{r['t']:.2f} ({r['df']:.1f})"
        p = "-" if r["p"] is None else f"{r['p']:.3g}"
        ph = "-" if r.get("p_holm") is None else f"{r['p_holm']:.3g} ({r['family']})"
        lines.append(f"| {metric_name(r['metric'])} | {r['a']} | {r['b']} | {r['test']}, {r['n']} | "
                     f"{_num(r['diff'], '+' + d)}{ci} | {t} | {p} | {ph} | {_num(r['detectable'], d)} | "
                     f"{r['verdict']} |")
    return lines
