"""Caption sources for text-conditioned precomputing: the captions each image of a folder gets from a manifest
(--captions: CSV/TSV, JSON or JSONL) or sidecar .txt files (docs/data.md "Captions"); plan_captions
(tread/data/precompute/plan.py) combines the sources, tread/encoders/text.py encodes them."""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tread.data.images import ImageFolderError, PathLike, read_name_value_file
from tread.utils.readers import DuplicateKeyError, loads_json, parse_json, read_text

FILE_KEYS = ("file", "file_name", "filename", "image", "path")
CAPTION_KEYS = ("caption", "text", "prompt")
MANIFEST_FORMS = ("CSV/TSV 'file name,caption' lines, a JSON object {file name: caption or [captions]}, or JSONL "
                  "lines {\"file\": ..., \"caption\": ...} / {\"file\": ..., \"captions\": [...]}")
MAX_CAPTION_CHARS = 10_000   # a longer caption is refused: T5 reads 512 tokens (~2,000 characters) at most
# Control characters (C0 but tab, line feed and carriage return; DEL; C1) and a byte order mark past the start
# (files joined with cat): binary or mis-encoded text, never a caption.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff]")
_QUOTED_NAME = {sep: re.compile(f'"((?:[^"]|"")*)"[ ]*{sep}') for sep in (",", "\t")}
_SEP_NAMES = {",": "a comma", "\t": "a tab"}


def _json_caption(name: str, caption: Any) -> str:
    if not isinstance(caption, str):
        raise ValueError(f"the caption of '{name}' is {caption!r}; captions must be strings")
    return caption


def read_captions_file(path: PathLike) -> dict[str, str]:
    """{file name (relative to the image folder, posix): caption} from a JSON object or a CSV/TSV file of
    `file name,caption` lines (docs/data.md "Captions"), one caption per file (read_caption_manifest reads
    several). A bad file raises ImageFolderError naming it (and the line)."""
    return read_name_value_file(path, what="caption", error_cls=ImageFolderError, split="first",
                                header=(("file_name", "filename", "file", "path", "image"),
                                        ("caption", "text", "prompt")),
                                json_value=_json_caption, json_example='{"file name": "caption"}', say_where=True)


@dataclass
class CaptionManifest:
    """A manifest's captions: {file name: [captions, in file order]} and where each file is first named
    ("line 3", "key 'a.png'")."""
    path: Path
    captions: dict[str, list[str]] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)

    def fail(self, where: str, problem: str) -> ImageFolderError:
        return ImageFolderError(f"captions file '{self.path}' {where}: {problem}")

    def add(self, name: str, captions: list[str], where: str) -> None:
        """Add a file's captions (checked: check_caption; the same caption twice for one file is an error)."""
        try:
            key = _file_key(name)
            for caption in captions:
                check_caption(caption)
        except ValueError as err:
            raise self.fail(f"{where} ('{name}')", str(err)) from None
        known = list(self.captions.get(key, []))
        for caption in captions:
            if caption in known:
                raise self.fail(where, f"'{name}' gets the caption {caption[:60]!r} twice (the file is first named "
                                       f"{self.where.get(key, where)}); several captions for one file must differ: "
                                       f"remove the repeated one")
            known.append(caption)
        self.captions[key] = known
        self.where.setdefault(key, where)


def _file_key(name: str) -> str:
    """A manifest's file name as the key images are matched by (posix, "./a.png" -> "a.png"); ValueError for an
    empty name or one with control characters."""
    if not name.strip():
        raise ValueError(f"the file name is {name!r} (empty); expected a path relative to --images, e.g. 'cls/x.png'")
    problem = control_problem(name)
    if problem:
        raise ValueError(f"the file name {name!r} holds {problem}")
    return Path(name).as_posix()


def control_problem(text: str) -> Optional[str]:
    """'control character U+0000 at character 3' for the first character of `text` that is a control character
    (tabs and line breaks aside) or a byte order mark, None when there is none."""
    found = _CONTROL.search(text)
    return None if found is None else f"control character U+{ord(found.group()):04X} at character {found.start() + 1}"


