"""The one base class of "your input is wrong" errors.

Every package raises its own subclass (a bad route, dataset, config key, checkpoint, CLI flag, ...);
the entry points print any of them as one `error: ...` line without a traceback."""
from __future__ import annotations


class UserError(ValueError):
    """An input that cannot work; the message names the key or file, the value and what is allowed."""


# What entry points report as `error: <message>`: our own errors, and missing / already existing files.
USER_ERRORS = (UserError, FileNotFoundError, FileExistsError)
