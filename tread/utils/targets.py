"""Building objects from config nodes with a `_target_`, but only from an allowlist: a config read back from a
checkpoint must not run whatever function it names, as Hydra's `instantiate` would.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

from tread.utils.errors import UserError


class TargetError(UserError):
    """A `_target_` that is not one of the allowed builders."""


def plain(node: Any) -> Any:
    """A spec as plain Python data: mappings as dicts and lists as lists, all the way down (a config node's
    interpolations resolve as its values are read)."""
    if isinstance(node, Mapping):
        return {k: plain(v) for k, v in node.items()}
    if isinstance(node, Sequence) and not isinstance(node, (str, bytes, tuple)):
        return [plain(v) for v in node]
    return node


def build_target(node: Mapping[str, Any], allowed: Mapping[str, Callable[..., Any]], key: str) -> Any:
    """Call the builder `allowed[node["_target_"]]` with the node's other keys (Hydra's `_convert_` and
    `_recursive_` are dropped; `_partial_: true` returns a functools.partial, as Hydra does)."""
    spec = dict(plain(node))
    target = spec.pop("_target_", None)
    if target not in allowed:
        raise TargetError(f"{key}._target_={target!r} is not allowed; allowed: {sorted(allowed)}.")
    partial = bool(spec.pop("_partial_", False))
    kwargs = {k: v for k, v in spec.items() if not (k.startswith("_") and k.endswith("_"))}
    fn = allowed[target]
    return functools.partial(fn, **kwargs) if partial else fn(**kwargs)


def upgrade_targets(tree: Any, allowed: Mapping[str, Sequence[str]]) -> Any:
    """A plain config (dicts and lists, as read from a checkpoint) with the `_target_` names that checkpoints
    written before the project became one package give `allowed`'s builders ("models.build_dit" for
    "tread.models.build_dit") replaced by today's, in place; other values are left for check_targets to judge."""
    legacy = {name.removeprefix("tread."): name for names in allowed.values() for name in names
              if name.startswith("tread.")}
    return _rename_targets(tree, legacy)


def _rename_targets(tree: Any, names: Mapping[str, str]) -> Any:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == "_target_" and isinstance(v, str) and v in names:
                tree[k] = names[v]
            else:
                _rename_targets(v, names)
    elif isinstance(tree, list):
        for v in tree:
            _rename_targets(v, names)
    return tree


def find_targets(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every `_target_` in a nested dict/list config."""
    found: list[tuple[str, Any]] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = f"{path}.{k}" if path else str(k)
            found += [(key, v)] if k == "_target_" else find_targets(v, key)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            found += find_targets(v, f"{path}[{i}]")
    return found


def check_targets(tree: Any, allowed: Mapping[str, Any], where: str) -> None:
    """Refuse a tree (read from a file) that names code other than the project's builders: each
    `_target_` must sit directly in a section of `allowed` and be one of that section's names."""
    for dotted, target in find_targets(plain(tree)):
        section = dotted[: -len("._target_")] if dotted.endswith("._target_") else ""
        if section not in allowed or target not in allowed[section]:
            names = sorted(n for names in allowed.values() for n in names)
            raise TargetError(f"{where}: {dotted}={target!r} is not one of the project's builders ({names}); a "
                              f"checkpoint cannot name code to run. Nothing was built from it.")
