"""One guarded way to read every file format the programs accept (JSON, YAML, UTF-8 text, .npy, .npz, images): a bad
file is ONE error (FileFormatError or the caller's `error=`), `<place>: <what is wrong>; expected <what>.
<hint>`, never a library traceback; nothing is unpickled.
"""
from __future__ import annotations

import io
import json
import os
import re
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Optional, TypeVar, Union

import numpy as np
import yaml
from PIL import Image, UnidentifiedImageError

from tread.utils.errors import UserError

PathLike = Union[str, os.PathLike]
Error = type[Exception]
T = TypeVar("T")
MAX_JSON_DEPTH = 64             # nesting of arrays/objects; our files need fewer than 10 levels
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")       # a zip with members, an empty zip (what np.load accepts)
NPY_EXPECT = "one array written by numpy.save (.npy, no pickled objects)"
NPZ_EXPECT = "an .npz archive (a zip of .npy arrays, as numpy.savez writes; no pickled objects)"
# PIL modes with 8 bits per channel: what RGB holds without clipping (16-bit "I;16", 32-bit "I" and "F" do not)
IMAGE_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
IMAGE_EXPECT = "an image file PIL decodes (PNG, JPEG, ...), at least 1x1 pixels, 8 bits per channel"
UNIDENTIFIED = "not an image PIL can identify"     # corrupt, truncated, 0x0 pixels or another format
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


class FileFormatError(UserError):
    """A file that is not what it must be: unreadable, truncated, of another format, or nested too deep."""


def where(what: str, path: PathLike) -> str:
    """How a message names a file: `what 'path'`, or the path alone when `what` is empty."""
    return f"{what} '{path}'" if what else str(path)


def fail(error: Error, place: str, problem: str, expect: str, hint: str = "") -> Exception:
    """The one error of a reader: `<place>: <problem>; expected <expect>. <hint>`."""
    return error(f"{place}: {problem}; expected {expect}." + (f" {hint}" if hint else ""))


def _read_bytes(path: PathLike, place: str, expect: str, error: Error, hint: str) -> bytes:
    """A file's bytes; a missing file stays FileNotFoundError, any other OSError is `error`."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise fail(error, place, f"unreadable ({err.strerror or err})", expect, hint) from None


# ----------------------------------------------------------------------------- JSON, YAML

def json_depth(text: Union[str, bytes]) -> int:
    """How deep arrays/objects nest in JSON text (strings skipped), counted without recursing: a vectorised
    scan (for megabytes of state-file metadata it costs about half of what json.loads does)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    codes = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    opens, closes = (codes == ord("[")) | (codes == ord("{")), (codes == ord("]")) | (codes == ord("}"))
    marks = opens | closes
    steps = np.where(opens[marks], 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def _depth_problem(text: str) -> Optional[str]:
    """What is wrong with text nesting deeper than MAX_JSON_DEPTH (None when it does not)."""
    opened = text.count("[") + text.count("{")      # fewer brackets than the limit: no need to scan
    depth = json_depth(text) if opened > MAX_JSON_DEPTH else opened
    return f"nested {depth} levels deep (the limit is {MAX_JSON_DEPTH})" if depth > MAX_JSON_DEPTH else None


def _text(data: Union[str, bytes], place: str, expect: str, error: Error, hint: str) -> str:
    """UTF-8 text whose nesting is within MAX_JSON_DEPTH (checked before any parser recurses)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise fail(error, place, f"not UTF-8 text ({err.reason} at byte {err.start})", expect, hint) from None
    problem = _depth_problem(data)
    if problem:
        raise fail(error, place, problem, expect, hint)
    return data


class DuplicateKeyError(ValueError):
    """A key given twice in one JSON object (json.loads would keep the last value and drop the first)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} is given twice in one object (the first value would be lost)")
        out[key] = value
    return out


def _loads(text: str, unique_keys: bool) -> Any:
    """json.loads of text already checked for depth; ValueError saying what is wrong in a few words."""
    try:
        return json.loads(text, object_pairs_hook=_unique_object if unique_keys else None)
    except DuplicateKeyError:
        raise
    except (ValueError, RecursionError) as err:   # JSONDecodeError, and ints of more than 4300 digits
        raise ValueError(f"invalid JSON ({' '.join(str(err).split())})") from None


