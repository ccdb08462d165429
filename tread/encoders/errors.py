"""The error every frozen-network loader raises, and the one shape of its "missing weights" message."""
from __future__ import annotations

from pathlib import Path
from typing import Union

from tread.utils.errors import UserError


class EncoderError(UserError):
    """A frozen network that cannot be built: an unknown name, or weights that are missing or do not load; the
    message names the path (or key) and how to provide it."""


class TextEncoderError(EncoderError):
    """A text encoder cannot be found / loaded, or prompts cannot be encoded; the message says what to do."""


def missing_weights(what: str, path: Union[str, Path], how: str) -> EncoderError:
    """One line: no `what` at `path`, and the steps that put it there (`how`)."""
    return EncoderError(f"no {what} at '{path}'. To provide it: {how}")
