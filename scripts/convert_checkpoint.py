"""Convert old pickle checkpoints to the safetensors format (cli/convert_checkpoint.py; `--help`).

    python scripts/convert_checkpoint.py outputs/runs/<run> --trust
"""
from cli.convert_checkpoint import main

if __name__ == "__main__":
    main()
