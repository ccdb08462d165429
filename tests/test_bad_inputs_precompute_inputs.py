"""The precompute script's inputs, broken (issue 43): caption manifests (CSV/TSV quoting, JSON duplicate keys,
JSONL lines, control characters, over-long captions), caption sidecars, image folders whose symbolic links loop
or break, and clip folders with a link loop, a cover image beside the clip folders, an empty frame folder or a
video none of whose frames decodes. Each is one `error:` line naming the file and the value, from the plan
(tread/data/precompute/plan.py, captions.py, video.py; tread/data/images.py, video.py), before the VAE or a text
encoder is loaded. The rules: tests/bad_input_table.py.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import pytest
from PIL import Image

from bad_input_table import precompute, refused
from tread.data.video import write_video

pytestmark = pytest.mark.slow   # ~40 program runs in the harness beside the other tables

Setup = Callable[[Path, dict], Any]
LONG = "a" * 10_001
DEEP = "[" * 200_000 + "]" * 200_000


# ----------------------------------------------------------------------------- inputs, made in {out}

def three_images(folder: Path) -> None:
    """{folder}/c/0.png, 1.png, 2.png (class 'c')."""
    (folder / "c").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(folder / "c" / f"{i}.png")


def fake_pixart(folder: Path) -> None:
    """A PixArt pipeline folder as far as the plan looks (the encoders are never loaded before a refusal)."""
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "text_encoder" / "config.json").write_text('{"model_type": "t5"}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")


def write(path: Path, content: Union[str, bytes]) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def captioned(files: dict[str, Union[str, bytes]]) -> Setup:
    """A setup: {out}/imgs (three images), {out}/pix (text encoders) and `files` ({path under out: content})."""
    def setup(out: Path, places: dict) -> None:
        three_images(out / "imgs")
        fake_pixart(out / "pix")
        for name, content in files.items():
            write(out / name, content)
    return setup


TEXT = ("--images", "{out}/imgs", "--out", "{out}/ds", "--device", "cpu", "--text-family", "pixart",
        "--text-encoders", "{out}/pix")


def manifest(id: str, name: str, content: Union[str, bytes], *needles: str) -> Any:
    """--captions {out}/<name> holding `content`; the needles name the file first."""
    return precompute(f"captions_{id}", *TEXT, "--captions", f"{{out}}/{name}", setup=captioned({name: content}),
                      needles=(f"captions file '{{out}}/{name}'", *needles))


def sidecar(id: str, content: Union[str, bytes], *needles: str) -> Any:
    """--caption-sidecars with imgs/c/0.txt holding `content` (the others captioned)."""
    files = {"imgs/c/0.txt": content, "imgs/c/1.txt": "a grey square\n", "imgs/c/2.txt": "a white square\n"}
    return precompute(f"sidecar_{id}", *TEXT, "--caption-sidecars", setup=captioned(files),
                      needles=("caption sidecar '{out}/imgs/c/0.txt'", *needles))


def images_with_link(make: Callable[[Path], Any]) -> Setup:
    """A setup: {out}/imgs (three images in class c), then make(imgs) (a link)."""
    def setup(out: Path, places: dict) -> None:
        three_images(out / "imgs")
        make(out / "imgs")
    return setup


def frame_folder(folder: Path, n: int = 2) -> None:
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((16, 16, 3), 30 * i, np.uint8)).save(folder / f"f_{i}.png")


def clips_with(make: Callable[[Path], Any]) -> Setup:
    """A setup: {out}/clips/cls/a and b (frame folders of two frames), then make(clips/cls)."""
    def setup(out: Path, places: dict) -> None:
        for name in ("a", "b"):
            frame_folder(out / "clips" / "cls" / name)
        make(out / "clips" / "cls")
    return setup


def cover_image(cls: Path) -> None:
    frame_folder(cls / "c")
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(cls / "cover.jpg")


def undecodable_mp4(cls: Path) -> None:
    """cls/z.mp4: sound headers (9 frames), its frame data zeroed: none decodes."""
    path = write_video(cls / "z.mp4", np.random.default_rng(0).integers(0, 255, (9, 16, 16, 3), np.uint8), 24)
    data = bytearray(path.read_bytes())
    at = data.find(b"mdat")
    size = struct.unpack(">I", data[at - 4:at])[0]
    data[at + 4:at - 4 + size] = bytes(size - 8)
    path.write_bytes(bytes(data))


def clip_case(id: str, make: Callable[[Path], Any], *needles: str) -> Any:
    return precompute(f"clips_{id}", "--videos", "{out}/clips", "--out", "{out}/ds", "--frames", "1", "--device",
                      "cpu", setup=clips_with(make), needles=needles)


# ----------------------------------------------------------------------------- the cases

CSV_CASES = [
    manifest("csv_unterminated_quote", "caps.csv", 'c/0.png,"a cat\nc/1.png,b\nc/2.png,c\n', "line 1",
             "'\"a cat'", "unexpected end of data"),
    manifest("csv_two_quoted_fields", "caps.csv", 'c/0.png,"a cat","a dog"\nc/1.png,b\nc/2.png,c\n', "line 1",
             "2 quoted fields"),
    manifest("csv_text_after_closing_quote", "caps.csv", 'c/0.png,b\nc/1.png,"a" cat\nc/2.png,c\n', "line 2",
             "',' expected after '\"'"),
    manifest("csv_quoted_name_not_closed", "caps.csv", '"c/0.png,a cat\n', "line 1",
             "the quoted file name is not closed"),
    manifest("csv_nul_byte", "caps.csv", b"c/0.png,a\x00cat\nc/1.png,b\nc/2.png,c\n", "line 1",
             "control character U+0000 at character 10"),
    manifest("csv_escape_sequence", "caps.csv", "c/0.png,a\nc/1.png,a \x1b[31mred\x1b[0m cat\nc/2.png,c\n",
             "line 2", "control character U+001B"),
    manifest("csv_caption_too_long", "caps.csv", f"c/0.png,{LONG}\nc/1.png,b\nc/2.png,c\n", "line 1",
             "('c/0.png')", "10,001 characters long", "at most 10,000"),
    manifest("csv_empty_file_name", "caps.csv", "c/0.png,a\n,b\n", "line 2", "the file name is '' (empty)"),
    manifest("csv_bom_inside", "caps.csv", "c/0.png,a\n\ufeffc/1.png,b\nc/2.png,c\n", "line 2",
             "control character U+FEFF"),
    manifest("csv_same_caption_twice", "caps.csv", "c/0.png,a cat\nc/1.png,b\nc/0.png,a cat\nc/2.png,c\n",
             "line 3", "'c/0.png' gets the caption 'a cat' twice", "first named line 1"),
    manifest("csv_not_utf8", "caps.csv", b"c/0.png,caf\xe9\n", "not UTF-8 text"),
    manifest("csv_no_separator", "caps.csv", "c/0.png a cat\n", "line 1", "is not '<file name>,<caption>'"),
    precompute("captions_csv_names_no_image", *TEXT, "--captions", "{out}/caps.csv",
               setup=captioned({"caps.csv": "c/0.png,a\nc/9.png,b\n"}),
               needles=("--captions '{out}/caps.csv' names file(s) that are not images", "c/9.png (line 2)")),
    manifest("tsv_unterminated_quote", "caps.tsv", 'c/0.png\ta\nc/1.png\t"b\n', "line 2", "unexpected end of data"),
    manifest("tsv_nul_byte", "caps.tsv", b"c/0.png\t\x00\x00\x00\n", "line 1", "control character U+0000"),
]

JSON_CASES = [
    manifest("json_duplicate_key", "caps.json", '{"c/0.png": "a", "c/1.png": "b", "c/0.png": "c"}',
             "key 'c/0.png' is given twice in one object"),
    manifest("json_one_file_two_keys", "caps.json", '{"c/0.png": "a", "./c/0.png": "b"}', "key './c/0.png'",
             "names the same file as key 'c/0.png'"),
    manifest("json_caption_not_string", "caps.json", '{"c/0.png": 3}', "the caption of 'c/0.png' is 3"),
    manifest("json_nested_deep", "caps.json", '{"c/0.png": ' + DEEP + "}", "nested 200001 levels deep"),
    manifest("json_nul_escape", "caps.json", '{"c/0.png": "a\\u0000b", "c/1.png": "b", "c/2.png": "c"}',
             "key 'c/0.png'", "control character U+0000"),
    manifest("json_caption_too_long", "caps.json", '{"c/0.png": ["a", "' + LONG + '"]}', "key 'c/0.png'",
             "10,001 characters long"),
    manifest("json_not_an_object", "caps.json", '["c/0.png", "a"]', "expected a JSON object", "got list"),
    manifest("jsonl_bad_line", "caps.jsonl", '{"file": "c/0.png", "caption": "a"}\n{"file": "c/1.png", "caption": \n',
             "line 2", "not a JSON object"),
    manifest("jsonl_duplicate_key", "caps.jsonl", '{"file": "c/0.png", "caption": "a", "caption": "b"}\n',
             "line 1", "key 'caption' is given twice in one object"),
    manifest("jsonl_captions_not_a_list", "caps.jsonl", '{"file": "c/0.png", "captions": "a"}\n', "line 1",
             "'captions' is 'a'"),
    manifest("jsonl_control_in_file_name", "caps.jsonl", '{"file": "c/0\\u0007.png", "caption": "a"}\n', "line 1",
             "the file name", "control character U+0007"),
    manifest("jsonl_same_caption_twice", "caps.jsonl", '{"file": "c/0.png", "captions": ["a", "b", "a"]}\n',
             "line 1", "gets the caption 'a' twice"),
]

SIDECAR_CASES = [
    sidecar("nul_bytes", b"\x00" * 64, "line 1", "control character U+0000 at character 1"),
    sidecar("bell", "a fine caption\na bad \x07 one\n", "line 2", "control character U+0007"),
    sidecar("form_feed", "one\x0ctwo\n", "line 1", "control character U+000C"),
    sidecar("too_long", LONG + "\n", "line 1", "10,001 characters long"),
    sidecar("not_utf8", b"\xff\xfe\xfd\n", "not UTF-8 text"),
]

FOLDER_CASES = [
    precompute("images_link_loop", "--images", "{out}/imgs", "--out", "{out}/ds", "--device", "cpu",
               setup=images_with_link(lambda imgs: os.symlink(imgs / "c", imgs / "c" / "self")),
               needles=("folder '{out}/imgs/c/self' is '{out}/imgs/c' again", "a symbolic link loop")),
    precompute("images_second_link_to_a_folder", "--images", "{out}/imgs", "--out", "{out}/ds", "--device", "cpu",
               setup=images_with_link(lambda imgs: (imgs / "d").mkdir() or os.symlink(imgs / "c", imgs / "d" / "c")),
               needles=("'{out}/imgs/d/c' is '{out}/imgs/c' again", "leads to a folder listed already")),
    precompute("images_broken_link", "--images", "{out}/imgs", "--out", "{out}/ds", "--device", "cpu",
               setup=images_with_link(lambda imgs: os.symlink(imgs / "gone.png", imgs / "c" / "3.png")),
               needles=("'{out}/imgs/c/3.png' is a broken symbolic link",)),
    clip_case("link_loop", lambda cls: os.symlink(cls, cls / "self"),
              "folder '{out}/clips/cls/self' is '{out}/clips/cls' again", "a symbolic link loop"),
    clip_case("cover_image", cover_image, "'{out}/clips/cls/cover.jpg' lies beside clip folders", "(a, b, c)"),
    clip_case("empty_frame_folder", lambda cls: (cls / "e").mkdir(), "under --videos '{out}/clips' hold no clip",
              "cls/e (an empty frame folder"),
    clip_case("no_frame_decodes", undecodable_mp4, "clip '{out}/clips/cls/z.mp4' cannot be decoded",
              "nothing was encoded"),
]

CASES = CSV_CASES + JSON_CASES + SIDECAR_CASES + FOLDER_CASES


def test_the_table_is_big_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
