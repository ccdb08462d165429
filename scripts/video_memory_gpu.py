"""Peak CUDA memory of Wan `mid`'s checkpointed training step at several latent frame counts, routing=none vs
paper (tread/cli/video_memory_gpu.py; `--help` for the flags).

    PYTHONPATH=. python3 scripts/video_memory_gpu.py --wheels .whl --out outputs/video_memory_gpu.json
"""
import sys

from tread.cli.video_memory_gpu import main

if __name__ == "__main__":
    sys.exit(main())
