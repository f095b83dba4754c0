"""In-process events: the smallest runtime, for patches that hand values to Python code.

A patched site calls ``__sp__.emit("moe.topk", indices, layer=3)``; code that
wants the values subscribes.  With no subscriber an emit is one truthiness test.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

_subscribers: list[Callable[["Event"], None]] = []


@dataclass(frozen=True)
class Event:
    name: str
    value: Any
    tags: dict = field(default_factory=dict)


def emit(name: str, value: Any = None, **tags) -> Any:
    """Hand ``value`` to every subscriber and return it unchanged (usable in wraps)."""
    if _subscribers:
        event = Event(name, value, tags)
        for callback in tuple(_subscribers):
            callback(event)
    return value


def subscribe(callback: Callable[[Event], None]) -> Callable[[], None]:
    """Call ``callback(event)`` for every emit; returns a function that unsubscribes."""
    _subscribers.append(callback)
    return lambda: _subscribers.remove(callback) if callback in _subscribers else None


@contextlib.contextmanager
def capture(*names: str) -> Iterator[list[Event]]:
    """Collect events (all, or those with the given names) emitted inside the block."""
    events: list[Event] = []
    unsubscribe = subscribe(lambda e: events.append(e) if not names or e.name in names else None)
    try:
        yield events
    finally:
        unsubscribe()
