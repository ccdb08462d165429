"""Try a run's exported adapter in the family's diffusers pipeline (tread/cli/diffusers_pipeline.py; `--help`).

    python scripts/diffusers_pipeline.py outputs/example/flux_lokr --prompts "a red disc" "a blue triangle"
"""
from tread.cli.diffusers_pipeline import main

if __name__ == "__main__":
    main()