def check_caption(caption: str) -> str:
    """A caption as it is: ValueError for control characters (a binary or mis-encoded file: NUL, escape, ...; tabs
    and line breaks are fine) and for more than MAX_CAPTION_CHARS characters."""
    problem = control_problem(caption)
    if problem:
        raise ValueError(f"the caption holds {problem}; allowed: text with tabs and line breaks only (a binary or "
                         f"mis-encoded file?)")
    if len(caption) > MAX_CAPTION_CHARS:
        raise ValueError(f"the caption is {len(caption):,} characters long; allowed: at most "
                         f"{MAX_CAPTION_CHARS:,} (MAX_CAPTION_CHARS; text encoders read a few hundred tokens)")
    return caption


def _check_text(text: str, place: str) -> None:
    """A line-based file's text before it is split into lines (str.splitlines would split at some control
    characters): the first control character is one ImageFolderError naming the line."""
    problem = control_problem(text)
    if problem:
        found = _CONTROL.search(text)
        line = text.count("\n", 0, found.start()) + 1
        column = found.start() - (text.rfind("\n", 0, found.start()) + 1) + 1
        raise ImageFolderError(f"{place} line {line}: control character U+{ord(found.group()):04X} at character "
                               f"{column}; allowed: text with tabs and line breaks only (a binary or mis-encoded "
                               f"file?)")


def read_caption_manifest(path: PathLike) -> CaptionManifest:
    """A captions manifest (docs/data.md's forms, by extension: .json, .jsonl, else CSV/TSV); a bad file or entry
    raises ImageFolderError naming the file and the line (or key)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ImageFolderError(f"captions file '{path}' not found")
    text = read_text(path, "captions file", "UTF-8 text", ImageFolderError)
    _check_text(text, f"captions file '{path}'")
    manifest, suffix = CaptionManifest(path), path.suffix.lower()
    reader = _read_json if suffix == ".json" else _read_jsonl if suffix == ".jsonl" else _read_csv
    reader(manifest, text)
    if not manifest.captions:
        raise ImageFolderError(f"captions file '{path}' has no entries ({MANIFEST_FORMS})")
    return manifest


def _caption_list(value: Any, what: str) -> list[str]:
    """A caption or a non-empty list of them, as a list; ValueError saying what is wrong."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(c, str) for c in items):
        raise ValueError(f"{what} is {value!r:.200}; allowed: a caption string or a non-empty list of strings")
    return items


def _read_json(manifest: CaptionManifest, text: str) -> None:
    obj = parse_json(text, f"captions file '{manifest.path}'", "a JSON object {file name: caption or [captions]}",
                     ImageFolderError, unique_keys=True)
    if not isinstance(obj, dict):
        raise ImageFolderError(f"captions file '{manifest.path}': expected a JSON object {{file name: caption or "
                               f"[captions]}}, got {type(obj).__name__}")
    for name, value in obj.items():
        where, key = f"key '{name}'", Path(name).as_posix()
        if key in manifest.captions:
            raise manifest.fail(where, f"names the same file as {manifest.where[key]} ('{key}'); give a file's "
                                       f"captions under one key, as a list")
        try:
            captions = _caption_list(value, f"the caption of '{name}'")
        except ValueError as err:
            raise ImageFolderError(f"captions file '{manifest.path}': {err}") from None
        manifest.add(name, captions, where)


def _read_jsonl(manifest: CaptionManifest, text: str) -> None:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            name, captions = _jsonl_entry(line)
        except ValueError as err:
            raise ImageFolderError(f"captions file '{manifest.path}' line {lineno}: {err}") from None
        manifest.add(name, captions, f"line {lineno}")


