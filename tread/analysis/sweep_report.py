"""Tables and plots of a route sweep (the library behind scripts/ablation_report.py): one row per run directory
with a summary.json (failed jobs included), report.md / report.csv, the FID plots and a compact README table.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from tread.analysis.along_run import budget_key, common_budget, elapsed, flops_at
from tread.analysis.seed_groups import (Group, comparison_table, comparisons, fid_at, group_table, metric_name,
                                         run_tokens, seed_groups)
from tread.analysis.stats import power_sentence
from tread.utils.errors import UserError
from tread.utils.readers import FileFormatError, parse_json, read_json

COLUMNS = ["run", "status", "overrides", "selection_ratio", "routes", "phases", "tokens_fraction",
           "tokens_fraction_run", "run_values", "final_step", "final_fid", "best_fid", "steps_per_sec",
           "images_per_sec", "train_flops_per_step", "train_flops_total", "train_flops_run", "train_sec", "wall_sec",
           "stop_reason", "error"]
# tokens_fraction, train_flops_per_step: a schedule's start phase; tokens_fraction_run (measured where recorded),
# train_flops_run: the whole run; run_values: what an older summary.json's fallback covers (seed_groups.run_tokens).
# The compact table --readme writes (label, key in the row).
README_COLUMNS = [("selection ratio", "selection_ratio"), ("routes", "routes"),
                  ("tokens processed (whole run)", "tokens_fraction_run"), ("steps", "final_step"),
                  ("steps/s", "steps_per_sec"), ("training time (s)", "train_sec"), ("training FLOPs", "train_flops_run"), ("final FID", "final_fid"), ("best FID", "best_fid")]
README_START, README_END = "<!-- ablation-report:start -->", "<!-- ablation-report:end -->"


class ReportError(UserError):
    """The sweep directory cannot be reported on; the message says why and what to do."""


def load_runs(sweep: Path) -> list[dict[str, Any]]:
    """One record per run directory under `sweep`: its summary.json plus the parsed metrics.jsonl."""
    if not sweep.is_dir():
        raise ReportError(f"sweep directory '{sweep}' not found: pass the folder of a multirun sweep "
                          f"(outputs/multirun/<date>_<time>) or of a single run.")
    runs = []
    for path in sorted(sweep.rglob("summary.json")):
        if "report" in path.relative_to(sweep).parts[:-1]:
            continue
        try:
            summary = read_json(path, "summary.json")
        except FileFormatError as err:
            summary = {"status": "failed", "error": f"unreadable {err}"}
        records = []
        metrics = path.parent / "metrics.jsonl"
        if metrics.is_file():
            for number, line in enumerate(metrics.read_text().splitlines(), 1):
                try:
                    records.append(parse_json(line, f"{metrics} line {number}"))
                except FileFormatError:
                    continue  # a line cut short by a crash
        name = str(path.parent.relative_to(sweep)) if path.parent != sweep else sweep.name
        runs.append({"run": name, "dir": path.parent, "summary": summary, "records": records})
    return runs


def selection_ratio(summary: dict[str, Any]) -> Optional[float]:
    """The first route's selection ratio (0 for dense runs), or None when unknown."""
    if "routes" not in summary:
        return None
    routes = summary["routes"] or []
    return float(routes[0]["selection_ratio"]) if routes else 0.0


def row(run: dict[str, Any]) -> dict[str, Any]:
    """The table row (COLUMNS) of a run: its summary's values plus status, overrides, ratio, routes and the
    whole-run values (older summaries: their fallbacks, run_values saying what they cover)."""
    s = run["summary"]
    routes = "; ".join(f"{r['selection_ratio']:g} @ {r['start_layer_idx']}..{r['end_layer_idx']}"
                       for r in s.get("routes") or []) or ("dense" if "routes" in s else "")
    out = {"run": run["run"], "status": s.get("status", "unknown"), "overrides": " ".join(s.get("overrides") or []),
           "selection_ratio": selection_ratio(s), "routes": routes, "error": s.get("error", ""),
           "phases": phases(s)}
    out["tokens_fraction_run"], note = run_tokens(s)
    out["run_values"] = note      # "" or what an older summary's token share covers: "one launch", "start phase"
    out["train_flops_run"] = s.get("train_flops_run", s.get("train_flops_total"))   # train_flops_total: whole run
    for key in COLUMNS:
        out.setdefault(key, s.get(key))
    return out


