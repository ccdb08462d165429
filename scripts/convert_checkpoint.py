"""Convert old pickle checkpoints to the safetensors format, or a checkpoint between the single and sharded layouts
(tread/cli/convert_checkpoint.py; `--help`).

    python scripts/convert_checkpoint.py outputs/runs/<run> --trust
    python scripts/convert_checkpoint.py STEP_DIR --layout single --out NEW_STEP_DIR
"""
from tread.cli.convert_checkpoint import main

if __name__ == "__main__":
    main()
