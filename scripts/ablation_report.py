"""Tables and plots of a route sweep (tread/cli/ablation_report.py; the library is tread/analysis/sweep_report.py).

    python train.py -m routing.routes.0.selection_ratio=0,0.25,0.5,0.75     # writes outputs/multirun/<date>/<job>/
    python scripts/ablation_report.py outputs/multirun/<date>               # -> <sweep>/report/
"""
import sys

from tread.cli.ablation_report import ReportError, main

if __name__ == "__main__":
    try:
        main()
    except ReportError as err:
        sys.exit(f"error: {err}")
