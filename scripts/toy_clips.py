"""Write the moving toy shapes as clip files (mp4, gif, frame folders) with `<stem>.txt` caption sidecars, for
precompute and the video worked example (tread/data/builtin/toy_clips.py; `--help`):

    python scripts/toy_clips.py DIR --sizes 16x16,24x16 --frames 9,17 --per-class 4
"""
import argparse

from tread.cli.errors import user_errors
from tread.data.buckets import parse_buckets, video_buckets
from tread.data.builtin.toy_clips import CLIP_FORMATS, TOY_CLIP_FPS, write_clip_files


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the moving toy shapes as clip files with caption sidecars.")
    parser.add_argument("out", help="folder to write (must be new or empty)")
    parser.add_argument("--sizes", default="16x16", help="frame sizes WIDTHxHEIGHT, comma-separated (default 16x16)")
    parser.add_argument("--frames", default="9", help="frames per clip, comma-separated (default 9); every size "
                                                     "gets every frame count")
    parser.add_argument("--per-class", type=int, default=4, help="clips per class for each size and frame count")
    parser.add_argument("--formats", default=",".join(CLIP_FORMATS),
                        help=f"clip formats cycled clip by clip, from {','.join(CLIP_FORMATS)} (default: all)")
    parser.add_argument("--fps", type=float, default=TOY_CLIP_FPS, help=f"frame rate (default {TOY_CLIP_FPS:g})")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    args = parser.parse_args()
    with user_errors():
        frames = [int(f) for f in args.frames.split(",") if f.strip().isdigit() and int(f) > 0]
        if len(frames) != len(args.frames.split(",")):
            raise SystemExit(f"error: --frames={args.frames!r}; allowed: positive integers, comma-separated")
        sizes = video_buckets(parse_buckets(args.sizes, "--sizes"), frames)
        written = write_clip_files(args.out, sizes, args.per_class, args.seed, args.formats.split(","), args.fps)
        print(f"wrote {sum(written.values())} clips with caption files to {args.out}: {written}")


if __name__ == "__main__":
    main()