def phases(summary: dict[str, Any]) -> str:
    """A routing schedule's phases, e.g. '0-419: 0.5 @ 2..8; 420-: none (dense)' ('' without a schedule)."""
    return "; ".join(f"{p['start_step']}-{'' if p.get('end_step') is None else p['end_step'] - 1}: {p['routes']}"
                     for p in summary.get("schedule") or [])


def fmt(value: Any) -> str:
    """A Markdown table cell: "-" for nothing, 4 significant digits, GF / TF for FLOP counts."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1e9:
            return f"{value / 1e12:.3g} TF" if abs(value) >= 1e12 else f"{value / 1e9:.3g} GF"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")[:160]


def add_fid_at(rows: list[dict[str, Any]], runs: list[dict[str, Any]], steps: list[int]) -> list[str]:
    """Add each run's FID at evaluation step S (--at-step) as column fid_at_S ("no evaluation at step S" when the
    run was not evaluated there); returns the new column names."""
    for r, run in zip(rows, runs):
        for step in steps:
            value = fid_at(run, step)
            r[f"fid_at_{step}"] = value if value is not None else f"no evaluation at step {step}"
    return [f"fid_at_{step}" for step in steps]


@dataclass
class Budgets:
    """What the seed groups are compared at (ablation_report's options): steps, measured time and FLOPs ("auto",
    a number or None), the metrics, and the declared family."""

    steps: Sequence[int] = ()
    time: Optional[Union[str, float]] = None
    flops: Optional[Union[str, float]] = None
    metrics: Sequence[str] = ("fid",)
    compare: Sequence[str] = ()


def budget_keys(groups: Sequence[Group], budgets: Budgets) -> list[tuple[str, list[str], Optional[str]]]:
    """(title, metric keys, axis) per budget: the final values, each --at-step step, equal time, equal FLOPs. The
    axis is set for an "auto" budget: its keys are at the largest budget every run reached (the groups' table),
    while each declared comparison is read at the largest budget both of its settings reached (comparisons)."""
    runs = [r for g in groups for r in g.runs]
    out: list[tuple[str, list[str], Optional[str]]] = [
        ("final", ["final_" + m for m in budgets.metrics] + ["final_loss"], None)]
    out += [(f"step {s}", [budget_key(m, "step", s) for m in budgets.metrics], None) for s in budgets.steps]
    for axis, value in (("time", budgets.time), ("flops", budgets.flops)):
        x = common_budget(runs, axis) if value == "auto" else value
        if x is not None:
            out.append((f"equal {axis}", [budget_key(m, axis, float(x)) for m in budgets.metrics],
                        axis if value == "auto" else None))
    return out


def group_section(runs: list[dict[str, Any]], budgets: Budgets) -> tuple[list[Group], list[str]]:
    """The seed groups of the completed runs and, when some setting has several seeds, the Markdown of their
    statistics per budget and of the declared comparisons (one Holm family per metric and budget; the power
    sentence for FID at equal time, else at the end: the primary family) (tread/analysis/seed_groups.py)."""
    groups = seed_groups(runs)
    if not any(len(g.runs) > 1 for g in groups):
        return groups, []
    md: list[str] = []
    families, primary = [], []
    for title, keys, axis in budget_keys(groups, budgets):
        note = " (each comparison below: at the largest one both of its settings reached)" if axis else ""
        md += [f"**{title[0].upper() + title[1:]}** ({metric_name(keys[0])}{note}):", "",
               *group_table(groups, keys), ""]
        if axis:
            families += [comparisons(groups, m, budgets.compare, axis) for m in budgets.metrics]
        else:
            families += [comparisons(groups, k, budgets.compare) for k in keys]
        if title in ("final", "equal time"):
            primary = families[-len(keys)]      # the first metric (FID) at equal time, else at the end
    md += ["Declared comparisons (each setting B against its baseline A; mean of B minus mean of A): paired t over "
           "shared seeds, else Welch; 95% interval; Holm over each metric's family at each budget; a difference is "
           "claimed ('differs') only with Holm-adjusted p < 0.05 and at least 5 seeds per setting:", "",
           *comparison_table([r for f in families for r in f])]
    sentence = power_sentence(primary)
    return groups, md + (["", sentence] if sentence else [])


def write_tables(rows: list[dict[str, Any]], out: Path, extra: Optional[list[str]] = None,
                 groups_md: Optional[list[str]] = None) -> tuple[Path, Path]:
    """report.csv (every column) and report.md (without the errors, which follow the table) in `out`; `extra`
    columns (--at-step) and the seed groups' section are added when given."""
    out.mkdir(parents=True, exist_ok=True)
    columns = COLUMNS + list(extra or [])
    with open(out / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows([{k: r.get(k) for k in columns} for r in rows])
    shown = [c for c in columns if c != "error" and (c != "phases" or any(r.get("phases") for r in rows))]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in shown) + " |")
    failed = [r for r in rows if r["status"] != "completed"]
    if failed:
        lines += ["", "Runs that did not complete:", ""]
        lines += [f"- `{r['run']}` ({r['status']}): {fmt(r['error'])}" for r in failed]
    if groups_md:
        lines += ["", "## Seeds", "", *groups_md]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md", out / "report.csv"


