"""The command-line arguments of the scripts, parsed one way: `Parser` (argparse whose usage errors are one
`error:` line, not the usage text and a traceback-free second line) and the value types with their ranges, so that
a number is bounded before anything is allocated or looped over.

    p = Parser(prog="benchmark.py", description=__doc__)
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=32)

A bad value raises a UsageError (a UserError), which the program prints as one line, e.g. `error: argument --batch:
'0' is not allowed: an integer in [1, 1048576] (python benchmark.py --help lists the flags)`. Integers are ASCII
digits only (tread/utils/numbers.py: the one parse the precompute flags use too)."""
from __future__ import annotations

import argparse
from typing import Callable, NoReturn, Optional

from tread.utils.errors import UserError
from tread.utils.numbers import MAX_FRAMES, MAX_SIDE, in_range, span   # re-exported: the scripts' limits

MAX_BATCH = 1 << 20             # samples per step
MAX_STEPS = 10 ** 7             # steps or rounds a measuring script runs
MAX_ROUNDS = 10 ** 4            # repeats, rounds, sampler steps
MAX_TOKENS = 1 << 20            # tokens of one sample
MAX_CHANNELS = 1 << 12          # latent channels
MAX_WORKERS = 1 << 10           # reader threads or loader processes
MAX_WORLD = 1 << 16             # processes (GPUs) of one run
MAX_SEED = 2 ** 32              # numpy's RandomState takes no larger seed


class UsageError(UserError):
    """A command-line argument argparse refused (unknown flag, missing value, out of range)."""


def parse_int(text: str, low: int, high: int) -> int:
    """`text` (ASCII digits) as an integer in [low, high], or ValueError saying what is allowed."""
    value = in_range(text, low, high)
    if value is None:
        raise ValueError(f"{text!r} is not allowed: {span(low, high)}")
    return value


def parse_number(text: str, low: float, high: float, low_open: bool = False) -> float:
    """`text` (a plain decimal) as a number in [low, high] ((low, high] with low_open), or ValueError saying what is
    allowed."""
    value = in_range(text, low, high, whole=False)
    if value is None or (low_open and value == low):
        raise ValueError(f"{text!r} is not allowed: a number in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(value)


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse `type=`: parse_int within [low, high]."""
    def parse(text: str) -> int:
        try:
            return parse_int(text, low, high)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = "integer"
    return parse


def number_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: parse_number within [low, high]."""
    def parse(text: str) -> float:
        try:
            return parse_number(text, low, high, low_open)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = "number"
    return parse


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors (an unknown flag, --batch abc, a value out of range) raise `error_type` (a
    UserError, which the program prints as one `error:` line) instead of printing the usage and exiting; --help
    still prints the help and exits."""

    error_type: type[UserError] = UsageError

    def __init__(self, *args, error_type: Optional[type[UserError]] = None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.error_type = error_type or self.error_type

    def error(self, message: str) -> NoReturn:
        raise self.error_type(f"{message} (python {self.prog} --help lists the flags)")
