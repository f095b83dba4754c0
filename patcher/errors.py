"""The error types source-patch raises.

Every error a user can cause derives from :class:`SourcePatchError`. None of them
derives from ``ImportError``: upstream code often wraps optional imports in
``try: ... except ImportError`` (and ``pytest.importorskip`` skips on it), which
would turn a patching failure into a silently unpatched, or silently skipped, run.

User-supplied text (ids, names, anchors, paths, YAML values) can be huge: where it
enters a message it goes through :func:`show` or :func:`shorten` (200 characters),
and every message is clipped again as a whole (:func:`clip`) as a safety net.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

SHOW_LIMIT = 200  # characters of one piece of user text in a message
LINE_LIMIT = 1000  # characters of one message line
LINES_LIMIT = 200  # lines of one message


def shorten(text, limit: int = SHOW_LIMIT) -> str:
    """``text`` (a str, or anything: str() of it) cut to ``limit`` characters, saying how long it was."""
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``, ``\\n``), uncut: a spec's
    description, a file name or a wheel's metadata cannot move the cursor, recolour or
    retitle the terminal."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


def show(value, limit: int = SHOW_LIMIT) -> str:
    """``repr(value)`` for a message, a long string cut to ``limit`` characters first."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return shorten(repr(value), limit)


def clip(text: str, limit: int = LINE_LIMIT, lines: int = LINES_LIMIT) -> str:
    """At most ``lines`` lines of at most ``limit`` characters: a long line keeps its
    start and its end (where a message usually says what is wrong) around the cut."""
    parts = str(text).split("\n")
    more = len(parts) - lines
    if more > 0:
        parts = parts[:lines] + [f"... ({more} more lines)"]
    head, tail = limit * 6 // 10, limit * 3 // 10
    return "\n".join(line if len(line) <= limit else
                     f"{line[:head]} ...({len(line) - head - tail} characters cut)... {line[-tail:]}"
                     for line in parts)


class SourcePatchError(Exception):
    """Base class of every error source-patch raises on bad input.  Its message is
    clipped (:func:`clip`): a 5 MB patch id makes a short error, not a 5 MB one."""

    def __init__(self, *args):
        super().__init__(*(clip(a) if isinstance(a, str) else a for a in args))


@dataclass(frozen=True)
class Location:
    """A place in a spec file: 1-based line and column, and the field's dotted path."""

    file: str
    line: int = 0
    column: int = 0
    field: str = ""

    def __str__(self) -> str:
        where = shorten(self.file)
        if self.line:
            where += f":{self.line}:{self.column}"
        return f"{where}: {shorten(self.field)}" if self.field else where


class SpecError(SourcePatchError):
    """A spec file that cannot be read, parsed or validated."""

    def __init__(self, message: str, location: Location):
        self.message = clip(message)
        self.location = location
        super().__init__(f"{location}: {message}")


class AnchorError(SourcePatchError):
    """One or more edits did not match their target the expected number of times.

    Raised before any edit of the module is applied: a module is patched whole or
    not at all. ``problems`` holds one human-readable paragraph per failing edit.
    """

    def __init__(self, module: str, file: str, version: str, problems: list[str]):
        self.module, self.file, self.version, self.problems = module, file, version, problems
        head = f"cannot patch module {shorten(module)} ({shorten(file)}, {shorten(version)}):"
        super().__init__("\n".join([head, *problems]))


class RequirementError(SourcePatchError):
    """A spec's ``requires`` is not met by the installed distributions."""


class ActivationError(SourcePatchError):
    """Patching was activated too late (a target is already imported) or misused."""


class NotActivatedError(ActivationError):
    """Raised by every import of a module outside the standard library once the start
    hook could not activate SOURCE_PATCH (``error``: the spec or activation error)."""

    def __init__(self, message: str, error: BaseException):
        self.error = error
        super().__init__(message)


class SourcePatchWarning(UserWarning):
    """Something a spec author should fix that does not stop the run (SOURCE_PATCH_STRICT=1
    makes the activation-time ones errors)."""


# --------------------------------------------------------------------------- warnings

_PATCHER = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NO_FRAME = "<source-patch>"  # where a warning with no caller outside source-patch points: no source line


def warn(message: str, category: type[Warning] = SourcePatchWarning) -> None:
    """Warn, attributed to the first frame outside the patcher, importlib and ``site``:
    the user's import (or call of the API), whose line is worth printing under the
    message, never a line of ours (``activation = _activate(specs, None)``).  At start-up
    no such frame exists (the start hook runs inside ``site``): the warning then names
    ``<source-patch>``, which has no source line.  Filters, ``-W`` and ``pytest.warns``
    see an ordinary warning; other libraries' warnings print as before."""
    import warnings

    frame = sys._getframe(1)
    while frame is not None and _internal(frame):
        frame = frame.f_back
    if frame is None:
        warnings.warn_explicit(message, category, _NO_FRAME, 1, module="source_patch", registry=_REGISTRY)
        return
    # As warnings.warn files it for that frame (its source line read from the file by
    # name: no module_globals, whose loader may not give source, as __main__'s under -c).
    glob = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=glob.get("__name__", "<unknown>"), registry=glob.setdefault("__warningregistry__", {}))


_REGISTRY: dict = {}  # the start-up warnings' (as a module's __warningregistry__: each said once)


def _internal(frame) -> bool:
    name = frame.f_code.co_filename
    return (name.startswith(_PATCHER) or name.startswith("<frozen importlib")
            or frame.f_globals.get("__name__") in ("site", "importlib"))
