"""The error types source-patch raises.

Every error a user can cause derives from :class:`SourcePatchError`. None of them
derives from ``ImportError``: upstream code often wraps optional imports in
``try: ... except ImportError`` and would silently run unpatched.
"""

from __future__ import annotations

from dataclasses import dataclass


LINE_LIMIT = 1000  # characters of one message line: user text (ids, anchors, names) can be huge


def clip(text: str, limit: int = LINE_LIMIT) -> str:
    """Each line of ``text`` cut to ``limit`` characters, saying how long it was."""
    return "\n".join(line if len(line) <= limit else f"{line[:limit]}... ({len(line)} characters)"
                     for line in str(text).split("\n"))


class SourcePatchError(Exception):
    """Base class of every error source-patch raises on bad input.  Its message's
    lines are clipped (:func:`clip`): a 5 MB patch id makes a short error, not a 5 MB one."""

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
        where = self.file
        if self.line:
            where += f":{self.line}:{self.column}"
        return f"{where}: {self.field}" if self.field else where


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
        head = f"cannot patch module {module} ({file}, {version}):"
        super().__init__("\n".join([head, *problems]))


class RequirementError(SourcePatchError):
    """A spec's ``requires`` is not met by the installed distributions."""


class ActivationError(SourcePatchError):
    """Patching was activated too late (a target is already imported) or misused."""