def evals(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's evaluation records that have a FID."""
    return [r for r in run["records"] if r.get("type") == "eval" and r.get("fid") is not None]


def write_plots(runs: list[dict[str, Any]], out: Path, groups: Sequence[Group] = ()) -> list[Path]:
    """fid_vs_ratio.png (when each selection ratio is one run), fid_vs_time.png, fid_vs_flops.png and loss.png of
    the completed runs (those with data). With seed `groups`, the runs of one setting share a colour and a legend
    entry."""
    # Lazy: matplotlib is a heavy optional dependency, needed only for the plots (--no-plots skips them).
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r["summary"].get("status") == "completed"]
    paths = []
    styles = _styles(done, groups)

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)

    points = sorted((selection_ratio(r["summary"]), r["summary"].get("final_fid"), r["summary"].get("best_fid"))
                    for r in done if selection_ratio(r["summary"]) is not None and r["summary"].get("final_fid") is not None)
    if points and len({p[0] for p in points}) == len(points):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="final FID")
        ax.plot([p[0] for p in points], [p[2] for p in points], "s--", label="best FID")
        ax.set_xlabel("selection ratio (fraction of tokens dropped)")
        ax.set_ylabel("FID")
        ax.legend()
        save(fig, "fid_vs_ratio.png")
    for name, xlabel, xs in (("fid_vs_time.png", "training time (s, evaluations excluded)",
                              lambda run, e: elapsed(run, e)),
                             ("fid_vs_flops.png", "training FLOPs (theoretical)",
                              lambda run, e: flops_at(run["summary"], e["step"]))):
        curves = [(r, evals(r)) for r in done if evals(r)]
        if curves:
            fig, ax = _curves(plt, [(r, [xs(r, e) for e in es], [e["fid"] for e in es]) for r, es in curves],
                              styles, "o-", xlabel, "FID")
            if name == "fid_vs_flops.png":
                ax.set_xscale("log")
            save(fig, name)
    losses = [(r, [x for x in r["records"] if x.get("type") == "train"]) for r in done]
    # The diffusion term: a REPA run's `loss` also holds its (negative) alignment term.
    losses = [(r, [x["step"] for x in xs], [x.get("diffusion_loss", x["loss"]) for x in xs]) for r, xs in losses if xs]
    if losses:
        fig, ax = _curves(plt, losses, styles, "-", "step", "training loss (diffusion term)")
        ax.set_yscale("log")
        save(fig, "loss.png")
    return paths


def _styles(done: list[dict[str, Any]], groups: Sequence[Group]) -> dict[str, tuple[Optional[str], Optional[str]]]:
    """Each run's (colour, legend label): by seed group when some setting has several seeds (one colour and one
    legend entry per setting), else one per run labelled by the overrides that tell the runs apart."""
    if any(len(g.runs) > 1 for g in groups):
        return {r["run"]: (f"C{i % 10}", g.label if k == 0 else None)
                for i, g in enumerate(groups) for k, r in enumerate(g.runs)}
    shared = frozenset.intersection(*(frozenset(r["summary"].get("overrides") or []) for r in done)) \
        if len(done) > 1 else frozenset()
    return {r["run"]: (None, _label(r, shared)) for r in done}


