"""Tables and plots of a route sweep: one row per run, FID against selection ratio, time and FLOPs.

    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5,0.75     # writes outputs/multirun/<date>/<job>/
    python scripts/ablation_report.py outputs/multirun/<date>               # -> <sweep>/report/

Reads every run under SWEEP_DIR with a summary.json; writes report.md, report.csv (failed runs included)
and, with matplotlib, FID-vs-ratio/time/FLOPs and loss plots.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from tread.cli.args import MAX_STEPS, Parser, int_in
from tread.analysis.sweep_report import (README_END, README_START, Budgets, ReportError, add_fid_at, budget_keys,
                                           group_section, load_runs, row, update_readme, write_group_plot, write_plots,
                                           write_tables)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line: SWEEP_DIR, --out, --no-plots, --readme, --marker and --at-step."""
    p = Parser(prog="ablation_report.py", description=__doc__, error_type=ReportError)
    p.add_argument("sweep_dir", help="a multirun sweep folder (or a single run directory)")
    p.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR/report)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--readme", default=None, help=f"also write a compact table and the plots into this Markdown "
                   f"file, between the lines {README_START} and {README_END}")
    p.add_argument("--marker", default=None, metavar="NAME", help="with --readme: fill the block between "
                   "<!-- ablation-report:NAME:start --> and <!-- ablation-report:NAME:end --> instead (several "
                   "report blocks in one file)")
    p.add_argument("--at-step", type=int_in(0, MAX_STEPS), action="append", default=[], metavar="S",
                   help="also report each run's FID at evaluation step S and, over seeds, its statistics "
                        "(repeatable; e.g. the equal-steps point of runs trained for equal time)")
    p.add_argument("--at-time", default=None, metavar="SECONDS|auto", help="over seeds: every metric at equal "
                   "MEASURED training time, interpolated along each run's evaluations (auto: the largest time "
                   "every run reaches)")
    p.add_argument("--at-flops", default=None, metavar="FLOPS|auto", help="the same at equal training FLOPs")
    p.add_argument("--metric", action="append", default=[], metavar="NAME", help="evaluated metrics to report "
                   "over seeds (repeatable; default fid; e.g. fd_ae, class_acc, shape_acc, colour_acc)")
    p.add_argument("--compare", action="append", default=[], metavar="B:A", help="the declared family: setting "
                   "B against its baseline A, by label (repeatable; default: every setting against the first)")
    return p.parse_args(argv)


def _budget(value: Optional[str], flag: str) -> Optional[Union[str, float]]:
    """--at-time / --at-flops: None, "auto" or a positive number (else one error line)."""
    if value is None or value == "auto":
        return value
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not x > 0:
        raise ReportError(f"{flag}={value!r}: give a positive number or 'auto'")
    return x


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Report on a sweep: tables, plots and optionally the README block; prints the Markdown table and what
    was written. A sweep that cannot be reported on raises ReportError (the script prints it as `error: ...`)."""
    args = parse_args(argv)
    sweep = Path(args.sweep_dir).expanduser()
    runs = load_runs(sweep)
    if not runs:
        raise ReportError(f"no runs under '{sweep}': no summary.json was found. Point at the sweep folder that "
                          f"train.py -m wrote (hydra.sweep.dir, e.g. outputs/multirun/<date>_<time>).")
    rows = [row(r) for r in runs]
    extra = add_fid_at(rows, runs, args.at_step)
    budgets = Budgets(args.at_step, _budget(args.at_time, "--at-time"), _budget(args.at_flops, "--at-flops"),
                      list(dict.fromkeys(["fid", *args.metric])), args.compare)
    try:
        groups, groups_md = group_section(runs, budgets)
    except ValueError as err:      # a --compare label that names no setting
        raise ReportError(str(err)) from None
    out = Path(args.out) if args.out else sweep / "report"
    md, csv_path = write_tables(rows, out, extra, groups_md)
    finished = [r for r in rows if r["status"] == "completed"]
    plots = [] if args.no_plots or not finished else write_plots(runs, out, groups)
    if groups_md and not args.no_plots:
        plots.append(write_group_plot(groups, [keys[0] for _, keys, _ in budget_keys(groups, budgets)], out))
    print(md.read_text())
    if not finished:
        print(f"No finished runs under '{sweep}' ({len(rows)} run(s): "
              f"{', '.join(sorted({r['status'] for r in rows}))}); nothing to plot.", file=sys.stderr)
    if args.readme:
        command = "python scripts/ablation_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
        update_readme(Path(args.readme), rows, plots, command, args.marker, groups_md)
    print(f"wrote {md}, {csv_path}" + "".join(f", {p}" for p in plots) + (f", {args.readme}" if args.readme else ""))
    return {"rows": rows, "markdown": str(md), "csv": str(csv_path), "plots": [str(p) for p in plots]}
