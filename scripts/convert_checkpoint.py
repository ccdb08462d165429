"""Convert old pickle checkpoints to the safetensors format (tread/cli/convert_checkpoint.py; `--help`).

    python scripts/convert_checkpoint.py outputs/runs/<run> --trust
"""
from tread.cli.convert_checkpoint import main

if __name__ == "__main__":
    main()
