"""Convert pickle checkpoints of earlier versions to safetensors, or a checkpoint into the other layout.

    python scripts/convert_checkpoint.py RUN_DIR_OR_STEP_DIR --trust [--remove-pickles]
    python scripts/convert_checkpoint.py STEP_DIR --layout single --out NEW_STEP_DIR     # sharded -> single
    python scripts/convert_checkpoint.py STEP_DIR --layout sharded --out NEW_STEP_DIR    # single -> sharded

Pickles are read with torch's restricted unpickler, but convert only files whose source you trust: without
--trust nothing is read (docs/reliability.md, "Checkpoints cannot run code").
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from tread.cli.args import Parser
from tread.cli.errors import user_errors
from tread.checkpoint.layouts import LAYOUTS, convert_layout
from tread.checkpoint.legacy import convert, legacy_dirs, rank_files
from tread.utils.errors import UserError


class ConvertError(UserError):
    """A converter call with flags that do not fit (a bad flag, --layout without --out, pickles without --trust)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = Parser(prog="scripts/convert_checkpoint.py", description=__doc__, error_type=ConvertError)
    p.add_argument("path", help="a run directory (all its old checkpoints) or a checkpoints/step_XXXXXXX directory")
    p.add_argument("--trust", action="store_true", help="you know where these files come from (see above)")
    p.add_argument("--remove-pickles", action="store_true", help="delete the old .pt files after converting")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="write PATH (a step dir, or a run dir's latest) in this layout as --out (no pickles read)")
    p.add_argument("--out", default=None, help="the new step dir for --layout (must not exist)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    with user_errors():
        args = parse_args(argv)
        if args.out is not None and args.layout is None:
            raise ConvertError(f"--out '{args.out}' is for --layout single|sharded, which is missing (without it the "
                               f"converter rewrites old pickle checkpoints in place)")
    if args.layout is not None:
        with user_errors():
            if args.out is None:
                raise ConvertError("--layout needs --out NEW_STEP_DIR (the source is never changed)")
            done = [convert_layout(Path(args.path), Path(args.out), args.layout)]
        print(f"converted {args.path} -> {done[0]} ({args.layout})")
        return done
    with user_errors():
        dirs = legacy_dirs(Path(args.path))
        if not args.trust:
            raise ConvertError(f"--trust is missing: '{args.path}' holds {len(dirs)} old checkpoint(s) in the pickle "
                               f"format. Pickles can name code to run; the converter reads them with torch's "
                               f"restricted unpickler, but the result is a checkpoint you will train and sample from. "
                               f"Add --trust if you know where these files come from.")
        for d in dirs:              # every step dir's file names, before any is converted
            rank_files(d)
        done = [convert(d, args.remove_pickles) for d in dirs]
    for d in done:
        print(f"converted {d}")
    return done
