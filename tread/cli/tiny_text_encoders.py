"""tiny_text_encoders.py: write tiny randomly initialised text encoders and tokenizers for a family, as a local
pipeline folder (offline stand-ins for tests and the CPU worked example; their embeddings mean nothing)."""
from __future__ import annotations

from typing import Optional, Sequence

from tread.cli.args import MAX_SEED, Parser, int_in
from tread.cli.errors import user_errors
from tread.encoders.text_families import TEXT_FAMILIES
from tread.encoders.tiny_text import save_tiny_text_encoders


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = Parser(prog="tiny_text_encoders.py", description=__doc__)
    parser.add_argument("family", choices=TEXT_FAMILIES, help="the text-to-image family whose encoders to mimic")
    parser.add_argument("out", help="folder to write (text_encoder*/, tokenizer*/, model_index.json)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED - 1), default=0, help="initialisation seed (default 0)")
    with user_errors():
        args = parser.parse_args(argv)
        out = save_tiny_text_encoders(args.family, args.out, seed=args.seed)
        print(f"wrote tiny random {args.family} text encoders to {out}")