def _jsonl_entry(line: str) -> tuple[str, list[str]]:
    """One JSONL line -> (file name, its captions); ValueError saying what is wrong."""
    try:
        obj = loads_json(line, unique_keys=True)
    except DuplicateKeyError:
        raise
    except ValueError as err:
        raise ValueError(f"not a JSON object ({err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{line.strip()[:80]!r} is not a JSON object")
    names = [obj[k] for k in FILE_KEYS if k in obj]
    found = [k for k in (*CAPTION_KEYS, "captions") if k in obj]
    if len(names) != 1 or not isinstance(names[0], str) or not names[0] or len(found) != 1:
        raise ValueError(f"{line.strip()[:80]!r} must have one file key ({', '.join(FILE_KEYS)}) with a file name "
                         f"and one of {', '.join(CAPTION_KEYS)} (a caption) or captions (a list)")
    value = obj[found[0]]
    if found[0] == "captions" and not isinstance(value, list):
        raise ValueError(f"'captions' is {value!r:.200}; allowed: a non-empty list of strings")
    return names[0], _caption_list(value, f"'{found[0]}'")


def _read_csv(manifest: CaptionManifest, text: str) -> None:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            name, caption = csv_row(line)
        except ValueError as err:
            raise manifest.fail(f"line {lineno}", str(err)) from None
        if not manifest.captions and name.lower() in FILE_KEYS and caption.lower() in CAPTION_KEYS:
            continue  # header
        manifest.add(name, [caption], f"line {lineno}")


def csv_row(line: str) -> tuple[str, str]:
    """A CSV/TSV manifest line (a tab-separated one when it has a tab) -> (file name, caption): the name is the
    first field (CSV-quoted or not), the caption the rest of the line, or, when it starts with a quote, exactly
    one CSV-quoted field (`"a, b"`, `"say ""hi"" twice"`; csv's strict rules). ValueError saying what is wrong."""
    sep = "\t" if "\t" in line else ","
    text = line.strip()
    quoted = _QUOTED_NAME[sep].match(text)
    if text.startswith('"') and quoted is None:
        raise ValueError(f"{text[:80]!r}: the quoted file name is not closed, or not followed by "
                         f"{_SEP_NAMES[sep]}; expected \"<file name>\"{sep}<caption>")
    if quoted is not None:
        name, caption = quoted.group(1).replace('""', '"'), text[quoted.end():].strip()
    else:
        name, found, caption = text.partition(sep)
        if not found:
            raise ValueError(f"{text[:80]!r} is not '<file name>,<caption>' (or tab-separated)")
        name, caption = name.strip(), caption.strip()
    return name, _quoted_caption(caption, sep) if caption.startswith('"') else caption


def _quoted_caption(text: str, sep: str) -> str:
    """A caption given in CSV quotes: exactly one field, closed on its line."""
    try:
        fields = next(csv.reader([text], delimiter=sep, strict=True))
    except csv.Error as err:
        raise ValueError(f"the quoted caption {text[:60]!r} is not one CSV field ({err}); a quoted caption is "
                         f"\"...\" with \"\" for a quote inside, closed on its line, nothing after it") from None
    if len(fields) != 1:
        raise ValueError(f"{len(fields)} quoted fields after the file name ({text[:60]!r}); expected one caption "
                         f"field (several captions: one line each)")
    return fields[0]


def read_sidecar(path: Path) -> Optional[list[str]]:
    """A caption sidecar's captions, one per non-empty line (stripped); None when the file does not exist ([] when
    it has no caption). An unreadable or non-UTF-8 file, control characters and over-long captions raise
    ImageFolderError naming the file (and the line)."""
    if not path.is_file():
        return None
    place = f"caption sidecar '{path}'"
    text = read_text(path, "caption sidecar", "UTF-8 text, one caption per line", ImageFolderError)
    _check_text(text, place)
    captions = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                captions.append(check_caption(line.strip()))
            except ValueError as err:
                raise ImageFolderError(f"{place} line {lineno}: {err}") from None
    return captions


def sidecar_of(image: Path) -> Path:
    """An image's caption sidecar: the same folder and stem, .txt."""
    return image.with_suffix(".txt")


def with_trigger(caption: str, word: Optional[str]) -> str:
    """`word, caption` (the trigger word alone for an empty caption); the caption itself without a word."""
    if not word:
        return caption
    return f"{word}, {caption}" if caption else word
