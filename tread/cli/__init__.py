"""The command-line programs behind train.py, sample.py, fid.py and scripts/: argument parsing, one-line
errors, and orchestration across packages. The entry points and scripts are thin wrappers around these."""
