"""Time the paper code's training step (a CompVis/tread checkout) and ours in one process (tread/cli/compare_paper.py;
`--help` lists every flag).

    python scripts/compare_paper.py /path/to/tread
    python scripts/compare_paper.py /path/to/tread --sizes DiT-S/2:16:32 --precisions fp32 --rounds 5
"""
from tread.cli.compare_paper import main

if __name__ == "__main__":
    main()
