"""Peak CUDA memory of Wan `mid`'s checkpointed training step at 1, 5, 9 and 21 latent frames of 60x104 latents,
routing=none vs paper (tread/cli/video_memory_gpu.py; `--help` for the flags). Under 4 minutes on one H100.

    PYTHONPATH=. python3 scripts/video_memory_gpu.py --wheels .whl --out outputs/video_memory_gpu.json
"""
import sys

from tread.cli.video_memory_gpu import main

if __name__ == "__main__":
    sys.exit(main())
