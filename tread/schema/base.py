"""What every config section is built from: a strict pydantic model (types are not coerced, unknown keys are
rejected) and the conversion of a validation error into one line naming the key, the value and what is
allowed. Why pydantic rather than Hydra structured configs: docs/design.md.
"""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, ValidationError

from tread.utils.errors import UserError
from tread.utils.io import file_in_the_way
from tread.utils.renamed_keys import RENAMED_KEYS, renamed_message

MISSING = "???"   # OmegaConf's mandatory-value marker, as to_container leaves it


class ConfigError(UserError):
    """A config value that cannot work; raised before any long work starts."""


class Section(BaseModel):
    """A config node: every key typed (no coercion), unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    def plain(self) -> dict[str, Any]:
        """The keys the config set, as plain data under their config names (`_target_`, ...): what the builders
        below the schema (models, objectives, data) take."""
        return self.model_dump(by_alias=True, exclude_unset=True)

    def check(self) -> None:
        """Rules between this section's keys and the rest of the config's (a section with such rules overrides)."""


def key(desc: str, *, default: Any = ..., alias: Optional[str] = None, **constraints: Any) -> Any:
    """A field whose description says what is allowed (it ends every error message about the field)."""
    return Field(default, description=desc, alias=alias, **constraints)


Number = Annotated[float, AllowInfNan(False)]    # a finite number (ints accepted)
# The most common kinds of key, with what they allow said once.
PositiveInt = Annotated[int, Field(ge=1, description="a positive integer")]
PositiveNumber = Annotated[float, AllowInfNan(False), Field(gt=0, description="a number > 0")]
NonNegativeNumber = Annotated[float, AllowInfNan(False), Field(ge=0, description="a number >= 0")]
Flag = Annotated[bool, Field(description="true or false")]
# Generator seeds lie in [0, 2**32): numpy's RandomState takes no others, and torch's derived streams
# (seed * 1_000_003 + rank) stay within 64 bits.
SEED_LIMIT = 2 ** 32


def dotted(prefix: str, loc: Sequence[Any]) -> str:
    """('routes', 0, 'selection_ratio') under 'routing' -> 'routing.routes[0].selection_ratio'; the union-member
    tags pydantic adds to a location (literal['auto'], function-after[...], bool, ...) are left out."""
    out = prefix
    for part in loc:
        if isinstance(part, str) and _is_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_tag(part: str) -> bool:
    return "[" in part or part.startswith("constrained-") or \
        part in ("bool", "int", "float", "str", "none", "list", "dict")


def _inner(annotation: Any) -> Any:
    """The model class inside Optional[...] / list[...] / Union[...] annotations (None if there is none)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner(arg)
        if found is not None:
            return found
    return None


def _walk(cls: type[BaseModel], loc: Sequence[Any]) -> tuple[Optional[type[BaseModel]], Optional[str]]:
    """(the model holding the last key of loc, that key's description), following loc through the fields."""
    holder, desc = cls, None
    for i, part in enumerate(loc):
        if isinstance(part, int) or holder is None or _is_tag(part):
            continue
        field = next((f for name, f in holder.model_fields.items() if part in (name, f.alias)), None)
        if field is None:
            return holder, None
        desc = field.description
        if i < len(loc) - 1:
            holder = _inner(field.annotation)
    return holder, desc


def message(err: ValidationError, cls: type[BaseModel], prefix: str) -> str:
    """The first error of a validation as one line: key, value, what is allowed. A renamed key comes first: it
    names the key to use (and explains that key missing beside it, in a library caller's settings)."""
    for e in err.errors():
        renamed = _renamed(e, cls, prefix)
        if renamed:
            return renamed
    e = err.errors()[0]
    loc, kind, value = e["loc"], e["type"], e.get("input")
    name = dotted(prefix, loc)
    if kind == "missing":
        _, desc = _walk(cls, loc)
        return f"{name} is missing from the config; it must be {desc}."
    if kind == "extra_forbidden":
        parent, _ = _walk(cls, loc[:-1] + ("",)) if len(loc) > 1 else (cls, None)
        allowed = [f.alias or n for n, f in (parent or cls).model_fields.items()]
        return f"{name} is not a known key; {dotted(prefix, loc[:-1]) or 'the config'} takes {allowed}."
    if kind in ("value_error", "assertion_error"):
        return str(e["msg"]).split(", ", 1)[-1]
    _, desc = _walk(cls, loc)
    return f"{name}={show(value)} is not allowed; allowed: {desc or e['msg']}."


def _renamed(e: dict, cls: type[BaseModel], prefix: str) -> Optional[str]:
    """The refusal of an unknown key that was renamed (tread/utils/renamed_keys.py) to a key of its section."""
    loc = e["loc"]
    if e["type"] != "extra_forbidden" or not loc or loc[-1] not in RENAMED_KEYS:
        return None
    parent = _walk(cls, loc[:-1] + ("",))[0] if len(loc) > 1 else cls
    if parent is None or RENAMED_KEYS[loc[-1]][0] not in parent.model_fields:
        return None
    return renamed_message(dotted(prefix, loc), show(e.get("input")))


def show(value: Any) -> str:
    """A value as the user types it in Hydra's syntax: true / false / null for booleans and None, inside lists and
    mappings too ([1, true], {start: 2, end: -3}); strings and numbers as repr spells them ('abc', 0.5)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def check(cls: type[BaseModel], value: Any, prefix: str) -> BaseModel:
    """cls.model_validate(value), any failure as a ConfigError naming prefix + key."""
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}={show(value)} is not allowed; allowed: a mapping of keys ({cls.__doc__}).")
    try:
        return cls.model_validate(value)
    except ValidationError as err:
        raise ConfigError(message(err, cls, prefix)) from None


def missing_keys(tree: Any, prefix: str = "") -> list[str]:
    """Keys whose value is still OmegaConf's ??? (mandatory, not given), depth first."""
    if isinstance(tree, dict):
        return [k for name, v in tree.items() for k in missing_keys(v, dotted(prefix, [name]))]
    if isinstance(tree, list):
        return [k for i, v in enumerate(tree) for k in missing_keys(v, dotted(prefix, [i]))]
    return [prefix] if tree == MISSING else []


def check_dirs(dirs: Mapping[str, Any], files: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse, naming the key, a directory key (`dirs`: key -> path or None) or an output file key (`files`:
    its folder) that lies at or below a regular file, before any work (making the directory would fail later)."""
    keys = [(n, v, False) for n, v in dirs.items()] + [(n, v, True) for n, v in (files or {}).items()]
    for name, value, folder in keys:
        if value is None or str(value) == "":
            continue
        path = Path(str(value)).expanduser()
        blocker = file_in_the_way(path.parent if folder else path)
        if blocker is None:
            continue
        where = "is a file" if blocker == path else f"lies below '{blocker}', which is a file"
        allowed = "a file path in a directory" if folder else "a directory path"
        raise ConfigError(f"{name}={show(str(value))} {where}, not a directory; allowed: {allowed} (every existing "
                          f"part of it a directory).")


def one_of(values: Sequence[Any]) -> str:
    return "one of " + ", ".join(str(v) for v in values)