def loads_json(text: str, unique_keys: bool = False) -> Any:
    """json.loads of `text` within MAX_JSON_DEPTH (never a RecursionError); ValueError saying what is wrong in a
    few words (invalid JSON, nested too deep, and with unique_keys a key given twice in one object), for readers
    that name the place themselves (a line of a JSONL file)."""
    problem = _depth_problem(text)
    if problem:
        raise ValueError(problem)
    return _loads(text, unique_keys)


def parse_json(data: Union[str, bytes], place: str, expect: str = "a JSON document", error: Error = FileFormatError,
               hint: str = "", unique_keys: bool = False) -> Any:
    """json.loads of text (or UTF-8 bytes) that `place` names (e.g. "lock file '/run/.lock'"); `error` if it is
    not UTF-8, nests deeper than MAX_JSON_DEPTH, or is not JSON (with unique_keys: or gives a key twice in one
    object, which json.loads would take silently, keeping the last)."""
    text = _text(data, place, expect, error, hint)
    try:
        return _loads(text, unique_keys)
    except ValueError as err:
        raise fail(error, place, str(err), expect, hint) from None


def read_text(path: PathLike, what: str = "text file", expect: str = "UTF-8 text", error: Error = FileFormatError,
              hint: str = "") -> str:
    """A UTF-8 text file's text (a leading byte order mark dropped); `error` if it is unreadable or not UTF-8
    (naming the byte), FileNotFoundError if it is missing."""
    place = where(what, path)
    data = _read_bytes(path, place, expect, error, hint)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise fail(error, place, f"not UTF-8 text ({err.reason} at byte {err.start})", expect, hint) from None


def read_json(path: PathLike, what: str = "JSON file", expect: str = "a JSON document",
              error: Error = FileFormatError, hint: str = "", unique_keys: bool = False) -> Any:
    """The JSON document in `path` (see parse_json); FileNotFoundError if it is missing."""
    place = where(what, path)
    return parse_json(_read_bytes(path, place, expect, error, hint), place, expect, error, hint, unique_keys)


def read_yaml(path: PathLike, what: str = "YAML file", expect: str = "a YAML document",
              error: Error = FileFormatError, hint: str = "") -> Any:
    """The YAML document in `path` as plain data (yaml.safe_load); `error` if it is not UTF-8, nests too deep or is
    not YAML; FileNotFoundError if it is missing."""
    place = where(what, path)
    text = _text(_read_bytes(path, place, expect, error, hint), place, expect, error, hint)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise fail(error, place, f"invalid YAML ({' '.join(str(err).split())})", expect, hint) from None
    except RecursionError:
        raise fail(error, place, "nested too deep to read", expect, hint) from None


# ----------------------------------------------------------------------------- .npy

def _head(path: PathLike, place: str, expect: str, error: Error, hint: str) -> bytes:
    """The first bytes of a file (its format's magic); FileNotFoundError if it is missing."""
    try:
        with open(path, "rb") as f:
            return f.read(len(NPY_MAGIC))
    except FileNotFoundError:
        raise
    except OSError as err:
        raise fail(error, place, f"unreadable ({err.strerror or err})", expect, hint) from None


def _npy_header(f: IO[bytes]) -> Optional[tuple[tuple[int, ...], bool, np.dtype]]:
    """(shape, fortran order, dtype) from an .npy header (None for a format version other than 1.0 / 2.0: numpy
    reads those itself); ValueError for a file that is not .npy."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    return None


def _check_npy(f: IO[bytes], place: str, error: Error, hint: str) -> None:
    """An .npy file's magic and header, read from `f`: not an .npz, not another format, no pickled objects."""
    head = f.read(len(NPY_MAGIC))
    if head.startswith(ZIP_MAGICS):
        raise fail(error, place, "an .npz archive (a zip of arrays), not a single .npy array", NPY_EXPECT, hint)
    if not head.startswith(NPY_MAGIC):
        problem = "empty" if not head else "not an .npy array (no .npy magic at its start: corrupt, or another format)"
        raise fail(error, place, problem, NPY_EXPECT, hint)
    f.seek(0)
    try:
        header = _npy_header(f)
    except (ValueError, OSError, EOFError) as err:
        raise fail(error, place, f"corrupt or truncated (its .npy header: {err})", NPY_EXPECT, hint) from None
    if header is not None and header[2].hasobject:
        raise fail(error, place, "an array of Python objects (a pickle: never loaded)", NPY_EXPECT, hint)


