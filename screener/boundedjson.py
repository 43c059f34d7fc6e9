"""Parse JSON from outside (alarm files, golden records, state files) within fixed bounds.

`json.loads` on hostile text can raise RecursionError (a file of nested `[`), spend seconds on a
5,000-digit integer (or raise ValueError from Python's digit limit), and accepts `NaN` and
`Infinity`, which then leak into arithmetic, and keeps the last of two equal keys in an object
(so a reader sees one value while a person, a diff or another parser sees the other). `loads` here
turns every one of those into a ValueError with one line saying what is wrong, so a reader's
caller handles a single exception.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_DEPTH = 64  # nesting of arrays/objects; our own files are at most five deep
MAX_INT_DIGITS = 40  # a 128-bit value has 39 digits; nothing we read is larger


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most "
                         f"{MAX_INT_DIGITS} allowed)")
    return int(text)


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):  # 1e999 parses to inf
        raise ValueError(f"the number {text[:40]} overflows a double")
    return v


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict; ValueError when a key appears twice (json keeps the last
    silently, which lets a file carry a second, hidden value of the same field)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:60]!r} in an object")
        out[key] = value
    return out


def depth(obj: Any) -> int:
    """How deeply arrays and objects nest in obj (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in data; ValueError (one line) when it is larger than max_bytes, not UTF-8,
    not JSON, nested deeper than max_depth, or holds NaN, an infinity, a huge integer or an
    object with a duplicate key."""
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_int=_bounded_int,
                           parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else "not valid JSON") from None
    if depth(value) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value


STRICT_MAX_BYTES = 64 << 20  # what strict() reads: far above anything we or the API write


def strict(data: bytes | str) -> Any:
    """loads() with a generous size bound: for JSON from outside that has no size of its own to
    respect (annotations, ConfigMaps, reports, API answers): duplicate keys, NaN and huge
    integers are refused there too (ValueError, one line)."""
    return loads(data, max_bytes=STRICT_MAX_BYTES)


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; OSError, or ValueError saying why not.

    Opened with O_NONBLOCK (a FIFO swapped in must not hang the reader) and, unless
    follow_symlinks, O_NOFOLLOW (ELOOP on a symlink); checked with fstat to be a regular file, so
    /dev/zero or a pipe is refused rather than read forever; read no further than the limit.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ValueError(f"larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
