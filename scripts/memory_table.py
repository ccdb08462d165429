"""Memory per GPU, DDP vs FSDP, full fine-tuning vs LoRA, for every model preset (tread/cli/memory_table.py).

    python scripts/memory_table.py
    python scripts/memory_table.py --world 4 16 --preset flux:dev
"""
from tread.cli.memory_table import main

if __name__ == "__main__":
    main()