def read_npy(path: PathLike, what: str = "array file", mmap: bool = False, error: Error = FileFormatError,
             hint: str = "") -> np.ndarray:
    """The array in an .npy file (memory-mapped read-only with mmap=True); never unpickles. `error` for an .npz
    given as .npy, another format, a truncated file or object arrays; FileNotFoundError if it is missing."""
    place = where(what, path)
    try:
        with open(path, "rb") as f:
            _check_npy(f, place, error, hint)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise fail(error, place, f"unreadable ({err.strerror or err})", NPY_EXPECT, hint) from None
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise fail(error, place, f"corrupt or truncated ({err})", NPY_EXPECT, hint) from None


def parse_npy(raw: bytes, place: str, error: Error = FileFormatError, hint: str = "") -> np.ndarray:
    """The array in the bytes of an .npy file (e.g. a tar member) that `place` names; never unpickles."""
    f = io.BytesIO(raw)
    _check_npy(f, place, error, hint)
    f.seek(0)
    try:
        return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise fail(error, place, f"corrupt or truncated ({err})", NPY_EXPECT, hint) from None


# ----------------------------------------------------------------------------- .npz

def _check_npz_head(path: PathLike, place: str, error: Error, hint: str) -> None:
    head = _head(path, place, NPZ_EXPECT, error, hint)
    if head.startswith(NPY_MAGIC):
        raise fail(error, place, "a single .npy array, not an .npz archive", NPZ_EXPECT, hint)
    if not head.startswith(ZIP_MAGICS):
        problem = "empty" if not head else "not an .npz archive (not a zip file: corrupt, or another format)"
        raise fail(error, place, problem, NPZ_EXPECT, hint)


@contextmanager
def _zip(path: PathLike, place: str, error: Error, hint: str) -> Iterator[zipfile.ZipFile]:
    """The .npz as an open zip file; a truncated or damaged one is `error`."""
    _check_npz_head(path, place, error, hint)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise fail(error, place, f"truncated or corrupt: not a readable zip archive ({err})", NPZ_EXPECT,
                   hint) from None
    with zf:
        yield zf


def npz_names(path: PathLike, what: str = "archive", error: Error = FileFormatError, hint: str = "") -> list[str]:
    """The names of the arrays in an .npz (without loading any)."""
    with _zip(path, where(what, path), error, hint) as zf:
        return [name[:-len(".npy")] for name in zf.namelist() if name.endswith(".npy")]


def read_npz(path: PathLike, what: str = "archive", keys: Optional[Iterable[str]] = None,
             error: Error = FileFormatError, hint: str = "") -> dict[str, np.ndarray]:
    """{name: array} of an .npz, loaded (only `keys` of them when given; absent ones are left out): for small
    arrays (statistics, settings, indices); stream big ones with iter_npz_batches. Never unpickles."""
    place = where(what, path)
    _check_npz_head(path, place, error, hint)
    wanted = None if keys is None else set(keys)
    try:
        with np.load(path, allow_pickle=False) as data:
            out = {k: data[k] for k in data.files if wanted is None or k in wanted}
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError) as err:
        raise fail(error, place, f"truncated or corrupt ({err})", NPZ_EXPECT, hint) from None
    other = sorted(k for k, v in out.items() if not isinstance(v, np.ndarray))
    if other:
        raise fail(error, place, f"members that are not .npy arrays ({other})", NPZ_EXPECT, hint)
    return out


@contextmanager
def _member(path: PathLike, key: str, place: str, error: Error, hint: str) -> Iterator[IO[bytes]]:
    """One array's member of an .npz, open for reading."""
    with _zip(path, place, error, hint) as zf:
        names = zf.namelist()
        if f"{key}.npy" not in names:
            raise fail(error, place, f"no '{key}' array (its arrays: {[n[:-4] for n in names]})",
                       f"an .npz archive with '{key}'", hint)
        try:
            member = zf.open(f"{key}.npy")
        except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError) as err:
            raise fail(error, place, f"an unreadable '{key}' array ({err})", NPZ_EXPECT, hint) from None
        with member:
            yield member


