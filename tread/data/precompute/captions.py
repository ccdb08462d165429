"""Caption sources for text-conditioned precomputing: the captions each image of a folder gets from a manifest
(--captions: CSV/TSV, JSON or JSONL) or sidecar .txt files (docs/data.md "Captions"); plan_captions
(tread/data/precompute/plan.py) combines the sources, tread/encoders/text.py encodes them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tread.data.images import ImageFolderError, PathLike, _split_line, read_name_value_file

FILE_KEYS = ("file", "file_name", "filename", "image", "path")
CAPTION_KEYS = ("caption", "text", "prompt")
MANIFEST_FORMS = ("CSV/TSV 'file name,caption' lines, a JSON object {file name: caption or [captions]}, or JSONL "
                  "lines {\"file\": ..., \"caption\": ...} / {\"file\": ..., \"captions\": [...]}")


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

    def add(self, name: str, captions: list[str], where: str) -> None:
        key = Path(name).as_posix()
        self.captions.setdefault(key, []).extend(captions)
        self.where.setdefault(key, where)


def read_caption_manifest(path: PathLike) -> CaptionManifest:
    """A captions manifest (docs/data.md's forms, by extension: .json, .jsonl, else CSV/TSV); a bad file or entry
    raises ImageFolderError naming the file and the line (or key)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ImageFolderError(f"captions file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ImageFolderError(f"captions file '{path}' is not UTF-8 text ({err})") from None
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
        raise ValueError(f"{what} is {value!r}; allowed: a caption string or a non-empty list of strings")
    return items


def _read_json(manifest: CaptionManifest, text: str) -> None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ImageFolderError(f"captions file '{manifest.path}' is not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise ImageFolderError(f"captions file '{manifest.path}': expected a JSON object {{file name: caption or "
                               f"[captions]}}, got {type(obj).__name__}")
    for name, value in obj.items():
        try:
            manifest.add(name, _caption_list(value, f"the caption of '{name}'"), f"key '{name}'")
        except ValueError as err:
            raise ImageFolderError(f"captions file '{manifest.path}': {err}") from None


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
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not a JSON object ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{line.strip()[:80]!r} is not a JSON object")
    names = [obj[k] for k in FILE_KEYS if k in obj]
    found = [k for k in (*CAPTION_KEYS, "captions") if k in obj]
    if len(names) != 1 or not isinstance(names[0], str) or not names[0] or len(found) != 1:
        raise ValueError(f"{line.strip()[:80]!r} must have one file key ({', '.join(FILE_KEYS)}) with a file name "
                         f"and one of {', '.join(CAPTION_KEYS)} (a caption) or captions (a list)")
    value = obj[found[0]]
    if found[0] == "captions" and not isinstance(value, list):
        raise ValueError(f"'captions' is {value!r}; allowed: a non-empty list of strings")
    return names[0], _caption_list(value, f"'{found[0]}'")


def _read_csv(manifest: CaptionManifest, text: str) -> None:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parsed = _split_line(line, "first")
        if parsed is None:
            raise ImageFolderError(f"captions file '{manifest.path}' line {lineno}: {line!r} is not "
                                   f"'<file name>,<caption>' (or tab-separated)")
        name, caption = parsed
        if not manifest.captions and name.lower() in FILE_KEYS and caption.lower() in CAPTION_KEYS:
            continue  # header
        manifest.add(name, [caption], f"line {lineno}")


def read_sidecar(path: Path) -> Optional[list[str]]:
    """A caption sidecar's captions, one per non-empty line (stripped); None when the file does not exist ([] when
    it has no caption). Unreadable or non-UTF-8 files raise ImageFolderError naming them."""
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ImageFolderError(f"caption sidecar '{path}' cannot be read as UTF-8 text ({err})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def sidecar_of(image: Path) -> Path:
    """An image's caption sidecar: the same folder and stem, .txt."""
    return image.with_suffix(".txt")


def with_trigger(caption: str, word: Optional[str]) -> str:
    """`word, caption` (the trigger word alone for an empty caption); the caption itself without a word."""
    if not word:
        return caption
    return f"{word}, {caption}" if caption else word
