"""One bounded reader for every structured input a peer, a file or a user hands us.

Each surface (a weight-sync manifest, a routing header, a dump manifest line, a feature
store header, a db row, a wheel member) reads through these helpers with its own limits
and its own error class, so bad input is that surface's clean error and never a
``RecursionError``, a ``MemoryError``, a hang on a FIFO or a raw ``OSError``.

- :func:`load_json` refuses input over ``max_bytes``, nested deeper than ``max_depth``
  or holding more than ``max_items`` containers *before* parsing (the C parser recurses,
  and a deep document is a crash, not an error), and says which surface refused it.
- :func:`open_regular` / :func:`read_regular` open a user-named path without blocking
  and accept regular files only, so a FIFO, a device or a folder is refused instead
  of hanging or filling memory.

Light on purpose: the spec loader imports it at import time (os, re, json, stat only).
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate, islice

MAX_DEPTH = 32  # no input of ours nests deeper; json.loads recurses in C
# A string, or an unterminated one to the end of the input (the final quote is
# optional): a match never fails once started, so no quote is scanned from twice.
# Requiring the closing quote made the regex rescan to the end from every escaped
# quote of an unterminated string: quadratic (64 KB of \" took 11 s).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPEN = re.compile(r"[\[{]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_CHUNK = 4096  # brackets whose depths are computed at once


def _fail(error: type[Exception], what: str, why: str) -> Exception:
    return error(f"{what}: {why}")


def check_nesting(text: str, *, what: str = "JSON", error: type[Exception] = ValueError,
                  max_depth: int = MAX_DEPTH, max_items: int | None = None) -> None:
    """Raise ``error`` if ``text`` nests deeper than ``max_depth`` or opens more than
    ``max_items`` arrays and objects; brackets inside strings do not count.

    Linear in ``len(text)``, in C: a peer's input runs this on an event loop or a
    host thread.  Brackets after an unterminated string do not count either: the
    parser fails at that string before it reaches them."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    opens = len(brackets) - brackets.count("]") - brackets.count("}")
    end = deep_at = many_at = len(brackets)  # where each limit is first passed
    if opens > max_depth:
        deep_at = _too_deep_at(brackets, max_depth)
    if max_items is not None and opens > max_items:
        many_at = next(islice(_OPEN.finditer(brackets), max_items, None)).start()
    if deep_at < end and deep_at <= many_at:  # the first limit passed names the error
        raise _fail(error, what, f"nested deeper than {max_depth} levels")
    if many_at < end:
        raise _fail(error, what, f"more than {max_items:,} arrays and objects")


def _too_deep_at(brackets: str, max_depth: int) -> int:
    """Where the depth of ``brackets`` first passes ``max_depth`` (len if never), in
    chunks so that a deep input stops early; each chunk's depths in C."""
    depth = 0
    for start in range(0, len(brackets), _CHUNK):
        depths = list(accumulate(map(_STEP.__getitem__, brackets[start:start + _CHUNK]), initial=depth))
        if max(depths) > max_depth:  # depth moves by 1: it passes the limit at max_depth + 1
            return start + depths.index(max_depth + 1) - 1  # depths[0] is the carried depth
        depth = depths[-1]
    return len(brackets)


def load_json(data: bytes | bytearray | memoryview | str, *, what: str = "JSON",
              error: type[Exception] = ValueError, max_bytes: int = 1 << 20,
              max_depth: int = MAX_DEPTH, max_items: int | None = None, kind: type | None = None):
    """``json.loads`` bounded in size, depth and container count; every failure (too
    large, too deep, not UTF-8, not JSON, not of type ``kind``) is ``error`` naming ``what``."""
    if len(data) > max_bytes:
        raise _fail(error, what, f"{len(data):,} bytes, more than the {max_bytes:,} allowed")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(error, what, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    check_nesting(text, what=what, error=error, max_depth=max_depth, max_items=max_items)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _fail(error, what, f"not valid JSON ({_first_line(exc)})") from None
    if kind is not None and not isinstance(value, kind):
        raise _fail(error, what, f"a JSON {type(value).__name__}, expected a {kind.__name__}")
    return value


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def open_regular(path: str | os.PathLike, *, what: str = "file", error: type[Exception] = OSError,
                 follow_symlinks: bool = True, missing_ok: bool = False):
    """Open ``path`` for binary reading if it is a regular file: opened without blocking
    (a FIFO neither hangs nor is read), a folder, device or socket is ``error``, as is
    a symlink when ``follow_symlinks`` is false.  Returns an open binary file; None
    where ``missing_ok`` and there is no such file (told by the open itself: a file
    created just after it is not mistaken for one that failed to open)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if missing_ok and isinstance(exc, FileNotFoundError):
            return None
        raise _fail(error, what, f"cannot open {os.fspath(path)}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _fail(error, what, f"{os.fspath(path)} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, *, max_bytes: int, what: str = "file",
                 error: type[Exception] = OSError, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (see :func:`open_regular`)."""
    with open_regular(path, what=what, error=error, follow_symlinks=follow_symlinks) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise _fail(error, what, f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise _fail(error, what, f"{os.fspath(path)} is larger than {max_bytes:,} bytes")
    return data
