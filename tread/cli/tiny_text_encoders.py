"""tiny_text_encoders.py: write tiny randomly initialised text encoders and tokenizers for a family, as a local
pipeline folder (offline stand-ins for tests and the CPU worked example; their embeddings mean nothing)."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from tread.cli.errors import user_errors
from tread.encoders.text_families import TEXT_FAMILIES
from tread.encoders.tiny_text import save_tiny_text_encoders


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family", choices=TEXT_FAMILIES, help="the text-to-image family whose encoders to mimic")
    parser.add_argument("out", help="folder to write (text_encoder*/, tokenizer*/, model_index.json)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    args = parser.parse_args(argv)
    with user_errors():
        out = save_tiny_text_encoders(args.family, args.out, seed=args.seed)
        print(f"wrote tiny random {args.family} text encoders to {out}")
