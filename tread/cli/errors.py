"""How every program reports a bad input: one `error: ...` line on stderr and exit status 1, no traceback."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from typing import Iterator, Optional

from tread.utils.errors import USER_ERRORS
from tread.utils.io import file_in_the_way
from tread.utils.renamed_keys import renamed_message


@contextlib.contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Turn user errors (tread.utils.errors.USER_ERRORS, plus `extra`) raised inside the block into
    `error: <message>`."""
    try:
        yield
    except (*USER_ERRORS, *extra) as err:
        sys.exit(f"error: {err}")


@contextlib.contextmanager
def hydra_errors(sampling_section: str = "") -> Iterator[None]:
    """Report Hydra's own input errors (unknown keys, group options, bad override syntax) as one `error:` line.

    Wrap the @hydra.main function's call in it (`with hydra_errors(): main()`); it sets HYDRA_FULL_ERROR inside
    the block so the errors reach here, and lets other exceptions through. `sampling_section` is where the
    program holds the sampling keys ("" for sample.py and fid.py, "eval" for train.py), for renamed-key errors."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    wanted = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (ConfigCompositionException, OverrideParseException) as err:
        if wanted:
            raise
        sys.exit(f"error: {hydra_message(err, sampling_section)}")
    except OSError as err:
        if wanted or not hydra_made_it(err):
            raise
        sys.exit(f"error: {run_dir_message(err)}")
    finally:
        if wanted is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = wanted


def hydra_made_it(err: BaseException) -> bool:
    """Whether an error came from Hydra itself (making the run directory before the program's code runs): no
    frame of it lies in this package."""
    package, here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.abspath(__file__)
    files = {os.path.abspath(frame.filename) for frame in traceback.extract_tb(err.__traceback__)} - {here}
    return not any(f.startswith(package + os.sep) for f in files)


def run_dir_message(err: OSError) -> str:
    """Hydra could not make the run directory (hydra.run.dir, by default under paths.output_dir): which, why."""
    blocker = file_in_the_way(err.filename) if err.filename else None
    why = f"'{blocker}' is a file, not a directory" if blocker else (err.strerror or str(err))
    return (f"hydra.run.dir='{err.filename}' cannot be made: {why}. Set paths.output_dir (or hydra.run.dir) to a "
            f"directory path whose existing parts are directories.")


# Hydra's refusal of an override of a key the config lacks: the key, and the override's value.
RENAMED_OVERRIDE = re.compile(r"Could not override '([^']+)'\.\s*To append to your config use \+\1=(.*)")


def hydra_message(err: BaseException, sampling_section: Optional[str] = None) -> str:
    """A Hydra composition or override error in one line: its sentences, a list of available options joined
    by commas, the OmegaConf cause's first line; no search path or documentation link."""
    from hydra.errors import OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    found = RENAMED_OVERRIDE.search(str(err))
    renamed = found and renamed_message(found.group(1), found.group(2).strip(), sampling_section)
    if renamed:   # an old key: the new one's name (tread/utils/renamed_keys.py)
        return renamed
    parts: list[str] = []
    for line in str(err).split("Config search path:")[0].splitlines():
        text = line.strip()
        if not text or text.startswith("See https://"):
            continue
        if line.startswith("\t") and parts and parts[-1].endswith((":", ",")):
            parts[-1] += f" {text},"
            continue
        parts.append(text)
    parts = [p.rstrip(",") for p in parts] or [type(err).__name__]
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        parts[0] = f"{parts[0].rstrip('.')} ({str(cause).strip().splitlines()[0]})."
    override = getattr(err, "override", None)
    if isinstance(err, OverrideParseException) and override and override not in parts[0]:
        parts.insert(0, f"bad override '{override}':")
    return " ".join(p if p.endswith((".", ":", "?", "!")) else p + "." for p in parts)
