"""Time the training step of a model under several route configs (tread/cli/benchmark.py; `--help` lists every flag).

    python scripts/benchmark.py --arch DiT-S/2 --resolution 16 --channels 4 --batch 32
    python scripts/benchmark.py --arch DiT-XL/2 --tokens 256 --batch 64 --precision bf16 --compile \\
        --routes none paper --sampling --json bench.json
    python scripts/benchmark.py --family all --preset tiny --set train.grad_accum_steps=2
"""
from tread.cli.benchmark import main

if __name__ == "__main__":
    main()
