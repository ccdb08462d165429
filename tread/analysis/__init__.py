"""The offline analysis of finished runs: a sweep's table and plots, seed groups with their paired statistics
(Holm-corrected, with power), metrics read at equal steps, measured time or FLOPs (scripts/ablation_report.py)."""
