"""Numbers read from a command line or a file, bounded before they are used: `in_range` is the one parse of every
size, count, budget and ratio a flag takes (ASCII digits only: str.isdigit and int() also take '²', '٣', '１２'),
and `span` says the range the way every error message says it."""
from __future__ import annotations

import numbers
import re
from typing import Optional, Union

_DIGITS = re.compile(r"[0-9]{1,19}")
_DECIMAL = re.compile(r"[0-9]{1,19}(\.[0-9]{0,19})?|\.[0-9]{1,19}")
Number = Union[int, float]
MAX_SIDE = 16384                  # pixels: a bucket side, --resolution, --bucket-stride
MAX_FRAMES = 1024                 # a clip's frame count (--frames, --frame-buckets), --frame-stride


def in_range(value: Union[str, Number], low: Number, high: Number, whole: bool = True) -> Optional[Number]:
    """`value` if it is an integer (`whole`; else any finite number) in [low, high], else None; text is parsed
    first (ASCII digits; not `whole`: a plain decimal such as 1.5). The one parse of every size, pixel budget,
    frame count and ratio flag."""
    if isinstance(value, str):
        text = value.strip()
        if not (_DIGITS if whole else _DECIMAL).fullmatch(text):
            return None
        value = int(text) if whole else float(text)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
        return None
    return value if low <= value <= high else None                      # NaN is in no range


def span(low: Number, high: Number, whole: bool = True) -> str:
    """An in_range range as its error messages say it: 'an integer in [1, 16384]'."""
    return f"{'an integer' if whole else 'a number'} in [{low}, {high}]"