def _curves(plt, curves: list[tuple[dict[str, Any], list[float], list[float]]], styles: dict, fmt: str,
            xlabel: str, ylabel: str):
    """One figure of per-run curves (run, xs, ys) in their styles."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for run, xs, ys in curves:
        color, label = styles.get(run["run"], (None, run["run"]))
        ax.plot(xs, ys, fmt, color=color, label=label, alpha=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return fig, ax


def write_group_plot(groups: list[Group], keys: Sequence[str], out: Path) -> Optional[Path]:
    """fid_by_setting.png: each setting's FID at each budget key (budget_keys: final, steps, equal time and FLOPs)
    as mean ± std over its seeds, with every seed's value; against the selection ratio when the settings differ
    only by it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [(k, metric_name(k)) for k in keys]
    ratios = [selection_ratio(g.runs[0]["summary"]) for g in groups]
    by_ratio = None not in ratios and len(set(ratios)) == len(groups) and all("ratio" in g.label for g in groups)
    xs = ratios if by_ratio else list(range(len(groups)))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(groups)), 3.8))
    for k, (metric, name) in enumerate(metrics):
        shift = (k - (len(metrics) - 1) / 2) * (0.012 if by_ratio else 0.15)
        for i, g in enumerate(groups):
            v = g.values(metric)
            if not v:
                continue
            x = xs[i] + shift
            ax.errorbar([x], [g.mean(metric)], yerr=[g.std(metric) or 0.0], fmt="os"[k % 2], color=f"C{k}",
                        capsize=4, label=name if i == 0 else None)
            ax.plot([x] * len(v), v, ".", color=f"C{k}", alpha=0.5)
    if by_ratio:
        ax.set_xlabel("selection ratio (fraction of tokens dropped)")
    else:
        ax.set_xticks(xs, [g.label for g in groups], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("FID (mean ± std over seeds; dots: seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fid_by_setting.png", dpi=120)
    plt.close(fig)
    return out / "fid_by_setting.png"


def _label(run: dict[str, Any], shared: frozenset = frozenset()) -> str:
    """The run's overrides without those every plotted run shares (e.g. experiment=...), or its folder name."""
    return " ".join(o for o in run["summary"].get("overrides") or [] if o not in shared) or run["run"]


def markers(name: Optional[str] = None) -> tuple[str, str]:
    """The block's marker lines: README_START/README_END, or for --marker NAME 'ablation-report:NAME:start/end'."""
    if not name:
        return README_START, README_END
    return f"<!-- ablation-report:{name}:start -->", f"<!-- ablation-report:{name}:end -->"


def update_readme(readme: Path, rows: list[dict[str, Any]], plots: list[Path], command: str,
                  marker: Optional[str] = None, groups_md: Optional[list[str]] = None) -> None:
    """Replace the block between the marker lines (markers(marker)) in `readme` with the compact table of the
    completed runs (sorted by selection ratio) or, with seeds, the groups' statistics and comparisons
    (`groups_md`), the plots (as links relative to the README) and `command`. The rest is left byte-identical."""
    start, end = markers(marker)
    text = readme.read_text() if readme.is_file() else ""
    lines_in = text.splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines_in) if line.strip() in (start, end)]
    if [lines_in[i].strip() for i in marks] != [start, end]:
        raise ReportError(f"--readme '{readme}' needs one '{start}' line and one '{end}' line after "
                          f"it (each on a line of its own) around the block to fill; found {len(marks)} marker "
                          f"line(s).")
    done = sorted((r for r in rows if r["status"] == "completed"),
                  key=lambda r: (r["selection_ratio"] is None, r["selection_ratio"] or 0.0, r["run"]))
    lines = [f"<!-- generated by: {command} -->", "",
             "| " + " | ".join(label for label, _ in README_COLUMNS) + " |", "|" + "---|" * len(README_COLUMNS)]
    for r in done:
        cells = [fmt(r.get(key)) if key != "tokens_fraction_run" or r.get(key) is None else
                 f"{100 * r[key]:.1f}%" + (f" ({r['run_values']})" if r["run_values"] else "")
                 for _, key in README_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    if groups_md:
        lines = lines[:2] + groups_md
    failed = [r for r in rows if r["status"] != "completed"]
    if failed:
        lines += ["", "Runs that did not complete: " + "; ".join(f"`{r['run']}` ({fmt(r['error'])})" for r in failed)]
    if plots:
        lines += [""] + [f"![{p.stem}]({os.path.relpath(p, readme.parent)})" for p in plots]
    head, tail = "".join(lines_in[:marks[0] + 1]), "".join(lines_in[marks[1]:])
    readme.write_text(head + "\n".join(lines) + "\n" + tail)
