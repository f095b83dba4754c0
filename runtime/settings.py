"""Settings of runtime components: their schemas, and where values come from.

A value is taken, in order of precedence, from the environment
(``SOURCE_PATCH_<COMPONENT>_<KEY>``), then from the ``runtime:`` section of the
active specs (later specs win), then from the schema's default.  This module
imports nothing heavy: the spec loader uses it to validate ``runtime:`` sections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Setting:
    default: Any
    parse: Callable[[Any], Any]  # raises ValueError/TypeError with a message for bad values
    help: str


# component -> key -> Setting.  Components register their schema here, not in their
# own (heavier) modules, so specs can be validated without importing them.
SCHEMAS: dict[str, dict[str, Setting]] = {}


def check(component: str, key: str, value: Any) -> Any:
    """The parsed value; KeyError naming the valid keys, or ValueError/TypeError."""
    schema = SCHEMAS[component]
    if key not in schema:
        raise KeyError(f"unknown key {key!r} for runtime component {component!r} "
                         f"(valid keys: {', '.join(sorted(schema))})")
    return schema[key].parse(value)


def resolve(component: str, environ=os.environ) -> dict[str, Any]:
    """Effective settings of a component: environment over specs over defaults."""
    schema = SCHEMAS[component]
    values = {key: setting.default for key, setting in schema.items()}
    for spec in _active_specs():
        values.update(spec.runtime.get(component, {}))
    prefix = f"SOURCE_PATCH_{component.upper()}_"
    for key in schema:
        raw = environ.get(prefix + key.upper())
        if raw is not None:
            try:
                values[key] = check(component, key, raw)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{prefix + key.upper()}={raw!r}: {exc}") from None
    return values


def _active_specs():
    import sys

    activation = sys.modules.get("source_patch.patcher.activation")
    finder = activation.installed_finder() if activation else None
    return finder.specs if finder else []


# -- parsers shared by components


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {value!r}")


def integer(low: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if low is not None and number < low:
            raise ValueError(f"expected an integer >= {low}, got {number}")
        return number
    return parse


def choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return parse


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value
