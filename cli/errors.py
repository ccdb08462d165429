"""How every program reports a bad input: one `error: ...` line on stderr and exit status 1, no traceback."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from utils.errors import USER_ERRORS


@contextlib.contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Turn user errors (utils.errors.USER_ERRORS, plus `extra`) raised inside the block into `error: <message>`."""
    try:
        yield
    except (*USER_ERRORS, *extra) as err:
        sys.exit(f"error: {err}")
