"""Caption files for text-conditioned precomputing (scripts/precompute_latents.py --captions): which caption each
image of a folder gets. Encoding the captions is the text encoders' job (tread/encoders/text.py)."""
from __future__ import annotations

from typing import Any

from .images import ImageFolderError, PathLike, read_name_value_file


def _json_caption(name: str, caption: Any) -> str:
    if not isinstance(caption, str):
        raise ValueError(f"the caption of '{name}' is {caption!r}; captions must be strings")
    return caption


def read_captions_file(path: PathLike) -> dict[str, str]:
    """{file name (relative to the image folder, posix): caption} from a JSON object {"file": "caption"} or a
    CSV/TSV file of `file name,caption` lines (tab-separated when the line has a tab; the caption is the rest of
    the line, so it may contain commas, and may be quoted as in CSV). Blank lines, `#` comments and a
    `file_name,caption` header are skipped. A bad file raises ImageFolderError naming it (and the line)."""
    return read_name_value_file(path, what="caption", error_cls=ImageFolderError, split="first",
                                header=(("file_name", "filename", "file", "path", "image"),
                                        ("caption", "text", "prompt")),
                                json_value=_json_caption, json_example='{"file name": "caption"}', say_where=True)
