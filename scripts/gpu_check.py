"""The GPU figures in one command (`make gpu-check`; tread/cli/gpu_check.py, `--help` for the flags). It runs with
the machine's own Python; where the project is not pip-installed, the repo root goes on PYTHONPATH (the Makefile
does that).

    PYTHONPATH=. python3 scripts/gpu_check.py --wheels .whl --paper-dir ../tread
"""
import sys

from tread.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
