"""The names a sharded checkpoint folder and its errors go by, shared by tread/checkpoint/sharded.py and the DCP
code it defers (dcp_io.py)."""
from __future__ import annotations

from tread.utils.errors import UserError

SHARDED_DIR = "sharded"     # the DCP folder inside a step dir
INDEX = ".metadata"


class ShardedFileError(UserError):
    """A sharded checkpoint folder that is missing, corrupt, or not what it should hold."""


class ShardedWriteError(Exception):
    """A sharded write that failed on some process (the first failure DCP gathered, with its rank)."""
