"""toy_classifier.py: train and cache the toy classifier, the offline feature network of the built-in data
(tread/encoders/toy_classifier.py; training and fid.py build it on first use, so this is only needed to rebuild it
or to build it ahead of a run)."""
from __future__ import annotations

from typing import Optional, Sequence

from tread.cli.args import MAX_SEED, Parser, int_in
from tread.cli.errors import user_errors
from tread.data import ensure_toy_classifier
from tread.encoders.patch import REPA_TOY_SEED
from tread.encoders.toy_classifier import DEFAULT_SEED, cache_path


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = Parser(prog="toy_classifier.py", description=__doc__)
    parser.add_argument("--cache-dir", default=".cache", help="where it is cached (paths.cache_dir; default .cache)")
    parser.add_argument("--resolution", type=int_in(8, 1024), default=32,
                        help="image side it is trained at (default 32; the "
                                                                   "built-in data=toy is 16)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED - 1), default=DEFAULT_SEED,
                        help=f"training seed (default {DEFAULT_SEED}, the FID features; REPA's toy encoder: "
                             f"{REPA_TOY_SEED})")
    parser.add_argument("--force", action="store_true", help="retrain even if a cached file exists")
    with user_errors():
        args = parser.parse_args(argv)
        path = cache_path(args.cache_dir, args.resolution, args.seed)
        if args.force and path.exists():
            path.unlink()
        ensure_toy_classifier(args.cache_dir, args.resolution, args.seed)
        print(f"Toy classifier at {path}")
