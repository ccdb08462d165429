"""Config keys renamed since checkpoints were written: one table serves both the refusal of an old key typed on the
command line or in a config (tread/schema/base.py, tread/cli/errors.py) and the upgrade of a checkpoint's stored
config on read (tread/checkpoint/files.py:read_meta), so that a run written before resumes and samples unchanged."""
from __future__ import annotations

from typing import Any, Optional

# The sampling keys (sample.py and fid.py at the top level, a training config's `eval` section): old -> (new, meaning).
RENAMED_KEYS = {
    "route_ratio": ("selection_ratio", "the fraction of tokens dropped, as routing.routes[i].selection_ratio"),
    "tread_weak_ratio": ("tread_weak_selection_ratio", "the fraction of tokens the weak TREAD-guidance branch drops, "
                                                       "as routing.routes[i].selection_ratio"),
}
SAMPLING_SECTION = "eval"   # where a training config, and so a checkpoint's, holds the sampling keys


def renamed_message(dotted: str, value: str, section: Optional[str] = None) -> Optional[str]:
    """The refusal of an old key, naming the new one; None for a key that was not renamed. `section` is where the
    sampling keys live in the program at hand ("" for sample.py and fid.py, "eval" for train.py; None: either)."""
    prefix, _, name = dotted.rpartition(".")
    sections = ("", SAMPLING_SECTION) if section is None else (section,)
    if name not in RENAMED_KEYS or prefix not in sections:
        return None
    new, meaning = RENAMED_KEYS[name]
    return f"{dotted} was renamed: use {prefix + '.' if prefix else ''}{new}={value} ({meaning})."


def rename_keys(node: dict) -> dict:
    """A mapping of sampling keys (a config section, a benchmark table row) with the old keys renamed, in place and
    in their places; where both names are present the new one wins."""
    if not any(old in node for old in RENAMED_KEYS):
        return node
    items = [(RENAMED_KEYS[k][0] if k in RENAMED_KEYS else k, v) for k, v in node.items()
             if not (k in RENAMED_KEYS and RENAMED_KEYS[k][0] in node)]
    node.clear()
    node.update(items)
    return node


def upgrade_keys(tree: Any) -> Any:
    """A checkpoint's plain tree (as read from checkpoint.json) with its renamed sampling keys upgraded, in place."""
    section = tree.get(SAMPLING_SECTION) if isinstance(tree, dict) else None
    if isinstance(section, dict):
        rename_keys(section)
    return tree