def npz_array_info(path: PathLike, key: str = "arr_0", what: str = "archive", error: Error = FileFormatError,
                   hint: str = "") -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one array in an .npz, read from its header without loading it."""
    place = where(what, path)
    with _member(path, key, place, error, hint) as f:
        try:
            header = _npy_header(f)
        except (ValueError, zipfile.BadZipFile, zlib.error, OSError, EOFError) as err:
            raise fail(error, place, f"a '{key}' member that is not a readable .npy array ({err})", NPZ_EXPECT,
                       hint) from None
    if header is None:                               # another .npy version: numpy reads it (loads the array)
        arr = read_npz(path, what, (key,), error, hint)[key]
        return arr.shape, arr.dtype
    return header[0], header[2]


def _read_exactly(f: IO[bytes], size: int, place: str, key: str, error: Error, hint: str) -> bytearray:
    data = bytearray()
    try:
        while len(data) < size:
            chunk = f.read(size - len(data))
            if not chunk:
                raise fail(error, place, f"truncated: its '{key}' array ends after {len(data)} of {size} "
                                         f"bytes", NPZ_EXPECT, hint)
            data += chunk
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as err:
        raise fail(error, place, f"a damaged '{key}' array ({err})", NPZ_EXPECT, hint) from None
    return data  # a bytearray, so np.frombuffer gives a writable array


def iter_npz_batches(path: PathLike, key: str = "arr_0", batch_size: int = 250, what: str = "archive",
                     error: Error = FileFormatError, hint: str = "") -> Iterator[np.ndarray]:
    """Consecutive row batches of one array of an .npz (compressed or not), streamed from the zip member so
    that e.g. 50K 256 px images (~10 GB) never sit in memory at once (as ADM's evaluator reads them)."""
    place = where(what, path)
    with _member(path, key, place, error, hint) as f:
        try:
            shape, fortran, dtype = _npy_header(f) or ((), True, None)
        except (ValueError, zipfile.BadZipFile, zlib.error, OSError, EOFError):
            shape, fortran, dtype = (), True, None
        if fortran or dtype.hasobject or not shape:  # rare layouts: load the whole array (read_npz checks it)
            arr = read_npz(path, what, (key,), error, hint)[key]
            for i in range(0, len(arr), batch_size):
                yield arr[i:i + batch_size]
            return
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        for i in range(0, shape[0], batch_size):
            n = min(batch_size, shape[0] - i)
            data = _read_exactly(f, n * row_bytes, place, key, error, hint)
            yield np.frombuffer(data, dtype=dtype).reshape(n, *shape[1:])


# ----------------------------------------------------------------------------- images

def _header_problem(im: Image.Image) -> Optional[str]:
    """What is wrong with an opened image before decoding it: an empty size, a mode RGB cannot hold."""
    width, height = im.size
    if width < 1 or height < 1:
        return f"{width}x{height} pixels (empty)"
    if im.mode not in IMAGE_MODES:
        return f"pixel mode {im.mode!r} (16-bit or floating-point values, which 8-bit RGB cannot hold)"
    return None


def _with_image(path: PathLike, use: Callable[[Image.Image], T]) -> tuple[Optional[str], Optional[T]]:
    """(None, use(image)) for an image whose header is fine and that `use` reads without error, else (what is
    wrong in a few words, None). FileNotFoundError if the file is missing."""
    try:
        with Image.open(path) as im:
            problem = _header_problem(im)
            return (problem, None) if problem else (None, use(im))
    except FileNotFoundError:
        raise
    except UnidentifiedImageError:
        return UNIDENTIFIED, None
    except Image.DecompressionBombError as err:
        return f"too large to decode safely ({err})", None
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError) as err:
        return f"corrupt or truncated ({' '.join(str(err).split()) or type(err).__name__})", None


def image_problem(path: PathLike, decode: bool = True) -> Optional[str]:
    """None if the image file is fine, else what is wrong with it in a few words. decode=True decodes every
    pixel (what reading it does); False checks the header and a PNG's chunks (PIL's verify: no JPEG data)."""
    return _with_image(path, (lambda im: im.load()) if decode else (lambda im: im.verify()))[0]


def image_size(path: PathLike, what: str = "image", error: Error = FileFormatError, hint: str = "",
               verify: bool = True) -> tuple[int, int]:
    """(width, height) of an image file, its header (and with verify, a PNG's chunks) checked without decoding
    the pixels."""
    problem, size = _with_image(path, lambda im: (im.size, im.verify() if verify else None)[0])
    if problem:
        raise fail(error, where(what, path), problem, IMAGE_EXPECT, hint)
    return size


def read_image(path: PathLike, what: str = "image", mode: str = "RGB", error: Error = FileFormatError,
               hint: str = "") -> Image.Image:
    """An image file fully decoded, converted to `mode` (RGB: 8-bit colour)."""
    problem, image = _with_image(path, lambda im: im.convert(mode))
    if problem:
        raise fail(error, where(what, path), problem, IMAGE_EXPECT, hint)
    return image
