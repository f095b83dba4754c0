"""Ambient tags and JSON-safe tag values, shared by every capability that records.

The ambient context (``phase``, ``microbatch``, ...) is set by call sites in a
training schedule (``__sp__.dump_context``) and read by anything that tags what it
records (dump records, trace frames).  It is replaced, never mutated in place, so a
reader on another thread always sees a consistent dict without a lock.
"""

from __future__ import annotations

from typing import Any

_context: dict = {}
_MISSING = object()


def context() -> dict:
    """The current ambient tags (do not mutate: it is shared)."""
    return _context


def tag_value(value: Any) -> Any:
    """A value that JSON can carry: numbers stay numbers (non-finite floats become
    strings, which strict JSON readers accept), a 1-element CPU tensor becomes its
    item, other tensors a short description, anything else its ``str``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if hasattr(value, "numel") and hasattr(value, "device"):  # a tensor, without importing torch
        if value.numel() == 1 and value.device.type == "cpu":
            return tag_value(value.item())
        return f"<tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')} {value.device}>"
    if hasattr(value, "__index__"):
        return int(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return tag_value(value.item())  # numpy scalars
    if isinstance(value, (list, tuple)):
        return [tag_value(v) for v in value]
    return str(value)


class Restore:
    """What :func:`set_context` returns: a context manager that restores the tags it
    changed on exit; ignoring it keeps the change."""

    __slots__ = ("_previous",)

    def __init__(self, previous: dict):
        self._previous = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _context
        context = dict(_context)
        for key, old in self._previous.items():
            if old is _MISSING:
                context.pop(key, None)
            else:
                context[key] = old
        _context = context
        return False


def set_context(**tags) -> Restore:
    """Merge ``tags`` into the ambient context; a tag set to None is removed."""
    global _context
    restore = Restore({key: _context.get(key, _MISSING) for key in tags})
    context = dict(_context)
    for key, value in tags.items():
        if value is None:
            context.pop(key, None)
        else:
            context[key] = tag_value(value)
    _context = context
    return restore


def next_microbatch(index: int | None = None) -> int:
    """Advance the ``microbatch`` tag by one (0 when unset) or set it to ``index``."""
    global _context
    current = _context.get("microbatch")
    if index is not None:
        new = int(index)
    elif isinstance(current, int) and not isinstance(current, bool):
        new = current + 1
    else:
        new = 0
    _context = {**_context, "microbatch": new}
    return new


def end_step() -> None:
    """A new step has no microbatch yet."""
    global _context
    if "microbatch" in _context:
        _context = {k: v for k, v in _context.items() if k != "microbatch"}
