"""The precompute script's hand-parsed arguments and outputs (issue 43, "precompute arguments and outputs"): bucket
sizes, pixel budgets, frame counts and ratios out of range or not ASCII numbers (tread.data.buckets.in_range),
flags that would do nothing in their combination, and outputs that cannot work (below a file, in a folder that
cannot be written, inside an input folder, an --out another precompute holds). Each is refused with one `error:`
line naming the flag and the value, before any work: every case names a missing --vae, so an error that came after
loading the VAE would name the VAE instead. The rules: tests/bad_input_table.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bad_input_table import precompute, refused
from tread.runtime.lock import own_record

pytestmark = pytest.mark.slow   # ~50 program runs in the harness beside the other tables

ROOT = os.geteuid() == 0          # root writes into a chmod 0o555 folder: those cases cannot refuse anything
NOT_AS_ROOT = "root writes into a chmod 0o555 folder; tests/test_precompute_faults.py mounts a read-only tmpfs instead"


def images(id: str, *args: str, needles: tuple[str, ...], setup=None):
    """A case of an image run: --images {imgs} --out {out}/ds and a --vae that does not exist, then `args`."""
    return precompute(id, "--images", "{imgs}", "--out", "{out}/ds", "--vae", "{missing}/vae", *args,
                      needles=needles, setup=setup)


def clips(id: str, *args: str, needles: tuple[str, ...]):
    """A case of a clip run: --videos {empty} (a folder) --out {out}/ds and a --vae that does not exist."""
    return precompute(id, "--videos", "{empty}", "--out", "{out}/ds", "--vae", "{missing}/vae", *args,
                      needles=needles)


def read_only(name: str):
    """A setup: {out}/name, a folder nobody but root can write in."""
    def setup(out: Path, places: dict) -> None:
        (out / name).mkdir()
        (out / name).chmod(0o555)
    return setup


def locked(out: Path, places: dict) -> None:
    """A setup: {out}/ds.parts/.lock held by this (live) test process, as a running precompute holds it."""
    (out / "ds.parts").mkdir()
    (out / "ds.parts" / ".lock").write_text(json.dumps(own_record()) + "\n")


SIZE_CASES = [
    images("buckets_huge", "--buckets", "1000000000x1000000000",
           needles=("--buckets='1000000000x1000000000'", "[1, 16384]")),
    images("buckets_overflow", "--buckets", "4000000000x4", needles=("--buckets='4000000000x4'", "[1, 16384]")),
    images("buckets_zero_side", "--buckets", "0x64", needles=("--buckets='0x64'", "WIDTHxHEIGHT")),
    images("buckets_negative", "--buckets=-16x16", needles=("--buckets='-16x16'", "WIDTHxHEIGHT")),
    images("buckets_superscript", "--buckets", "16²x16", needles=("--buckets='16²x16'", "WIDTHxHEIGHT")),
    images("buckets_arabic_digits", "--buckets", "٣٢x32", needles=("--buckets='٣٢x32'", "WIDTHxHEIGHT")),
    images("buckets_trailing_comma", "--buckets", "16x16,", needles=("--buckets='16x16,'", "''")),
    images("buckets_empty_item", "--buckets", "16x16,,32x32", needles=("--buckets='16x16,,32x32'", "''")),
    images("buckets_too_many", "--buckets", ",".join(f"{16 * (i + 1)}x16" for i in range(1025)),
           needles=("--buckets lists 1025 sizes", "at most 1024")),
    images("resolution_huge", "--resolution", "1000000", needles=("--resolution=1000000", "[8, 16384]")),
    images("resolution_superscript", "--resolution", "256²", needles=("--resolution", "'256²'")),
    images("bucket_stride_huge", "--buckets", "16x16", "--bucket-stride", "100000",
           needles=("--bucket-stride=100000", "[1, 16384]")),
    images("bucket_stride_zero", "--buckets", "16x16", "--bucket-stride", "0",
           needles=("--bucket-stride=0", "[1, 16384]")),
]

BUDGET_CASES = [
    images("pixels_huge", "--bucket-pixels", "1000000000000",
           needles=("--bucket-pixels='1000000000000'", "[1, 268435456]")),
    images("pixels_superscript", "--bucket-pixels", "1024²", needles=("--bucket-pixels='1024²'", "pixel counts")),
    images("pixels_zero", "--bucket-pixels", "0", needles=("--bucket-pixels='0'", "[1, 268435456]")),
    images("pixels_negative", "--bucket-pixels=-65536", needles=("--bucket-pixels='-65536'", "pixel counts")),
    images("pixels_nan", "--bucket-pixels", "nan", needles=("--bucket-pixels='nan'", "pixel counts")),
    images("pixels_trailing_comma", "--bucket-pixels", "65536,", needles=("--bucket-pixels='65536,'",)),
    images("pixels_too_many_budgets", "--bucket-pixels", ",".join(str(4096 * (i + 1)) for i in range(17)),
           needles=("--bucket-pixels=", "at most 16 comma-separated")),
    images("pixels_too_many_buckets", "--bucket-pixels", "16777216", "--bucket-stride", "1", "--max-aspect", "16",
           needles=("--bucket-pixels=16777216 derives", "more than 1024", "--bucket-stride")),
]

FRAME_CASES = [
    clips("frame_buckets_superscript", "--frame-buckets", "5,³", needles=("--frame-buckets='5,³'", "[1, 1024]")),
    clips("frame_buckets_huge", "--frame-buckets", "5,1000000000000",
          needles=("--frame-buckets='5,1000000000000'", "[1, 1024]")),
    clips("frame_buckets_zero", "--frame-buckets", "0,5", needles=("--frame-buckets='0,5'", "[1, 1024]")),
    clips("frame_buckets_negative", "--frame-buckets=-5", needles=("--frame-buckets='-5'", "[1, 1024]")),
    clips("frame_buckets_trailing_comma", "--frame-buckets", "5,9,", needles=("--frame-buckets='5,9,'",)),
    clips("frames_huge", "--frames", "100000000", needles=("--frames=100000000", "[1, 1024]")),
    clips("frame_stride_huge", "--frames", "5", "--frame-stride", "10000000",
          needles=("--frame-stride=10000000", "[1, 1024]")),
]

RATIO_CASES = [
    images("max_aspect_nan", "--bucket-pixels", "65536", "--max-aspect", "nan",
           needles=("--max-aspect=nan", "[1, 16]")),
    images("max_aspect_inf", "--bucket-pixels", "65536", "--max-aspect", "inf",
           needles=("--max-aspect=inf", "[1, 16]")),
    images("max_aspect_below_one", "--bucket-pixels", "65536", "--max-aspect", "0.5",
           needles=("--max-aspect=0.5", "[1, 16]")),
    images("max_aspect_huge", "--bucket-pixels", "65536", "--max-aspect", "1e308",
           needles=("--max-aspect=1e+308", "[1, 16]")),
    images("max_aspect_superscript", "--bucket-pixels", "65536", "--max-aspect", "2²",
           needles=("--max-aspect", "'2²'")),
]

COMBINATION_CASES = [
    images("max_aspect_with_buckets", "--buckets", "16x16", "--max-aspect", "3",
           needles=("--max-aspect=3.0 only applies with --bucket-pixels", "--buckets")),
    images("max_aspect_alone", "--max-aspect", "3", needles=("--max-aspect=3.0 only applies with --bucket-pixels",)),
    images("bucket_stride_alone", "--bucket-stride", "8",
           needles=("--bucket-stride=8 only applies with --buckets or --bucket-pixels",)),
    images("resolution_with_buckets", "--buckets", "16x16", "--resolution", "256",
           needles=("--resolution=256 does nothing with --buckets",)),
    images("resolution_with_bucket_pixels", "--bucket-pixels", "65536", "--resolution", "128",
           needles=("--resolution=128 does nothing with --buckets/--bucket-pixels",)),
    images("frame_stride_without_videos", "--frame-stride", "2",
           needles=("--frame-stride", "only apply with --videos")),
]

OUTPUT_CASES = [
    precompute("out_below_a_file", "--images", "{imgs}", "--out", "{ref}/ds", "--vae", "{missing}/vae",
               needles=("--out '{ref}/ds' cannot be made", "'{ref}' is a file")),
    precompute("out_inside_images", "--images", "{imgs}", "--out", "{imgs}/ds", "--vae", "{missing}/vae",
               needles=("--out '{imgs}/ds' is inside --images '{imgs}'",)),
    precompute("out_is_images", "--images", "{empty}", "--out", "{empty}", "--vae", "{missing}/vae",
               needles=("--out '{empty}' is --images '{empty}'",)),
    clips("out_inside_videos", "--frames", "5", "--out", "{empty}/ds",
          needles=("--out '{empty}/ds' is inside --videos '{empty}'",)),
    images("ref_out_below_a_file", "--ref-out", "{ref}/r.npz",
           needles=("--ref-out '{ref}/r.npz' cannot be made", "'{ref}' is a file")),
    images("ref_out_inside_images", "--ref-out", "{imgs}/r.npz",
           needles=("--ref-out '{imgs}/r.npz' is inside --images '{imgs}'",)),
    images("ref_out_inside_out", "--ref-out", "{out}/ds/r.npz",
           needles=("--ref-out '{out}/ds/r.npz' is inside --out '{out}/ds'",)),
    images("ref_out_is_out", "--ref-out", "{out}/ds", needles=("--ref-out '{out}/ds' is --out '{out}/ds'",)),
    images("out_locked", needles=("--out '{out}/ds' is being written by another precompute",
                                  f"pid {os.getpid()} on host", "{out}/ds.parts/.lock"), setup=locked),
]

# As root these are not refused (root writes anywhere): skipped there, run by every other user.
READ_ONLY_CASES = [
    precompute("out_read_only", "--images", "{imgs}", "--out", "{out}/ro/ds", "--vae", "{missing}/vae",
               needles=("--out '{out}/ro/ds' cannot be written", "'{out}/ro'"), setup=read_only("ro")),
    images("ref_out_read_only", "--ref-out", "{out}/ro/r.npz",
           needles=("--ref-out '{out}/ro/r.npz' cannot be written", "'{out}/ro'"), setup=read_only("ro")),
]

CASES = SIZE_CASES + BUDGET_CASES + FRAME_CASES + RATIO_CASES + COMBINATION_CASES + OUTPUT_CASES


def test_the_table_is_big_enough():
    assert len(CASES + READ_ONLY_CASES) >= 30


@pytest.mark.parametrize("case", [c.param() for c in CASES] +
                         [pytest.param(c, id=c.name, marks=pytest.mark.skipif(ROOT, reason=NOT_AS_ROOT))
                          for c in READ_ONLY_CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
